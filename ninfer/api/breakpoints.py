"""Prompt-cache breakpoints (serving contract §1.7): the prompt depths whose prefix the engine
publishes to the cache tiers during prefill (``Request.publish_at``), so that a later request
sharing that prefix — another conversation with the same system prompt and tools, a branch of
the same one — reuses it from L2 / L3. This matters most on hybrid (Qwen3.5) models, whose
recurrent state restores only at an image's exact end: without a published boundary, a new
conversation could never reuse another's system prompt.

Where the boundaries are (each found by rendering part of the conversation with the same
template and arguments; templates such as Qwen's refuse a conversation without a user query,
and render an assistant turn differently when it is the last one, so a prefix is always
rendered followed by a placeholder user turn, ``SENTINEL``, and the boundary is where that
render stops agreeing with the prompt's text):

- implicit (every API, unless Responses' ``prompt_cache_options.mode`` is ``explicit``): the end
  of the leading system / developer messages and the tools;
- explicit: ``ChatRequest.cache_breakpoints`` marks (``CacheMark``: message index, char
  offset) from Responses' ``prompt_cache_breakpoint`` and Anthropic's ``cache_control``: a mark whose part
  ends its message (offset None) cuts after the rendered message; a mark followed by more
  parts, or by the message's tool calls, cuts right after that part's text (the message
  rendered up to it with ``SENTINEL`` after it, its tool calls dropped). A mark on the last message's end is not a breakpoint: that is the frontier the
  lane itself keeps (L1) and hands to L2 / L3 when it leaves or grows, off the latency path.

A boundary whose rendered prefix is not a prefix of the prompt's text (a template that renders
earlier turns differently once later ones exist) is dropped; one that falls inside a token
snaps back to the deepest exact token prefix (the common prefix of the two token lists).
Depths are distinct, sorted, and strictly inside the prompt.
"""
from __future__ import annotations

import numpy as np

from ..engine.chat_template import TemplateError
from ..engine.continuation import reusable_depth

MAX_EXPLICIT = 4   # explicit marks per request (the APIs' too_many_*_breakpoints)
SENTINEL = "\ue000ninfer:breakpoint\ue000"   # private-use: never in a client's text
HEAD_ROLES = ("system", "developer")
PLACEHOLDER = {"role": "user", "content": SENTINEL}


