"""The dashboard's view of the serving fold (``events.fold``): series, latency summary, the
request table and the cache panel.

One definition serves the live page (``GET /dashboard/state``) and offline replay of a JSONL file
(``POST /dashboard/replay``): the browser only renders what this returns, so live and offline
views cannot drift. Per time bucket (``events.series``): aggregate and per-sequence decode
tok/s, mean decode batch, prefill tok/s, the occupancy sample that held and the execution
thread's wall-clock split.
"""
from __future__ import annotations

import math

from .fold import ServingState


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _percentile(values: list, q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def _plain(m):
    return None if m is None else dict(m)


def dashboard_view(state: ServingState) -> dict:
    """Everything the page draws: series per bucket, latency summary, requests, budget."""
    series = []
    for b in state.series.buckets:
        batch = b.decode_lane_rounds / b.decode_rounds if b.decode_rounds else None
        agg = _rate(b.decode_tokens, b.decode_seconds)
        series.append({
            "t": b.t, "decode_tok_s": agg,
            "decode_tok_s_per_seq": agg / batch if agg is not None and batch else None,
            "decode_batch": batch, "prefill_tok_s": _rate(b.prefill_tokens, b.prefill_seconds),
            "occupancy": _plain(b.occupancy), "worker": _plain(b.worker_delta)})
    reqs = [dict(r) for r in state.table.rows.values()]
    done = [r for r in reqs if r["state"] == "finished"]
    ttfts = [r["ttft_s"] for r in done]
    latency = {"requests": len(done), "ttft_p50_s": _percentile(ttfts, 50),
               "ttft_p90_s": _percentile(ttfts, 90), "ttft_p99_s": _percentile(ttfts, 99)}
    if done:
        restore = sum(r.get("restore_s", 0.0) for r in done)
        latency["queue_share"] = (sum(r["queue_s"] for r in done) - restore) / max(sum(ttfts),
                                                                                  1e-12)
        latency["prefill_share"] = sum(r["prefill_s"] for r in done) / max(sum(ttfts), 1e-12)
        latency["restore_share"] = restore / max(sum(ttfts), 1e-12)
    t = state.table
    started = ({"config": dict(state.config), "memory": dict(state.memory),
                "artifact": dict(state.artifact), "environment": dict(state.environment)}
               if state.started else None)
    return {
        "instance": state.instance, "bucket_s": state.series.bucket_s, "series": series,
        "latency": latency, "requests": reqs[::-1][:50],
        "prefill_avoided_share": (t.cached_tokens / t.prompt_tokens
                                  if t.prompt_tokens else None),
        "started": started, "gpu": _plain(state.gpu),
        "cache": _cache_view(state),
    }


def _cache_view(state: ServingState) -> dict | None:
    """The cache panel: L1 prefix reuse (retained lanes); None when the server did not report
    prefix reuse (the panel then says there is nothing to show)."""
    cfg = state.config
    if cfg.get("prefix_reuse") is None:
        return None
    c = state.cache
    return {
        "prefix reuse": "on" if cfg["prefix_reuse"] else "off (--no-prefix-reuse)",
        "L1 lanes retaining a prefix": f"{len(c.resident)} of {cfg.get('max_concurrency')}",
        "L1 retained tokens": sum(c.resident.values()),
        "lookups (hits / total)": f"{c.hits} / {c.lookups}",
        "prompt tokens reused": c.reused_tokens,
        "evicted prefixes (tokens)": f"{c.evictions} ({c.evicted_tokens})",
        "truncated prefixes (tokens cut)": f"{c.truncations} ({c.truncated_tokens})",
        "L2 host images (bytes)": (f"{c.l2_entries} ({c.l2_bytes})"
                                   if cfg.get("continuation_cache") in ("l1-l2", "l1-l2-l3")
                                   else "off"),
        "L2 demotions / restores": f"{c.l2_demotions} / {c.restores['l2']}",
        "L3 disk images (bytes)": (f"{c.l3_entries} ({c.l3_bytes})"
                                   if cfg.get("continuation_cache") == "l1-l2-l3" else "off"),
        "L3 writes / restores": f"{c.l3_persisted} / {c.restores['l3']}",
    }
