"""Needle-in-a-haystack retrieval under each ``--kv-dtype``: real SmolLM2, NumPy backend.

A haystack of varied filler sentences (fixed seed) fills the prompt up to ``--context`` tokens;
one fact, "The secret code for <name> is <number>.", is planted at each depth fraction
(0 = first sentence, 1 = last, before the question), and the chat-templated question at the
end asks for it. The engine answers greedily (``--max-tokens``); a hit is the number in the
answer. Every mode runs its own engine, so each quantizes its own KV. Within one mode the
depths run deepest first with prefix reuse on (the haystack before the needle is shared; the
quantized modes attend to the pages as stored, so a reused prefix reads what a cold prefill
would write; ``--no-reuse`` prefills each prompt cold).

    python bench/needle.py [MODEL] [--context 7500] [--depths 10] [--modes fp16,int8,...]
                           [--json OUT]

MODEL defaults to the embedded SmolLM2-135M-Instruct (8,192-token context).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

MODES = ("fp16", "int8", "rk8v4", "rk4v4", "rk4v4-e8", "rk2v4-e8")
NAME, CODE = "Marigold", "48271"
NEEDLE = f"The secret code for {NAME} is {CODE}."
QUESTION = f"What is the secret code for {NAME}? Answer with the number only."

# filler vocabulary: sentences are drawn from these, so the haystack never repeats one line
_SUBJ = ("The old miller", "A young painter", "The harbour master", "My neighbour", "The baker",
         "A tired traveller", "The village choir", "Our teacher", "The gardener", "A fisherman",
         "The librarian", "The river", "A small fox", "The night train", "The north wind",
         "A quiet student", "The shepherd", "The carpenter", "An elderly poet", "The potter")
_VERB = ("walked past", "painted", "talked about", "waited near", "remembered", "repaired",
         "sang about", "carried", "looked at", "wrote a letter about", "cleaned", "forgot",
         "dreamed of", "visited", "described", "sketched", "admired", "moved", "found", "sold")
_OBJ = ("the stone bridge", "a basket of apples", "the blue door", "the autumn fair",
        "a broken clock", "the lighthouse", "an old map", "the market square", "a wooden boat",
        "the orchard", "a pair of boots", "the chapel bell", "a jar of honey", "the mill pond",
        "the empty barn", "a woollen scarf", "the hill path", "a loaf of rye bread",
        "the garden wall", "a silver spoon")
_TAIL = ("in the morning", "after the rain", "before supper", "while the bells rang",
         "on a grey afternoon", "without a word", "at the end of summer", "with great care",
         "as the fog lifted", "late in the evening", "under the elm trees", "for the first time",
         "during the long winter", "near the harbour", "once again", "by the fire")
_AFTER = ("It was quiet", "Nobody noticed", "Everyone smiled", "The dog barked",
          "Then it rained", "Few people cared")


def sentences(seed: int):
    """An endless deterministic stream of filler sentences (no digits, no 'secret code')."""
    rng = random.Random(seed)
    while True:
        s = f"{rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_TAIL)}."
        if rng.random() < 0.3:
            s += f" {rng.choice(_AFTER)}."
        yield s


def chat_ids(rt, text: str) -> list[int]:
    """Token ids of one user message under the model's chat template, generation prompt added."""
    return rt.tokenizer.encode(rt.template.render([{"role": "user", "content": text}],
                                                  add_generation_prompt=True))


def build_prompts(rt, context_tokens: int, depths: list[float], seed: int = 0) -> list[list[int]]:
    """One prompt of at most ``context_tokens`` tokens per depth fraction: the same haystack,
    the needle inserted at the sentence boundary nearest that fraction of its tokens."""
    fixed = len(chat_ids(rt, f"{NEEDLE}\n\n{QUESTION}")) + 2
    hay, lens, total = [], [], 0
    for s in sentences(seed):   # (each sentence after the first tokenizes with its space)
        n = len(rt.tokenizer.encode(" " + s))
        if fixed + total + n > context_tokens:
            break
        hay.append(s)
        lens.append(n)
        total += n
    cum = [0]
    for n in lens:
        cum.append(cum[-1] + n)
    prompts = []
    for d in depths:
        k = min(range(len(cum)), key=lambda i: abs(cum[i] - d * total))
        text = " ".join(hay[:k] + [NEEDLE] + hay[k:])
        ids = chat_ids(rt, f"{text}\n\n{QUESTION}")
        if len(ids) > context_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens past --context {context_tokens}")
        prompts.append(ids)
    return prompts


