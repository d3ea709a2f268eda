"""The peer in the same run: llama.cpp's ``llama-bench`` on the very GGUF ninfer just measured.

Building ``llama-bench`` (the workplace's ``../shared/peer/``, outside this repository): on the
development machine ``../shared/peer/prepare-llamacpp.sh`` packs llama.cpp from the
llama-cpp-python sdist into the ignored ``.peer/`` folder (with ``device-build-llamacpp.sh``
copied beside it); on the GPU machine ``bash .peer/device-build-llamacpp.sh`` builds it for sm_90
into ``/tmp/llama/build/bin/llama-bench`` (~320 s). Elsewhere, any CUDA build of llama.cpp's
``llama-bench`` does. ``bench/gpu_decode.py MODEL.gguf --peer /tmp/llama/build/bin/llama-bench``
calls ``llama_bench`` after its own measurements and prints the two side by side, the peer's
roofline fraction computed with ninfer's bytes per token and the copy bandwidth measured in the
same process (the ground rule of the benchmarks: a peer measured in the same run).

Importable without a GPU (the JSON parsing is tested on the CPU).
"""
from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

# Every layer on the GPU, flash attention on: how the earlier sessions ran it (bench/RESULTS.md).
DEFAULT_ARGS = ("-ngl", "99", "-fa", "1")


def parse_llama_bench_json(text: str) -> dict:
    """``llama-bench -o json`` output -> ``{"tg": {...} | None, "pp": {...} | None, "build_commit":
    str | None, "gpu_info": str | None}``, where ``tg`` / ``pp`` = ``{"n": tokens, "tok_s": mean,
    "stddev": sd}`` of the generation-only and prompt-only tests (the last of each kind).

    Raises:
        ValueError: not a JSON list of test objects, or a test without ``n_prompt`` /
            ``n_gen`` / ``avg_ts``.
    """
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON: {e}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("llama-bench output is not a list of test objects")
    out: dict = {"tg": None, "pp": None, "build_commit": None, "gpu_info": None}
    for r in rows:
        try:
            n_prompt, n_gen, ts = int(r["n_prompt"]), int(r["n_gen"]), float(r["avg_ts"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"llama-bench test without n_prompt / n_gen / avg_ts: {e}") from None
        entry = {"n": n_gen or n_prompt, "tok_s": ts, "stddev": float(r.get("stddev_ts", 0.0))}
        if n_prompt == 0 and n_gen > 0:
            out["tg"] = entry
        elif n_gen == 0 and n_prompt > 0:
            out["pp"] = entry
        out["build_commit"] = r.get("build_commit", out["build_commit"])
        out["gpu_info"] = r.get("gpu_info", out["gpu_info"])
    return out


def llama_bench(binary: str, model: str, *, n_prompt: int = 512, n_gen: int = 128,
                reps: int = 3, args: Sequence[str] = DEFAULT_ARGS,
                timeout_s: float = 1200.0) -> dict:
    """Run ``binary -m model -p n_prompt -n n_gen -r reps <args> -o json`` and parse it
    (``parse_llama_bench_json``), with the command line under ``"cmd"``.

    Raises:
        FileNotFoundError: no such binary.
        subprocess.CalledProcessError: llama-bench failed (its stderr is in the exception).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
        ValueError: unparseable output.
    """
    cmd = [binary, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
           *args, "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    res = parse_llama_bench_json(done.stdout)
    res["cmd"] = " ".join(cmd)
    return res


def side_by_side(ours_tok_s: float, peer_tok_s: float, bytes_per_token: float,
                 copy_bw: float) -> dict:
    """Both decode rates (tok/s) as fractions of the memory roofline (``bytes_per_token`` x
    tok/s / ``copy_bw`` bytes/s: ninfer's byte count for both) and ninfer's speed-up."""
    return {"ninfer_tok_s": round(ours_tok_s, 1), "peer_tok_s": round(peer_tok_s, 1),
            "ninfer_roofline": round(bytes_per_token * ours_tok_s / copy_bw, 3),
            "peer_roofline": round(bytes_per_token * peer_tok_s / copy_bw, 3),
            "speedup": round(ours_tok_s / peer_tok_s, 3)}
