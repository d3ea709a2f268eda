"""The execution thread: one OS thread owns the model, the KV pool and every lane.

Each ``step()`` drains the inbox, admits waiting requests into free lanes, then runs one unit
of work the scheduler chooses — one prefill chunk of one lane (up to ``max_prefill_lanes``
prefilling lanes take chunk turns), or one decode round over every decode-ready lane — and
commits its results: tokens and text go back to the requester through the outbox
(``TrioToken.run_sync_soon``, never blocking the thread), every transition is emitted on the
event bus with ``emit_threadsafe``.

Requests and cancellations reach the thread through a lock-free inbox (``collections.deque``)
plus a ``threading.Event`` wake-up. ``step()`` can also be driven by hand (tests, ``ninfer
generate``) with no thread and no trio loop. The parts, one job each: ``scheduler``,
``admission``, ``lanes``, ``prefix``, ``tiers``, ``runner``, ``prefill``, ``decode``,
``output``, ``outbox``, ``slots``, ``speculative``.
"""
from __future__ import annotations

import collections
import threading
import time

from ..events import schema as ev
from .admission import Admission
from .config import EngineConfig
from .decode import Decoder
from .lanes import Lane, LanePool, session_digest
from .outbox import Outbox
from .output import Output
from .prefill import Prefiller
from .prefix import routing_key
from .requests import ErrorOutput, FinalOutput, Request, SlotCommand, SlotResult, TokenOutput
from .runner import ModelRunner
from .scheduler import Scheduler
from .slots import run_slot_command
from .stats import EngineStats, WorkerClock, snapshot
from .tiers import Tiers

# names callers import from here
__all__ = ["Engine", "EngineConfig", "EngineStats", "ErrorOutput", "FinalOutput", "Lane",
           "Request", "SlotCommand", "SlotResult", "TokenOutput", "routing_key",
           "session_digest"]


