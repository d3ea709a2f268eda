"""``ninfer plan MODEL --max-context N``: the start-up memory budget of a configuration, before
anything loads.

The model is read from its headers only (``store.model_shapes``): a ``.ninfer`` artifact, a
GGUF, an HF checkpoint folder, or a bare ``config.json`` (weights estimated from the parameter
count at ``--weight-bits``). The parts are ``engine.memory.plan_config``'s, the numbers
``ninfer serve`` checks with the same settings. Exit status: 0 when the plan fits the capacity
(or no capacity is known), ``EXIT_DOES_NOT_FIT`` (3) when it does not, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

EXIT_DOES_NOT_FIT = 3
STORED_INT4_BITS = 4.5   # int4 codes + one fp16 scale per 32 weights, as ninfer stores them


def add_parser(sub) -> None:
    """The ``plan`` subcommand on ``ninfer``'s subparsers."""
    from .config import ServeConfig, parse_prefill_chunk
    from .engine.kv_dtypes import CHOICES as KV_CHOICES

    d = ServeConfig()
    p = sub.add_parser("plan", help="the memory budget of a model and configuration, before "
                       f"loading anything (exit {EXIT_DOES_NOT_FIT}: it does not fit)")
    p.add_argument("model", nargs="?", default=None,
                   help=".ninfer artifact, GGUF, HF checkpoint folder, or an HF config.json "
                   "(Llama family or Qwen3.5; default: the bundled SmolLM2, as serve)")
    p.add_argument("--max-context", type=int, required=True, help="tokens per lane")
    p.add_argument("--kv-dtype", default="auto", choices=KV_CHOICES,
                   help="KV cache storage type (default auto, as serve: fp16 on cupy, fp32 on "
                   "numpy)")
    p.add_argument("--max-concurrency", type=int, default=1,
                   help=f"lanes (default 1: one long context; serve's default is "
                   f"{d.max_concurrency})")
    p.add_argument("--gpu-memory", default=None, help="capacity to plan against, e.g. 24GiB "
                   "(or 24G), 20000MB or bytes (default: this GPU's free memory, if there is one)")
    p.add_argument("--page-size", type=int, default=d.page_size,
                   help=f"tokens per KV page (default {d.page_size})")
    p.add_argument("--prefill-chunk", type=parse_prefill_chunk, default=d.prefill_chunk,
                   help="max prompt tokens per prefill pass, or auto: planned at 512, the "
                   "largest chunk serve's measurement may pick within the capacity reported "
                   f"beside (cupy) (default {d.prefill_chunk})")
    p.add_argument("--backend", default="cupy", choices=("cupy", "numpy"),
                   help="where the weights would live (default cupy: packed int4 / int8)")
    p.add_argument("--cuda-graph", default=True, action=argparse.BooleanOptionalAction,
                   help="include the decode graphs' allowance (cupy; default on)")
    p.add_argument("--weight-bits", type=float, default=None,
                   help="bits per parameter for a config.json (default "
                   f"{STORED_INT4_BITS}: int4 group-32 with fp16 scales; 32 on numpy)")
    p.add_argument("--turn-checkpoints", type=int, default=d.turn_checkpoints,
                   help="hybrid models: serve's ring of past turn checkpoints per lane (host "
                   "memory, beside the total: the turn checkpoint, the anchor and N more "
                   "recurrent states per lane)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(fn=run)


def _weights(shapes, backend: str, bits: float | None) -> tuple[int, int, str]:
    """(resident bytes, largest packed weight's elements, how the weights were sized)."""
    from .engine.weight_bytes import resident_bytes
    from .store.model_shapes import TensorShape, expected_shapes

    params = shapes.parameter_count()
    if shapes.tensors:
        total, largest = resident_bytes(shapes.tensors, backend)
        return total, largest, f"{params / 1e9:.3g}B parameters from the {shapes.source} " \
            f"tensor headers, as prepared on {backend}"
    bits = bits if bits is not None else (STORED_INT4_BITS if backend == "cupy" else 32.0)
    # the largest packed weight (GPU scratch) as if every matrix were int4
    packed = [TensorShape(n, "q4", s, 32) for n, s in
              expected_shapes(shapes.architecture, shapes.config).items()]
    _, largest = resident_bytes(packed, backend)
    how = f"{params / 1e9:.3g}B parameters at {bits:g} bits" + \
        (" (int4 group-32 with fp16 scales, as ninfer stores them)"
         if bits == STORED_INT4_BITS else "")
    return math.ceil(params * bits / 8), largest, how


def _capacity(ns) -> tuple[int | None, str]:
    from .config import parse_size

    if ns.gpu_memory is not None:
        return parse_size(ns.gpu_memory), "--gpu-memory"
    if ns.backend == "cupy":
        from .kernels import cupy_usable
        if cupy_usable():
            from .engine.memory import device_capacity_bytes
            from .kernels import get_ops
            return device_capacity_bytes(get_ops("cupy")), "this GPU's free memory"
    return None, "unknown (give --gpu-memory)"


def make_plan(ns):
    """(MemoryPlan, details dict) of parsed ``plan`` arguments.

    Raises:
        FileNotFoundError, ArtifactError, ValueError: bad model or arguments.
    """
    from .config import MAX_CONTEXT_TOKENS
    from .engine import chunk_size
    from .engine.memory import (kv_bytes_per_token, kv_layers, l2_budget_bytes, plan_config,
                                state_bytes_per_lane)
    from .kernels.graph_buckets import buckets_for
    from .store.model_shapes import read_model_shapes

    auto = ns.prefill_chunk == chunk_size.AUTO
    for flag in ("max_context", "max_concurrency", "page_size") + (() if auto else
                                                                    ("prefill_chunk",)):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if getattr(ns, flag) > MAX_CONTEXT_TOKENS:   # (past int32: a typo, not a plan)
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(ns, flag)} is more than "
                             f"{MAX_CONTEXT_TOKENS} (2**31 - 1)")
    if ns.turn_checkpoints < 0:
        raise ValueError("--turn-checkpoints must be >= 0")
    if ns.weight_bits is not None and not 0 < ns.weight_bits <= 64:
        raise ValueError("--weight-bits must be a number in (0, 64]")
    from .engine.kv_dtypes import resolve
    ns.kv_dtype = resolve(ns.kv_dtype, ns.backend)
    capacity, cap_source = _capacity(ns)
    from .store.default_model import model_or_default
    ns.model = model_or_default(ns.model)
    shapes = read_model_shapes(ns.model)
    try:   # (a config's bad field: the message names the file)
        config = shapes.model_config()
        weights, largest, how = _weights(shapes, ns.backend, ns.weight_bits)
    except ValueError as exc:
        raise ValueError(f"{ns.model}: {exc}") from None
    buckets = buckets_for(ns.max_concurrency) if ns.backend == "cupy" and ns.cuda_graph else ()
    mtp = shapes.mtp_layers

    def plan_at(chunk: int):
        return plan_config(config, weights, backend=ns.backend,
                           max_concurrency=ns.max_concurrency, max_context=ns.max_context,
                           page_size=ns.page_size, prefill_chunk=chunk,
                           max_packed_elems=largest, mtp_layers=mtp, kv_dtype=ns.kv_dtype,
                           cuda_graph_buckets=buckets, capacity_bytes=capacity,
                           checkpoints=2 + ns.turn_checkpoints,
                           prefill_graph=bool(buckets) and not getattr(config, "gdn_layers", ()))

    # auto: serve measures at start-up (cupy); here the floor, and the ceiling memory allows
    chunk = chunk_size.MIN_TOKENS if auto else ns.prefill_chunk
    plan = plan_at(chunk)
    details = {"model": str(ns.model), "source": shapes.source,
               "architecture": shapes.architecture, "parameters": shapes.parameter_count(),
               "weights_sized": how, "backend": ns.backend, "max_context": ns.max_context,
               "max_concurrency": ns.max_concurrency, "kv_layers": kv_layers(config, mtp),
               "mtp_layers": mtp, "kv_heads": config.num_key_value_heads,
               "head_dim": config.head_dim,
               "kv_bytes_per_token": kv_bytes_per_token(config, ns.kv_dtype, mtp),
               "state_bytes_per_lane": state_bytes_per_lane(config),
               "gdn_layers": len(getattr(config, "gdn_layers", ())),
               "turn_checkpoints": ns.turn_checkpoints,
               "capacity_source": cap_source, "prefill_chunk": chunk,
               # serve's --continuation-cache-l2-mib auto before the host's cap
               "l2_budget_bytes": l2_budget_bytes("auto", plan, None)[0]}
    if auto and ns.backend == "cupy":
        hi = min(chunk_size.MAX_TOKENS, math.ceil(ns.max_context / chunk_size.MULTIPLE)
                 * chunk_size.MULTIPLE)
        details["prefill_chunk_max_tokens"] = chunk_size.memory_max_tokens(
            lambda t: plan_at(t).total_bytes, capacity, lo=min(chunk, hi), hi=hi) or hi
    from .config import context_window   # (serve's warning beyond the trained length)
    warnings = context_window(ns.max_context, {
        "max_position_embeddings": config.max_position_embeddings})[1]
    if warnings:
        details["warnings"] = warnings
    return plan, details


