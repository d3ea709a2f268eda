"""The peer in the same run: llama.cpp's ``llama-bench`` on the very GGUF ninfer just measured.

``ninfer bench decode|prefill MODEL.gguf --peer PATH/llama-bench`` runs it after its own
measurements (decode: ``-p 0 -n STEPS``, prefill: ``-p LENGTHS -n 0``) and prints the two side by
side, the peer's roofline fraction computed with ninfer's bytes per token and the copy bandwidth
measured in the same process. How the binary is built: ``bench/README.md``.
"""
from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

# Every layer on the GPU, flash attention on (bench/history/RESULTS.md ran it so).
DEFAULT_ARGS = ("-ngl", "99", "-fa", "1")


def parse_llama_bench_json(text: str) -> dict:
    """``llama-bench -o json`` output -> ``{"tg": {...} | None, "pp": {...} | None, "pp_by_n":
    {n: {...}}, "tg_by_n": {n: {...}}, "build_commit": str | None, "gpu_info": str | None}``,
    where an entry is ``{"n": tokens, "tok_s": mean, "stddev": sd}`` of a generation-only or
    prompt-only test, ``tg`` / ``pp`` the last of each kind.

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
    out: dict = {"tg": None, "pp": None, "tg_by_n": {}, "pp_by_n": {}, "build_commit": None,
                 "gpu_info": None}
    for r in rows:
        try:
            n_prompt, n_gen, ts = int(r["n_prompt"]), int(r["n_gen"]), float(r["avg_ts"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"llama-bench test without n_prompt / n_gen / avg_ts: {e}") from None
        entry = {"n": n_gen or n_prompt, "tok_s": ts, "stddev": float(r.get("stddev_ts", 0.0))}
        if n_prompt == 0 and n_gen > 0:
            out["tg"] = out["tg_by_n"][n_gen] = entry
        elif n_gen == 0 and n_prompt > 0:
            out["pp"] = out["pp_by_n"][n_prompt] = entry
        out["build_commit"] = r.get("build_commit", out["build_commit"])
        out["gpu_info"] = r.get("gpu_info", out["gpu_info"])
    return out


def llama_bench(binary: str, model: str, *, n_prompt: int | Sequence[int] = 512,
                n_gen: int = 128, reps: int = 3, args: Sequence[str] = DEFAULT_ARGS,
                timeout_s: float = 1200.0) -> dict:
    """Run ``binary -m model -p n_prompt -n n_gen -r reps <args> -o json`` and parse it
    (``parse_llama_bench_json``), with the command line under ``"cmd"``. ``n_prompt`` may list
    several lengths (``-p 512,4096``); 0 skips the prompt tests, ``n_gen=0`` the generation one.

    Raises:
        FileNotFoundError: no such binary.
        subprocess.CalledProcessError: llama-bench failed (its stderr is in the exception).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
        ValueError: unparseable output.
    """
    p = n_prompt if isinstance(n_prompt, int) else ",".join(str(x) for x in n_prompt)
    cmd = [binary, "-m", model, "-p", str(p), "-n", str(n_gen), "-r", str(reps),
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


def beside_decode(decode: dict, got: dict, bandwidth: float) -> dict | None:
    """ninfer's batch-1 decode (``decode[1]``) next to the peer's generation test, both as
    fractions of this run's roofline with ninfer's bytes per token; None without either."""
    b1 = decode.get(1)
    if not b1 or not got["tg"]:
        return None
    out = side_by_side(b1["tok_s"], got["tg"]["tok_s"], b1["bytes_per_token"], bandwidth)
    out["peer_test"] = f"tg{got['tg']['n']}"
    return out


def beside_prefill(prefill: dict, got: dict) -> dict:
    """ninfer's prefill tok/s next to the peer's prompt test of the same length."""
    out = {}
    for n, ours in prefill.items():
        theirs = got["pp_by_n"].get(int(n))
        if theirs:
            out[n] = {"ninfer_tok_s": ours["tok_s"], "peer_tok_s": round(theirs["tok_s"], 1),
                      "speedup": round(ours["tok_s"] / theirs["tok_s"], 3)}
    return out
