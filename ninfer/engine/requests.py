"""What a request is and what the engine sends back: the request, its token / final / error
outputs, and the slot commands of ``POST /slots/{id}`` (types only; ``engine.py`` runs them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .continuation import LaneImage
from .sampling import SamplingParams


# --- what the engine sends back ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One committed output token. ``text``: newly completed text (may be empty while a UTF-8
    character or a possible stop string is incomplete); ``index``: output position;
    ``logprob`` / ``top_logprobs`` (``((id, logprob), ...)``, best first) when the request asked
    for log-probabilities (natural log, the model's raw distribution); ``reasoning``: the text
    belongs to the thinking block (``reasoning_content``), not the answer."""
    token_id: int
    text: str
    index: int
    logprob: float | None = None
    top_logprobs: tuple = ()
    reasoning: bool = False


@dataclass(frozen=True, slots=True)
class FinalOutput:
    """The request ended normally. ``finish_reason``: OpenAI's ``stop`` | ``length``;
    ``engine_reason``: ``stop_token`` | ``stop_string`` | ``output_limit`` |
    ``context_capacity``; ``text``: trailing text released at the end (held-back bytes);
    ``timings``: seconds (``queue_s prefill_s decode_s ttft_s total_s``); ``draft_n`` /
    ``draft_n_accepted``: MTP draft tokens and those verification accepted (speculative
    decoding; 0 otherwise)."""
    finish_reason: str
    engine_reason: str
    text: str
    lane: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    timings: dict
    text_is_reasoning: bool = False
    draft_n: int = 0
    draft_n_accepted: int = 0
    stop_string: str | None = None   # the stop string that ended it (``stop_string``)
    # prompt tokens past the reused prefix that this request published to a cache tier at a
    # prompt-cache breakpoint (``Request.publish_at``): the deepest such depth minus
    # ``cached_tokens``, 0 when it published nothing new
    cache_write_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ErrorOutput:
    """The request failed inside the engine. ``code`` is a stable error code."""
    code: str
    message: str


# --- requests and lanes ------------------------------------------------------------------

