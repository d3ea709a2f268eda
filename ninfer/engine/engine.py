"""The execution thread: admission, scheduling, forward passes, sampling, commit and events.

One OS thread owns the model, the KV pool and every lane. Each ``step()`` admits waiting
requests into free lanes, then runs one unit of work — one prefill chunk of one lane, or one
decode round over every decode-ready lane — and commits its results:

- tokens and text go back to the requester through ``deliver`` callbacks, which are scheduled
  onto the trio loop with ``TrioToken.run_sync_soon`` (never blocking the thread);
- every transition is emitted on the event bus with ``emit_threadsafe``.

Requests and cancellations reach the thread through a lock-free inbox (``collections.deque``)
plus a ``threading.Event`` wake-up. ``step()`` can also be driven by hand (tests, ``ninfer
generate``) with no thread and no trio loop.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..events import schema as ev
from .continuation import (HostTier, LaneImage, check_layout, export_lane, export_state,
                           image_key, import_lane, restore_state, reusable_depth)
from .kv import OutOfPages
from .lanes import Checkpoint, Lane, LanePool, session_digest
from .outbox import Outbox
from .output import Output
from .requests import ErrorOutput, FinalOutput, Request, SlotCommand, SlotResult, TokenOutput
from .sampling import apply_penalties, sample, top_logprobs


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine sizing. ``max_context``: tokens per lane (prompt + output); ``page_size``: tokens
    per KV page; ``prefill_chunk``: max prompt tokens per prefill forward pass; ``spec``:
    ``none`` | ``mtp`` (greedy requests drafted by the model's MTP head, ``draft_tokens`` 1..5
    per round; ignored when the model has no MTP head); ``prefix_reuse``: an idle lane keeps
    its last request's computed prefix, and a new request whose prompt starts with it skips
    recomputing it (``cache.lookup``); ``l2_bytes``: host memory for prefixes demoted from
    lanes that lost them (0: no L2 tier); ``min_restore_tokens``: a host or disk image is
    restored only when it saves at least this many tokens (a shared chat-template header is
    cheaper to prefill than to copy in); ``turn_checkpoint``: hybrid models keep one turn
    checkpoint per lane (``Request.checkpoint_at``), reused as ``restore_turn_checkpoint``;
    ``decode_lookahead``: ``auto`` | ``on`` | ``off``: a decode round of greedy lanes (no
    penalties, logprobs or drafts) launches the next round before it reads its own tokens, the
    next round's tokens taken on the device (``auto``: where the model replays CUDA graphs
    (``greedy``, ``enabled``) and its head is the tokenizer's width; ``on`` also elsewhere,
    through ``forward`` and the host's choice, for tests; never for recurrent models)."""
    max_concurrency: int = 4
    max_context: int = 8192
    prefill_chunk: int = 512
    page_size: int = 16
    spec: str = "none"
    draft_tokens: int = 3
    prefix_reuse: bool = True
    l2_bytes: int = 0
    min_restore_tokens: int = 64
    turn_checkpoint: bool = True
    decode_lookahead: str = "auto"

    def __post_init__(self):
        if self.decode_lookahead not in ("auto", "on", "off"):
            raise ValueError(f"decode_lookahead must be 'auto', 'on' or 'off', got "
                             f"{self.decode_lookahead!r}")
        if self.spec not in ("none", "mtp"):
            raise ValueError(f"spec must be 'none' or 'mtp', got {self.spec!r}")
        if not 1 <= self.draft_tokens <= 5:
            raise ValueError(f"draft_tokens must be in [1, 5], got {self.draft_tokens}")

    @property
    def pages_per_lane(self) -> int:
        return math.ceil(self.max_context / self.page_size)

    @property
    def num_pages(self) -> int:
        return self.max_concurrency * self.pages_per_lane


@dataclass(slots=True)
class _Round:
    """A launched decode round: its lanes, their requests then, the context length each lane
    has once the round is committed (``positions``) and the launch time; either the logits
    (sampled at commit) or ``result``, a function returning the chosen ids (``fed``: chosen
    on the device, so the next round may feed on them); ``ids`` once read."""
    lanes: list
    reqs: list
    positions: list
    t0: float
    logits: object = None
    result: Callable | None = None
    fed: bool = False
    ids: np.ndarray | None = None


