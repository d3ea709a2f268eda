"""Event-log throughput: records/s through the bus with every sink on (JSONL file, SSE hub with a
subscriber, the serving fold), against the rate the engine produces records at
``--max-concurrency 8``; and engine decode tok/s with logging on vs off (target: <= 2 % cost).

    python bench/events_throughput.py [MODEL]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import trio

from ninfer.events import schema as ev
from ninfer.events.bus import EventBus
from ninfer.events.fold import ServingState, fold_or_skip
from ninfer.events.sinks import FoldSink, JsonlSink, SseHub


def all_sinks(bus: EventBus, log: Path) -> SseHub:
    hub = SseHub()
    for s in (JsonlSink(log), hub, FoldSink("serving", fold_or_skip, ServingState())):
        bus.add_sink(s)
    return hub


async def bus_rate(log: Path, n: int = 50_000) -> float:
    bus = EventBus()
    hub = all_sinks(bus, log)
    bus.attach()
    sub = hub.subscribe()
    events = [ev.SchedulerRound(round=i, lanes=list(range(8)), tokens=8, duration_s=0.01,
                                itl_s=[0.01] * 8, waiting=0) for i in range(n)]
    t = time.perf_counter()
    for i, e in enumerate(events):
        bus.emit(e)
        if i % 256 == 0:
            await hub.next_items(sub, 0)  # the subscriber keeps up
    return n / (time.perf_counter() - t)


def engine_run(rt, concurrency: int, tokens: int, bus: EventBus) -> tuple[float, float, int]:
    """(decode tok/s over full-width rounds, seconds, records emitted)."""
    from ninfer.engine.engine import Engine, EngineConfig
    from ninfer.engine.requests import Request
    from ninfer.engine.sampling import SamplingParams

    widths = []

    class Rounds:
        name = "rounds"

        def write(self, record, line):
            if record.kind == "scheduler.round" and len(record.event.lanes) == concurrency:
                widths.append((record.event.tokens, record.event.duration_s))

    bus.add_sink(Rounds())
    engine = Engine(rt.model, rt.tokenizer, bus, EngineConfig(max_concurrency=concurrency,
                                                              max_context=1024))
    ids = rt.tokenizer.encode(rt.template.render([{"role": "user", "content": "Tell a story."}],
                                                 add_generation_prompt=True))
    for i in range(concurrency):
        engine.submit(Request(f"r{i}", ids, SamplingParams(temperature=0.0), tokens,
                              lambda _o: None, ignore_eos=True))
    before = bus.records_emitted
    t = time.perf_counter()
    while engine.step():
        bus.flush()
    bus.flush()
    wall = time.perf_counter() - t
    toks = sum(a for a, _ in widths[2:])
    secs = sum(b for _, b in widths[2:])
    return toks / secs, wall, bus.records_emitted - before


def main() -> int:
    from ninfer.server import load_runtime

    rt = load_runtime(sys.argv[1] if len(sys.argv) > 1 else None)
    with tempfile.TemporaryDirectory() as d:
        rate = trio.run(bus_rate, Path(d) / "bus.jsonl")
        print(f"bus with all sinks: {rate:,.0f} records/s")
        bus = EventBus()
        all_sinks(bus, Path(d) / "engine.jsonl")
        tps, wall, n = engine_run(rt, 8, 32, bus)
        print(f"engine at --max-concurrency 8: {n / wall:,.0f} records/s produced "
              f"({n} records in {wall:.1f} s; headroom {rate / (n / wall):,.0f}x)")
        on = [engine_run(rt, 1, 48, _logged(Path(d) / f"on{i}.jsonl"))[0] for i in range(3)]
        off = [engine_run(rt, 1, 48, EventBus())[0] for _ in range(3)]
        print(f"batch-1 decode: logging on {max(on):.1f} tok/s, off {max(off):.1f} tok/s, "
              f"cost {100 * (1 - max(on) / max(off)):+.1f} %")
    return 0


def _logged(path: Path) -> EventBus:
    bus = EventBus()
    all_sinks(bus, path)
    return bus


if __name__ == "__main__":
    sys.exit(main())
