"""The chat-form prompt: where system messages go, which thinking mode the template is asked
for, and the rendered, tokenized prompt with its turn checkpoint and cache breakpoints.
Shared by the protocols that speak in messages (chat, Messages, Responses)."""
from __future__ import annotations

from dataclasses import dataclass

import trio

from ..engine.chat_template import TemplateError
from .breakpoints import breakpoint_depths, message_depths
from .errors import ApiError
from . import fields

# prompts rendered and tokenized at once (worker threads: the tokenizer releases the GIL for
# long texts, so each one in flight holds its memory, up to ~150 bytes per byte of text)
PROMPT_THREADS = trio.CapacityLimiter(4)


@dataclass(frozen=True, slots=True)
class ThinkingParams:
    """A route's names of the thinking parameters (in its errors and ignored fields)."""
    reasoning_effort: str = "reasoning_effort"
    enable_thinking: str = "enable_thinking"


@dataclass(frozen=True, slots=True)
class Thinking:
    """The thinking mode asked of the template, and the thinking-token budget (None: none)."""
    template_kwargs: dict
    budget: int | None


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A tokenized prompt; ``checkpoint_at``: where the history ends and the generation opener
    begins (None: unknown); ``anchor_at``: where the content of its closing user message
    begins (None: unknown, or no closing user message); ``publish_at``: the depths of its
    prompt-cache breakpoints; ``boundaries``: where its last messages begin (the ring's)."""
    ids: list
    checkpoint_at: int | None
    publish_at: tuple
    anchor_at: int | None = None
    boundaries: tuple = ()


_ANCHOR_MARK = "\u2063ninfer-anchor\u2063"   # (invisible separators: no real message has it)


def prompt_too_long(n_bytes: int, n_ctx: int, param: str) -> ApiError:
    """400 ``context_length_exceeded`` for a text longer than the context could hold at all."""
    return ApiError(400, f"the prompt is {n_bytes} bytes of text, more than the context "
                    f"window of {n_ctx} tokens can hold", "context_length_exceeded", param,
                    {"n_prompt_bytes": n_bytes, "n_ctx": n_ctx})


def _takes_later_system(template) -> bool:
    """Whether the chat template renders a system message after the first turn."""
    try:
        template.render([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}],
                        add_generation_prompt=True)
        return True
    except TemplateError:
        return False


