"""What a benchmark run prints and writes: one line per measurement (the peer beside it) and the
whole result as JSON."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def provenance(argv: list[str] | None) -> dict:
    """Date, the ninfer source commit (None outside a git checkout) and the command line."""
    commit = None
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).resolve().parent)
        if done.returncode == 0:
            commit = done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    cmd = "ninfer bench " + " ".join(argv) if argv is not None else None
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit, "command": cmd}


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def decode_lines(res: dict) -> list[str]:
    bw = res["copy_bw_GBs"]
    beside = (res.get("peer") or {}).get("decode_b1")
    out = []
    for b, e in res["decode"].items():
        line = (f"decode b{b}: {e['tok_s']:.1f} tok/s, {e['GBs']:.1f} GB/s, "
                f"{_pct(e['roofline_fraction'])} of the roofline (copy {bw:.1f} GB/s)")
        if e.get("lookahead"):
            line += f"; plain {e['tok_s_plain']:.1f}"
            if not e["lookahead_tokens_match"]:
                line += "; LOOKAHEAD TOKENS DIFFER"
        if "device_step_ms" in e:
            line += f"; device step {e['device_step_ms']:.3f} ms"
        if beside and str(b) == "1":
            line += (f" | llama.cpp {beside['peer_test']} {beside['peer_tok_s']:.1f} tok/s "
                     f"({_pct(beside['peer_roofline'])}): {beside['speedup']:.2f}x")
        out.append(line)
    return out


def prefill_lines(res: dict) -> list[str]:
    beside = (res.get("peer") or {}).get("prefill", {})
    out = []
    chunk = res.get("prefill_chunk")
    for p, e in res["prefill"].items():
        line = f"prefill {p}: {e['tok_s']:.1f} tok/s" + (f" (chunks of {chunk})" if chunk else "")
        if p in beside:
            line += (f" | llama.cpp pp{p} {beside[p]['peer_tok_s']:.1f} tok/s: "
                     f"{beside[p]['speedup']:.2f}x")
        out.append(line)
    b = res.get("ttft_behind")
    if b:
        out.append(f"ttft short-behind-{b['long_tokens']}: {b['short_tokens']}-token request "
                   f"{b['delay_s']} s after the long one: first token in {b['short_ttft_s']} s "
                   f"(the long one's {b['long_ttft_s']} s; {b['prefill_lanes']} prefill lanes, "
                   f"chunks of {b['chunk']})")
    return out


def serve_lines(res: dict) -> list[str]:
    s = res["server"]
    return [f"server overhead b1: engine-only {res['engine_graph']['tok_s']:.1f} tok/s, "
            f"server {s['client_tok_s']:.1f} client-observed ({_pct(res['overhead_client'])}), "
            f"{s['server_engine_tok_s']:.1f} by its engine "
            f"({_pct(res['overhead_server_engine'])}); ready in {s['ready_s']} s"] + (
        # the server cannot be faster than the engine it runs: the machine's noise is larger
        ["note: negative overhead, the runs varied more than the server costs (a busy machine? "
         "more --repeats)"] if min(res["overhead_client"], res["overhead_server_engine"]) < 0
        else [])


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def perplexity_lines(res: dict) -> list[str]:
    p = res["perplexity"]
    out = [f"perplexity: {p['ppl']:.4f} +/- {p['ppl_se']:.4f} over {_n(p['tokens'], 'token')} "
           f"({_n(p['windows'], 'window')} of {p['ctx']}"
           + (f", prefilled in passes of {res['chunk']}" if res.get("chunk") else "") + ")"]
    k = res.get("kl")
    if k:
        ref = res["reference"]
        gemm = f", {ref['prefill_gemm']} GEMMs" if "prefill_gemm" in ref else ""
        out.append(f"against KV {ref['kv_dtype']}{gemm} (ppl "
                   f"{k['ref_ppl']:.4f}): KL mean {k['kl_mean']:.6f}, median "
                   f"{k['kl_median']:.6f}, p99 {k['kl_p99']:.6f}, max {k['kl_max']:.6f}; same "
                   f"top token {_pct(k['same_top'])}; ln(PPL/PPL ref) {k['ln_ppl_ratio']:+.6f}")
    return out


LINES = {"decode": decode_lines, "prefill": prefill_lines, "serve": serve_lines,
         "perplexity": perplexity_lines}


def write_json(res: dict, path: str | None) -> None:
    """Write ``res`` as indented JSON to ``path`` (nothing without one)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


def emit(res: dict, path: str | None) -> None:
    """Print the summary lines, and write ``res`` to ``path`` if given."""
    head = f"# {res['kind']} {Path(res['model']).name} on {res['device']} ({res['backend']})"
    if "kv_dtype" in res:  # decode / prefill: the cache's storage moves their numbers
        head += f", KV cache {res['kv_dtype']}"
    print("\n".join([head, *LINES[res["kind"]](res)]), flush=True)
    write_json(res, path)