def _gib(n: int) -> str:
    """A row's GiB and bytes columns, led by a space however wide the number."""
    return f" {n / 2**30:9.2f} GiB  {n:>15,} B"


def render(plan, d: dict) -> str:
    """The plan as the text ``ninfer plan`` prints."""
    lanes = d["max_concurrency"]
    rows = [
        ("weights", plan.weights_bytes, d["weights_sized"]),
        # (kv_pool_bytes, as server.started reports it, holds the recurrent state too)
        ("KV pool", plan.kv_pool_bytes,
         f"{plan.kv_pages} pages x {plan.kv_page_size} tokens x {d['kv_bytes_per_token']} B "
         f"({plan.kv_dtype}: {d['kv_layers']} attention layers"
         f"{' incl. MTP' if d['mtp_layers'] else ''} x {d['kv_heads']} KV heads x "
         f"{d['head_dim']}){', and the state' if d['gdn_layers'] else ''}"),
    ]
    if d["gdn_layers"]:
        rows.append(("  of which state", plan.state_bytes,
                     f"{lanes} slot{'s' if lanes > 1 else ''} x {d['state_bytes_per_lane']} B "
                     f"({d['gdn_layers']} Gated DeltaNet layers, float32)"))
    scratch = ", fp16 GEMM scratch of the largest weight" if plan.backend == "cupy" else ""
    if plan.backend == "cupy" and d["gdn_layers"]:
        scratch += ", one GDN layer's chunked delta rule"
    chunk = f"{d['prefill_chunk']}-token prefill chunk"
    if "prefill_chunk_max_tokens" in d and not plan.deficit_bytes:
        chunk += f" (auto: up to {d['prefill_chunk_max_tokens']} fit)"
    rows += [("workspace", plan.workspace_bytes, f"{chunk}: activations, logits{scratch}"),
             ("CUDA graphs", plan.cuda_graph_bytes,
              f"buckets {list(plan.cuda_graph_buckets)}" if plan.cuda_graph_buckets
              else "none"),
             ("total", plan.total_bytes, "")]
    if d["gdn_layers"]:   # host memory, like the L2 budget: not the device's
        n = 2 + d["turn_checkpoints"]
        rows.append(("host: turn ckpts", plan.checkpoint_bytes,
                     f"{lanes} lane{'s' if lanes > 1 else ''} x {n} states (turn checkpoint, "
                     f"anchor, {d['turn_checkpoints']} in the ring), not in the total"))
    rows.append(("host: L2 ceiling", d["l2_budget_bytes"], "serve's --continuation-cache-l2-mib "
                 "auto: twice the KV pool, at least 2 GiB; a ceiling, not a reservation (serve "
                 "also caps it at half the serving host's available memory)"))
    out = [f"{d['model']}: {d['architecture']} ({d['source']}), {d['backend']}, "
           f"{lanes} lane{'s' if lanes > 1 else ''} x {d['max_context']} tokens, "
           f"KV {plan.kv_dtype}"]
    out += [f"  {name:<16}{_gib(n)}  {note}".rstrip() for name, n, note in rows]
    if plan.capacity_bytes is None:
        out.append(f"  {'capacity':<16}{'unknown':>14}  (give --gpu-memory)")
        return "\n".join(out)
    out.append(f"  {'capacity':<16}{_gib(plan.capacity_bytes)}  {d['capacity_source']}")
    if plan.deficit_bytes:
        out.append(f"  {'deficit':<16}{_gib(plan.deficit_bytes)}")
        out.append(f"does not fit: short by {plan.deficit_bytes} bytes "
                   f"({plan.deficit_bytes / 2**30:.2f} GiB)")
    else:
        free = plan.capacity_bytes - plan.total_bytes
        out.append(f"  {'free':<16}{_gib(free)}")
        out.append("fits")
    return "\n".join(out)


