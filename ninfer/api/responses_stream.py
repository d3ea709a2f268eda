"""The Responses stream (``stream: true``): ``event: TYPE`` frames whose JSON carries the same
``type`` and an increasing ``sequence_number``: ``response.created``, ``response.in_progress``,
per Item ``response.output_item.added`` → (reasoning: ``response.reasoning_summary_part.added``,
``response.reasoning_summary_text.delta`` …, ``.done``, ``response.reasoning_summary_part.done``;
message: ``response.content_part.added``, ``response.output_text.delta`` …,
``response.output_text.done``, ``response.content_part.done``; call:
``response.function_call_arguments.delta`` …, ``response.function_call_arguments.done``) →
``response.output_item.done``, then exactly one ``response.completed`` | ``response.incomplete``
| ``response.failed``. No ``[DONE]``. Keep-alives are SSE comments."""
from __future__ import annotations

import json

from .generation import Choice
from .responses_output import (call_item, message_item, new_item_id, reasoning_item,
                               response_status)


class OutputItemStream:
    """The output Items of one streamed response, opened and closed as the answer changes
    channel (reasoning, message) or a call starts, and the numbered events that say so."""

    def __init__(self, c: Choice):
        self.c = c
        self.seq = 0
        self.output: list[dict] = []
        self.current: dict | None = None   # the Item being streamed
        self.texts: dict = {}              # item id -> text so far

    def event(self, kind: str, **data) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: " + json.dumps(
            {"type": kind, "sequence_number": self.seq - 1, **data}, ensure_ascii=False,
            separators=(",", ":")) + "\n\n"

    def close_current(self) -> str:
        """The ``.done`` events of the Item being streamed, which takes its final form."""
        if self.current is None:
            return ""
        ev, c, output = self.event, self.c, self.output
        item, idx, out = self.current, len(output) - 1, ""
        text = self.texts.get(item["id"], "")
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            out += ev("response.reasoning_summary_text.done", item_id=item["id"],
                      output_index=idx, summary_index=0, text=text)
            out += ev("response.reasoning_summary_part.done", item_id=item["id"],
                      output_index=idx, summary_index=0, part=part)
            output[idx] = reasoning_item(item["id"], text)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out += ev("response.output_text.done", item_id=item["id"], output_index=idx,
                      content_index=0, text=text, logprobs=[])
            out += ev("response.content_part.done", item_id=item["id"], output_index=idx,
                      content_index=0, part=part)
            # the answer's last Item shares the response's fate (cut by the token limit)
            done = c.final is not None and not (c.tools is not None and c.tools.calls)
            output[idx] = message_item(item["id"], text, response_status(c) if done
                                       else "completed")
        else:
            call = item["_call"]
            out += ev("response.function_call_arguments.done", item_id=item["id"],
                      output_index=idx, arguments=call.arguments)
            output[idx] = call_item(item["id"], call)
        out += ev("response.output_item.done", output_index=idx, item=output[idx])
        self.current = None
        return out

    def open_item(self, kind: str, call=None) -> str:
        """Close the current Item, announce a new one of ``kind``."""
        ev = self.event
        out = self.close_current()
        iid = new_item_id(kind)
        if kind == "reasoning":
            item = {"id": iid, "type": "reasoning", "summary": []}
        elif kind == "message":
            item = {"id": iid, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        else:
            item = {"id": iid, "type": "function_call", "status": "in_progress",
                    "call_id": call.id, "name": call.name, "arguments": ""}
        self.output.append(item)
        idx = len(self.output) - 1
        out += ev("response.output_item.added", output_index=idx, item=item)
        if kind == "reasoning":
            out += ev("response.reasoning_summary_part.added", item_id=iid,
                      output_index=idx, summary_index=0,
                      part={"type": "summary_text", "text": ""})
        elif kind == "message":
            out += ev("response.content_part.added", item_id=iid, output_index=idx,
                      content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []})
        self.current = {**item, "_call": call}
        self.texts[iid] = ""
        return out

    def text_delta(self, kind: str, text: str) -> str:
        """``text`` of the ``reasoning`` or ``message`` channel, in an Item of that kind."""
        out = ""
        if self.current is None or self.current["type"] != kind:
            out += self.open_item(kind)
        iid, idx = self.current["id"], len(self.output) - 1
        self.texts[iid] += text
        if kind == "reasoning":
            return out + self.event("response.reasoning_summary_text.delta", item_id=iid,
                                    output_index=idx, summary_index=0, delta=text)
        return out + self.event("response.output_text.delta", item_id=iid, output_index=idx,
                                content_index=0, delta=text, logprobs=[])

    def call_events(self) -> str:
        """The tool calls parsed since the last event: a ``function_call`` Item each, its
        arguments streamed as deltas."""
        out = ""
        for e in self.c.take_call_events():
            if e.kind == "start":
                out += self.open_item("function_call", e.call)
            elif e.kind == "args":
                out += self.event("response.function_call_arguments.delta",
                                  item_id=self.current["id"],
                                  output_index=len(self.output) - 1, delta=e.text)
            elif e.kind == "end":
                out += self.close_current()
        return out

    def finish_answer(self) -> str:
        """At the final output: an answer (maybe empty) unless there were calls, and the
        current Item closed."""
        calls = self.c.tools.calls if self.c.tools is not None else []
        out = ""
        if not calls and not any(o["type"] == "message" for o in self.output):
            if self.current is None or self.current["type"] != "message":
                out += self.open_item("message")
        return out + self.close_current()
