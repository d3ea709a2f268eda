"""Greedy agreement of every ``--kv-dtype`` with fp16: real SmolLM2, NumPy backend.

Twenty chat prompts, each answered greedily (``--max-tokens``) by one engine per mode, which
quantizes its own KV; every answer is compared with fp16's, token by token. Reports, per mode,
the tokens equal to fp16's at the same position, the tokens before each answer's first
divergence, the answers equal to fp16's as a whole, and that every answer finished with finite
logits (the codec raises on a NaN or inf K / V; an answer that fails is a row, not a crash).

    python bench/kv_agreement.py [MODEL] [--max-tokens 32] [--modes fp32,fp16,...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from needle import MODES, chat_ids, run_mode   # same folder

PROMPTS = (
    "What is the capital of France?", "Write a haiku about autumn.",
    "List three prime numbers.", "Explain what a CPU does in one sentence.",
    "How many legs does a spider have?", "Give me a synonym for happy.",
    "What is 12 times 7?", "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish.",
    "Write a Python function that adds two numbers.", "What does DNA stand for?",
    "Suggest a name for a pet goldfish.", "What is the boiling point of water in Celsius?",
    "Describe a rainy day in two sentences.", "Who wrote Romeo and Juliet?",
    "What are the three primary colors?", "Give one tip for sleeping better.",
    "What is the largest planet in the solar system?", "Summarize the water cycle briefly.")


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Position-wise equal tokens, tokens before the first divergence, equal answers."""
    same = prefix = whole = 0
    for a, b in zip(got, ref):
        same += sum(x == y for x, y in zip(a, b))
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        whole += a == b
    total = sum(map(len, ref))
    return {"equal_tokens": same, "tokens": total, "equal_share": round(same / total, 4),
            "before_divergence": prefix, "equal_answers": whole}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default=",".join(("fp32",) + MODES))
    ap.add_argument("--json", default=None, help="write every answer here")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if "fp16" not in modes:
        modes.insert(0, "fp16")
    modes.sort(key=lambda m: m != "fp16")   # the reference first
    from ninfer.server import load_runtime
    rt = load_runtime(args.model, "numpy")   # every dtype: the NumPy reference
    prompts = [chat_ids(rt, p) for p in PROMPTS]
    answers, rows = {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        try:   # no prefix reuse: each prompt prefilled cold into this mode's pages
            out = run_mode(rt, mode, prompts, args.max_tokens, reuse=False)
            answers[mode] = [r["ids"] for r in out]
            rows[mode] = agreement(answers["fp16"], answers[mode]) | {"failed": None}
        except (RuntimeError, ValueError, FloatingPointError) as exc:
            rows[mode] = {"failed": f"{type(exc).__name__}: {exc}"}
        print(f"{mode:9s} {rows[mode]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{len(PROMPTS)} prompts x {args.max_tokens} tokens, greedy, against fp16:\n")
    print("| mode | tokens = fp16 | before the first divergence | answers = fp16 |")
    print("|---|---|---|---|")
    for mode, r in rows.items():
        if r["failed"]:
            print(f"| {mode} | failed: {r['failed']} | | |")
            continue
        print(f"| {mode} | {r['equal_tokens']} / {r['tokens']} ({r['equal_share']:.0%}) | "
              f"{r['before_divergence']} | {r['equal_answers']} / {len(PROMPTS)} |")
    if args.json:
        decode = lambda ids: rt.tokenizer.decode(ids, skip_special=True)
        with open(args.json, "w") as f:
            json.dump({"prompts": list(PROMPTS), "max_tokens": args.max_tokens, "rows": rows,
                       "answers": {m: [decode(a) for a in v] for m, v in answers.items()}},
                      f, indent=1)
    return 0 if not any(r["failed"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
