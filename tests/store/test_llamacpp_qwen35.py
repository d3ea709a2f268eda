"""ninfer against llama.cpp's own computation on the same converted Qwen3.5 GGUF (issue 30 item 5):
the tiny random Qwen3.5, converted to F32 by llama.cpp's ``convert_hf_to_gguf.py``, served by
``llama-server`` and loaded by ninfer; the whole next-token distribution after prompts of
1..600 tokens (600 = three ninfer prefill chunks of 256) and along 16 greedy tokens must agree,
and so must every greedy token. Runs only where ``$NINFER_LLAMA_SERVER`` names a llama-server
binary (its shared libraries next to it; ``$NINFER_LLAMA_ARGS``: more server arguments,
default ``--no-repack``, which avoids a crash in the CPU AMX repack code on some hosts).
``bench/experiments/llamacpp_logits_qwen35.py`` is the runner (and the command for the numbers
in bench/README.md)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from qwen35_gguf import llama_cpp_sources

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "experiments"))
import llamacpp_logits_qwen35 as cmp  # noqa: E402

pytestmark = pytest.mark.slow
SERVER = os.environ.get("NINFER_LLAMA_SERVER")
ARGS = tuple(os.environ.get("NINFER_LLAMA_ARGS", "--no-repack").split())


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    if not SERVER or not Path(SERVER).is_file():
        pytest.skip("set NINFER_LLAMA_SERVER to a llama-server binary")
    src, why = llama_cpp_sources(Path.home() / ".cache" / "ninfer")
    if src is None:
        pytest.skip(why)
    return cmp.tiny_gguf(tmp_path_factory.mktemp("qwen35_llamacpp"))


# Without flash attention llama.cpp runs this F32 model in f32 throughout: measured 2.9e-6
# (its probabilities are f32 values printed in JSON). With it (its default, "auto") llama.cpp
# casts K and V to f16 for the attention (llama-graph.cpp build_attn_mha): measured 3.7e-4.
@pytest.mark.parametrize("fa,tol", [("off", 5e-5), ("on", 1e-3)])
def test_distribution_and_greedy_tokens_match_llama_cpp(tiny_gguf, tmp_path, fa, tol):
    res = cmp.run_all(SERVER, tiny_gguf, [1, 7, 80, 600], steps=16, chunk=256, top=10,
                      kv="f32", work=tmp_path, extra=(*ARGS, "-fa", fa))
    print(cmp.report(res))
    assert [r["chunks"] for r in res["rows"]] == [1, 1, 1, 3]
    assert all(len(r["positions"]) == 16 for r in res["rows"])
    assert res["max_top_rel"] < tol and res["max_centered_rel"] < tol
    assert res["all_argmax_equal"]
    for r in res["rows"]:
        assert r["llama_tokens"] == r["ninfer_tokens"], r["prompt_len"]
