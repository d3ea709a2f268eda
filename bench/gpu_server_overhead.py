"""Cost of the HTTP server and the event log against engine-only decode, batch 1.

Usage (on the GPU machine; works on the CPU too with --backend numpy):
    python bench/gpu_server_overhead.py MODEL [--backend cupy] [--tokens 256] [--repeats 3]
        [--json OUT.json]

Measures, one greedy request at a time, the same prompt and the same ``max_tokens``:

1. engine-only: the model wrapped exactly as ``ninfer serve`` wraps it
   (``server.decode_model``: decode replayed from CUDA graphs per batch bucket, graphs captured
   up front), an ``Engine`` driven by hand with ``step()`` and a bus with no sinks; also with
   ``cuda_graph=False`` (the same padded schedule, eager);
2. server: ``python -m ninfer serve MODEL --request-log-jsonl LOG`` as a subprocess (every sink
   on: JSONL file, SSE hub, metrics / telemetry / dashboard folds; its own engine thread), the
   request streamed over HTTP with httpx.

Decode tok/s = (completion tokens - 1) / (time of the last token - time of the first), from
the engine's ``FinalOutput`` timings (engine-only), from the server's ``request.finished``
record (engine thread inside the server) and from the client's arrival times of the first and
last streamed content chunks (what a user sees). Overhead = 1 - client tok/s / engine-only
tok/s (target: at most 10 %). Medians over ``--repeats`` requests after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from benchutil import report  # bench/ is on sys.path when run as a script

PROMPT = "Write a long story about a dragon who learns to cook, with many details."


def engine_only(rt, cuda_graph: bool, tokens: int, repeats: int) -> dict:
    """Median engine decode tok/s (FinalOutput timings) of ``repeats`` greedy requests."""
    from ninfer.engine.engine import Engine, EngineConfig, FinalOutput, Request
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus
    from ninfer.server import decode_model

    ecfg = EngineConfig(max_concurrency=4, max_context=2048)
    model, runner = decode_model(rt.model, ecfg, cuda_graph)
    bus = EventBus()
    engine = Engine(model, rt.tokenizer, bus, ecfg)
    if runner is not None:
        runner.capture_all(engine.kv)
    ids = rt.tokenizer.encode(rt.template.render([{"role": "user", "content": PROMPT}],
                                                 add_generation_prompt=True))
    rates, counts = [], []
    for i in range(repeats + 1):
        out = []
        engine.submit(Request(f"e{i}", ids, SamplingParams(temperature=0.0), tokens,
                              out.append))
        while engine.step():
            bus.flush()
        fin = next(o for o in out if isinstance(o, FinalOutput))
        if i:
            rates.append((fin.completion_tokens - 1) / fin.timings["decode_s"])
            counts.append(fin.completion_tokens)
    return {"tok_s": round(statistics.median(rates), 1), "all": [round(r, 1) for r in rates],
            "completion_tokens": counts, "replays": getattr(runner, "replays", None)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_run(model: str, backend: str, tokens: int, repeats: int, extra=()) -> dict:
    """Median client-observed and server-engine decode tok/s through ``ninfer serve``."""
    port = _free_port()
    log = os.path.join(tempfile.mkdtemp(), "requests.jsonl")
    cmd = [sys.executable, "-m", "ninfer", "serve", model, "--backend", backend, "--port",
           str(port), "--max-concurrency", "4", "--max-context", "2048",
           "--request-log-jsonl", log, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + proc.stdout.read())
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("server did not come up")
            time.sleep(0.1)
        ready_s = time.perf_counter() - t0
        client, counts = [], []
        mid = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        body = {"model": mid, "messages": [{"role": "user", "content": PROMPT}],
                "temperature": 0, "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        for i in range(repeats + 1):
            times, usage = [], None
            with httpx.stream("POST", base + "/v1/chat/completions", json=body,
                              timeout=300) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read()!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                        times.append(time.perf_counter())
                    if obj.get("usage"):
                        usage = obj["usage"]
            if i:
                n = usage["completion_tokens"]
                client.append((n - 1) / (times[-1] - times[0]))
                counts.append(n)
        time.sleep(0.3)
        recs = [json.loads(x) for x in open(log, encoding="utf-8")]
        started = recs[0]
        fins = [r for r in recs if r["kind"] == "request.finished"][1:]
        srv = [(r["completion_tokens"] - 1) / r["timings"]["decode_s"] for r in fins]
        return {"client_tok_s": round(statistics.median(client), 1),
                "server_engine_tok_s": round(statistics.median(srv), 1),
                "client_all": [round(x, 1) for x in client], "completion_tokens": counts,
                "ready_s": round(ready_s, 1), "records": len(recs),
                "started_memory": started["memory"],
                "started_backend": started["environment"]["backend"]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from ninfer.server import load_runtime
    rt = load_runtime(a.model, a.backend)
    res = {"model": a.model, "backend": a.backend, "date": time.strftime("%Y-%m-%d"),
           "tokens": a.tokens}
    if a.backend == "cupy":
        import cupy as cp
        res["gpu"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res["engine_graph"] = engine_only(rt, True, a.tokens, a.repeats)
    print("engine-only, cuda graphs:", res["engine_graph"], flush=True)
    if a.backend == "cupy":
        res["engine_eager"] = engine_only(rt, False, a.tokens, a.repeats)
        print("engine-only, eager:", res["engine_eager"], flush=True)
    res["server"] = server_run(a.model, a.backend, a.tokens, a.repeats)
    print("server:", {k: v for k, v in res["server"].items() if k != "started_memory"},
          flush=True)
    base = res["engine_graph"]["tok_s"]
    res["overhead_client"] = round(1 - res["server"]["client_tok_s"] / base, 4)
    res["overhead_server_engine"] = round(1 - res["server"]["server_engine_tok_s"] / base, 4)
    report(res, a.json)


if __name__ == "__main__":
    main()