def _common_prefix_len(a: str, b: str, block: int = 4096) -> int:
    """Length of the common prefix of ``a`` and ``b``: whole blocks compared as slices (C
    speed; a prompt can be hundreds of thousands of characters), then the differing block
    character by character."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + block] == b[i:i + block]:
        i += block
    if i >= n:
        return n
    end = min(i + block, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def breakpoint_depths(template, tokenizer, creq, template_kwargs: dict, text: str,
                      ids: list[int]) -> tuple[int, ...]:
    """Token depths of ``creq``'s prompt-cache breakpoints in its prompt (``text`` rendered
    with the generation prompt, ``ids`` its tokens), as described above.

    Args:
        template: the chat template (``render(messages, tools=..., add_generation_prompt=...,
            **kwargs)``).
        tokenizer: ``encode_batch(texts) -> list[list[int]]``.
        creq: a ChatRequest (``messages``, ``tools``, ``implicit_breakpoints``,
            ``cache_breakpoints``).
        template_kwargs: the arguments the prompt was rendered with.

    Returns:
        Sorted distinct depths ``0 < d < len(ids)`` (possibly empty). Never raises for a
        template that cannot render a prefix: that boundary is dropped.
    """
    msgs = creq.messages
    render, agreeing = _renderers(template, creq, template_kwargs, text)
    cuts = []
    if creq.implicit_breakpoints:
        k = 0
        while k < len(msgs) and msgs[k].get("role") in HEAD_ROLES:
            k += 1
        if k or creq.tools:
            cuts.append(agreeing(k))
    for i, offset in creq.cache_breakpoints:   # (CacheMark: message, offset)
        content = msgs[i].get("content")
        if offset is None or not isinstance(content, str):
            if i < len(msgs) - 1:   # (the last message's end: the lane's own frontier)
                cuts.append(agreeing(i + 1))
            continue
        part = {k: v for k, v in msgs[i].items() if k != "tool_calls"}
        part["content"] = content[:offset] + SENTINEL
        for marked in (render(msgs[:i] + [part, PLACEHOLDER]), render(msgs[:i] + [part])):
            if marked is not None and text.startswith(marked):
                cuts.append(marked)
                break
    return _depths(tokenizer, cuts, ids)


def with_siblings(publish_at: tuple, prompt_len: int, n: int) -> tuple[int, ...]:
    """``publish_at`` for one of ``n`` choices of the same prompt (``n`` > 1): also the depth
    just below the prompt's end, so that the first choice prefills the prompt and publishes
    it, and the others wait for it (``request.deferred``) and restore it, computing one token
    each instead of the whole prompt (vLLM shares it through its prefix cache the same way)."""
    if n < 2 or prompt_len < 2:
        return tuple(publish_at)
    return tuple(sorted(set(publish_at) | {prompt_len - 1}))


def message_depths(template, tokenizer, creq, template_kwargs: dict, text: str,
                   ids: list[int], last: int) -> tuple[int, ...]:
    """Token depths where each of the last ``last`` messages of ``creq``'s prompt begins (the
    end of the one before it, found as the breakpoints are), for the hybrid lane's ring
    (``Request.boundaries``); sorted, distinct, strictly inside the prompt."""
    msgs = creq.messages
    _, agreeing = _renderers(template, creq, template_kwargs, text)
    return _depths(tokenizer, [agreeing(j) for j in range(max(1, len(msgs) - last), len(msgs))],
                   ids)


def _depths(tokenizer, cuts: list, ids: list[int]) -> tuple[int, ...]:
    """The token depths of the text prefixes ``cuts`` (None: dropped) in ``ids``."""
    prefixes = sorted({c for c in cuts if c})
    if not prefixes:
        return ()
    prompt = np.asarray(ids)
    depths = {reusable_depth(np.asarray(pids), prompt, len(ids) - 1, exact=False)
              for pids in tokenizer.encode_batch(prefixes)}
    return tuple(sorted(d for d in depths if d > 0))


def _renderers(template, creq, template_kwargs: dict, text: str):
    """``(render, agreeing)``: a prefix of ``creq``'s messages rendered without the generation
    prompt (up to ``SENTINEL``; None when the template refuses it), and the prompt's text up to
    the start of message ``j`` (``agreeing(j)``)."""
    msgs = creq.messages

    def render(messages) -> str | None:
        try:
            out = template.render(messages, tools=creq.tools, add_generation_prompt=False,
                                  **template_kwargs)
        except TemplateError:
            return None
        at = out.find(SENTINEL)
        return out[:at] if at >= 0 else out

    def agreeing(j: int) -> str | None:
        """The longest start of the prompt's text that a render of ``msgs[:j]`` shares,
        followed by the placeholder or not (Qwen's template renders an assistant turn before
        the last user query unlike one after it), among those that hold all of message
        ``j - 1``'s text (else the two part inside the prefix) — or, for ``j`` 0, the last
        tool's name."""
        last = msgs[j - 1].get("content") if j else (
            ((creq.tools or [{}])[-1].get("function") or {}).get("name"))
        best = None
        for probe in (render(msgs[:j] + [PLACEHOLDER]), render(msgs[:j]) if j else None):
            if probe is None:
                continue
            n = _common_prefix_len(probe, text)
            if isinstance(last, str) and last.strip() and last.strip() not in text[:n]:
                continue   # (stripped: templates trim message text)
            if best is None or n > len(best):
                best = text[:n]
        return best

    return render, agreeing