class ChatPrompt:
    """What the loaded chat template offers, and prompts rendered through it."""

    def __init__(self, state):
        self.state = state
        # thinking-capable template: it reads enable_thinking and </think> is one token
        source = getattr(state.template, "source", "") or ""
        end = state.tokenizer.encode("</think>")
        self.think_end_id = end[0] if "enable_thinking" in source and len(end) == 1 else None
        self.mid_system = state.template is not None and _takes_later_system(state.template)

    def placed_system(self, messages: list[dict]) -> list[dict]:
        """``messages`` with each system message after the first turn as a user turn when the
        template takes a system message only first (Qwen3.5's raises; SmolLM2's renders it
        where it is, which its model follows better)."""
        if self.mid_system:
            return messages
        return [{**m, "role": "user"} if m["role"] == "system" and i > 0 else m
                for i, m in enumerate(messages)]

    def thinking(self, creq, names: ThinkingParams) -> Thinking:
        """The thinking mode of a request. Thinking asked of a template without a thinking
        mode is served without thinking, the parameter logged as ignored (``fields``).

        Raises:
            ApiError: 400 ``reasoning_effort_not_supported`` for an effort the loaded chat
                template does not offer, or (``--strict-request-fields``) any thinking on a
                template without it.
        """
        cfg = self.state.config
        effort = creq.reasoning_effort
        if self.think_end_id is None:
            if effort not in (None, "none") or creq.enable_thinking:
                param = names.reasoning_effort if effort else names.enable_thinking
                fields.current().refuse_or_ignore(ApiError(
                    400, "this model's chat template has no thinking mode",
                    "reasoning_effort_not_supported", param), param)
            return Thinking(template_kwargs={}, budget=None)
        if effort not in (None, "none", "low", "medium", "high"):
            raise ApiError(400, f"reasoning_effort '{effort}' is not offered by this model "
                           "(none, low, medium, high)", "reasoning_effort_not_supported",
                           names.reasoning_effort)
        if effort is None:
            effort = "none" if creq.enable_thinking is False else cfg.reasoning_effort
            if creq.enable_thinking and effort == "none":
                effort = "medium"
        preserve = {"preserve_thinking": cfg.preserve_thinking if creq.preserve_thinking is None
                    else creq.preserve_thinking}
        if effort == "none":
            return Thinking(template_kwargs={"enable_thinking": False, **preserve}, budget=None)
        return Thinking(template_kwargs={"enable_thinking": True, **preserve},
                        budget=getattr(cfg, f"reasoning_budget_{effort}"))

    async def render(self, creq, template_kwargs: dict, param: str, checkpoint: bool = False,
                     breakpoints: bool = False, boundaries: int = 0) -> RenderedPrompt:
        """The rendered and tokenized prompt of ``creq`` (on a worker thread: a long prompt
        must not stall the event loop); with ``checkpoint``, the depth of its turn checkpoint
        (the prompt rendered with and without the generation prompt; None when the opener's
        tokens are not the prompt's tail); with ``breakpoints``, the depths of its prompt-cache
        breakpoints (``breakpoint_depths``, for ``Request.publish_at``; else ()); with
        ``boundaries`` > 0, where that many last messages begin (``Request.boundaries``).

        Raises:
            ApiError: 400 ``template_error`` / ``invalid_unicode`` /
                ``context_length_exceeded``, naming ``param``.
        """
        state = self.state

        def render_and_tokenize() -> RenderedPrompt:
            text = state.template.render(creq.messages, tools=creq.tools,
                                         add_generation_prompt=True, **template_kwargs)
            n_bytes = len(text.encode("utf-8"))  # lone surrogates (invalid Unicode) fail here
            if n_bytes > state.n_ctx * state.tokenizer.max_token_bytes:
                # more tokens than the context holds, for certain: refused before the
                # tokenizer spends seconds and gigabytes on it
                raise prompt_too_long(n_bytes, state.n_ctx, param)
            ids = state.tokenizer.encode(text)
            at = self._checkpoint_depth(creq, template_kwargs, text, ids) if checkpoint \
                else None
            anchor = self._anchor_depth(creq, template_kwargs, text, ids) if checkpoint \
                else None
            publish = breakpoint_depths(state.template, state.tokenizer, creq, template_kwargs,
                                        text, ids) if breakpoints else ()
            bounds = message_depths(state.template, state.tokenizer, creq, template_kwargs,
                                    text, ids, boundaries) if boundaries > 0 else ()
            return RenderedPrompt(ids=ids, checkpoint_at=at, publish_at=publish,
                                  anchor_at=anchor, boundaries=bounds)

        try:
            return await trio.to_thread.run_sync(render_and_tokenize, limiter=PROMPT_THREADS)
        except TemplateError as exc:   # (its message names the chat template)
            if creq.loose_arguments:   # what it most likely failed on, named where it is
                raise ApiError(400, f"function.arguments is not a JSON object, and this model's "
                               f"template reads its keys ({exc})", "invalid_value",
                               creq.loose_arguments[0]) from None
            raise ApiError(400, str(exc), "template_error", param) from None
        except UnicodeEncodeError:
            raise ApiError(400, "messages contain invalid Unicode (an unpaired surrogate)",
                           "invalid_unicode", param) from None

    def _checkpoint_depth(self, creq, template_kwargs: dict, text: str,
                          ids: list) -> int | None:
        """Where the rendered history ends in ``ids`` (the generation opener's tokens are its
        tail), or None."""
        state = self.state
        try:
            hist = state.template.render(creq.messages, tools=creq.tools,
                                         add_generation_prompt=False, **template_kwargs)
        except TemplateError:   # a template that needs the opener: no checkpoint
            return None
        if text.startswith(hist) and len(text) > len(hist):
            opener = state.tokenizer.encode(text[len(hist):])
            if 0 < len(opener) < len(ids) and ids[-len(opener):] == opener:
                return len(ids) - len(opener)
        return None

    def _anchor_depth(self, creq, template_kwargs: dict, text: str, ids: list) -> int | None:
        """Where the content of the closing user message begins in ``ids``: the prompt
        rendered with that content replaced by a marker must match ``text`` up to the marker,
        and the tokens of the rest must be the tail of ``ids``; else None."""
        msgs = creq.messages
        if len(msgs) < 2 or msgs[-1].get("role") != "user":
            return None
        state = self.state
        try:
            marked = state.template.render([*msgs[:-1], {**msgs[-1], "content": _ANCHOR_MARK}],
                                           tools=creq.tools, add_generation_prompt=True,
                                           **template_kwargs)
        except TemplateError:
            return None
        cut = marked.find(_ANCHOR_MARK)
        if cut <= 0 or not text.startswith(marked[:cut]) or cut >= len(text):
            return None
        tail = state.tokenizer.encode(text[cut:])
        if 0 < len(tail) < len(ids) and ids[-len(tail):] == tail:
            return len(ids) - len(tail)
        return None
