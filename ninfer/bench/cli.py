"""``ninfer bench decode|prefill|serve|perplexity [MODEL] [--peer LLAMA_BENCH] [--json OUT]``: the
options, one frozen config from them, and the run of each kind."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ninfer.bench import report
from ninfer.engine import kv_dtypes
from ninfer.engine.kv_dtypes import CHOICES as KV_CHOICES


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run. ``model`` None: the bundled SmolLM2. ``backend``: auto | cupy | numpy.
    decode: ``batches``, ``steps`` timed steps after ``context`` cached tokens, ``lookahead``
    (the engine's greedy rounds; needs ``cuda_graph``). prefill: ``lengths``, in passes of
    ``chunk`` tokens (None: one pass; "auto": as ``--prefill-chunk auto`` picks it), ``reps``
    timed passes a length (llama-bench's ``-r`` too); ``behind`` > 0: also the first-token time of a
    ``behind_short``-token request submitted ``behind_delay`` s after a ``behind``-token cold
    prefill started, through the engine with ``prefill_lanes`` prefill lanes. decode and
    prefill: ``rounds`` repetitions, ``kv_dtype`` the KV cache's storage (``--kv-dtype``), ``peer``
    a llama-bench binary run afterwards. serve:
    ``tokens`` a request, ``repeats`` requests. perplexity: the ``text`` file in ``windows``
    windows (0: all) of ``ctx`` tokens, prefilled in passes of ``chunk``; ``kl``: against the
    reference configuration too."""

    kind: str
    model: str | None = None
    backend: str = "auto"
    batches: tuple[int, ...] = (1, 8, 32)
    steps: int = 128
    context: int = 64
    rounds: int = 1
    lengths: tuple[int, ...] = (512, 4096)
    chunk: int | str | None = None
    reps: int = 3
    behind: int = 0
    behind_short: int = 200
    behind_delay: float = 1.0
    prefill_lanes: int = 2
    cuda_graph: bool = True
    kv_dtype: str = "fp32"
    prefill_gemm: str = "fp16"
    lookahead: bool = True
    peer: str | None = None
    tokens: int = 256
    repeats: int = 3
    text: str | None = None
    ctx: int = 512
    windows: int = 0
    kl: bool = False


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def _chunk(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _positive(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 1, got {text!r}")


def _positive(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):   # (nan too)
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _ctx(text: str) -> int:   # a window: a context half and a scored half
    return _positive(text, 4)


def add_parser(sub) -> None:
    """Register ``bench`` and its four kinds on the ``ninfer`` subparsers."""
    b = sub.add_parser("bench", help="decode / prefill throughput against the memory roofline, "
                       "server overhead, perplexity; llama.cpp beside it (bench/README.md)")
    kinds = b.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, text in (("decode", "decode tok/s, GB/s and %% of the copy-bandwidth roofline "
                        "per batch size"),
                       ("prefill", "prefill tok/s per prompt length"),
                       ("serve", "HTTP server + events overhead against engine-only decode, "
                        "batch 1"),
                       ("perplexity", "perplexity over a text, and with --kl the KL divergence "
                        "from the reference configuration (llama-perplexity's scoring)")):
        k = kinds.add_parser(kind, help=text, description=text.replace("%%", "%"))
        k.add_argument("model", nargs="?", default=None,
                       help=".ninfer or GGUF file (default: SmolLM2-135M-Instruct)")
        k.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"),
                       help="auto: cupy when a GPU is usable (default)")
        k.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
        if kind == "decode":
            k.add_argument("--batches", type=_ints, default=(1, 8, 32), help="lanes (default 1,8,32)")
            k.add_argument("--steps", type=_positive, default=128, help="timed steps a batch (default 128)")
            k.add_argument("--context", type=_positive, default=64,
                           help="cached tokens a lane at the start (default 64)")
            k.add_argument("--no-lookahead", action="store_true",
                           help="time only plain steps (each reads its tokens before the next)")
        if kind == "prefill":
            k.add_argument("--prefill", type=_ints, default=(512, 4096), dest="lengths",
                           help="prompt lengths (default 512,4096)")
            k.add_argument("--chunk", type=_chunk, default=None,
                           help="prefill in passes of this many tokens, as the engine does; "
                                "auto: as --prefill-chunk auto picks it, measured on the GPU "
                                "(default: one pass)")
            k.add_argument("--reps", type=_positive, default=3,
                           help="timed prefills a length after one warm-up, for ninfer and "
                                "llama-bench (default 3)")
            k.add_argument("--behind", type=_positive, default=0, metavar="TOKENS",
                           help="also time a short request's first token behind a cold "
                                "prefill of TOKENS, through the engine")
            k.add_argument("--behind-short", type=_positive, default=200,
                           help="the short request's tokens (default 200)")
            k.add_argument("--behind-delay", type=_seconds, default=1.0,
                           help="seconds between the two submissions (default 1)")
            k.add_argument("--prefill-lanes", type=_positive, default=2,
                           help="the engine's --max-prefill-lanes for --behind (default 2)")
        if kind == "perplexity":
            k.add_argument("--text", required=True, metavar="FILE",
                           help="the text to score (UTF-8)")
            k.add_argument("--ctx", type=_ctx, default=512,
                           help="tokens a window; its second half is scored (default 512)")
            k.add_argument("--windows", type=_positive, default=0,
                           help="score at most this many windows (default: all the text holds)")
            k.add_argument("--chunk", type=_positive, default=None,
                           help="prefill a window in passes of this many tokens (default: one)")
            k.add_argument("--kl", action="store_true",
                           help="also run the reference configuration (the backend's default "
                                "--kv-dtype, fp16 prefill GEMMs) and report the KL divergence "
                                "and top-token agreement against it")
        if kind in ("decode", "prefill", "perplexity"):
            k.add_argument("--kv-dtype", default="auto", choices=KV_CHOICES,
                           help="how the KV cache stores K and V, as serve's --kv-dtype "
                                "(default auto: fp16 on cupy, fp32 on numpy)")
            k.add_argument("--prefill-gemm", default="fp16", choices=("fp16", "fp8"),
                           help="the prefill GEMMs' operands, as serve's --prefill-gemm "
                                "(default fp16)")
        if kind in ("decode", "prefill"):
            k.add_argument("--rounds", type=_positive, default=1,
                           help="repeat the measurements; medians are reported (default 1)")
            k.add_argument("--no-cuda-graph", action="store_true",
                           help="run the padded decode schedule eagerly")
            k.add_argument("--peer", default=None, metavar="LLAMA_BENCH",
                           help="then run this llama.cpp llama-bench on the same GGUF")
        if kind == "serve":
            k.add_argument("--tokens", type=_positive, default=256, help="max_tokens a request (default 256)")
            k.add_argument("--repeats", type=_positive, default=3, help="timed requests after one warm-up (default 3)")
        k.set_defaults(fn=run_from_args, parser=k)


def config_from_args(ns) -> BenchConfig:
    keys = {f for f in BenchConfig.__slots__ if hasattr(ns, f)}
    cfg = {k: getattr(ns, k) for k in keys}
    if getattr(ns, "no_cuda_graph", False):
        cfg["cuda_graph"] = False
    cfg["lookahead"] = not getattr(ns, "no_lookahead", False) and cfg.get("cuda_graph", True)
    return BenchConfig(**cfg)


def _check_json(path: str | None) -> None:
    """Refuse a ``--json`` path that cannot be written before anything runs (a long GPU run
    would lose its results at the end)."""
    if path is None:
        return
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"--json {path}: not a writable file path")


