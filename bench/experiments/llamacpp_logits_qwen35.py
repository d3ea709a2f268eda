"""ninfer against llama.cpp's own computation on the same Qwen3.5 (``qwen35``) GGUF: the full
next-token distribution after prompts of several lengths and along a greedy continuation.

Usage (CPU is enough; the tiny model takes ~1 min):
    PYTHONPATH=$PWD python bench/experiments/llamacpp_logits_qwen35.py \
        --server /path/to/llama.cpp/build/bin/llama-server [--gguf F32.gguf] \
        [--lengths 1,7,80,300,1200] [--steps 16] [--chunk 512] [--top 10] [--kv f32] \
        [--llama-args "--no-repack"] [--json OUT]

Without ``--gguf``, the tiny random Qwen3.5 of ``tests/store/qwen35_gguf.py`` is written by
transformers and converted to an F32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (found as
the tests find it: ``$NINFER_LLAMA_CPP``, ``.peer/llama.cpp.tgz``, the cache, pip's sdist).

llama.cpp side: ``llama-server`` ``/completion`` with ``n_probs`` = vocabulary size and
``post_sampling_probs: false`` returns the softmax of its raw logits (``llamacpp_server.py``);
one request per position, prompt recomputed (batched prefill, ubatch 512). Its greedy token is
the argmax of that distribution. ninfer side: the GGUF loaded as ``ninfer serve`` loads it
(``load_model_file`` + ``load_model``, numpy ops), the prompt run in prefill chunks of
``--chunk`` tokens (the engine's ``prefill_chunk``), then one-token decode steps on its own
argmax. Reported per position: the max relative error of the top-N probabilities (N by
llama.cpp's ranking), the max relative error of the centered logits (log-probabilities minus
their mean, error over the largest |value|: the metric of the transformers tests), equal argmax.

``n_probs`` = vocabulary (320 for the tiny model) already gives full logits up to a constant, so
no extra llama.cpp tool (``llama-eval-callback``, a libllama logits dumper) is built. Pass
``--llama-args "--no-repack -fa off"`` for llama.cpp's exact f32 path: with flash attention (its
default) it casts F32 K/V to f16 for the attention (``llama-graph.cpp`` ``build_attn_mha``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests" / "store")]
from llamacpp_server import LlamaServer, add_merges_if_missing  # noqa: E402


def tiny_gguf(folder: Path) -> Path:
    """The tests' tiny random Qwen3.5, converted to F32 by llama.cpp's converter."""
    from qwen35_gguf import llama_cpp_sources, make_checkpoint, run_converter
    src, why = llama_cpp_sources(Path.home() / ".cache" / "ninfer")
    if src is None:
        raise RuntimeError(why)
    (folder / "hf").mkdir(parents=True, exist_ok=True)
    make_checkpoint(folder / "hf")
    out = folder / "tiny-f32.gguf"
    run_converter(src, folder / "hf", out, "f32")
    return out


class NinferRunner:
    """The GGUF as ninfer serves it: chunked prefill of a prompt, then greedy decode steps."""

    def __init__(self, gguf: Path, backend: str = "numpy", page: int = 16):
        from ninfer.engine.models import load_model
        from ninfer.kernels import get_ops
        from ninfer.store.artifact import load_model_file
        self.ops = get_ops(backend)
        self.model = load_model(load_model_file(gguf), self.ops)
        self.vocab, self.page = int(self.model.config.vocab_size), page

    def run(self, prompt: list[int], steps: int, chunk: int) -> tuple[list[np.ndarray], list[int]]:
        """Logits (float64) after the prompt and after each of ``steps`` greedy tokens, and
        those tokens; a fresh cache and state slot per call."""
        from ninfer.engine.models.llama import ForwardBatch
        total = len(prompt) + steps
        pages = list(range(-(-total // self.page)))
        kv = self.model.new_kv_cache(len(pages), self.page, max_lanes=1)

        def step(toks: list[int], start: int) -> np.ndarray:
            b = ForwardBatch.from_sequences([toks], [start], [pages], self.page, state_slots=[0])
            return self.ops.to_numpy(self.model.forward(b, kv))[0].astype(np.float64)

        for a in range(0, len(prompt), chunk):   # the engine's prefill chunks
            logits = step(prompt[a:a + chunk], a)
        out, toks = [logits], []
        for i in range(steps):
            toks.append(int(np.argmax(out[-1])))
            if i + 1 < steps:   # the last token's logits are not compared
                out.append(step([toks[-1]], len(prompt) + i))
        return out, toks


def llama_run(server: LlamaServer, prompt: list[int], steps: int, vocab: int,
              safe: int) -> tuple[list[np.ndarray], list[int]]:
    """llama.cpp's log-probabilities after the prompt and after each of its greedy tokens."""
    seq, out, toks = list(prompt), [], []
    for i in range(steps):
        out.append(server.logprobs(seq, vocab, safe))
        toks.append(int(np.argmax(out[-1])))
        seq.append(toks[-1])
    return out[:steps], toks


