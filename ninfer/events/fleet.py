"""What gateways read of a worker: the load and model views of the serving fold.

A cache-aware gateway in front of several replicas (``smg``, ``vllm-router``; see
docs/scale-out.md) polls each one for its load. ``smg`` reads SGLang's ``GET /v1/loads``
document (``WorkerLoadResponse``: one ``SchedulerLoadSnapshot`` per data-parallel rank, here
one) from workers it registers as ``generic`` (docs/scale-out.md says what ``vllm-router``
reads instead). It is a fold of the log, like ``/telemetry``, so ``ninfer replay`` reproduces
it.

KV usage counts the pages that running requests hold: pages of idle lanes that retain a prefix
for reuse (L1) are taken back whenever a request needs them, so a replica whose warm cache
fills its pool is not "full" to a gateway's overload guard (smg's ``--worker-overload-token-usage``).
"""
from __future__ import annotations

import datetime

from .fold import ServingState


def kv_usage(state: ServingState) -> tuple[int, int]:
    """``(used, total)`` KV pages: those running requests hold, from the last
    ``telemetry.sample`` (the start-up plan's page count before the first sample), 0 once none
    runs (a sample taken while some ran is stale then)."""
    occ = state.occupancy or {}
    total = int(occ.get("total_pages", state.memory.get("kv_pages", 0)))
    free, retained = int(occ.get("free_pages", total)), int(occ.get("retained_pages", 0))
    used = max(total - free - retained, 0) if state.requests.running else 0
    return used, total


def worker_load(state: ServingState, version: str) -> dict:
    """SGLang's ``/v1/loads`` document (smg ``WorkerLoadResponse``) for this replica.

    ``num_used_tokens`` / ``max_total_num_tokens``: KV positions (pages x page size) held by
    running requests / in the pool; ``token_usage`` their ratio; ``cache_hit_rate``: prompt
    tokens reused over prompt tokens looked up (prefix reuse, every tier)."""
    page_size = int(state.memory.get("kv_page_size", state.config.get("page_size", 0)) or 0)
    used, total = kv_usage(state)
    running = len(state.requests.running)
    waiting = state.requests.waiting
    c = state.cache
    snapshot = {
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used * page_size, "max_total_num_tokens": total * page_size,
        "token_usage": round(used / total, 4) if total else 0.0,
        "gen_throughput": 0.0,   # not folded yet (a rate needs a window): 0, as smg allows
        "cache_hit_rate": round(c.reused_tokens / c.lookup_prompt_tokens, 4)
        if c.lookup_prompt_tokens else 0.0,
        "utilization": round(running / len(state.lanes.views), 4) if state.lanes.views else 0.0,
        "max_running_requests": int(state.config.get("max_concurrency", 0) or 0),
    }
    ts = state.sample_ts   # of the occupancy read ("" before the first sample)
    return {"timestamp": datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat()
            if ts else "", "version": version, "dp_rank_count": 1,
            "loads": [snapshot]}


