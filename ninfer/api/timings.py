"""llama.cpp's ``timings`` object, which chat, completions and Messages replies carry."""
from __future__ import annotations

from ..engine.requests import FinalOutput


def llama_timings(finals: list[FinalOutput]) -> dict:
    """llama.cpp ``timings`` of a reply; with ``n`` choices (decoded together) the predicted
    figures cover all of them: tokens summed, wall time the longest choice's."""
    f = finals[0]
    t = f.timings
    prompt_n = f.prompt_tokens - f.cached_tokens  # computed by prefill, as llama.cpp's
    predicted = sum(x.completion_tokens for x in finals)
    decode_s = max(x.timings["decode_s"] for x in finals)
    # (the prompt's own forward passes, as llama.cpp's: not the other lanes' turns between them)
    prefill_s = t["prefill_compute_s"]
    out = {"prompt_n": prompt_n, "prompt_ms": prefill_s * 1000.0,
           "predicted_n": predicted, "predicted_ms": decode_s * 1000.0}
    if prefill_s > 0:
        out["prompt_per_second"] = prompt_n / prefill_s
    if decode_s > 0 and predicted > len(finals):
        out["predicted_per_second"] = (predicted - len(finals)) / decode_s
    if t["ttft_s"] > 0:
        out["ttft_ms"] = t["ttft_s"] * 1000.0
    if f.cached_tokens > 0:
        out["cache_n"] = f.cached_tokens
    draft_n = sum(getattr(x, "draft_n", 0) for x in finals)
    if draft_n > 0:  # speculative decoding drafted for this response
        out["draft_n"] = draft_n
        out["draft_n_accepted"] = sum(getattr(x, "draft_n_accepted", 0) for x in finals)
    return out