@dataclass(slots=True)
class Request:
    """A prepared generation request.

    Args:
        request_id: unique id (also on every event of this request).
        prompt_ids: rendered and tokenized prompt.
        params: resolved sampling parameters.
        max_tokens: output cap (>= 1).
        deliver: called (on the trio thread when the engine runs threaded) with each
            TokenOutput, then exactly one FinalOutput or ErrorOutput — or nothing after a
            cancellation.
        stop: stop strings (never emitted; the text before them is).
        ignore_eos: keep generating through the end-of-generation tokens.
        deadline: monotonic time after which a request still waiting for a lane is refused
            with ``request_queue_timeout`` (None: wait forever). Admitted requests never expire.
        logprobs: None, or how many top alternatives to report with each token (0..20).
        checkpoint_at: hybrid models: the prompt depth of a turn checkpoint (the end of the
            history before the generation opener): prefill stops there once and copies the
            lane's recurrent state aside, so that a next prompt which keeps the history but
            renders the answer differently (a template that drops the thinking of closed
            turns, a regenerated answer) resumes there instead of from zero. None: no checkpoint.
        cache_key: the session key (``api/session_key.py``: ``routing_key(prompt_cache_key)``,
            of Anthropic's ``metadata.user_id``, or the conversation's root digest; "" for
            none): a routing hint, never an authorisation. A free lane whose session was
            served under the same key is taken before an empty one (the client's own
            conversation, even one it rewrote); what is reused is still decided by the tokens
            alone.
        session_kind: where ``cache_key`` came from: ``prompt_cache_key``, ``user_id`` (the
            client names its session) or ``root`` (inferred: its own history counts as not
            lost only within the lane's latest turn, ``ReusePolicy.own``).
        anchor_at: hybrid models: the prompt depth where the newest user query's content
            begins (the prompt ends with a user message): prefill stops there once and copies
            the state aside as the lane's user-turn anchor, kept through the tool-loop turns
            that follow, so that a next prompt which rewrites that message (a reminder moved
            to the next one) or drops the thinking of the turns after it resumes there. It may
            equal ``checkpoint_at`` (one copy plays both roles). None: no anchor.
        boundaries: hybrid models with the turn-checkpoint ring: prompt depths where messages
            begin; prefill stops at those past the reused prefix (spaced, at most the ring's
            size, ``checkpoints.boundaries``) and copies the state into the ring, so that a
            later edit of one of these messages resumes just below it.
        think_budget: when set, the prompt opened a thinking block: output is reasoning until
            the model emits ``think_end_id``, and after ``think_budget`` reasoning tokens the
            server emits ``think_end_id`` itself (a reasoning budget, as llama.cpp's).
        think_end_id: the token that closes the thinking block (e.g. ``</think>``).
        publish_at: prompt-cache breakpoints (serving contract §1.7): prompt depths (each
            below the prompt's length) whose prefix the engine publishes as an image to the
            host (L2) and disk (L3) tiers, where they exist, so that any later request sharing
            that prefix (another conversation with the same system prompt and tools) reuses it;
            prefill stops at each once and copies it out, unless every tier already holds it
            (``cache.published``). Depths below ``min_restore_tokens`` publish nothing.
        protocol, model, stream, message_count, max_tokens_source, http_request_id,
            ignored_fields, volatile_spans: copied
            onto ``request.received`` for the log (http_request_id: the HTTP response's
            ``x-request-id``).
        cached_tokens: None until admitted; then the prompt tokens reused, written by the
            engine before it delivers any output (a stream's opening usage reads it).
    """
    request_id: str
    prompt_ids: list
    params: SamplingParams
    max_tokens: int
    deliver: Callable
    stop: tuple = ()
    ignore_eos: bool = False
    protocol: str = "engine"
    model: str = ""
    stream: bool = False
    message_count: int = 0
    max_tokens_source: str = "client"
    deadline: float | None = None
    logprobs: int | None = None
    think_budget: int | None = None
    think_end_id: int | None = None
    received_t: float = 0.0
    checkpoint_at: int | None = None
    anchor_at: int | None = None
    boundaries: tuple = ()
    cache_key: str = ""
    session_kind: str = ""
    publish_at: tuple = ()
    http_request_id: str = ""
    ignored_fields: tuple = ()
    volatile_spans: tuple = ()
    cached_tokens: int | None = None   # set by the engine at admission (the reused prefix)


@dataclass(slots=True)
class SlotCommand:
    """The engine's part of ``POST /slots/{id}?action=...`` (serving contract §1.10), run on the
    execution thread between steps, so it sees a lane at a step boundary: ``save`` exports the
    lane's retained session (with a hybrid lane's turn checkpoints, ``image.checkpoints``),
    ``restore`` loads ``image`` into it (whatever the lane retained is evicted first, to L2
    when there is one), ``erase`` drops its session (never to L2).
    ``if_digest`` (save, erase): the ``session_digest`` the lane must hold, checked at that
    same boundary. ``deliver`` receives one ``SlotResult``. ``filename``: the slot file
    (save, restore), which the lane's session is then bound to (``--auto-save-evicted``)."""
    action: str
    lane: int
    deliver: Callable
    if_digest: str | None = None
    image: LaneImage | None = None
    filename: str = ""


@dataclass(slots=True)
class SlotResult:
    """Outcome of a SlotCommand. ``code`` (when not ``ok``): ``slot_busy`` (a request runs
    on the lane), ``slot_session_mismatch`` (``if_digest`` differs, or nothing is held), or
    ``slot_<action>_failed``; ``tokens``: saved / restored / erased; ``image``: the saved
    session (save); ``session_digest``: the lane's after the action (save / restore)."""
    ok: bool
    code: str = ""
    message: str = ""
    tokens: int = 0
    image: LaneImage | None = None
    session_digest: str = ""
    seconds: float = 0.0