def run_from_args(ns) -> int:
    argv = getattr(ns, "argv", None)  # the command line after ``ninfer``, for the record
    _check_json(ns.json)
    res = run(config_from_args(ns), argv[1:] if argv else None)
    report.emit(res, ns.json)
    return 0


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(cfg: BenchConfig, argv: list[str] | None = None) -> dict:
    """Measure what ``cfg`` asks for -> the result (``report`` prints and writes it).

    Raises:
        ValueError: ``peer`` with a model that is not a GGUF file, an unavailable backend, or
            a model that is not Llama-architecture (decode, prefill).
    """
    from ninfer.bench import model as bench_model
    from ninfer.bench import roofline
    from ninfer.kernels import resolve_backend
    from ninfer.server import inert_prefill_gemm, prefill_gemm

    res = {"kind": cfg.kind, **report.provenance(argv)}
    backend = resolve_backend(cfg.backend)
    inert = inert_prefill_gemm(cfg.prefill_gemm, backend)
    if inert:
        _log(f"note: {inert}")
    if cfg.kind == "serve":
        from ninfer.bench import serve
        res.update(serve.measure(cfg.model, backend, tokens=cfg.tokens, repeats=cfg.repeats,
                                 log=_log))
        res.update(backend=backend, device=bench_model.device_name(backend))
        return res
    if cfg.kind == "perplexity":
        from ninfer.bench import perplexity
        res.update(perplexity.run(cfg, backend, log=_log))
        return res
    if cfg.peer:  # before anything is loaded or measured
        from ninfer.server import resolve_model_path
        if resolve_model_path(cfg.model).suffix != ".gguf":
            raise ValueError("--peer needs the GGUF file (llama-bench reads GGUF only)")
    positions = (cfg.context + cfg.steps + 16 if cfg.kind == "decode"
                 else max(cfg.lengths + (cfg.behind + cfg.behind_short + 64,)))
    bm = bench_model.load(cfg.model, backend, max_positions=positions,
                          max_batch=max(cfg.batches) if cfg.kind == "decode" else 1,
                          cuda_graph=cfg.cuda_graph,
                          kv_dtype=kv_dtypes.resolve(cfg.kv_dtype, backend),
                          prefill_fp8=cfg.prefill_gemm == "fp8")
    bw = roofline.copy_bandwidth(bm.backend)
    res.update({"model": str(bm.path), "backend": bm.backend,
                "device": bench_model.device_name(bm.backend),
                "mode": ("plain" if bm.model is bm.base
                         else "cuda_graph" if cfg.cuda_graph else "eager"),
                "kv_dtype": bm.kv_dtype,
                **prefill_gemm(bm.ops),
                "load_s": round(bm.load_s, 1), "copy_bw_GBs": round(bw / 1e9, 1)})
    if cfg.kind == "decode":
        from ninfer.bench import decode
        res.update(decode.measure(bm, batches=cfg.batches, steps=cfg.steps,
                                  context=cfg.context, rounds=cfg.rounds,
                                  lookahead=cfg.lookahead, bandwidth=bw, log=_log))
    else:
        from ninfer.bench import prefill
        chunk = cfg.chunk
        if chunk == "auto":
            chunk, res["prefill_chunk_auto"] = prefill.auto_chunk(bm, max(cfg.lengths))
            _log(f"prefill chunk auto: {chunk} tokens")
        if bm.model is not bm.base and cfg.cuda_graph:   # (the lengths serve would capture)
            res["prefill_graphs"] = list(bm.model.prefill_graphs(chunk or max(cfg.lengths)))
        res.update(prefill.measure(bm, lengths=cfg.lengths, rounds=cfg.rounds, chunk=chunk,
                                   reps=cfg.reps, log=_log))
        if cfg.behind:
            from ninfer.bench import ttft_behind
            res.update(ttft_behind.measure(bm, long=cfg.behind, short=cfg.behind_short,
                                           delay=cfg.behind_delay, chunk=chunk or 512,
                                           prefill_lanes=cfg.prefill_lanes, log=_log))
    if cfg.peer:
        res["peer"] = run_peer(cfg, str(res["model"]), res, bw)
    return res


def run_peer(cfg: BenchConfig, path: str, res: dict, bandwidth: float) -> dict:
    """llama-bench on the same GGUF: decode as ``-p 0 -n STEPS``, prefill as ``-p LENGTHS -n
    0``, beside ninfer's numbers."""
    from ninfer.bench import peer

    if cfg.kind == "decode":
        got = peer.llama_bench(cfg.peer, path, n_prompt=0, n_gen=cfg.steps)
        return {"llama_bench": got, "decode_b1": peer.beside_decode(res["decode"], got,
                                                                    bandwidth)}
    got = peer.llama_bench(cfg.peer, path, n_prompt=cfg.lengths, n_gen=0, reps=cfg.reps)
    return {"llama_bench": got, "prefill": peer.beside_prefill(res["prefill"], got)}
