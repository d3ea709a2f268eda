"""First-token time of a short request submitted while a deep cold prefill runs (issue 31's
``ttft short-behind-64k`` row): a real engine on its own thread, two lanes, the long prompt
submitted first and the short one ``delay`` seconds later, both random token ids with no reuse.
The short request's time to first token counts from its own submission."""
from __future__ import annotations

import threading
import time

import numpy as np

from ninfer.bench.model import BenchModel


def measure(bm: BenchModel, *, long: int, short: int = 200, delay: float = 1.0,
            chunk: int = 512, prefill_lanes: int = 2, log=print) -> dict:
    """``{"ttft_behind": {...}}``: both requests' first-token seconds (each from its own
    submission), and whether the short one's came before the long one's.

    Raises:
        RuntimeError: a request failed or did not finish within ten minutes.
    """
    from ninfer.engine.engine import Engine, EngineConfig, FinalOutput, Request, TokenOutput
    from ninfer.engine.sampling import SamplingParams
    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.events.bus import EventBus
    from ninfer.server import decode_model
    from ninfer.store.artifact import load_model_file

    tok = Tokenizer.from_dict(load_model_file(bm.path).tokenizer)
    config = EngineConfig(max_concurrency=2, max_context=long + short + 64, prefill_chunk=chunk,
                          max_prefill_lanes=prefill_lanes, prefix_reuse=False,
                          decode_lookahead="off", kv_dtype=bm.kv_dtype)
    engine = Engine(decode_model(bm.base, config)[0], tok, EventBus(), config)
    rng = np.random.default_rng(7)
    vocab = bm.config.vocab_size
    marks: dict[str, float] = {}
    failed: set[str] = set()
    done = {name: threading.Event() for name in ("long", "short")}

    def deliver(name):
        def got(item):   # (called on the engine's thread)
            if isinstance(item, TokenOutput):
                marks.setdefault(name, time.monotonic())
                return
            if not isinstance(item, FinalOutput):
                failed.add(name)
            done[name].set()
        return got

    greedy = SamplingParams(temperature=0.0)
    sent = {}
    engine.start()
    try:
        for name, n, wait in (("long", long, 0.0), ("short", short, delay)):
            time.sleep(wait)
            ids = rng.integers(0, vocab, size=n).tolist()
            sent[name] = time.monotonic()
            engine.submit(Request(f"ttft-{name}", ids, greedy, 1, deliver(name)))
        for name, ev in done.items():
            if not ev.wait(600):
                raise RuntimeError(f"ttft_behind: the {name} request did not finish")
    finally:
        engine.stop()
    failed |= {n for n in ("long", "short") if n not in marks}
    if failed:
        raise RuntimeError(f"ttft_behind: {', '.join(sorted(failed))} failed")
    row = {"long_tokens": long, "short_tokens": short, "delay_s": delay, "chunk": chunk,
           "prefill_lanes": prefill_lanes,
           "short_ttft_s": round(marks["short"] - sent["short"], 3),
           "long_ttft_s": round(marks["long"] - sent["long"], 3),
           "short_first": marks["short"] < marks["long"]}
    log(f"ttft behind {long}: short {row['short_ttft_s']} s, long {row['long_ttft_s']} s")
    return {"ttft_behind": row}