def _replan(ns, **changes):
    """The plan of ``ns`` with ``changes``, or None where that configuration is refused."""
    try:
        return make_plan(argparse.Namespace(**(vars(ns) | changes)))[0]
    except ValueError:   # (a dtype this model or backend cannot store)
        return None


def _size(n: int) -> str:
    """Bytes as GiB, MiB below one GiB, bytes below one MiB (a small shortfall is not
    "0.00 GiB")."""
    return (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20
            else f"{n} bytes")


def what_fits(ns, plan) -> dict:
    """What would fit instead of a plan that does not: ``kv_dtype`` (the first smaller dtype
    that fits, ``kv_dtypes.smaller``: what a refused serve suggests) with its
    ``headroom_bytes``, and ``max_context`` (the longest context at this dtype, a multiple of
    the page size); or, where the plan without its KV pages already exceeds the capacity,
    ``without_kv_bytes`` alone (no KV dtype or context helps)."""
    from .engine.kv_dtypes import smaller
    rest = plan.total_bytes - plan.kv_pool_bytes + plan.state_bytes   # all but the pages
    if rest >= plan.capacity_bytes:
        return {"without_kv_bytes": rest}
    out = {}
    for dtype in smaller(plan.kv_dtype):
        other = _replan(ns, kv_dtype=dtype)
        if other is not None and not other.deficit_bytes:
            out.update(kv_dtype=dtype, headroom_bytes=other.capacity_bytes - other.total_bytes)
            break
    ps = ns.page_size
    lo, hi = 0, -(-ns.max_context // ps)   # pages of context: lo fits (or 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        other = _replan(ns, max_context=mid * ps)
        lo, hi = (mid, hi) if other is not None and not other.deficit_bytes else (lo, mid)
    if lo:
        out["max_context"] = lo * ps
    return out


def _what_fits_text(plan, fits: dict) -> str:
    """``what_fits`` as the end of the refusal's line."""
    if "without_kv_bytes" in fits:
        return (f"; without its KV pages it takes {_size(fits['without_kv_bytes'])} of the "
                f"{_size(plan.capacity_bytes)}: no KV dtype or context fits")
    said = []
    if "kv_dtype" in fits:
        said.append(f"--kv-dtype {fits['kv_dtype']} ({_size(fits['headroom_bytes'])} free)")
    if "max_context" in fits:
        said.append(f"--max-context {fits['max_context']} at --kv-dtype {plan.kv_dtype}")
    return f"; fits with {' or '.join(said)}" if said else ""


def run(ns) -> int:
    """``ninfer plan``: print the plan; 0 fits (or unknown capacity), 3 does not fit."""
    plan, details = make_plan(ns)
    fits = plan.capacity_bytes is None or plan.deficit_bytes == 0
    instead = {} if fits else what_fits(ns, plan)
    if ns.json:
        print(json.dumps(details | plan.to_dict() | {
            "deficit_bytes": plan.deficit_bytes, "fits": fits}
            | ({} if fits else {"fits_with": instead})))
    else:   # (warnings on stderr, as serve's: stdout is the plan alone)
        for w in details.get("warnings", ()):
            print(f"ninfer plan: warning: {w}", file=sys.stderr)
        print(render(plan, details))
    if not fits:
        print(f"ninfer plan: does not fit: short by {_size(plan.deficit_bytes)}"
              f"{_what_fits_text(plan, instead)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0
