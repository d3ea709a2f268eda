"""``ninfer bench perplexity``: windows and scoring on fresh random logits against direct
formulas, and the whole command on the real SmolLM2 against HuggingFace transformers on the same
GGUF weights and the same windows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ninfer.bench.perplexity import Scores, kl_summary, ppl_summary, windows

README = Path(__file__).resolve().parents[2] / "README.md"   # a text every clone has


def test_windows_cut_as_llama_perplexity_cuts_them():
    ids = list(range(100, 130))
    assert windows(ids, 8, 0, None) == [ids[0:8], ids[8:16], ids[16:24]]   # 6 left: dropped
    assert windows(ids, 8, 2, None) == [ids[0:8], ids[8:16]]
    # with a BOS id: [bos] + ids cut in windows of 8, each one's first token replaced by BOS
    seq = [1] + ids
    assert windows(ids, 8, 0, 1) == [[1] + seq[i * 8 + 1:(i + 1) * 8] for i in range(3)]
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(ids[:7], 8, 0, None)
    with pytest.raises(ValueError, match="at least 4"):
        windows(ids, 3, 0, None)


def test_scores_equal_the_direct_formulas_on_random_logits():
    rng = np.random.default_rng()
    n, v = 150, 97   # more rows than a block of ROWS
    ref = rng.normal(0, 3, (n, v)).astype(np.float32)
    got = (ref + rng.normal(0, 0.5, (n, v))).astype(np.float32)
    targets = rng.integers(0, v, n).tolist()
    s = Scores([], [], [], [])
    s.add(got, targets, ref)

    def logp(x):
        x = x.astype(np.float64)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, rp = logp(got), logp(ref)
    nll = -lp[np.arange(n), targets]
    np.testing.assert_allclose(s.nll, nll, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.ref_nll, -rp[np.arange(n), targets], rtol=1e-12, atol=1e-12)
    kl = (np.exp(rp) * (rp - lp)).sum(-1)
    np.testing.assert_allclose(s.kl, kl, rtol=1e-9, atol=1e-12)
    assert s.same_top == (ref.argmax(-1) == got.argmax(-1)).tolist()
    p = ppl_summary(s.nll)
    assert p["tokens"] == n and p["ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-6)
    assert p["ppl_se"] == pytest.approx(p["ppl"] * nll.std(ddof=1) / np.sqrt(n), rel=1e-3)
    k = kl_summary(s)
    assert k["kl_mean"] == pytest.approx(kl.mean()) and k["kl_max"] == pytest.approx(kl.max())
    assert k["ln_ppl_ratio"] == pytest.approx(nll.mean() + rp[np.arange(n), targets].mean())
    same = Scores([], [], [], [])
    same.add(ref, targets, ref)   # a configuration against itself: no divergence
    assert max(same.kl) == 0 and all(same.same_top)


def _perplexity(tmp_path, *args) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "ppl.json"
    given = "--json" in args
    r = subprocess.run([sys.executable, "-m", "ninfer", "bench", "perplexity", *args,
                        "--backend", "numpy", *([] if given else ["--json", str(out)])],
                       capture_output=True, text=True, timeout=600)
    return (json.loads(out.read_text()) if r.returncode == 0 and not given else {}), r


@pytest.mark.slow
def test_perplexity_equals_transformers_on_the_same_windows(smollm2_gguf, tmp_path):
    """Windows of 64 tokens prefilled in passes of 24 (the scored half spans two passes):
    ninfer's perplexity equals transformers' on the same token windows."""
    import torch
    import transformers

    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.store.artifact import load_model_file

    res, r = _perplexity(tmp_path, "--text", str(README), "--ctx", "64", "--windows", "3",
                         "--chunk", "24")
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_dict(load_model_file(smollm2_gguf).tokenizer)
    ids = tok.encode(README.read_text(encoding="utf-8"), parse_special=False)
    assert res["text_tokens"] == len(ids) and res["kv_dtype"] == "fp32"
    wins = windows(ids, 64, 3, tok.bos_id if tok.add_bos else None)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, torch_dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for w in wins:
            lp = torch.log_softmax(hf(torch.tensor([w])).logits[0].double(), -1).numpy()
            nll += [-lp[i, w[i + 1]] for i in range(32, 63)]
    p = res["perplexity"]
    assert p["tokens"] == len(nll) == 3 * 31 and p["windows"] == 3
    assert p["ppl"] == pytest.approx(np.exp(np.mean(nll)), rel=1e-3)
    assert 1 < p["ppl"] < 1000 and p["ppl_se"] > 0
    assert "perplexity: " in r.stdout


@pytest.mark.slow
def test_kl_against_the_reference_is_zero_for_it_and_positive_for_a_lossy_cache(tmp_path):
    args = ("--text", str(README), "--ctx", "48", "--windows", "2", "--kl")
    same, r = _perplexity(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    assert same["reference"] == {"kv_dtype": "fp32"}
    assert same["kl"]["kl_max"] == 0 and same["kl"]["same_top"] == 1
    assert same["kl"]["ref_ppl"] == same["perplexity"]["ppl"]
    lossy, r = _perplexity(tmp_path, *args, "--kv-dtype", "rk2v4-e8")
    assert r.returncode == 0, r.stderr
    assert lossy["kv_dtype"] == "rk2v4-e8" and lossy["kl"]["kl_mean"] > 0
    assert lossy["kl"]["ref_ppl"] == same["perplexity"]["ppl"]   # the same reference
    assert lossy["perplexity"]["ppl"] != same["perplexity"]["ppl"]
    assert "same top token" in r.stdout


@pytest.mark.parametrize("text, args, message", [
    (None, (), "--text {path}: No such file"),
    ("dir", (), "--text {path}: Is a directory"),
    (b"\xff\xfe not utf-8", (), "not UTF-8"),
    (b"too short", ("--ctx", "512"), "fewer than one window"),
    (b"too short", ("--ctx", "9000"), "--ctx 9000 is beyond the model's trained context "
                                      "(8192); the text has"),
    (b"text", ("--ctx", "3"), "--ctx: must be >= 4"),
    (b"text", ("--ctx", "abc"), "expected an integer >= 4, got 'abc'"),
    (b"text", ("--json", "{tmp}/no/such/folder.json"), "not a writable file path"),
])
def test_bad_input_is_a_clear_error(tmp_path, text, args, message):
    path = tmp_path / "text.txt"
    if text == "dir":
        path.mkdir()
    elif text is not None:
        path.write_bytes(text)
    args = [a.format(tmp=tmp_path) for a in args]
    _, r = _perplexity(tmp_path, "--text", str(path), *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message.format(path=path) in r.stderr
    assert "perplexity:" not in r.stdout and "window 1" not in r.stderr   # nothing ran
