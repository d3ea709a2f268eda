"""Wiring: load the model, build the engine, bus, sinks and app, and serve them with hypercorn.

``load_runtime(model_path, ...)`` loads everything a generator needs (artifact, model,
tokenizer, chat template). ``build_server(config)`` adds the bus, sinks, engine and app.
``serve(server)`` runs inside trio: attaches the bus, starts the execution thread, emits
``server.started`` and serves HTTP until cancelled.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

from .config import ServeConfig, context_window
from .engine.chat_template import ChatTemplate, TemplateError
from .engine.chunk_size import MIN_TOKENS, ChunkChoice, resolve_prefill_chunk
from .engine.engine import Engine, EngineConfig
from .engine import kv_dtypes
from .engine.memory import (checkpoint_states, device_capacity_bytes, host_available_bytes,
                            l2_budget_bytes, plan_memory)
from .engine.tokenizer import Tokenizer
from .events import schema as ev
from .events.bus import EventBus
from .events.fold import ServingState, fold_or_skip
from .events.metrics import make_registry
from .events.request_line import RequestLineSink
from .events.sinks import FoldSink, JsonlSink, SseHub
from .replay.sessions import SessionRecorder
from .store.default_model import find_default_model, missing_model_message


class ModelNotFound(SystemExit):
    """No model argument and no default model installed (exits with one line of advice)."""


@dataclass
class Runtime:
    """A loaded model with its tokenizer and chat template."""
    path: Path
    artifact: object
    model: object
    tokenizer: Tokenizer
    template: ChatTemplate
    load_s: float
    model_id: str


def resolve_model_path(model: str | None) -> Path:
    """The model argument, or the default SmolLM2 GGUF.

    Raises:
        ModelNotFound: neither given nor installed (message says how to install it).
        FileNotFoundError: the given path does not exist.
    """
    if model is None:
        found = find_default_model()
        if found is None:
            raise ModelNotFound(missing_model_message())
        return found
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    return path


def load_runtime(model: str | None, backend: str = "numpy", model_id: str | None = None,
                 kernel_config=None) -> Runtime:
    """Load artifact (or GGUF), model weights, tokenizer and chat template (``kernel_config``:
    the cupy backend's ``KernelConfig``, None for the defaults)."""
    from .kernels import get_ops
    from .engine.models import load_model
    from .store.artifact import load_model_file

    path = resolve_model_path(model)
    t0 = time.perf_counter()
    art = load_model_file(path)
    model_obj = load_model(art, get_ops(backend, kernel_config))
    tok = Tokenizer.from_dict(art.tokenizer)
    try:   # (a damaged or foreign template: the model cannot be served as a chat model)
        template = ChatTemplate(
            art.chat_template or DEFAULT_CHATML,
            bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
    except TemplateError as exc:
        raise ValueError(f"{path}: its {exc}") from None
    load_s = time.perf_counter() - t0
    mid = model_id or path.name.split(".")[0]
    return Runtime(path, art, model_obj, tok, template, load_s, mid)


DEFAULT_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                  "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass
class Server:
    config: ServeConfig
    runtime: Runtime
    bus: EventBus
    engine: Engine
    app: object
    state: object
    sinks: list
    memory: dict = field(default_factory=dict)   # server.started ``memory`` (the plan)
    runner: object = None                         # the decode-graph wrapper, when in use
    warnings: list = field(default_factory=list)  # server.started ``warnings``
    prefill_chunk: ChunkChoice | None = None       # how --prefill-chunk was resolved


def memory_line(server: Server) -> str:
    """What the server holds, in one line for its start-up banner (llama-server prints its KV
    buffer's size and type): the KV cache's dtype, pages and bytes for its lanes and context,
    the weights, the L2 ceiling."""
    m, gib = server.memory, lambda n: f"{n / 2**30:.2f} GiB"
    lanes = server.config.max_concurrency
    line = (f"KV cache {m['kv_dtype']}: {m['kv_pages']:,} pages x {m['kv_page_size']} tokens "
            f"({gib(m['kv_pool_bytes'])}) for {lanes} lane{'s' if lanes > 1 else ''} x "
            f"{server.state.n_ctx} tokens; weights {gib(m['weights_bytes'])}")
    if m.get("l2_budget_bytes"):
        line += f"; L2 up to {gib(m['l2_budget_bytes'])}"
    return line


def decode_model(model, config: EngineConfig, cuda_graph: bool = True):
    """The model the engine should run, and its decode runner (or None).

    When the backend offers ``ops.decode_runner`` (cupy), ``model`` is wrapped so that decode
    batches run per batch-size bucket (1, 2, 4, ... up to ``config.max_concurrency``) over static
    inputs, replayed from CUDA graphs (``cuda_graph``) or eagerly; the engine sees an ordinary
    model. Otherwise (numpy, or a model the runner cannot drive) ``(model, None)``."""
    make = getattr(model.ops, "decode_runner", None)
    runner = make(model, config.pages_per_lane, config.max_concurrency, cuda_graph) \
        if make is not None else None
    return (model if runner is None else runner), runner


def build_server(config: ServeConfig, runtime: Runtime | None = None) -> Server:
    """Load the model (unless ``runtime`` is given), check the memory budget, and wire engine,
    bus, sinks and app; on the GPU the decode graphs are captured here, before listening.

    Raises:
        OSError: the request log cannot be opened (startup fails before listening).
        ValueError: a ``--kv-dtype`` the backend or the model's head dim cannot store (or
            another bad flag), before the KV pool is allocated.
        MemoryBudgetError: weights + KV pool + workspace + CUDA graphs exceed the device's
            capacity (``--memory-capacity-bytes``, or the GPU's free memory capped by
            ``--gpu-memory``); nothing of the KV pool has been allocated.

    ``--prefill-chunk auto`` is resolved before the plan (``chunk_size``): on the GPU by timing
    prefill passes into a scratch cache, the chunk bounded so that the plan still fits.
    """
    from .api.app import ServerState, create_app

    from .kernels.config import KernelConfig
    # (a given runtime keeps the kernel choices its backend was made with)
    rt = runtime or load_runtime(config.model, config.backend, config.model_id,
                                 KernelConfig(activations=config.gemv_activations,
                                              prefill_fp8=config.prefill_gemm == "fp8"))
    n_ctx, warnings = context_window(config.max_context, rt.artifact.config)
    warnings += inert_option_warnings(config, bool(rt.model.is_recurrent),
                                      getattr(rt.model.ops, "name", "numpy"))
    for w in warnings:
        print(f"ninfer: warning: {w}", file=sys.stderr, flush=True)
    ecfg = EngineConfig(max_concurrency=config.max_concurrency, max_context=n_ctx,
                        # (auto: a placeholder until resolve_prefill_chunk below)
                        prefill_chunk=config.prefill_chunk
                        if isinstance(config.prefill_chunk, int) else MIN_TOKENS,
                        max_prefill_lanes=config.max_prefill_lanes, page_size=config.page_size,
                        spec=config.spec, draft_tokens=config.draft_tokens,
                        prefix_reuse=config.prefix_reuse,
                        turn_checkpoint=config.turn_checkpoint,
                        turn_checkpoints=config.turn_checkpoints
                        if config.turn_checkpoint else 0,
                        decode_lookahead="auto" if config.decode_lookahead else "off",
                        kv_dtype=kv_dtypes.resolve_for(config.kv_dtype, rt.model),
                        ledger_events=bool(config.kv_events_endpoint),
                        min_restore_tokens=config.continuation_cache_min_restore_tokens)
    # a KV dtype the backend or the head dim cannot store: refused before anything is sized
    kv_dtypes.check_model(ecfg.kv_dtype, rt.model)
    model, runner = decode_model(rt.model, ecfg, config.cuda_graph)
    capacity = config.memory_capacity_bytes
    if capacity is None:
        capacity = device_capacity_bytes(rt.model.ops)
        budget = config.gpu_memory_bytes
        if budget is not None:   # a budget below the card's; on the host, the budget itself
            capacity = budget if capacity is None else min(capacity, budget)

    graphs = runner is not None and runner.enabled
    # (a small model's prefill chunk is bound by the host: replayed from a graph too)
    prefill_graph = graphs and not rt.model.is_recurrent

    def plan_at(chunk: int):
        return plan_memory(rt.model, max_concurrency=ecfg.max_concurrency, max_context=n_ctx,
                           page_size=ecfg.page_size, prefill_chunk=chunk,
                           cuda_graph_buckets=runner.buckets if graphs else (),
                           capacity_bytes=capacity, kv_dtype=ecfg.kv_dtype,
                           checkpoints=checkpoint_states(ecfg), prefill_graph=prefill_graph)

    chunk = resolve_prefill_chunk(config.prefill_chunk, rt.model, max_context=n_ctx,
                                  total_bytes_at=lambda t: plan_at(t).total_bytes,
                                  capacity_bytes=capacity, kv_dtype=ecfg.kv_dtype)
    if chunk.warning:
        warnings.append(chunk.warning)
        print(f"ninfer: warning: {chunk.warning}", file=sys.stderr, flush=True)
    ecfg = dataclasses.replace(ecfg, prefill_chunk=chunk.tokens)
    if prefill_graph:
        runner.prefill_graphs(min(ecfg.prefill_chunk, n_ctx))   # (a pass fits a lane)
    plan = plan_at(ecfg.prefill_chunk)
    plan.check()
    host = host_available_bytes()   # (read once: the host check and the L2 ceiling)
    if capacity is None and host is not None and plan.total_bytes > host:
        # (nothing capped the plan on the host, whose pages commit only as they are used)
        warning = (f"this configuration needs {plan.total_bytes / 2**30:.2f} GiB of host "
                   f"memory and {host / 2**30:.2f} GiB are available: it may be killed as the "
                   "KV cache fills; lower --max-context or --max-concurrency, or a smaller "
                   "--kv-dtype (`ninfer plan --backend numpy --gpu-memory N` sizes them)")
        warnings.append(warning)
        print(f"ninfer: warning: {warning}", file=sys.stderr, flush=True)
    l2_choice = "no L2 tier"   # (--continuation-cache l1: the host is not read)
    if config.continuation_cache in ("l1-l2", "l1-l2-l3"):
        l2_bytes, l2_choice = l2_budget_bytes(config.continuation_cache_l2_mib, plan, host)
        ecfg = dataclasses.replace(ecfg, l2_bytes=l2_bytes)
    bus = EventBus()
    sinks = []
    if config.request_log_jsonl:
        sinks.append(JsonlSink(config.request_log_jsonl))
    if config.kv_events_endpoint:   # vLLM's KV-cache events, folded from the cache records
        from .events.kv_blocks import KvBlockIndex
        from .events.kv_publisher import KvEventPublisher
        sinks.append(KvEventPublisher(KvBlockIndex(ecfg.page_size, model.is_recurrent),
                                      config.kv_events_endpoint,
                                      config.kv_events_replay_endpoint, config.kv_events_topic))
    if config.log_requests:   # one stderr line per ended request, folded from its records
        sinks.append(RequestLineSink())
    hub = SseHub()
    folds = FoldSink("serving", fold_or_skip, ServingState(), report=bus.emit_threadsafe)
    sinks += [hub, folds]
    for s in sinks:
        bus.add_sink(s)
    engine = Engine(model, rt.tokenizer, bus, ecfg)
    identity = {"artifact_sha256": rt.artifact.sha256, **engine.layout_identity()}
    if config.continuation_cache == "l1-l2-l3" and config.prefix_reuse:
        from .store.continuation_store import ContinuationStore, StoreUnavailable
        try:
            store = ContinuationStore(
                config.continuation_cache_dir, config.continuation_cache_namespace,
                config.continuation_cache_l3_mib << 20, identity)
            if store.quarantined is not None:   # (store.quarantined: attach_store)
                print(f"ninfer: continuation store {store.path} is corrupt "
                      f"({store.quarantined[1]}): moved to {store.quarantined[0]}, "
                      "serving with an empty one", file=sys.stderr, flush=True)
            engine.attach_store(store, config.continuation_cache_persist_min_tokens)
        except StoreUnavailable as exc:  # serve without L3, and say so (§4.3)
            print(f"ninfer: continuation store disabled: {exc}", file=sys.stderr, flush=True)
            bus.emit_threadsafe(ev.StoreDisabled(tier="l3", error=str(exc)))
    if config.slot_save_path:   # fail before listening, not at the first save
        try:
            os.makedirs(config.slot_save_path, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=config.slot_save_path, prefix=".probe-")
            probe.close()
            from .store.slot_file import sweep_temporary_files
            sweep_temporary_files(config.slot_save_path)   # saves a killed server left
        except OSError as exc:
            raise ValueError(f"--slot-save-path {config.slot_save_path}: not a writable "
                             f"directory ({exc.strerror or exc})") from None
        if config.auto_save_evicted and config.prefix_reuse:
            from .store.slot_spill import SlotSpiller
            engine.attach_autosave(SlotSpiller(config.slot_save_path, identity, bus))
    if config.spec == "mtp" and engine.spec is None:
        raise ValueError(f"--spec mtp needs a model with an MTP head (mtp.* weights); "
                         f"{rt.path.name} has none")
    memory = plan.to_dict() | {"l2_budget_bytes": ecfg.l2_bytes, "l2_budget_choice": l2_choice}
    if runner is not None:
        runner.capture_all(engine.kv)
        memory["cuda_graph_pool_bytes"] = runner.pool_bytes
    state = ServerState(engine=engine, bus=bus, tokenizer=rt.tokenizer, template=rt.template,
                        config=config, model_id=rt.model_id, n_ctx=n_ctx, folds=folds,
                        recorder=SessionRecorder(config.record_sessions)
                        if config.record_sessions else None,
                        artifact_sha256=rt.artifact.sha256, runtime_identity=identity,
                        hub=hub, registry=make_registry(lambda: folds.state,
                                                        config.max_concurrency),
                        started_unix=int(time.time()), model_path=str(rt.path))
    return Server(config, rt, bus, engine, create_app(state), state, sinks, memory, runner,
                  warnings, chunk)


def inert_prefill_gemm(gemm: str, backend: str) -> str | None:
    """The warning for ``--prefill-gemm`` other than fp16 off the GPU (None where it applies)."""
    if gemm == "fp16" or backend == "cupy":
        return None
    return (f"--prefill-gemm {gemm} has no effect on the {backend} backend (it chooses the GPU's "
            "prefill GEMMs)")


_DEFAULT_PREFILL_LANES = next(f.default for f in dataclasses.fields(ServeConfig)
                              if f.name == "max_prefill_lanes")


def inert_option_warnings(config: ServeConfig, recurrent: bool,
                          backend: str = "cupy") -> list[str]:
    """Warnings for options given that this model or the other options make inert (they are
    accepted, so a shared launch script keeps working, and said once in server.started)."""
    out = []
    gemm = inert_prefill_gemm(config.prefill_gemm, backend)
    if gemm:
        out.append(gemm)
    if config.turn_checkpoints and not recurrent:
        out.append(f"--turn-checkpoints {config.turn_checkpoints} has no effect: this model has "
                   f"no recurrent state (its lanes resume at any depth from their KV pages)")
    elif config.turn_checkpoints and not config.turn_checkpoint:
        out.append(f"--turn-checkpoints {config.turn_checkpoints} has no effect with "
                   f"--no-turn-checkpoint")
    # (the default, 2, is left unsaid under --max-concurrency 1: it was not asked for)
    lanes = config.max_prefill_lanes
    if lanes > config.max_concurrency and lanes != _DEFAULT_PREFILL_LANES:
        out.append(f"--max-prefill-lanes {lanes} is beyond --max-concurrency "
                   f"{config.max_concurrency}: at most {config.max_concurrency} lanes prefill "
                   f"in turn")
    return out



def prefill_gemm(ops) -> dict:
    """``{"prefill_gemm": "fp8" | "fp16"}``: what the GPU's prefill GEMMs run on
    (``--prefill-gemm``, where this GPU and the model take it); {} on the CPU."""
    used = getattr(ops, "prefill_gemm", None)
    return {"prefill_gemm": used()} if used is not None else {}


def environment(backend: str, kernel_config=None) -> dict:
    """Backend, host and (when present) GPU identity: NVML name / UUID / driver, and the CUDA
    runtime and driver versions and the kernel choices (``kernel_config``, None: the
    defaults) when the CuPy backend is in use."""
    from .sampler import GpuReader

    env = {"backend": backend, "python": sys.version.split()[0], "numpy": np.__version__,
           "platform": platform.platform(), "cpu_count": os.cpu_count()}
    gpu = GpuReader().read()
    env["gpu"] = ({k: gpu[k] for k in ("name", "uuid", "driver_version", "memory_total_bytes")}
                  if gpu.get("available") else {"available": False, "reason": gpu["reason"]})
    if backend == "cupy":
        try:
            import cupy
            rt = cupy.cuda.runtime
            env["cuda_runtime_version"] = rt.runtimeGetVersion()
            env["cuda_driver_version"] = rt.driverGetVersion()
            env["cupy"] = cupy.__version__
            from .kernels.config import KernelConfig
            from .kernels.gpu import launch
            kc = kernel_config or KernelConfig()
            env["gemv_activations"] = kc.activations
            env["programmatic_dependent_launch"] = kc.pdl and launch.available()
        except Exception as exc:  # reported, never fatal here
            env["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return env


def started_event(server: Server) -> ev.ServerStarted:
    """The ``server.started`` event: config, artifact, environment (the resolved backend) and
    the memory budget (``Server.memory`` plus the stored weight size and the allocated KV)."""
    rt = server.runtime
    art = rt.artifact
    weights_bytes = sum(t.nbytes for t in art.tensors.values())
    return ev.ServerStarted(
        config=server.config.to_dict() | {
            "max_context_effective": server.state.n_ctx,
            "decode_lookahead_effective": server.engine.lookahead,
            "prefill_chunk_effective": server.engine.config.prefill_chunk,
            "continuation_cache_l2_bytes": server.engine.config.l2_bytes,
            "kv_dtype_effective": server.engine.config.kv_dtype,
            "prefill_chunk_choice": (server.prefill_chunk or ChunkChoice(
                server.engine.config.prefill_chunk, "given")).to_dict()},
        artifact={"path": str(rt.path), "sha256": art.sha256, "size_bytes": art.size_bytes,
                  "load_s": rt.load_s, "architecture": art.architecture,
                  "model_id": rt.model_id},
        environment=environment(getattr(rt.model.ops, "name", server.config.backend),
                                getattr(rt.model.ops, "config", None))
        | prefill_gemm(rt.model.ops),
        memory=server.memory | {
            "weights_stored_bytes": weights_bytes, "kv_cache_bytes": server.engine.kv.nbytes,
            "kv_pages": server.engine.config.num_pages,
            "kv_page_size": server.engine.config.page_size},
        argv=list(sys.argv), warnings=list(server.warnings))


# SO_SNDBUF of the listening sockets (inherited by accepted ones); None: the kernel's. Tests set
# it small so that a client that stops reading fills the server's buffer quickly.
LISTEN_SNDBUF: int | None = None


def _listen_options(sock, send_timeout_s: float) -> None:
    """Socket options of a listening socket, which its accepted connections inherit (Linux):
    ``TCP_USER_TIMEOUT`` (ms) = ``send_timeout_s``, so that a connection whose client accepts
    no bytes for that long (a full window it never drains, or a dead peer) is aborted by the
    kernel: hypercorn's socket writes are shielded from cancellation and would otherwise wait
    forever, holding the request's admission slot and stalling a graceful shutdown. A system
    without the option keeps the default."""
    import socket as _socket
    if send_timeout_s > 0 and hasattr(_socket, "TCP_USER_TIMEOUT") and \
            sock.family in (_socket.AF_INET, _socket.AF_INET6):
        sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_USER_TIMEOUT,
                        int(send_timeout_s * 1000))
    if LISTEN_SNDBUF is not None:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, LISTEN_SNDBUF)


def _HyperConfig():
    """A hypercorn ``Config`` whose listening sockets get ``_listen_options``."""
    from hypercorn.config import Config

    class HyperConfig(Config):
        send_timeout_s = 0.0

        def create_sockets(self):
            sockets = super().create_sockets()
            for sock in sockets.insecure_sockets + sockets.secure_sockets:
                _listen_options(sock, self.send_timeout_s)
            return sockets

    return HyperConfig()


async def serve(server: Server, *, handle_signals: bool = False,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled, or with ``handle_signals`` (main thread only) until SIGINT or
    SIGTERM, which stop it gracefully: no new connections, in-flight ones get hypercorn's
    graceful timeout, then ``server.stopping`` records the signal; a second one during that
    stop exits the process at once (``_exit_on_second_signal``). ``task_status.started()`` is
    called once the socket listens."""
    from hypercorn.trio import serve as hyper_serve

    server.bus.attach()
    server.engine.start(trio.lowlevel.current_trio_token())
    server.bus.emit(started_event(server))
    from .sampler import run_sampler
    hconf = _HyperConfig()
    hconf.send_timeout_s = server.config.send_timeout_s
    hconf.bind = [f"{server.config.host}:{server.config.port}"]
    hconf.accesslog = None
    hconf.errorlog = "-"
    hconf.graceful_timeout = 1.0
    reason = "shutdown"   # or "signal ..." once until_signal has emitted server.stopping
    restore = {}          # signal -> the handler to put back once serve() is done
    receiver = contextlib.ExitStack()
    if handle_signals:
        # before the socket listens, so a signal sent once it accepts is a graceful stop; the
        # handler of a second signal goes in under trio's receiver, which puts it back (and
        # re-raises any signal still queued in it) once the first one closes the receiver
        for sig in (signal.SIGINT, signal.SIGTERM):
            restore[sig] = signal.signal(sig, _exit_on_second_signal)
        signals = receiver.enter_context(trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))

    async def until_signal() -> None:
        nonlocal reason
        with receiver:
            async for signum in signals:
                reason = f"signal {signal.Signals(signum).name}"
                st = server.engine.stats
                fate = (f"{st.running} running and {st.waiting} waiting requests end with "
                        "error server_shutting_down" if st.running or st.waiting
                        else "no requests in flight")
                print(f"ninfer: {signal.Signals(signum).name} received, shutting down: {fate}",
                      file=sys.stderr, flush=True)
                # before the request.failed records it causes, and while /events is open
                server.bus.emit(ev.ServerStopping(reason=reason))
                server.engine.shutdown(reason)
                break
        # the execution thread fails the requests between two steps (later on a
        # loaded machine: /events must not end before their request.failed records)
        await trio.to_thread.run_sync(server.engine.shutdown_done.wait, 5.0)
        await trio.sleep(0.1)   # let the streams send their error frames
        server.bus.flush()      # the failures above, then /events streams end
        server.state.hub.close()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_sampler, server.bus, server.engine,
                               server.config.telemetry_interval_ms / 1000.0)
            await hyper_serve(server.app, hconf, task_status=task_status,
                              shutdown_trigger=until_signal if handle_signals else None)
            nursery.cancel_scope.cancel()
    finally:
        receiver.close()
        if not reason.startswith("signal"):
            server.bus.emit(ev.ServerStopping(reason=reason))
        server.engine.stop()
        server.bus.flush()
        for s in server.sinks:
            if hasattr(s, "close"):
                s.close()
        for sig, handler in restore.items():
            signal.signal(sig, handler)


def _exit_on_second_signal(signum: int, _frame) -> None:
    """The SIGINT / SIGTERM handler during a graceful stop: one line on stderr, then the
    process ends at once with status 128 + the signal's number (130 SIGINT, 143 SIGTERM, what
    a shell reports for a death by it), leaving the rest of the stop undone (requests still
    open are cut; the JSONL log holds every record written so far, each flushed)."""
    name = signal.Signals(signum).name
    os.write(2, f"ninfer: second signal ({name}) during the graceful stop: exiting now with "
                f"status {128 + signum}\n".encode())
    os._exit(128 + signum)