def compare(ref_lp: np.ndarray, logits: np.ndarray, top: int) -> dict:
    """Errors of ninfer's ``logits`` against llama.cpp's log-probabilities ``ref_lp``."""
    lp = logits - logits.max()
    lp = lp - np.log(np.exp(lp).sum())
    ids = np.argsort(-ref_lp)[:top]
    p_ref, p = np.exp(ref_lp[ids]), np.exp(lp[ids])
    c_ref, c = ref_lp - ref_lp.mean(), lp - lp.mean()
    s = np.sort(ref_lp)
    return {"top_rel": float(np.max(np.abs(p - p_ref) / p_ref)),
            "centered_rel": float(np.abs(c - c_ref).max() / np.abs(c_ref).max()),
            "argmax_equal": bool(np.argmax(lp) == np.argmax(ref_lp)),
            "margin": float(s[-1] - s[-2])}


def run_all(server_bin: str, gguf: Path | None, lengths: list[int], steps: int, chunk: int,
            top: int, kv: str = "f32", seed: int = 0, work: Path | None = None,
            extra: tuple[str, ...] = ("--no-repack",)) -> dict:
    """Every prompt length: both sides' greedy tokens and the per-position errors."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(work or tmp)
        gguf = Path(gguf) if gguf else tiny_gguf(work)
        served = add_merges_if_missing(gguf, work / "with-merges.gguf")
        ninfer = NinferRunner(served)
        rng = np.random.default_rng(seed)
        rows = []
        with LlamaServer(server_bin, served, ctx=max(lengths) + steps + 64, kv_type=kv,
                         extra=extra, log=work / "llama-server.log") as srv:
            safe = srv.token_id("a")
            for n in lengths:
                prompt = rng.integers(0, min(ninfer.vocab, 256), n).tolist()
                ref, ref_toks = llama_run(srv, prompt, steps, ninfer.vocab, safe)
                got, toks = ninfer.run(prompt, steps, chunk)
                errs = [compare(r, g, top) for r, g in zip(ref, got)]
                rows.append({"prompt_len": n, "chunks": -(-n // chunk), "llama_tokens": ref_toks,
                             "ninfer_tokens": toks, "greedy_equal": ref_toks == toks,
                             "first": errs[0], "positions": errs})
    worst = lambda k: max(e[k] for r in rows for e in r["positions"])  # noqa: E731
    return {"gguf": str(gguf), "kv_type": kv, "chunk": chunk, "top": top, "steps": steps,
            "rows": rows, "max_top_rel": worst("top_rel"),
            "max_centered_rel": worst("centered_rel"),
            "all_argmax_equal": all(e["argmax_equal"] for r in rows for e in r["positions"]),
            "all_greedy_equal": all(r["greedy_equal"] for r in rows),
            "min_margin": min(e["margin"] for r in rows for e in r["positions"])}


def report(res: dict) -> str:
    lines = [f"llama.cpp (KV {res['kv_type']}) vs ninfer (numpy, prefill chunk {res['chunk']}): "
             f"top-{res['top']} probabilities and centered logits"]
    for r in res["rows"]:
        pos = r["positions"]
        lines.append(f"  prompt {r['prompt_len']:5d} ({r['chunks']} chunk(s)): next token top-rel "
                     f"{r['first']['top_rel']:.2e} centered {r['first']['centered_rel']:.2e}; "
                     f"{len(pos)} greedy positions max top-rel "
                     f"{max(e['top_rel'] for e in pos):.2e} centered "
                     f"{max(e['centered_rel'] for e in pos):.2e}; greedy tokens equal "
                     f"{r['greedy_equal']}")
    lines.append(f"  all: max top-rel {res['max_top_rel']:.2e}, max centered "
                 f"{res['max_centered_rel']:.2e}, "
                 f"argmax equal {res['all_argmax_equal']}, greedy equal {res['all_greedy_equal']}, "
                 f"smallest top-2 logit margin {res['min_margin']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default=os.environ.get("NINFER_LLAMA_SERVER"),
                    help="llama-server binary (default $NINFER_LLAMA_SERVER)")
    ap.add_argument("--gguf", type=Path, help="a qwen35 GGUF (default: the tiny one, converted)")
    ap.add_argument("--lengths", default="1,7,80,300,1200")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--kv", default="f32", help="llama.cpp KV cache type (f32, f16)")
    ap.add_argument("--llama-args", default="--no-repack",
                    help="more llama-server arguments, one string (default --no-repack)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if not a.server:
        ap.error("--server or $NINFER_LLAMA_SERVER is required")
    res = run_all(a.server, a.gguf, [int(x) for x in a.lengths.split(",")], a.steps, a.chunk,
                  a.top, a.kv, extra=tuple(a.llama_args.split()))
    print(report(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0 if res["all_greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
