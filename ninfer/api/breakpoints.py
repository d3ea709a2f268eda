"""Prompt-cache breakpoints (serving contract §1.7): the prompt depths whose prefix the engine
publishes to the cache tiers during prefill (``Request.publish_at``), so that a later request
sharing that prefix — another conversation with the same system prompt and tools, a branch of
the same one — reuses it from L2 / L3. This matters most on hybrid (Qwen3.5) models, whose
recurrent state restores only at an image's exact end: without a published boundary, a new
conversation could never reuse another's system prompt.

Where the boundaries are (each found by rendering a prefix of the conversation with the same
template and arguments, then tokenizing it):

- implicit (every API, unless Responses' ``prompt_cache_options.mode`` is ``explicit``): the end
  of the system / developer messages and the tools (the leading messages of those roles,
  rendered without a generation prompt);
- explicit: ``ChatRequest.cache_breakpoints`` ``(message index, char offset)`` marks from
  Responses' ``prompt_cache_breakpoint`` and Anthropic's ``cache_control``: a mark whose part
  ends its message (offset None) cuts after the rendered message, closer included (on the last
  message: where the generation opener begins); a mark followed by more parts cuts right after
  that part's text (the message rendered up to it with a sentinel after it).

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

    def render(messages) -> str | None:
        try:
            return template.render(messages, tools=creq.tools, add_generation_prompt=False,
                                   **template_kwargs)
        except TemplateError:
            return None

    cuts = []
    if creq.implicit_breakpoints:
        k = 0
        while k < len(msgs) and msgs[k].get("role") in HEAD_ROLES:
            k += 1
        if k or creq.tools:
            cuts.append(render(msgs[:k]))
    for i, offset in creq.cache_breakpoints:
        content = msgs[i].get("content")
        if offset is None or not isinstance(content, str) or offset >= len(content):
            cuts.append(render(msgs[:i + 1]))
            continue
        marked = render(msgs[:i] + [{**msgs[i], "content": content[:offset] + SENTINEL}])
        at = -1 if marked is None else marked.find(SENTINEL)
        cuts.append(marked[:at] if at >= 0 else None)
    prefixes = sorted({c for c in cuts if c and text.startswith(c)})
    if not prefixes:
        return ()
    prompt = np.asarray(ids)
    depths = {reusable_depth(np.asarray(pids), prompt, len(ids) - 1, exact=False)
              for pids in tokenizer.encode_batch(prefixes)}
    return tuple(sorted(d for d in depths if d > 0))
