"""Time to first token over a growing multi-turn conversation, with and without prefix reuse.

An agent-style session: a long system prompt, then turns that each append the model's answer
and a new user message (a tool result) to the history. Each turn is one request through the
engine (the same code path the server runs); the TTFT, the prompt tokens and the tokens
prefill actually computed come from the engine's own records (``request.first_token``,
``cache.lookup``). The same session runs twice, ``--prefix-reuse`` on and off, after two short
unmeasured warm-up sessions (compilation, graph capture); greedy answers must agree (the run
fails otherwise).

    python bench/multiturn_ttft.py [MODEL] [--turns 8] [--backend numpy|cupy]

MODEL defaults to the embedded SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import argparse
import sys

SYSTEM = ("You are a coding assistant working in a repository. Tools: read_file(path), "
          "run(cmd). Answer briefly. ") * 12


def session(rt, turns: int, reuse: bool, max_tokens: int) -> list[dict]:
    from ninfer.engine.engine import Engine, EngineConfig
    from ninfer.engine.requests import FinalOutput, Request
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus

    rows: list[dict] = []

    class Sink:
        name = "bench"

        def write(self, record, line):
            e = record.event
            if record.kind == "cache.lookup":
                rows.append({"prompt": e.prompt_tokens, "reused": e.cached_tokens,
                             "path": e.path})
            elif record.kind == "request.first_token":
                rows[-1]["ttft_s"] = e.ttft_s

    bus = EventBus()
    bus.add_sink(Sink())
    engine = Engine(rt.model, rt.tokenizer, bus, EngineConfig(
        max_concurrency=2, max_context=4096, prefill_chunk=512, prefix_reuse=reuse))
    messages = [{"role": "system", "content": SYSTEM}]
    answers = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: the tool printed "
                         f"'{turn * 7} tests passed, {turn % 3} failed'. What next?"})
        ids = rt.tokenizer.encode(rt.template.render(messages, add_generation_prompt=True))
        out: list = []
        engine.submit(Request(f"t{turn}", ids, SamplingParams(temperature=0.0), max_tokens,
                              out.append))
        while engine.step():
            bus.flush()
        bus.flush()
        fin = out[-1]
        if not isinstance(fin, FinalOutput):
            raise RuntimeError(f"turn {turn} failed: {fin}")
        text = "".join(o.text for o in out)
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
    for r, a in zip(rows, answers):
        r["answer"] = a
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--backend", default="numpy")
    args = ap.parse_args(argv)
    from ninfer.server import load_runtime
    rt = load_runtime(args.model, args.backend)
    # a short session of each kind first: kernel compilation (CuPy compiles at first use) and
    # CUDA-graph captures land there, not in a measured turn; each session has its own engine
    session(rt, 3, True, args.max_tokens)
    session(rt, 2, False, args.max_tokens)
    cold = session(rt, args.turns, False, args.max_tokens)
    warm = session(rt, args.turns, True, args.max_tokens)
    print(f"model {rt.model_id}, backend {args.backend}, {args.turns} turns, "
          f"{args.max_tokens} output tokens per turn")
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'path':>17} {'TTFT reuse ms':>14} "
          f"{'TTFT cold ms':>13} {'speed-up':>9}")
    same = True
    for i, (w, c) in enumerate(zip(warm, cold)):
        same &= w["answer"] == c["answer"]
        print(f"{i:>4} {w['prompt']:>7} {w['reused']:>7} {w['path']:>17} "
              f"{w['ttft_s'] * 1e3:>14.1f} {c['ttft_s'] * 1e3:>13.1f} "
              f"{c['ttft_s'] / w['ttft_s']:>8.1f}x")
    tw = sum(w["ttft_s"] for w in warm[1:])
    tc = sum(c["ttft_s"] for c in cold[1:])
    print(f"turns 1..{args.turns - 1}: TTFT total {tw * 1e3:.0f} ms with reuse, "
          f"{tc * 1e3:.0f} ms cold ({tc / tw:.1f}x); prompt tokens computed "
          f"{sum(w['prompt'] - w['reused'] for w in warm)} vs {sum(c['prompt'] for c in cold)}")
    print("greedy answers identical with and without reuse:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
