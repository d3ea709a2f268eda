"""Agent traces through the smg gateway in front of 1 replica, then 2: aggregate throughput and
reused-token share (docs/scale-out.md; target: 2 replicas at least 1.8x one at the same share).

Usage:
    python bench/fleet_trace.py [--model MODEL] [--replicas 1,2] [--cpus 0,1]
        [--traces tool-loop] [--scale 1] [--turns 8] [--parallel 16] [--max-tokens 16]
        [--lanes 4] [--seed 0] [--smg-args '...'] [--json OUT]

Each run starts a fresh fleet (``ninfer fleet``'s code: replicas, each with its own L3
namespace, behind ``smg launch --policy cache_aware``) and replays ``--parallel`` copies of the
traces concurrently through the gateway (``bench/agent_trace.py``, same seed every run, so
every run sends the same requests): by default 16 tool-loop sessions of 8 turns against 4 lanes
a replica, so that both runs keep every lane busy (with only as many sessions as lanes, a lane
idles between a session's turns; a replica with a queue never does). Replica i runs on the
i-th entry of ``--cpus`` with one math-library thread a CPU, in both runs, so that the
comparison is of replicas, not of cores; the gateway and this client run unpinned. A row:
requests, prompt tokens, reused share (reused / prompt, the server's counts), prefilled and
generated tokens, wall time, and ``tok_s`` = (prefilled + generated) / wall, the tokens the
replicas computed a second; ``x``: its ratio to the first row's; the requests each replica
admitted; the CPU seconds this client and the gateway used meanwhile (on the replicas' cores
when there are no others); the load average before the run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import agent_trace  # noqa: E402

from ninfer.fleet import FleetConfig, _cpu_sets, find_smg  # noqa: E402
from ninfer.fleet_supervisor import Fleet  # noqa: E402
from ninfer.ports import free_ports  # noqa: E402


# each session's requests carry its name as smg's routing key: its first turn goes to the
# replica with the fewest sessions, every later one where it is pinned
STICKY = "--sticky-sessions --assignment-mode min_group"
# without keys (--session-header ''): smg's text match pins nearly every session to one
# replica (seen: 56 of 64 requests) unless a replica this far above the mean load spills
SPILL = "--balance-abs-threshold 1 --balance-rel-threshold 1.25"


def fleet_config(n: int, cpus, model, lanes: int, max_context: int, tmp: str,
                 smg_args=()) -> FleetConfig:
    """``n`` replicas on the first ``n`` CPU sets (as many math-library threads as CPUs), fresh
    stores and free ports under ``tmp``; the gateway keeps every later turn where its prefix
    is (no warm-up diversion)."""
    base = free_ports(n + 2)   # the gateway, its metrics, then the replicas
    return FleetConfig(
        model=model, replicas=n, port=base, metrics_port=base + 1, replica_port=base + 2,
        kv_events_port=0, cache_dir=f"{tmp}/l3", cpus=tuple(cpus[:n]), log_dir=f"{tmp}/logs",
        serve_args=("--max-concurrency", str(lanes), "--max-context", str(max_context),
                    "--continuation-cache-persist-min-tokens", "16",
                    "--pending-timeout-ms", "600000"),   # (a queued turn waits, not 429)
        smg_args=("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
                  "--log-level", "warn", *smg_args))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _admitted(port: int) -> int:
    """Requests replica ``port`` admitted (its ``/telemetry``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/telemetry", timeout=30) as r:
        return json.loads(r.read())["scheduler"]["admitted_requests"]


def row(n: int, res: dict) -> dict:
    """One run's totals over every trace."""
    rows = [r for t in res["traces"].values() for r in t["rows"]]
    tot = agent_trace.summary([agent_trace.Row(**r) for r in rows])
    wall = res["wall_s"]
    computed = tot["prefilled"] + tot["completion_tokens"]
    return {"replicas": n, "requests": len(rows), "prompt_tokens": tot["prompt_tokens"],
            "reused": tot["reused"], "ceiling": tot["ceiling"],
            "reused_share": round(tot["reused"] / tot["prompt_tokens"], 4),
            "prefilled": tot["prefilled"], "generated": tot["completion_tokens"],
            "wall_s": wall, "tok_s": round(computed / wall, 1)}


def measure(a, log=print) -> list[dict]:
    """One row per replica count of ``a.replicas``, each from a fresh fleet."""
    import trio

    smg = find_smg(a.smg)
    out = []
    for n in a.replicas:
        # (the ports stay free until the fleet binds them: the gap is a few milliseconds)
        with tempfile.TemporaryDirectory(prefix=f"fleet-trace-{n}-") as tmp:
            fleet = Fleet(fleet_config(n, a.cpus, a.model, a.lanes, a.max_context, tmp,
                                       shlex.split(a.smg_args)), smg)
            fleet.start(handle_signals=False)
            try:
                load = os.getloadavg()[0]
                cpu0 = _cpu_s(os.getpid()), _cpu_s(fleet.gateway.popen.pid)
                res = trio.run(functools.partial(
                    agent_trace.replay, fleet.url, a.traces, a.scale, a.turns, a.model,
                    seed=a.seed, log=lambda *_: None, parallel=a.parallel,
                    max_tokens=a.max_tokens, session_header=a.session_header or None))
                cpu = [round(_cpu_s(p) - c, 1) for p, c in zip(
                    (os.getpid(), fleet.gateway.popen.pid), cpu0)]
                split = [_admitted(port) for port in fleet.config.replica_ports()]
            finally:
                fleet.stop()
        r = {**row(n, res), "per_replica": split, "load_before": round(load, 2),
             "client_cpu_s": cpu[0], "gateway_cpu_s": cpu[1],
             "rows": [r for t in res["traces"].values() for r in t["rows"]]}
        r["x"] = round(r["tok_s"] / out[0]["tok_s"], 2) if out else 1.0
        out.append(r)
        log(f"fleet-trace {n} replica{'s' if n > 1 else ' '}  {r['requests']} requests  "
            f"prompt {r['prompt_tokens']}  reused {r['reused_share']:.1%}  prefilled "
            f"{r['prefilled']}  generated {r['generated']}  {r['wall_s']:.1f} s  "
            f"{r['tok_s']:.1f} tok/s  x{r['x']:.2f}  (requests per replica "
            f"{'/'.join(map(str, split))}; CPU s client {cpu[0]}, smg {cpu[1]}; load average "
            f"{load:.2f} before)")
    return out


def _counts(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected replica counts like 1,2, got {text!r}")
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"replica counts must be >= 1, got {text!r}")
    return vals


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model file (default: the bundled SmolLM2)")
    ap.add_argument("--replicas", type=_counts, default=(1, 2))
    ap.add_argument("--cpus", type=_cpu_sets, default=_cpu_sets("0,1"),
                    help="replica i's CPU or range (default 0,1)")
    ap.add_argument("--traces", default="tool-loop")
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=16, help="copies replayed at once "
                    "(default 16: more sessions than the lanes of 2 replicas)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lanes", type=int, default=4, help="--max-concurrency of a replica")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smg", default=None)
    ap.add_argument("--smg-args", default=STICKY, help=f"more smg flags (default {STICKY!r}; "
                    f"cache-aware by text alone: {SPILL!r} and --session-header '')")
    ap.add_argument("--session-header", default="x-smg-routing-key",
                    help="the header naming each request's session ('': none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.traces = a.traces.split(",")
    unknown = [t for t in a.traces if t not in agent_trace.TRACES]
    if unknown:
        ap.error(f"unknown trace {unknown[0]!r} (expected some of "
                 f"{', '.join(agent_trace.TRACES)})")
    if len(a.cpus) < max(a.replicas):
        ap.error(f"--cpus names {len(a.cpus)} CPU sets for {max(a.replicas)} replicas")
    return a


def main(argv=None) -> int:
    from ninfer.fleet import FleetError

    a = parse(argv)
    try:
        rows = measure(a)
    except FleetError as exc:
        print(f"fleet_trace: {exc}", file=sys.stderr)
        return 1
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
