"""Admission, shared by every generating protocol (serving contract §1.11).

A request takes a request-lifetime slot (``max_concurrency + max_pending_requests`` of them, one
pool for all routes) before it is prepared and holds it until its reply is released; none free
→ 429 ``server_overloaded``. One deadline (``--pending-timeout-ms``) starts then and covers
preparation and the engine FIFO. ``n`` choices hold a slot each (429 when fewer are free; 400
``invalid_value`` when n exceeds them all). Beside the slots, the limits every engine request
gets: its output cap against the context, its seed and its sampling parameters.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from quart import g, request

from ..engine.sampling import SamplingError, SamplingParams
from ..events.schema import RequestRejected
from .errors import ApiError


class Admission:
    """The request-lifetime slots of one server: how many are held, and the 429 when full."""

    def __init__(self, state):
        self.state = state
        self.in_flight = 0   # slots held by requests not yet released

    @property
    def capacity(self) -> int:
        cfg = self.state.config
        return cfg.max_concurrency + cfg.max_pending_requests

    def admit(self, request_id: str) -> AdmissionTicket:
        """One slot for the request ``request_id``, and its deadline.

        Raises:
            ApiError: 503 ``service_unavailable`` when the engine stopped for good; 429
                ``server_overloaded`` (logged as ``request.rejected``) when no slot is free.
        """
        if self.state.engine.fatal is not None:
            raise ApiError(503, "the engine stopped after an internal error; restart the "
                           "server", "service_unavailable")
        ticket = AdmissionTicket(admission=self, request_id=request_id, deadline=0.0)
        ticket.take(1)
        ticket.deadline = time.monotonic() + self.state.config.pending_timeout_ms / 1000.0
        return ticket

    def overloaded(self, request_id: str, want: int) -> ApiError:
        """The 429 of a request that asked ``want`` more slots than are free (logged)."""
        cfg = self.state.config
        msg = (f"server overloaded: {self.in_flight} requests in flight, {want} more asked "
               f"(max_concurrency {cfg.max_concurrency} + max_pending_requests "
               f"{cfg.max_pending_requests})")
        self.state.bus.emit(RequestRejected(request_id=request_id, code="server_overloaded",
                                            message=msg,
                                            http_request_id=g.get("request_id", ""),
                                            path=request.path))
        return ApiError(429, msg, "server_overloaded", logged=True)


@dataclass
class AdmissionTicket:
    """The slots one request holds, until ``release()`` (idempotent)."""
    admission: Admission
    request_id: str
    deadline: float   # time.monotonic() by which the engine must have started it
    held: int = 0
    released: bool = False

    def take(self, k: int) -> None:
        """``k`` more slots for this request, or 429."""
        pool = self.admission
        if pool.in_flight + k > pool.capacity:
            raise pool.overloaded(self.request_id, k)
        pool.in_flight += k
        self.held += k

    def reserve_choices(self, n: int, prompts: int = 1) -> None:
        """Once ``n`` is known, before any engine request: the other choices (``n`` for each
        of ``prompts`` Completions prompts) take slots too, so that ``n`` cannot fill the engine
        queue past the admission bound."""
        capacity, total = self.admission.capacity, n * prompts
        if total > capacity:
            asked = f"'n' {n} x {prompts} prompts is {total}" if prompts > 1 else f"'n' is {n}"
            raise ApiError(400, f"{asked}: at most {capacity} choices fit in this "
                           f"server's admission (max_concurrency + max_pending_requests)",
                           "invalid_value", "n")
        self.take(total - 1)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.in_flight -= self.held


@dataclass(frozen=True, slots=True)
class OutputCap:
    """The most tokens a request may generate, and where that number came from
    (``max_tokens_source``: ``client``, ``client_clamped`` or ``server_default``)."""
    max_tokens: int
    source: str


def output_cap(state, asked: int | None, n_prompt: int, param: str,
               default: int | None = None) -> OutputCap:
    """The output cap of a prompt of ``n_prompt`` tokens: the client's ``max_tokens`` clamped
    to what is left of the context (``client_clamped``: generation ends there with ``length``,
    as llama.cpp and Ollama do), else ``default`` (the server's ``--default-max-tokens`` when
    None) cut to the room left.

    Raises:
        ApiError: 400 ``context_length_exceeded`` naming ``param`` when the prompt leaves no
            room for one token, or (``--strict-max-tokens``) for the prompt plus ``max_tokens``.
    """
    n_ctx, cfg = state.n_ctx, state.config
    room = n_ctx - n_prompt
    if room < 1 or (asked is not None and asked > room and cfg.strict_max_tokens):
        # the prompt alone, whatever max_tokens says (it would be clamped): Anthropic's wording,
        # which Claude Code recognizes (it offers /compact); the window keeps one output token
        message = (f"prompt is too long: {n_prompt} tokens > {n_ctx - 1} maximum (the context "
                   f"window of {n_ctx} tokens keeps one for the output)") if room < 1 else (
            f"the request needs {n_prompt} prompt tokens + {asked} output tokens, more than the "
            f"context window of {n_ctx} tokens (--strict-max-tokens: max_tokens is not clamped)")
        raise ApiError(400, message, "context_length_exceeded", param,
                       {"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})
    if asked is None:
        limit = cfg.default_max_tokens if default is None else default
        return OutputCap(max_tokens=min(limit, room), source="server_default")
    if asked > room:
        return OutputCap(max_tokens=room, source="client_clamped")
    return OutputCap(max_tokens=asked, source="client")


def request_seed(config, creq) -> int:
    """The request's seed, else the server's ``--seed``, else a fresh random one."""
    if creq.seed is not None:
        return creq.seed
    return config.seed if config.seed is not None else secrets.randbits(63)


def sampling_params(config, creq, seed: int) -> SamplingParams:
    """The sampling parameters of ``creq`` (``--temperature``, ``--top-k``, ``--top-p`` and
    ``--min-p`` for those it gives none of).

    Raises:
        ApiError: 400 ``invalid_value`` for a combination the sampler refuses.
    """
    temperature = config.temperature if creq.temperature is None else creq.temperature
    try:
        return SamplingParams(
            temperature=temperature, top_k=config.top_k if creq.top_k is None else creq.top_k,
            top_p=config.top_p if creq.top_p is None else creq.top_p,
            min_p=config.min_p if creq.min_p is None else creq.min_p,
            seed=seed % 2 ** 64, presence_penalty=creq.presence_penalty,
            frequency_penalty=creq.frequency_penalty,
            repetition_penalty=creq.repetition_penalty)
    except SamplingError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None
