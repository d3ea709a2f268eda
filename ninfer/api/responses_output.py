"""The Responses object and its output Items: ``object: "response"``, ``status`` ``completed`` |
``incomplete`` (output or context limit, or an answer cut inside a tool call:
``incomplete_details.reason`` ``max_output_tokens``) | ``failed``; ``output`` Items: a
``reasoning`` Item (``summary_text``) when the model thought, an assistant ``message``
(``output_text``) unless the answer was only tool calls, then one ``function_call`` Item per call
(``fc_…`` id, ``call_…`` call_id). ``usage``: ``input_tokens``,
``input_tokens_details.cached_tokens`` (reused prefix), ``input_tokens_details.cache_write_tokens``
(tokens past it up to the deepest breakpoint this request published), ``output_tokens``,
``output_tokens_details.reasoning_tokens``, ``total_tokens``."""
from __future__ import annotations

import secrets

from .generation import Choice
from .responses_request import ResponsesRequest

ITEM_ID_PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


def new_item_id(kind: str) -> str:
    """A fresh id for an output Item of ``kind`` (``reasoning``, ``message``,
    ``function_call``)."""
    return ITEM_ID_PREFIX[kind] + secrets.token_hex(12)


def reasoning_item(iid: str, text: str) -> dict:
    return {"id": iid, "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}]}


def message_item(iid: str, text: str, status: str) -> dict:
    return {"id": iid, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(iid: str, call) -> dict:
    return {"id": iid, "type": "function_call",
            "status": "completed" if call.complete else "incomplete",
            "call_id": call.id, "name": call.name, "arguments": call.arguments}


def response_shell(creq: ResponsesRequest, base: dict, model: str, status: str) -> dict:
    """The response object without output or usage (as ``response.created`` sends it)."""
    return {"id": base["id"], "object": "response", "created_at": base["created"],
            "status": status, "error": None, "incomplete_details": None,
            "instructions": creq.instructions, "max_output_tokens": creq.max_tokens,
            "model": model, "output": [],
            "parallel_tool_calls": creq.parallel_tool_calls,
            "previous_response_id": creq.previous_response_id,
            "reasoning": {"effort": creq.effort_label, "summary": None},
            "store": creq.store, "temperature": creq.temperature, "top_p": creq.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": creq.tool_choice,
            "tools": creq.flat_tools, "truncation": "disabled", "usage": None,
            "metadata": creq.metadata, "prompt_cache_key": creq.prompt_cache_key}


def response_status(c: Choice) -> str:
    """``incomplete`` when the answer hit the token limit (but not after all the calls it may
    make) or ended inside a call, else ``completed``."""
    incomplete = (c.final.finish_reason == "length" and not c.calls_done) or (
        c.tools is not None and c.tools.incomplete)
    return "incomplete" if incomplete else "completed"


def response_usage(c: Choice) -> dict:
    f = c.final
    return {"input_tokens": f.prompt_tokens,
            "input_tokens_details": {"cached_tokens": f.cached_tokens,
                                     "cache_write_tokens": min(
                                         f.cache_write_tokens,
                                         f.prompt_tokens - f.cached_tokens)},
            "output_tokens": f.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
            "total_tokens": f.prompt_tokens + f.completion_tokens}
