"""The cost of the HTTP server and the event log against engine-only decode, batch 1.

One greedy request at a time, the same prompt and ``max_tokens``:
1. engine-only: the model wrapped as ``ninfer serve`` wraps it (``server.decode_model``: CUDA
   graphs per batch bucket, captured up front), an ``Engine`` stepped by hand with a bus and no
   sinks; on the GPU also with ``cuda_graph=False`` (the same padded schedule, eager);
2. server: ``python -m ninfer serve MODEL --request-log-jsonl LOG`` as a subprocess (every sink
   on), the request streamed over HTTP.
Decode tok/s = (completion tokens - 1) / (last token time - first token time): from the engine's
``FinalOutput`` timings, the server's ``request.finished`` record and the client's arrival times
of the first and last content chunks. Overhead = 1 - client tok/s / engine-only tok/s. Medians
over ``repeats`` requests after one warm-up.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ninfer.ports import free_ports

PROMPT = "Write a long story about a dragon who learns to cook, with many details."
READY_TIMEOUT_S = 300


def engine_only(rt, cuda_graph: bool, tokens: int, repeats: int) -> dict:
    """Median engine decode tok/s (``FinalOutput`` timings) of ``repeats`` greedy requests."""
    from ninfer.engine.engine import Engine, EngineConfig
    from ninfer.engine.requests import FinalOutput, Request
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
        out: list = []
        engine.submit(Request(f"e{i}", ids, SamplingParams(temperature=0.0), tokens,
                              out.append))
        while engine.step():
            bus.flush()
        fin = next(o for o in out if isinstance(o, FinalOutput))
        if i:  # the first request warms up
            rates.append((fin.completion_tokens - 1) / fin.timings["decode_s"])
            counts.append(fin.completion_tokens)
    return {"tok_s": round(statistics.median(rates), 1), "all": [round(r, 1) for r in rates],
            "completion_tokens": counts, "replays": getattr(runner, "replays", None)}


def _wait_ready(proc: subprocess.Popen, base: str) -> float:
    """Seconds until ``/health`` answers 200.

    Raises:
        RuntimeError: the server exited, or was not up within ``READY_TIMEOUT_S``.
    """
    import httpx

    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        if time.perf_counter() - t0 > READY_TIMEOUT_S:
            raise RuntimeError("server did not come up")
        time.sleep(0.1)


def _stream_once(base: str, body: dict) -> tuple[list[float], dict]:
    """Arrival times of the content chunks of one streamed chat completion, and its usage."""
    import httpx

    times, usage = [], None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
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
    return times, usage


def server_run(model: str, backend: str, tokens: int, repeats: int) -> dict:
    """Median client-observed and server-engine decode tok/s through ``ninfer serve``."""
    import httpx

    port = free_ports()
    log = os.path.join(tempfile.mkdtemp(), "requests.jsonl")
    cmd = [sys.executable, "-m", "ninfer", "serve", model, "--backend", backend, "--port",
           str(port), "--max-concurrency", "4", "--max-context", "2048",
           "--request-log-jsonl", log]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        ready_s = _wait_ready(proc, base)
        mid = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        body = {"model": mid, "messages": [{"role": "user", "content": PROMPT}],
                "temperature": 0, "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        client, counts = [], []
        for i in range(repeats + 1):
            times, usage = _stream_once(base, body)
            if i:  # the first request warms up
                n = usage["completion_tokens"]
                client.append((n - 1) / (times[-1] - times[0]))
                counts.append(n)
        time.sleep(0.3)  # the last records reach the log
        with open(log, encoding="utf-8") as f:
            recs = [json.loads(x) for x in f]
        fins = [r for r in recs if r["kind"] == "request.finished"][1:]
        srv = [(r["completion_tokens"] - 1) / r["timings"]["decode_s"] for r in fins]
        return {"client_tok_s": round(statistics.median(client), 1),
                "server_engine_tok_s": round(statistics.median(srv), 1),
                "client_all": [round(x, 1) for x in client], "completion_tokens": counts,
                "ready_s": round(ready_s, 1), "records": len(recs),
                "started_backend": recs[0]["environment"]["backend"]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure(model: str | None, backend: str, *, tokens: int, repeats: int, log=print) -> dict:
    """Engine-only decode (graphs, and eager on the GPU), then the server's, and the overhead."""
    from ninfer.kernels import resolve_backend
    from ninfer.server import load_runtime

    backend = resolve_backend(backend)
    rt = load_runtime(model, backend)
    res: dict = {"model": str(rt.path), "tokens": tokens, "repeats": repeats}
    res["engine_graph"] = engine_only(rt, True, tokens, repeats)
    log(f"engine-only: {res['engine_graph']}")
    if backend == "cupy":
        res["engine_eager"] = engine_only(rt, False, tokens, repeats)
        log(f"engine-only, eager: {res['engine_eager']}")
    res["server"] = server_run(str(rt.path), backend, tokens, repeats)
    log(f"server: {res['server']}")
    base = res["engine_graph"]["tok_s"]
    res["overhead_client"] = round(1 - res["server"]["client_tok_s"] / base, 4)
    res["overhead_server_engine"] = round(1 - res["server"]["server_engine_tok_s"] / base, 4)
    return res
