"""CPU decode benchmark: ninfer's NumPy engine vs HuggingFace transformers (CPU torch) on the same
GGUF, in the same run.

Prints decode tok/s at batch 1 and 4 for both, ninfer's ratio to transformers, and the fraction of
the memory-bandwidth roofline each reaches (bytes streamed per decode step / measured copy
bandwidth). Usage::

    python bench/cpu_decode.py [MODEL.gguf] [--tokens 64] [--batches 1 4] [--no-peer]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np


def copy_bandwidth_bytes_per_s(n_bytes: int = 256 << 20, reps: int = 5) -> float:
    """Best of ``reps`` large array copies; counts read + write bytes (like STREAM copy)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def ninfer_decode(rt, batch: int, n_tokens: int, prompt_ids: list[int]) -> float:
    """Aggregate decode tok/s over rounds where all ``batch`` lanes decode."""
    from ninfer.engine.engine import Engine, EngineConfig, Request
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus

    rounds = []

    class Rounds:
        name = "rounds"

        def write(self, record, line):
            if record.kind == "scheduler.round" and len(record.event.lanes) == batch:
                rounds.append((record.event.tokens, record.event.duration_s))

    bus = EventBus()
    bus.add_sink(Rounds())
    engine = Engine(rt.model, rt.tokenizer, bus,
                    EngineConfig(max_concurrency=batch, max_context=2048, prefill_chunk=512))
    for i in range(batch):
        engine.submit(Request(f"b{i}", list(prompt_ids), SamplingParams(temperature=0.0),
                              n_tokens, lambda _item: None, ignore_eos=True))
    while engine.step():
        bus.flush()
    bus.flush()
    tokens = sum(t for t, _ in rounds[2:])  # skip two warm-up rounds
    secs = sum(d for _, d in rounds[2:])
    return tokens / secs


def transformers_decode(model, batch: int, n_tokens: int, prompt_ids: list[int]) -> float:
    import torch

    ids = torch.tensor([prompt_ids] * batch)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        pkv = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(n_tokens - 1):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
    times = times[2:]
    return batch * len(times) / sum(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    args = ap.parse_args(argv)

    from ninfer.server import load_runtime

    rt = load_runtime(args.model)
    msgs = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    prompt_ids = rt.tokenizer.encode(rt.template.render(msgs, add_generation_prompt=True))
    cfg = rt.artifact.config
    bw = copy_bandwidth_bytes_per_s()
    # bytes streamed per decode step: every float32 weight except the gathered embedding rows,
    # plus the tied head (the embedding matrix read in full) — KV is small at this context.
    m = rt.model
    weight_bytes = sum(a.nbytes for layer in m.layers for a in (getattr(layer, f) for f in layer.__slots__)
                       if isinstance(a, np.ndarray)) + m.norm.nbytes + m.lm_head.nbytes
    print(f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()} "
          f"{os.cpu_count()} cores, numpy {np.__version__}, python {sys.version.split()[0]}")
    print(f"# model {rt.path.name}: {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}; prompt {len(prompt_ids)} tokens; {args.tokens} decode tokens")
    print(f"# copy bandwidth {bw / 1e9:.1f} GB/s; float32 bytes per decode step "
          f"{weight_bytes / 1e6:.0f} MB -> roofline {bw / weight_bytes:.1f} steps/s")
    peer = None
    if not args.no_peer:
        import torch
        from transformers import LlamaForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        peer = LlamaForCausalLM.from_pretrained(str(rt.path.parent), gguf_file=rt.path.name,
                                                torch_dtype=torch.float32)
        peer.eval()
    print(f"{'batch':>5} {'ninfer tok/s':>13} {'roofline':>9} {'transformers tok/s':>19} "
          f"{'roofline':>9} {'ratio':>6}")
    for b in args.batches:
        ours = ninfer_decode(rt, b, args.tokens, prompt_ids)
        line = f"{b:>5} {ours:>13.1f} {ours / b / (bw / weight_bytes):>8.0%}"
        if peer is not None:
            theirs = transformers_decode(peer, b, args.tokens, prompt_ids)
            line += (f" {theirs:>19.1f} {theirs / b / (bw / weight_bytes):>8.0%} "
                     f"{ours / theirs:>5.2f}x")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