class Engine:
    """Owns model execution. Thread-safe entry points: ``submit``, ``cancel``, ``finish``,
    ``slot_command``, ``shutdown``, ``stop``.

    Args:
        model: a model with ``forward(ForwardBatch, kv)``, ``new_kv_cache(pages, page_size)``
            and ``is_recurrent``, or a ``runner.GraphReplayer`` wrapping one.
        tokenizer: ninfer Tokenizer (stop ids, incremental detokenization).
        bus: EventBus receiving ``emit_threadsafe`` events.
        config: EngineConfig.
    """

    def __init__(self, model, tokenizer, bus, config: EngineConfig):
        self.model, self.tokenizer, self.bus, self._config = model, tokenizer, bus, config
        # ids the tokenizer knows; a model head may be padded wider (Qwen3.5: 248,320 > 248,077)
        self.vocab = min(model.config.vocab_size, tokenizer.vocab_size)
        self.runner = ModelRunner(model, config, self.vocab)
        self.kv, self.recurrent = self.runner.kv, self.runner.recurrent
        self.lane_pool = LanePool(self.kv, bus, config.max_concurrency, config.num_pages,
                                  config.page_size, self.recurrent, config.prefix_reuse)
        self.lane_pool.ledger_events = config.ledger_events
        self.lanes, self.pool = self.lane_pool.lanes, self.lane_pool.pages
        self.tiers = Tiers(self.kv, self.runner.ops, self.lane_pool, bus, config, self.recurrent)
        self.outbox = Outbox()
        self.output = Output(self.lane_pool, tokenizer, bus, self.outbox, config.max_context)
        self.scheduler = Scheduler(self.lanes, config.max_context, bus.emit_threadsafe,
                                   config.max_prefill_lanes)
        self.spec = None  # MtpSpeculator when speculative decoding is on and possible
        if config.spec == "mtp":
            from .speculative import MtpSpeculator
            if MtpSpeculator.supports(model):
                self.spec = MtpSpeculator(self.runner, self.lane_pool, self.output,
                                          config.draft_tokens)
        self.clock = WorkerClock()
        self.decoder = Decoder(self.runner, self.lane_pool, self.output, self.outbox, bus,
                               self.spec, lambda: len(self.waiting), self.clock.account)
        self.prefiller = Prefiller(self.runner, self.lane_pool, self.tiers, self.output,
                                   self.spec, bus, config)
        self.admission = Admission(self.scheduler, self.lane_pool, self.tiers, self.runner,
                                   self.spec, tokenizer, bus, self.outbox, config)
        self.waiting = self.scheduler.waiting
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._closing: str | None = None   # shutdown(): why new and running requests fail
        # set once the execution thread has failed every request after shutdown()
        self.shutdown_done = threading.Event()
        self._thread: threading.Thread | None = None
        self.prefill_steps = 0
        self.fatal: BaseException | None = None
        self.stats = EngineStats(free_pages=self.pool.num_free, total_pages=config.num_pages)

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """Swap the policy knobs between steps (``min_restore_tokens``, ``prefix_reuse``, ...;
        sizing must stay): every part reads the new one."""
        self._config = config
        for part in (self.runner, self.tiers, self.prefiller, self.admission):
            part.config = config
        self.scheduler.max_prefill_lanes = config.max_prefill_lanes
        self.lane_pool.prefix_reuse = config.prefix_reuse

    # -- the parts' state, by the names callers use ---------------------------------------
    lookahead = property(lambda self: self.runner.lookahead,
                         doc="Whether greedy decode rounds run one ahead.")
    l2 = property(lambda self: self.tiers.l2, doc="The L2 HostTier, or None.")
    store = property(lambda self: self.tiers.store, doc="The L3 ContinuationStore, or None.")
    persister = property(lambda self: self.tiers.persister, doc="The L3 writer, or None.")
    spiller = property(lambda self: self.admission.autosave and self.admission.autosave.spiller,
                       doc="The auto-save writer (--auto-save-evicted), or None.")
    publishes = property(lambda self: self.tiers.publishes,
                         doc="Whether prompt-cache breakpoints can publish anything.")

    def layout_identity(self) -> dict:
        """What a stored image's layout must match to be restored here."""
        return self.tiers.layout_identity()

    def attach_autosave(self, spiller) -> None:
        """``--auto-save-evicted``: a session bound to a slot file is written there through
        ``spiller`` (``store.slot_spill.SlotSpiller``) when its lane loses it involuntarily
        (``autosave.py``). Call before ``start``."""
        from .autosave import AutoSave
        self.admission.autosave = AutoSave(self.lane_pool, self.tiers, spiller, self.bus)

    def attach_store(self, store, persist_min_tokens: int = 1024) -> None:
        """Use ``store`` (``ContinuationStore``) as L3: a finished request's retained prefix of
        at least ``persist_min_tokens`` tokens is written there by a writer thread, and a
        request whose prompt continues a stored image is restored from it (also after a
        restart). Call before ``start``."""
        self.tiers.attach_store(store, persist_min_tokens)

    # -- thread-safe entry points ---------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue ``req`` (any thread). Emits ``request.received`` from the execution thread."""
        req.received_t = time.monotonic()
        self._send("submit", req)

    def cancel(self, request_id: str, reason: str = "client_disconnected") -> None:
        """Cancel a request (any thread); its lane and pages are freed at the next boundary."""
        self._send("cancel", (request_id, reason))

    def finish(self, request_id: str, reason: str = "tool_calls") -> None:
        """End a running request normally at the next boundary (any thread), as a stop token
        would: its ``FinalOutput`` (finish "stop", engine reason ``reason``) and
        ``request.finished`` follow the tokens already delivered. For the API's tool-call
        limit (``parallel_tool_calls: false``): the output after the one allowed call would be
        dropped anyway. A request that is no longer running is left alone."""
        self._send("finish", (request_id, reason))

    def slot_command(self, cmd: SlotCommand) -> None:
        """Queue a slot save / restore / erase (any thread); run between steps."""
        self._send("slot", cmd)

    def shutdown(self, reason: str) -> None:
        """Begin a graceful shutdown (any thread): every running and waiting request, and every
        one submitted after this, fails with ``server_shutting_down`` (a stream gets it as an
        in-band error) instead of being cut off when the server closes its connections.
        ``shutdown_done`` is set once the execution thread has failed them (between steps)."""
        self._send("shutdown", reason)

    def _send(self, op: str, arg) -> None:
        self._inbox.append((op, arg))
        self._wake.set()

    def start(self, trio_token=None) -> None:
        """Start the execution thread; deliveries go through ``trio_token`` when given."""
        self.outbox.trio_token = trio_token
        # deferring a round's outputs pays only where forward() returns before the device is
        # done (the GPU backends); on the CPU it would only delay every token by one step
        self.outbox.defer = trio_token is not None and self.runner.on_device
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the execution thread, then write the queued L3 images and spills and close the
        store."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.tiers.close()
        if self.admission.autosave is not None:
            self.admission.autosave.close()

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                if not self.step():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self.clock.account("idle")
            self.decoder.resolve_ahead()
            self.outbox.flush()
        except BaseException as exc:  # a crashed engine must not hang every client
            self.fatal = exc
            self.bus.emit_threadsafe(ev.EngineFailed(error=f"{type(exc).__name__}: {exc}"))
            self.decoder.ahead = None
            self.outbox.release()
            self._fail_all("service_unavailable", f"engine stopped: {type(exc).__name__}")
            self.outbox.flush()
            raise

    def step(self) -> bool:
        """Drain the inbox, admit, run one unit of work (schedule → run → commit → emit).
        Returns False when there was nothing to do."""
        self.clock.account("upkeep")
        self._drain_inbox()
        if self.waiting and self.lane_pool.free_lanes():
            self.decoder.resolve_ahead()   # (an admission may take a lane, its pages, its prefix)
        self.admission.run()
        self.clock.account("admission")
        unit = self.scheduler.next_unit()
        if unit is None:
            self.outbox.flush()
        elif unit.prefill is not None:
            self.decoder.resolve_ahead()   # (a 1-token chunk may replay the round's graph bucket)
            self.outbox.flush()
            self.prefiller.chunk(unit.prefill, unit.prefill_lanes, unit.prefill_queued,
                                 unit.publish_first)
            self.prefill_steps += 1
            self.clock.account("prefill")
        else:
            self.decoder.round(list(unit.decode))
            self.clock.account("decode")
        self.stats = snapshot(self.lanes, len(self.waiting), self.decoder.rounds,
                              self.prefill_steps, self.pool.num_free, self.config.num_pages,
                              self.clock)
        return unit is not None

    def check_integrity(self) -> None:
        """Verify page ownership (``LanePool.check_integrity``)."""
        self.lane_pool.check_integrity()

    def idle(self) -> bool:
        return not self._inbox and not self.waiting and all(ln.req is None for ln in self.lanes)

    # -- inbox ----------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._inbox:
            self.decoder.resolve_ahead()   # (every op sees the lanes committed)
            op, arg = self._inbox.popleft()
            if op == "submit":
                self._receive(arg)
            elif op == "shutdown":
                self._closing = arg
                self._fail_all("server_shutting_down", self._closing_message())
                self.shutdown_done.set()
            elif op == "slot":
                t0 = time.monotonic()
                res = run_slot_command(arg, self.lanes[arg.lane], self.lane_pool, self.tiers,
                                       self.config.max_context)
                res.seconds = time.monotonic() - t0
                self.outbox.post(arg.deliver, res)   # (the HTTP side emits slot.action)
            elif op == "finish":
                lane = self.lane_pool.lane_of(arg[0])
                if lane is not None and lane.first_token_t:
                    self.output.finish(lane, arg[1], time.monotonic(), flush=False)
            else:
                self._cancel(*arg)

    def _closing_message(self) -> str:
        return (f"the server is shutting down ({self._closing}); the request was not "
                "completed, retry it once the server is back")

    def _receive(self, req: Request) -> None:
        self.bus.emit_threadsafe(ev.RequestReceived(
            request_id=req.request_id, protocol=req.protocol, model=req.model,
            stream=req.stream, message_count=req.message_count,
            prompt_tokens=len(req.prompt_ids), max_tokens=req.max_tokens,
            max_tokens_source=req.max_tokens_source, sampling=req.params.to_dict(),
            http_request_id=req.http_request_id, ignored_fields=list(req.ignored_fields),
            volatile_spans=list(req.volatile_spans)))
        if self._closing is not None:
            self.output.refuse(req, "server_shutting_down", self._closing_message())
        elif not self.scheduler.enqueue(req):
            self.output.refuse(req, "context_length_exceeded",
                               f"the prompt has {len(req.prompt_ids)} tokens; a lane holds "
                               f"{self.config.max_context} (prompt + at least one output "
                               "token)")

    def _cancel(self, request_id: str, reason: str) -> None:
        if self.scheduler.remove(request_id) is not None:
            self.bus.emit_threadsafe(ev.RequestCancelled(request_id=request_id, lane=-1,
                                                         completion_tokens=0, reason=reason))
            return
        lane = self.lane_pool.lane_of(request_id)
        if lane is not None:
            n = lane.generated
            self.lane_pool.release(lane, retain=True)
            self.bus.emit_threadsafe(ev.RequestCancelled(request_id=request_id, lane=lane.id,
                                                         completion_tokens=n, reason=reason))

    def _fail_all(self, code: str, message: str) -> None:
        for lane in self.lanes:
            if lane.req is not None:
                try:
                    self.output.fail(lane, code, message)
                except Exception:
                    pass
        while self.waiting:
            self.output.refuse(self.waiting.popleft(), code, message)