def run_mode(rt, mode: str, prompts: list[list[int]], max_tokens: int = 20,
             reuse: bool = True) -> list[dict]:
    """Greedy answers of ``prompts`` through one engine whose KV pages store ``mode``; deepest
    needle (the last prompt) first so that each prompt reuses the longest cached prefix.

    Returns:
        One dict per prompt, in the order given: ``answer`` (text), ``ids``, ``hit`` (the code
        appears in the answer), ``prompt_tokens``, ``cached_tokens``, ``seconds``.
    """
    from ninfer.engine.engine import Engine, EngineConfig
    from ninfer.engine.requests import FinalOutput, Request, TokenOutput
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus

    bus = EventBus()
    ctx = -(-(max(map(len, prompts)) + max_tokens) // 16) * 16
    engine = Engine(rt.model, rt.tokenizer, bus, EngineConfig(
        max_concurrency=1, max_context=ctx, prefill_chunk=512, prefix_reuse=reuse,
        kv_dtype=mode))
    rows: dict[int, dict] = {}
    for i in reversed(range(len(prompts))):
        out: list = []
        t0 = time.perf_counter()
        engine.submit(Request(f"{mode}-{i}", prompts[i], SamplingParams(temperature=0.0),
                              max_tokens, out.append))
        while engine.step():
            bus.flush()
        bus.flush()
        fin = out[-1]
        if not isinstance(fin, FinalOutput):
            raise RuntimeError(f"{mode} depth #{i}: {fin}")
        ids = [o.token_id for o in out if isinstance(o, TokenOutput)]
        answer = rt.tokenizer.decode(ids, skip_special=True)
        rows[i] = {"answer": answer, "ids": ids, "hit": CODE in answer.replace(",", ""),
                   "prompt_tokens": fin.prompt_tokens, "cached_tokens": fin.cached_tokens,
                   "seconds": round(time.perf_counter() - t0, 2)}
    return [rows[i] for i in range(len(prompts))]


def table(results: dict[str, list[dict]], depths: list[float]) -> str:
    """Mode x depth (``hit`` / ``-``), hits per mode, and answers equal to fp16's."""
    head = "| mode | " + " | ".join(f"{d:.2f}" for d in depths) + " | hits | = fp16 |"
    lines = [head, "|---" * (len(depths) + 3) + "|"]
    ref = results.get("fp16")
    for mode, rows in results.items():
        same = "" if ref is None else str(sum(a["answer"] == b["answer"]
                                              for a, b in zip(rows, ref)))
        cells = " | ".join("hit" if r["hit"] else "-" for r in rows)
        lines.append(f"| {mode} | {cells} | {sum(r['hit'] for r in rows)}/{len(rows)} "
                     f"| {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--context", type=int, default=7500, help="prompt tokens, at most")
    ap.add_argument("--depths", type=int, default=10, help="depth fractions, 0..1 evenly")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=20,
                    help="enough for the model to restate the question before the number")
    ap.add_argument("--no-reuse", action="store_true", help="prefill every prompt cold")
    ap.add_argument("--json", default=None, help="write every answer here")
    args = ap.parse_args(argv)
    from ninfer.server import load_runtime
    rt = load_runtime(args.model, "numpy")   # quantized KV: the NumPy backend only
    n = args.depths
    depths = [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
    prompts = build_prompts(rt, args.context, depths)
    print(f"context {args.context}: prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, depths {n}", flush=True)
    results = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        results[mode] = run_mode(rt, mode, prompts, args.max_tokens, not args.no_reuse)
        print(f"{mode}: {sum(r['hit'] for r in results[mode])}/{n} hits, "
              f"{time.perf_counter() - t0:.0f} s; answers "
              f"{[r['answer'] for r in results[mode]]}", flush=True)
        if args.json:   # written after every mode: a stopped run keeps what it finished
            with open(args.json, "w") as f:
                json.dump({"context": args.context, "depths": depths, "needle": NEEDLE,
                           "question": QUESTION, "max_tokens": args.max_tokens,
                           "reuse": not args.no_reuse, "results": results}, f, indent=1)
    print(table(results, depths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