WORKER_ACTIVITIES = ("prefill", "decode", "admission", "upkeep", "idle")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An immutable snapshot the execution thread publishes after every unit of work (a single
    reference swap, so readers on other threads never see a torn value).

    ``worker_seconds``: cumulative wall clock of the execution thread by activity (mutually
    exclusive; ``WORKER_ACTIVITIES``). Counts are current occupancy."""
    running: int = 0
    prefilling: int = 0
    decode_ready: int = 0
    waiting: int = 0
    decode_rounds: int = 0
    prefill_steps: int = 0
    free_pages: int = 0
    total_pages: int = 0
    retained_lanes: int = 0
    retained_pages: int = 0
    worker_seconds: tuple = tuple((a, 0.0) for a in WORKER_ACTIVITIES)


class Engine:
    """Owns model execution. Thread-safe entry points: ``submit``, ``cancel``, ``stop``.

    Args:
        model: a model with ``forward(ForwardBatch, kv)`` and ``new_kv_cache(pages, page_size)``.
        tokenizer: ninfer Tokenizer (stop ids, incremental detokenization).
        bus: EventBus receiving ``emit_threadsafe`` events.
        config: EngineConfig.
    """

    def __init__(self, model, tokenizer, bus, config: EngineConfig):
        from .models.llama import ForwardBatch  # the batch layout every model shares
        self._ForwardBatch = ForwardBatch
        self.model = model
        self.tokenizer = tokenizer
        self.bus = bus
        self.config = config
        # hybrid models (recurrent layers) keep one state slot per lane beside the paged KV
        self.recurrent = model.is_recurrent
        self.kv = (model.new_kv_cache(config.num_pages, config.page_size,
                                      max_lanes=config.max_concurrency) if self.recurrent
                   else model.new_kv_cache(config.num_pages, config.page_size))
        self.lane_pool = LanePool(self.kv, bus, config.max_concurrency, config.num_pages,
                                  config.page_size, self.recurrent, config.prefix_reuse)
        self.lanes = self.lane_pool.lanes
        self.pool = self.lane_pool.pages
        self.lane_pool.demote = self._demote
        self.lane_pool.persist = self._persist
        self.outbox = Outbox()
        self.output = Output(self.lane_pool, tokenizer, bus, self.outbox, config.max_context)
        # ids the tokenizer knows; a model head may be padded wider (Qwen3.5: 248,320 > 248,077)
        self.vocab = min(model.config.vocab_size, tokenizer.vocab_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._closing: str | None = None   # shutdown(): why new and running requests fail
        # set once the execution thread has failed every request after shutdown()
        self.shutdown_done = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefill_turn = True
        # decode lookahead (EngineConfig.decode_lookahead): the round launched ahead, not yet
        # committed (its lanes' next tokens fed on the device), or None
        la = config.decode_lookahead
        # (not for recurrent layers: a round ahead that is dropped would have advanced the
        # lane's state, which a KV position beyond the lane's length does not)
        self._lookahead = not self.recurrent and (la == "on" or (
            la == "auto" and callable(getattr(model, "greedy", None))
            and getattr(model, "enabled", True) and self.vocab == model.config.vocab_size))
        self._ahead: _Round | None = None
        self._fed_ids: np.ndarray | None = None   # the ids a forward() launch feeds on
        self._committed_t = 0.0   # when the last decode round was committed
        self.round = 0
        self.prefill_steps = 0
        self.fatal: BaseException | None = None
        self._worker = dict.fromkeys(WORKER_ACTIVITIES, 0.0)
        self._mark = time.monotonic()
        self.stats = EngineStats(free_pages=self.pool.num_free, total_pages=config.num_pages)
        self.l2 = HostTier(config.l2_bytes, supersede=not self.recurrent) \
            if config.l2_bytes > 0 and config.prefix_reuse \
            else None
        self.store = None       # L3 ContinuationStore (attach_store)
        self.persister = None
        # keys of breakpoint images every tier refused for their size (_publish)
        self._unpublishable: collections.OrderedDict = collections.OrderedDict()
        # waiting request id -> (builder lane, builder request id, depth) it waits for
        self._deferrals: dict[str, tuple[int, str, int]] = {}
        self.persist_min_tokens = 0
        self.spec = None  # MtpSpeculator when speculative decoding is on and possible
        if config.spec == "mtp":
            from .speculative import MtpSpeculator
            if MtpSpeculator.supports(model):
                self.spec = MtpSpeculator(self, config.draft_tokens)

    @property
    def lookahead(self) -> bool:
        """Whether greedy decode rounds run one ahead (``EngineConfig.decode_lookahead``)."""
        return self._lookahead

    def layout_identity(self) -> dict:
        """What a stored image's layout must match to be restored here: the paged KV geometry
        and, on hybrid models, the recurrent state shapes."""
        kv = getattr(self.kv, "kv", self.kv) if self.recurrent else self.kv
        ops = getattr(self.model, "ops", None) or getattr(getattr(self.model, "model", None),
                                                          "ops", None)
        out = {"kv_layers": len(kv.k), "nkv": kv.nkv, "hd": kv.hd,
               "kv_dtype": str(getattr(kv.k[0], "dtype", "float32")),
               "backend": getattr(ops, "name", "numpy"), "recurrent": self.recurrent}
        if self.recurrent:
            out["conv"] = [list(a.shape[1:]) for a in self.kv.conv]
            out["ssm"] = [list(a.shape[1:]) for a in self.kv.ssm]
        return out

    def attach_store(self, store, persist_min_tokens: int = 1024) -> None:
        """Use ``store`` (``ContinuationStore``) as L3: a finished request's retained prefix of
        at least ``persist_min_tokens`` tokens is written there by a writer thread, and a
        request whose prompt continues a stored image is restored from it (also after a
        restart). Call before ``start``."""
        from ..store.continuation_store import Persister
        self.store = store
        self.persister = Persister(store, self.bus)
        self.persist_min_tokens = persist_min_tokens
        if getattr(store, "quarantined", None) is not None:   # it opened empty, in its place
            moved_to, reason = store.quarantined
            self.bus.emit_threadsafe(ev.StoreQuarantined(tier="l3", path=store.path,
                                                         moved_to=moved_to, reason=reason))
        self.bus.emit_threadsafe(ev.StoreOpened(tier="l3", path=store.path, entries=len(store),
                                                bytes=store.nbytes,
                                                foreign=store.foreign))

    # -- thread-safe entry points ---------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue ``req`` (any thread). Emits ``request.received`` from the execution thread."""
        req.received_t = time.monotonic()
        self._inbox.append(("submit", req))
        self._wake.set()

    def cancel(self, request_id: str, reason: str = "client_disconnected") -> None:
        """Cancel a request (any thread); its lane and pages are freed at the next boundary."""
        self._inbox.append(("cancel", (request_id, reason)))
        self._wake.set()

    def finish(self, request_id: str, reason: str = "tool_calls") -> None:
        """End a running request normally at the next boundary (any thread), as a stop token
        would: its ``FinalOutput`` (finish "stop", engine reason ``reason``) and
        ``request.finished`` follow the tokens already delivered. For the API's tool-call
        limit (``parallel_tool_calls: false``): the output after the one allowed call would be
        dropped anyway. A request that is no longer running is left alone."""
        self._inbox.append(("finish", (request_id, reason)))
        self._wake.set()

    def slot_command(self, cmd: SlotCommand) -> None:
        """Queue a slot save / restore / erase (any thread); run between steps."""
        self._inbox.append(("slot", cmd))
        self._wake.set()

    def shutdown(self, reason: str) -> None:
        """Begin a graceful shutdown (any thread): every running and waiting request, and every
        one submitted after this, fails with ``server_shutting_down`` (a stream gets it as an
        in-band error) instead of being cut off when the server closes its connections.
        ``shutdown_done`` is set once the execution thread has failed them (between steps)."""
        self._inbox.append(("shutdown", reason))
        self._wake.set()

    def start(self, trio_token=None) -> None:
        """Start the execution thread; deliveries go through ``trio_token`` when given."""
        self.outbox.trio_token = trio_token
        # deferring a round's outputs pays only where forward() returns before the device is
        # done (the GPU backends); on the CPU it would only delay every token by one step
        ops = getattr(self.model, "ops", None)
        self.outbox.defer = trio_token is not None and getattr(ops, "name", "numpy") != "numpy"
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the execution thread, then write the queued L3 images and close the store."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.persister is not None:
            self.persister.close()
            self.persister = None

    # -- the loop -------------------------------------------------------------------------
    def _account(self, activity: str) -> None:
        """Charge the wall clock since the last mark to ``activity``."""
        now = time.monotonic()
        self._worker[activity] += now - self._mark
        self._mark = now

    def _publish_stats(self) -> None:
        running = sum(ln.req is not None for ln in self.lanes)
        prefilling = sum(ln.prefilling for ln in self.lanes)
        retained = [ln for ln in self.lanes if ln.retained]
        self.stats = EngineStats(running, prefilling, running - prefilling, len(self.waiting),
                                 self.round, self.prefill_steps, self.pool.num_free,
                                 self.config.num_pages, len(retained),
                                 sum(len(ln.pages) for ln in retained),
                                 tuple(self._worker.items()))

    def _run(self) -> None:
        try:
            while not self._stop:
                if not self.step():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self._account("idle")
            self._resolve_ahead()
            self.outbox.flush()
        except BaseException as exc:  # a crashed engine must not hang every client
            self.fatal = exc
            self.bus.emit_threadsafe(ev.EngineFailed(error=f"{type(exc).__name__}: {exc}"))
            self._ahead = None
            self.outbox.release()
            self._fail_all("service_unavailable", f"engine stopped: {type(exc).__name__}")
            self.outbox.flush()
            raise

    def step(self) -> bool:
        """Drain the inbox, admit, run one unit of work. Returns False when there was nothing
        to do."""
        self._account("upkeep")
        self._drain_inbox()
        self._admit()
        self._account("admission")
        prefill = [ln for ln in self.lanes if ln.prefilling]
        decode = [ln for ln in self.lanes if ln.decode_ready]
        if not prefill and not decode:
            self.outbox.flush()
            self._publish_stats()
            return False
        if prefill and (not decode or self._prefill_turn):
            self._resolve_ahead()   # (a 1-token chunk may replay the round's graph bucket)
            self.outbox.flush()
            lane = min(prefill, key=lambda ln: ln.admitted_t)
            self._prefill_chunk(lane)
            self.prefill_steps += 1
            self._account("prefill")
        else:
            self._decode_round(decode)
            self._account("decode")
        self._prefill_turn = not self._prefill_turn
        self._publish_stats()
        return True

    def check_integrity(self) -> None:
        """Verify page ownership (``LanePool.check_integrity``)."""
        self.lane_pool.check_integrity()

    def idle(self) -> bool:
        return not self._inbox and not self.waiting and all(ln.req is None for ln in self.lanes)

    # -- inbox and admission --------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._inbox:
            self._resolve_ahead()   # (every op sees the lanes committed)
            op, arg = self._inbox.popleft()
            if op == "submit":
                self._receive(arg)
            elif op == "shutdown":
                self._closing = arg
                self._fail_all("server_shutting_down", self._closing_message())
                self.shutdown_done.set()
            elif op == "slot":
                self._slot(arg)
            elif op == "finish":
                rid, reason = arg
                lane = self.lane_pool.lane_of(rid)
                if lane is not None and lane.first_token_t:
                    self.output.finish(lane, reason, time.monotonic(), flush=False)
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
            http_request_id=req.http_request_id, ignored_fields=list(req.ignored_fields)))
        if self._closing is not None:
            self.output.refuse(req, "server_shutting_down", self._closing_message())
            return
        if len(req.prompt_ids) + 1 > self.config.max_context or not req.prompt_ids:
            self.output.refuse(req, "context_length_exceeded",
                         f"the prompt has {len(req.prompt_ids)} tokens; a lane holds "
                         f"{self.config.max_context} (prompt + at least one output token)")
            return
        self.waiting.append(req)

    def _expire(self) -> None:
        """Refuse waiting requests whose deadline passed (never admitted ones), except those
        the last admission deferred (``_defer``: they wait on a builder's progress with a free
        lane as their claim, and are looked at again, first, by the next admission), and those
        a free lane is there for now: the first ones in the queue, as many as lanes are free
        (a long step of the engine delayed them, not the lack of a lane)."""
        now = time.monotonic()
        free = sum(1 for ln in self.lanes if ln.req is None)
        first = {r.request_id for r in itertools.islice(self.waiting, free)}
        for req in [r for r in self.waiting if r.deadline is not None and r.deadline <= now
                    and r.request_id not in self._deferrals and r.request_id not in first]:
            self.waiting.remove(req)
            msg = "the request waited too long for a free lane"
            self.bus.emit_threadsafe(ev.RequestRejected(request_id=req.request_id,
                                                        code="request_queue_timeout",
                                                        message=msg,
                                                        http_request_id=req.http_request_id))
            self.outbox.post(req.deliver, ErrorOutput("request_queue_timeout", msg))

    def _admit(self) -> None:
        if self.waiting and any(ln.req is None for ln in self.lanes):
            self._resolve_ahead()   # (an admission may take a lane, its pages, its prefix)
        self._expire()
        deferred = []   # waiting for a lane that is building a prefix they share (in order)
        try:
            self._admit_waiting(deferred)
        finally:   # (they keep their place, whatever happened)
            self.waiting.extendleft(reversed(deferred))
            live = {r.request_id for r in self.waiting}
            self._deferrals = {k: v for k, v in self._deferrals.items() if k in live}

    def _admit_waiting(self, deferred: list) -> None:
        while self.waiting:
            free = [ln for ln in self.lanes if ln.req is None]
            if len(free) <= len(deferred):   # the free lanes left are the deferred ones' claim
                return
            req = self.waiting.popleft()
            if self._defer(req, free):
                deferred.append(req)
                continue
            spec = self.spec is not None and self.spec.eligible(req)
            prompt = np.asarray(req.prompt_ids, dtype=np.int64)
            depth = {ln.id: self._reusable(ln, prompt, spec) for ln in free}
            lane = self._choose(free, depth, len(prompt), req.cache_key)
            image, d2, tier = None, 0, "l2"
            if self.l2 is not None and not spec:  # images carry no pending MTP rows
                image, d2 = self.l2.best(prompt, len(prompt) - 1, exact=self.recurrent)
            if self.store is not None and not spec:
                entry, d3 = self.store.best(prompt, len(prompt) - 1, exact=self.recurrent)
                if d3 > max(d2, depth[lane.id]) and d3 >= self.config.min_restore_tokens:
                    # None: corrupt (deleted: store.entry_dropped) or gone, a safe miss
                    loaded = self.store.load(entry, on_drop=self._l3_dropped)
                    if loaded is not None:
                        image, d2, tier = loaded, d3, "l3"
            source, path = "l1", None
            if d2 > depth[lane.id] and d2 >= self.config.min_restore_tokens and \
                    self._restore(lane, req, image, d2, tier):
                depth[lane.id], source = d2, tier
                path = "append_frontier" if d2 == image.n else "truncate_frontier"
            self._assign(lane, req, spec, depth[lane.id],
                         candidates=sum(ln.retained for ln in free), source=source, path=path)

    def _deferral_holds(self, rid: str) -> bool:
        """Whether request ``rid``'s recorded builder (``_deferrals``: lane, its request, depth)
        still serves that request and has not computed that depth yet."""
        rec = self._deferrals.get(rid)
        if rec is None:
            return False
        ln = self.lanes[rec[0]]
        return ln.req is not None and ln.req.request_id == rec[1] and ln.num_computed < rec[2]

    def _defer(self, req: Request, free: list[Lane]) -> bool:
        """Whether ``req`` waits for a lane that is prefilling toward a breakpoint both share
        (the same tokens up to a depth in both ``publish_at``, not yet published and not
        reached: serving contract §1.7, one builder per cold prefix), when the lane it would
        take does not hold that much of its prompt already: admitted after the builder
        publishes it to L2 (only with L2: an L3 image becomes visible later, on the writer
        thread), it restores the prefix instead of computing it again. While it waits, a free
        lane stays its claim (``_admit_waiting``) and its queue deadline is suspended
        (``_expire``). Not for requests decoded speculatively (images carry no MTP rows), nor
        for a depth whose image could not fit L2's budget.
        ``request.deferred`` names each new builder it waits for (``_deferrals``)."""
        if self._deferral_holds(req.request_id):
            return True   # (the tokens were compared when the builder was found)
        self._deferrals.pop(req.request_id, None)
        if self.l2 is None or not self.config.prefix_reuse or not req.publish_at or \
                (self.spec is not None and self.spec.eligible(req)):
            return False
        # an image of d tokens takes at least d * bpt bytes: one larger than L2's budget would
        # never become visible there, and waiting for it would only delay the prefill
        bpt = self.kv.bytes_per_token
        for ln in self.lanes:
            b = ln.req
            if b is None or ln.spec or not ln.prefilling or b is req:
                continue
            for d in sorted(set(req.publish_at) & set(b.publish_at)):
                if d * bpt > self.l2.budget_bytes:
                    break
                if ln.num_computed < d < len(req.prompt_ids) and \
                        ln.tokens[:d] == list(req.prompt_ids[:d]) and self._unpublished(ln, d):
                    prompt = np.asarray(req.prompt_ids, dtype=np.int64)
                    depth = {f.id: self._reusable(f, prompt, False) for f in free}
                    if depth[self._choose(free, depth, len(prompt), req.cache_key).id] >= d:
                        return False
                    self._deferrals[req.request_id] = (ln.id, b.request_id, d)
                    self.bus.emit_threadsafe(ev.RequestDeferred(
                        request_id=req.request_id, builder_lane=ln.id,
                        builder_request=b.request_id, tokens=d))
                    return True
        return False

    def _choose(self, free: list[Lane], depth: dict, n_prompt: int = 0, key: str = "") -> Lane:
        """The free lane a request takes, given the prompt tokens each would reuse.

        While an empty lane is free, a retained session is taken only when the request keeps
        (nearly) all of it: it extends the session, or cuts back at most a page or 1/16 of the
        reused depth (a re-rendered tail: retokenization, a rewritten last message). Otherwise
        sessions that merely share a header (a long system prompt, the tool list) would keep
        cutting each other back to it while lanes stand empty. A hybrid lane's turn checkpoint
        counts as kept: the request carries that session's whole history, and so does a session
        served under the request's ``prompt_cache_key`` (the client names its own
        conversation; its loss does not count). With no empty lane, some session must go: the
        most tokens saved net of the retained tokens destroyed. Ties go
        to an empty lane, then the shallowest retained prefix, then the longest idle."""
        def own(ln: Lane) -> bool:   # the client's own session (prompt_cache_key), sharing
            # more than a chat-template header with the prompt
            return bool(key) and ln.retained and ln.cache_key == key and depth[ln.id] >= max(
                self.config.page_size, self.config.min_restore_tokens)

        def loss(ln: Lane) -> int:
            return 0 if own(ln) else ln.num_computed - depth[ln.id]

        if any(not ln.retained for ln in free):
            keep = [ln for ln in free if not ln.retained or own(ln) or (
                depth[ln.id] > 0 and loss(ln) <= max(self.config.page_size, depth[ln.id] // 16))
                or self._at_checkpoint(ln, depth, n_prompt)]
            return max(keep, key=lambda ln: (depth[ln.id], own(ln), not ln.retained,
                                             -ln.num_computed, -ln.retained_t))
        return max(free, key=lambda ln: (depth[ln.id] - loss(ln), own(ln), -ln.num_computed,
                                         -ln.retained_t))

    @staticmethod
    def _at_checkpoint(lane: Lane, depth: dict, n_prompt: int) -> bool:
        """The request resumes ``lane``'s session at a turn checkpoint rather than merely
        sharing a header with it: at the latest request's checkpoint (the next turn of that
        request), or at the user-turn anchor with a prompt that carries at least half of what
        the lane holds past it (the turns since, their thinking dropped)."""
        d = depth[lane.id]
        if d <= 0:
            return False
        if lane.ckpt is not None and d == lane.ckpt.depth and \
                lane.ckpt.request_id == lane.last_request:
            return True
        return lane.anchor is not None and d == lane.anchor.depth and \
            n_prompt - d >= (lane.num_computed - d) // 2

    def _reusable(self, lane: Lane, prompt: np.ndarray, spec: bool) -> int:
        """Prompt tokens ``lane``'s retained prefix saves recomputing (0: none).

        At least the prompt's last token is always recomputed (its logits give the first
        output). Attention-only models reuse the longest common prefix (KV can be cut back to
        any position); hybrid models and speculative lanes only their exact frontier (the
        recurrent state and the MTP head's pending rows cannot be rewound)."""
        if not lane.retained or not self.config.prefix_reuse:
            return 0
        if spec and lane.mtp_pending is None:
            return 0  # the MTP head's KV does not cover this prefix
        depth = reusable_depth(np.asarray(lane.tokens[:lane.num_computed], dtype=np.int64),
                               prompt, len(prompt) - 1, self.recurrent or spec)
        if depth == 0 and not spec:
            # a turn checkpoint: a rewind point of the recurrent state below the frontier
            for entry in (lane.ckpt, lane.anchor):
                c = 0 if entry is None else entry.depth
                if max(depth + 1, self.config.min_restore_tokens) <= c <= len(prompt) - 1 \
                        and np.array_equal(np.asarray(lane.tokens[:c], dtype=np.int64),
                                           prompt[:c]):
                    depth = c
        return depth

    def _l3_dropped(self, entry, reason: str) -> None:
        """``ContinuationStore.load``'s ``on_drop``: a corrupt entry was deleted."""
        self.bus.emit_threadsafe(ev.StoreEntryDropped(
            tier="l3", tokens=int(entry.tokens.size), bytes=entry.nbytes, reason=reason,
            entries=len(self.store),
            store_bytes=self.store.nbytes))

    def _restore(self, lane: Lane, req: Request, image: LaneImage, depth: int,
                 tier: str = "l2") -> bool:
        """Load ``image``'s first ``depth`` positions into ``lane`` (whose own retained prefix,
        if any, is demoted first); the lane then retains exactly that prefix. False when the
        image does not fit this cache (the lane is left empty: a cold prefill, never a crash)."""
        t0 = time.monotonic()
        if lane.retained:
            self.lane_pool.evict(lane, "reassigned")
        self.lane_pool.take_pages(lane, depth)
        try:
            import_lane(self.kv, image, depth, lane.pages, lane.id if self.recurrent else None)
        except (ValueError, IndexError) as exc:
            self.lane_pool.reset(lane, 0)
            self.bus.emit_threadsafe(ev.CacheRestoreRefused(request_id=req.request_id,
                                                            lane=lane.id, tier=tier,
                                                            tokens=depth, error=str(exc)))
            return False
        lane.tokens = [int(t) for t in image.tokens[:depth]]
        lane.num_computed = depth
        lane.mtp_pending = lane.ckpt = lane.anchor = None
        lane.persisted = depth if tier == "l3" else 0
        # the bytes copied: the whole image, or the K / V of its first ``depth`` positions
        copied = image.nbytes if depth == image.n else \
            (image.k.nbytes + image.v.nbytes) * depth // image.n
        self.bus.emit_threadsafe(ev.CacheRestored(request_id=req.request_id, lane=lane.id,
                                                  tier=tier, tokens=depth,
                                                  bytes=copied, duration_s=time.monotonic() - t0))
        return True

    def _ops(self):
        return getattr(self.model, "ops", None) or getattr(getattr(self.model, "model", None),
                                                           "ops", None)

    def _export(self, lane: Lane) -> LaneImage:
        return export_lane(self.kv, self._ops(), lane.pages, lane.num_computed, lane.tokens,
                           lane.id if self.recurrent else None)

    def _persist(self, lane: Lane) -> None:
        """Queue a just-retained prefix for L3 (long enough, not stored yet)."""
        n = lane.num_computed
        # due when the session grew by persist_min_tokens since the lane last queued one
        if self.persister is None or n - lane.persisted < max(self.persist_min_tokens, 1):
            return
        if self.store.key_of(np.asarray(lane.tokens[:n])) in self.store.catalog:
            return
        try:
            image = self._export(lane)
        except ValueError:  # state not at the ledger's frontier: nothing consistent to keep
            return
        if self.persister.submit(image):
            lane.persisted = n

    def _demote(self, lane: Lane) -> None:
        """Copy an idle lane's retained prefix to L2 before the lane loses it (a prefix
        shorter than a page is not worth an image)."""
        n = lane.num_computed
        if self.l2 is None or n < self.config.page_size:
            return
        try:
            image = self._export(lane)
        except ValueError:
            return
        admitted, evicted, superseded = self.l2.put(image)
        self._l2_evicted(evicted, superseded)
        self.bus.emit_threadsafe(ev.CacheDemoted(lane=lane.id, tier="l2", tokens=n,
                                                 bytes=image.nbytes, admitted=admitted,
                                                 entries=len(self.l2), tier_bytes=self.l2.nbytes))

    def _l2_evicted(self, evicted: list, superseded: list) -> None:
        """``cache.evicted`` for the images an L2 admission dropped."""
        for reason, images in (("capacity", evicted), ("superseded", superseded)):
            for old in images:
                self.bus.emit_threadsafe(ev.CacheEvicted(tier="l2", tokens=old.n, bytes=old.nbytes,
                                                         reason=reason,
                                                         entries=len(self.l2),
                                                         tier_bytes=self.l2.nbytes))

    def _slot(self, cmd: SlotCommand) -> None:
        t0 = time.monotonic()
        lane = self.lanes[cmd.lane]
        res = self._slot_action(cmd, lane)
        res.seconds = time.monotonic() - t0
        self.outbox.post(cmd.deliver, res)   # (the HTTP side emits slot.action with the file's part)

    def _slot_action(self, cmd: SlotCommand, lane: Lane) -> SlotResult:
        action = cmd.action
        if lane.req is not None:
            return SlotResult(False, "slot_busy", f"slot {lane.id} is serving a request")
        held = session_digest(lane.tokens[:lane.num_computed]) if lane.retained else ""
        if cmd.if_digest is not None and action in ("save", "erase") and \
                cmd.if_digest != held:
            return SlotResult(False, "slot_session_mismatch",
                              f"slot {lane.id} does not hold session {cmd.if_digest} (it "
                              + (f"holds {held})" if held else "holds none)"))
        if action == "save":
            if not lane.retained:
                return SlotResult(False, "slot_save_failed",
                                  f"slot {lane.id} holds no session to save")
            try:
                image = self._export(lane)
            except ValueError as exc:
                return SlotResult(False, "slot_save_failed", str(exc))
            marks = {}
            for role, e in (("turn", lane.ckpt), ("anchor", lane.anchor)):
                if e is not None:
                    marks.setdefault(id(e), [e, []])[1].append(role)
            image.checkpoints = [(e.depth, e.conv, e.ssm, tuple(roles))
                                 for e, roles in marks.values()] or None
            return SlotResult(True, tokens=image.n, image=image, session_digest=held)
        if action == "erase":
            return SlotResult(True, tokens=self.lane_pool.erase(lane))
        # restore
        image = cmd.image
        if image is None or image.n < 1 or image.n + 1 > self.config.max_context:
            return SlotResult(False, "slot_restore_failed",
                              f"the saved session has {0 if image is None else image.n} "
                              f"tokens; a lane holds {self.config.max_context} (the session "
                              "+ at least one token)")
        try:
            check_layout(self.layout_identity(), image)
        except ValueError as exc:   # refused before the lane's own session is touched
            return SlotResult(False, "slot_restore_failed", f"the session does not fit this "
                              f"cache: {exc}")
        if lane.retained:
            self.lane_pool.evict(lane, "restored")
        try:
            self.lane_pool.take_pages(lane, image.n)
        except OutOfPages as exc:
            return SlotResult(False, "slot_restore_failed", f"no room in the KV pool: {exc}")
        try:
            import_lane(self.kv, image, image.n, lane.pages, lane.id if self.recurrent
                        else None)
        except Exception as exc:  # whatever the image holds, the engine goes on
            self.lane_pool.reset(lane, 0)
            return SlotResult(False, "slot_restore_failed", f"the session does not fit this "
                              f"cache: {exc}")
        lane.tokens = [int(t) for t in image.tokens]
        lane.num_computed = image.n
        lane.mtp_pending, lane.persisted, lane.ckpt, lane.anchor = None, 0, None, None
        lane.retained_t, lane.cache_key, lane.last_request = time.monotonic(), "", ""
        for depth, conv, ssm, roles in (image.checkpoints or []) if self.recurrent else ():
            entry = Checkpoint(depth, conv, ssm, "")   # "": the restored session's latest one
            if "turn" in roles:
                lane.ckpt = entry
            if "anchor" in roles:
                lane.anchor = entry
        self.lane_pool.retained(lane, "", 0)
        return SlotResult(True, tokens=image.n, session_digest=session_digest(lane.tokens))

    def _assign(self, lane: Lane, req: Request, spec: bool, depth: int,
                candidates: int, source: str = "l1", path: str | None = None) -> None:
        """Bind ``req`` to ``lane``, reusing its first ``depth`` retained tokens (``source``:
        the tier they came from; ``path``: the reuse path when it was decided elsewhere)."""
        now = time.monotonic()
        routed = bool(req.cache_key) and lane.retained and lane.cache_key == req.cache_key \
            and depth >= max(self.config.page_size, self.config.min_restore_tokens)
        entry = next((e for e in (lane.ckpt, lane.anchor) if e is not None and e.depth == depth),
                     None) if 0 < depth < lane.num_computed else None
        if entry is not None:
            self.lane_pool.truncate(lane, depth)   # KV back to the checkpoint, then its state
            restore_state(self.kv, lane.id, entry.conv, entry.ssm, depth)
            path = "restore_turn_checkpoint"
        if depth > 0 and self.recurrent and int(self.kv.lengths[lane.id]) != depth:
            depth = 0  # the state slot is not at the frontier the ledger says: a safe miss
        path = path if depth > 0 and path is not None else (
            "disabled" if not self.config.prefix_reuse else
            "full_reset" if depth == 0 else
            "append_frontier" if depth == lane.num_computed else "truncate_frontier")
        if depth == 0:
            if lane.retained:
                self.lane_pool.evict(lane, "reassigned")
            else:
                self.lane_pool.reset(lane, 0)   # a new conversation: nothing of it is kept
        elif depth < lane.num_computed:
            self.lane_pool.truncate(lane, depth)
        self.lane_pool.assign(lane, req, self.tokenizer, self.vocab, spec, depth, now)
        if spec and depth > 0:
            self.spec.resume(lane)  # the retained pending MTP rows meet the new prompt
        lane.mtp_pending = None
        self.bus.emit_threadsafe(ev.LaneAssigned(lane=lane.id, request_id=req.request_id,
                                                 n_ctx=self.config.max_context,
                                                 pages=len(lane.pages)))
        self.bus.emit_threadsafe(ev.CacheLookup(request_id=req.request_id, lane=lane.id,
                                                prompt_tokens=lane.prompt_len, cached_tokens=depth,
                                                path=path, candidates=candidates,
                                                source=source if depth else "none",
                                                routed=routed))
        self.bus.emit_threadsafe(ev.RequestAdmitted(request_id=req.request_id, lane=lane.id,
                                                    queue_s=now - req.received_t,
                                                    cached_tokens=depth))

    def _cancel(self, request_id: str, reason: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.bus.emit_threadsafe(ev.RequestCancelled(request_id=request_id, lane=-1,
                                                             completion_tokens=0, reason=reason))
                return
        lane = self.lane_pool.lane_of(request_id)
        if lane is not None:
            n = lane.generated
            self.lane_pool.release(lane, retain=True)
            self.bus.emit_threadsafe(ev.RequestCancelled(request_id=request_id, lane=lane.id,
                                                         completion_tokens=n, reason=reason))

    # -- work units -----------------------------------------------------------------------
    def _batch(self, lanes: list[Lane], spans: list[tuple[int, int]], tokens=None):
        """ForwardBatch for ``lanes``, lane i computing token positions ``spans[i] = (a, b)``
        (of its own tokens, or of ``tokens[i]``)."""
        if tokens is None:
            tokens = [ln.tokens[a:b] for ln, (a, b) in zip(lanes, spans)]
        return self._ForwardBatch.from_sequences(
            tokens, [a for a, _ in spans],
            [ln.pages for ln in lanes], self.config.page_size,
            state_slots=[ln.id for ln in lanes] if self.recurrent else None)

    def _prefill_chunk(self, lane: Lane) -> None:
        req = lane.req
        a = lane.num_computed
        b = min(lane.prompt_len, a + self.config.prefill_chunk)
        c = req.checkpoint_at
        checkpoint = (self.recurrent and self.config.turn_checkpoint and self.config.prefix_reuse
                      and not lane.spec and c is not None and a < c <= b and c < lane.prompt_len)
        publish = self._publish_depth(lane, a, b)
        if checkpoint or publish:
            # this chunk ends at the checkpoint or the breakpoint (the nearer); the next one
            # goes on from there
            b = min(d for d in (c if checkpoint else None, publish) if d)
            checkpoint, publish = checkpoint and b == c, publish if publish == b else None
        try:
            self.lane_pool.ensure_pages(lane, b)
        except OutOfPages:
            self.output.fail(lane, "kv_cache_full", "no free KV pages for this request")
            return
        t0 = time.monotonic()
        if lane.spec:
            logits = self.spec.prefill(lane, a, b)
        else:
            logits = self.model.forward(self._batch([lane], [(a, b)]), self.kv)
        lane.num_computed = b
        if checkpoint:
            self._checkpoint(lane, c)
        if publish:
            self._publish(lane, publish)
        done = b >= lane.prompt_len
        sampled = None
        if done:
            sampled = self._sample([lane], logits)[0]
        t1 = time.monotonic()
        self.bus.emit_threadsafe(ev.RequestPrefillChunk(request_id=req.request_id, lane=lane.id,
                                                        tokens=b - a, done_tokens=b,
                                                        prompt_tokens=lane.prompt_len,
                                                        duration_s=t1 - t0))
        if done:
            lane.first_token_t = t1
            self.bus.emit_threadsafe(ev.RequestFirstToken(request_id=req.request_id, lane=lane.id,
                                                          ttft_s=t1 - req.received_t))
            self.output.commit(lane, sampled, t1)

    @property
    def publishes(self) -> bool:
        """Whether prompt-cache breakpoints can publish anything: prefix reuse on and an L2 or
        L3 tier in use (``Request.publish_at`` is ignored otherwise)."""
        return self.config.prefix_reuse and (self.l2 is not None or self.persister is not None)

    def _publish_depth(self, lane: Lane, a: int, b: int) -> int | None:
        """The nearest of the request's breakpoints (``Request.publish_at``) in (a, b] that
        this chunk should stop at to publish, or None: only with a tier to publish to, prefix
        reuse on, a depth of at least ``min_restore_tokens`` below the prompt's end, not held
        by every tier already (or refused by all, ``_holds``), and not on a speculative (MTP)
        lane (as turn checkpoints: not measured there)."""
        if not self.publishes or lane.spec:
            return None
        for d in sorted(lane.req.publish_at):
            if a < d <= b and self._unpublished(lane, d):
                return d
        return None

    def _unpublished(self, lane: Lane, d: int) -> bool:
        """Whether depth ``d`` of ``lane``'s prompt is worth publishing: below the prompt's end,
        at least ``min_restore_tokens`` deep, and not held (or refused) by every tier."""
        return d < lane.prompt_len and d >= max(self.config.min_restore_tokens, 1) and \
            not all(self._holds(lane.tokens[:d]))

    def _holds(self, tokens) -> tuple[bool, bool]:
        """Whether L2 and L3 (each True when absent) hold an image of ledger ``tokens``, or
        cannot take it (an earlier copy was refused by every tier for its size: never copied
        out again)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        key = image_key(tokens)
        if key in self._unpublishable:
            return True, True
        return (self.l2 is None or self.l2.holds(key),
                self.persister is None or self.store.key_of(tokens) in self.store.catalog)

    def _publish(self, lane: Lane, depth: int) -> None:
        """Publish the lane's prefix ``tokens[:depth]`` (its frontier now) as an image to L2
        and L3, skipping the tiers that already hold it (``cache.published``); an image
        larger than L2's budget and half of L3's quota (what L3 refuses) is remembered as
        unpublishable."""
        in_l2, in_l3 = self._holds(lane.tokens[:depth])
        t0 = time.monotonic()
        try:
            image = export_lane(self.kv, self._ops(), lane.pages, depth, lane.tokens,
                                lane.id if self.recurrent else None)
        except ValueError:  # state not at the ledger's frontier: nothing consistent to keep
            return
        tiers, too_big = [], True
        if not in_l2:
            admitted, evicted, superseded = self.l2.put(image)
            self._l2_evicted(evicted, superseded)
            if admitted:
                tiers.append("l2")
            too_big = not admitted
        if not in_l3:
            fits = image.nbytes <= self.store.quota_bytes // 2   # what ContinuationStore takes
            too_big = too_big and not fits
            if fits and self.persister.submit(image):
                tiers.append("l3")   # queued (store.persisted when durable)
        if tiers:
            lane.published = max(lane.published, depth)
        elif too_big:
            self._unpublishable[image.key] = None
            while len(self._unpublishable) > 256:
                self._unpublishable.popitem(last=False)
        self.bus.emit_threadsafe(ev.CachePublished(
            request_id=lane.req.request_id, lane=lane.id, tokens=depth, bytes=image.nbytes,
            tiers=tiers,
            session_digest=session_digest(lane.tokens[:depth]), duration_s=time.monotonic() - t0,
            l2_entries=len(self.l2) if self.l2 is not None else 0,
            l2_bytes=self.l2.nbytes if self.l2 is not None else 0))

    def _checkpoint(self, lane: Lane, depth: int) -> None:
        """Copy the lane's recurrent state (at frontier ``depth``) aside as its turn
        checkpoint, replacing the previous one."""
        conv, ssm = export_state(self.kv, self._ops(), lane.id, depth)
        lane.ckpt = Checkpoint(depth, conv, ssm, lane.req.request_id)
        if lane.req.checkpoint_anchor:
            lane.anchor = lane.ckpt
        self.bus.emit_threadsafe(ev.LaneCheckpointed(
            lane=lane.id, request_id=lane.req.request_id, tokens=depth,
            bytes=sum(a.nbytes for a in conv + ssm),
            session_digest=session_digest(lane.tokens[:depth])))

    def _sample(self, lanes: list[Lane], logits: np.ndarray) -> list[tuple]:
        """One ``(token, logprobs)`` per lane from ``logits`` ``(len(lanes), V)``; each row
        uses only its own lane's parameters, penalty state and output position.

        ``logits`` may live on a device (``model.ops``): when every lane is greedy without
        penalties or logprobs the argmax runs there and only the ids come back; otherwise the
        logits are copied to the host for the NumPy sampler."""
        logits = logits[:, :self.vocab]  # padded head columns are never sampled
        ops = getattr(self.model, "ops", None)
        if ops is not None:
            if hasattr(ops, "argmax") and all(
                    ln.req.params.greedy and not ln.req.params.penalized
                    and ln.req.logprobs is None for ln in lanes):
                return [(int(t), None) for t in ops.argmax(logits)]
            logits = ops.to_numpy(logits)
        out = []
        for i, ln in enumerate(lanes):
            p = ln.req.params
            row = apply_penalties(logits[i], ln.counts, ln.seen, p) if p.penalized \
                else logits[i]
            tok = sample(row, p, ln.generated)
            lp = top_logprobs(logits[i], tok, ln.req.logprobs) \
                if ln.req.logprobs is not None else None
            out.append((tok, lp))
        return out

    def _decode_round(self, lanes: list[Lane]) -> None:
        """One decode round of ``lanes``: launch, then commit each lane's token. With the
        lookahead (``EngineConfig.decode_lookahead``) and greedy lanes the next round is
        launched before this one's tokens are read, its tokens fed on the device
        (``_launch``), and left in flight as ``_ahead``: the device never waits for the host
        between rounds. A round ahead whose lane a commit changed (a finish, a forced token)
        is committed at once for the lanes it is still right for; an inbox op, an admission
        or a prefill chunk commits it first (``_resolve_ahead``)."""
        if self.spec is not None and any(ln.spec for ln in lanes):
            self._resolve_ahead()
            self.outbox.flush()
            self.spec.round([ln for ln in lanes if ln.spec])
            lanes = [ln for ln in lanes if not ln.spec and ln.decode_ready]
            if not lanes:
                return
        cur, self._ahead = self._ahead, None
        still = self._still(cur) if cur is not None else []
        if cur is not None and (cur.lanes != lanes or not all(still)):
            self._commit_round(cur, still)
            cur = None
            lanes = [ln for ln in lanes if ln.decode_ready]
        if cur is None:
            ok = []
            for ln in lanes:
                try:
                    self.lane_pool.ensure_pages(ln, ln.num_computed + 1)
                    ok.append(ln)
                except OutOfPages:
                    self.output.fail(ln, "kv_cache_full", "no free KV pages for this request")
            if not ok:
                self.outbox.flush()
                return
            cur = self._launch(ok, feed=False)
        # (none while a lane prefills: the next turn is its chunk, which commits the round ahead)
        ahead = cur.fed and not any(ln.prefilling for ln in self.lanes)
        nxt = self._launch(cur.lanes, feed=True) if ahead and self._pages_ahead(cur) else None
        self.outbox.flush()  # the previous round's outputs, while this one computes
        self._commit_round(cur)
        if nxt is not None:
            keep = [k and ln.tokens[-1] == t for k, ln, t in zip(self._still(nxt), nxt.lanes,
                                                                  cur.ids)]
            if all(keep):
                self._ahead = nxt
            elif any(keep):
                self._commit_round(nxt, keep)
            # (else the round ahead is dropped: its KV rows lie past every lane's length)

    @staticmethod
    def _still(r: _Round) -> list[bool]:
        """Per lane of the launched round ``r``: whether the round is still the lane's next
        position of the same request (not finished, cancelled or reassigned since)."""
        return [ln.req is q and ln.decode_ready and ln.num_computed + 1 == p
                for ln, q, p in zip(r.lanes, r.reqs, r.positions)]

    def _pages_ahead(self, r: _Round) -> bool:
        """Whether every lane of round ``r`` has (or now gets) the page of the position after
        it; a lane that cannot get it simply runs without a round ahead."""
        if any(ln.num_computed + 2 > self.config.max_context for ln in r.lanes):
            return False
        try:
            for ln in r.lanes:
                self.lane_pool.ensure_pages(ln, ln.num_computed + 2)
        except OutOfPages:
            return False
        return True

    def _launch(self, lanes: list[Lane], feed: bool) -> _Round:
        """Launch a decode round of ``lanes`` at their next positions (``feed``: one further,
        with the tokens the previous round chose, which only the device knows yet). Where the
        lookahead applies (greedy lanes: ``_greedy_lanes``) the round chooses its tokens as
        it runs (``model.greedy``, else ``forward`` and ``_sample``) and is marked ``fed``:
        the next round may feed on it."""
        t0 = time.monotonic()
        d = 1 if feed else 0
        spans = [(ln.num_computed + d, ln.num_computed + d + 1) for ln in lanes]
        # (fed: the tokens are the device's; placeholders here)
        batch = self._batch(lanes, spans, [[0]] * len(lanes) if feed else None)
        r = _Round(lanes, [ln.req for ln in lanes], [b for _, b in spans], t0)
        if not (feed or (self._lookahead and self._greedy_lanes(lanes))):
            r.logits = self.model.forward(batch, self.kv)
            return r
        greedy = getattr(self.model, "greedy", None)
        if callable(greedy) and self.vocab == self.model.config.vocab_size:
            r.result = greedy(batch, self.kv, feed=feed)
        if r.result is not None:
            self._fed_ids = None
        elif not feed and self.config.decode_lookahead != "on":   # (no replay: a plain round)
            r.logits = self.model.forward(batch, self.kv)
            return r
        else:   # forward, then the host's choice (what the device would): "on", for tests
            if feed:
                if self._fed_ids is None:
                    raise RuntimeError("decode lookahead: no chosen ids to feed on")
                batch.token_ids[:] = self._fed_ids
            logits = self.model.forward(batch, self.kv)
            ids = np.array([t for t, _ in self._sample(lanes, logits)], dtype=np.int64)
            self._fed_ids = ids.astype(np.int32)
            r.result = lambda: ids
        r.fed = True
        return r

    @staticmethod
    def _greedy_lanes(lanes: list[Lane]) -> bool:
        return all(ln.req.params.greedy and not ln.req.params.penalized
                   and ln.req.logprobs is None and not ln.spec for ln in lanes)

    def _commit_round(self, r: _Round, keep: list[bool] | None = None) -> None:
        """Read round ``r``'s tokens and commit them (only for the lanes ``keep`` marks): the
        lanes' computed positions advance, the round's event, then each token."""
        keep = [(keep is None or keep[i]) and ln.req is r.reqs[i]
                for i, ln in enumerate(r.lanes)]
        idx = [i for i, k in enumerate(keep) if k]
        lanes = [r.lanes[i] for i in idx]
        if r.logits is not None:
            if not lanes:
                return
            sampled = self._sample(lanes, r.logits if len(idx) == len(keep) else r.logits[idx])
        else:
            r.ids = r.result()
            sampled = [(int(r.ids[i]), None) for i in idx]
            if not lanes:
                return
        for ln in lanes:
            ln.num_computed += 1
        if r.ids is None:   # (a logits round: the kept lanes' tokens; never fed on)
            r.ids = np.array([t for t, _ in sampled], dtype=np.int64)
        t1 = time.monotonic()
        self.round += 1
        itl = [t1 - ln.last_token_t for ln in lanes]
        # (a round launched ahead counts from the commit before it: rounds tile the time)
        t0, self._committed_t = max(r.t0, self._committed_t), t1
        self.bus.emit_threadsafe(ev.SchedulerRound(round=self.round, lanes=[ln.id for ln in lanes],
                                                   tokens=len(lanes), duration_s=t1 - t0, itl_s=itl,
                                                   waiting=len(self.waiting)))
        self.outbox.hold()
        try:
            for ln, tok in zip(lanes, sampled):
                self.output.commit(ln, tok, t1)
        finally:
            self.outbox.release()

    def _resolve_ahead(self) -> None:
        """Commit the round launched ahead, if any (before the lanes change otherwise)."""
        r, self._ahead = self._ahead, None
        if r is not None:
            self._commit_round(r)
            self._account("decode")

    def _fail_all(self, code: str, message: str) -> None:
        for lane in self.lanes:
            if lane.req is not None:
                try:
                    self.output.fail(lane, code, message)
                except Exception:
                    pass
        while self.waiting:
            self.output.refuse(self.waiting.popleft(), code, message)

def routing_key(prompt_cache_key: str | None) -> str:
    """The engine's form of a ``prompt_cache_key``: a 16-hex BLAKE2b digest ("" for None), so
    the raw key never reaches the lanes, the events or the logs."""
    if not prompt_cache_key:
        return ""
    return hashlib.blake2b(prompt_cache_key.encode(), digest_size=8,
                           person=b"ninfer-pck").hexdigest()
