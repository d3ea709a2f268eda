"""Stored responses (``store: true``): a process-local LRU of responses with their Item
history, which ``previous_response_id`` continues, ``item_reference`` points into and
``GET /v1/responses/{id}/input_items`` pages through. ``store: false`` responses can be
neither fetched nor continued."""
from __future__ import annotations

import collections
import json
from typing import NamedTuple

from .errors import ApiError
from .tool_calls import strict_json


class StoredResponse(NamedTuple):
    """A stored response: the response object, its Item history (input and replayable
    output), and the request's resolved ``preserve_thinking`` (a continuation inherits it)."""
    response: dict
    history: list
    preserve_thinking: bool | None



class ResponseStore:
    """Process-local LRU of stored responses (``StoredResponse``), by response id.

    Args:
        max_records: responses kept; the least recently used one goes first (>= 1).
        max_bytes: their JSON size kept at most (None: no byte budget); least recently used
            first out.
    """

    def __init__(self, max_records: int = 1024, max_bytes: int | None = None):
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._records: collections.OrderedDict = collections.OrderedDict()
        self._sizes: dict = {}   # id -> bytes
        self._items: dict = {}   # output Item id -> Item (for item_reference)

    @staticmethod
    def size_of(response: dict, history: list) -> int:
        """What a record counts against ``max_bytes``: its response and history as JSON."""
        return len(json.dumps([response, history], ensure_ascii=False,
                              separators=(",", ":")).encode())

    def put(self, response: dict, history: list, preserve_thinking: bool | None = None) -> None:
        """Store a record (least recently used ones go to make room) with the request's
        resolved ``preserve_thinking``, which a continuation inherits.

        Raises:
            ApiError: 400 ``response_store_capacity_exceeded``, nothing stored: the record
                alone is larger than ``max_bytes``.
        """
        size = self.size_of(response, history)
        if self.max_bytes is not None and size > self.max_bytes:
            raise ApiError(400, f"the response ({size} bytes with its input history) is "
                           f"larger than the whole response store ({self.max_bytes} bytes, "
                           "--response-store-max-mib); send it with store: false",
                           "response_store_capacity_exceeded", "store")
        self.delete(response["id"])
        self._records[response["id"]] = StoredResponse(response, history, preserve_thinking)
        self._sizes[response["id"]] = size
        self.nbytes += size
        for item in response["output"]:
            self._items[item["id"]] = item
        while len(self._records) > self.max_records or (
                self.max_bytes is not None and self.nbytes > self.max_bytes):
            self.delete(next(iter(self._records)))

    def get(self, rid: str) -> StoredResponse | None:
        """The record of response ``rid`` (now the most recently used), or None."""
        rec = self._records.get(rid)
        if rec is not None:
            self._records.move_to_end(rid)
        return rec

    def item(self, item_id: str) -> dict | None:
        return self._items.get(item_id)

    def delete(self, rid: str) -> bool:
        rec = self._records.pop(rid, None)
        if rec is None:
            return False
        self.nbytes -= self._sizes.pop(rid)
        for item in rec.response["output"]:
            self._items.pop(item["id"], None)
        return True


def input_items_page(store: ResponseStore, rid: str, args) -> dict:
    """``GET /v1/responses/{id}/input_items``: the Items the response was generated from
    (its chain's, ``previous_response_id`` ones included), normalized (a message's string
    content as one ``input_text`` / ``output_text`` part), a page at a time.

    Args:
        args: the query: ``limit`` (1-100, default 20), ``order`` (``desc``, newest first,
            the default, or ``asc``), ``after`` (an Item id of the list: the page starts
            after it), ``before`` (an Item id: the page is the ``limit`` Items just before
            it), ``include`` (accepted, nothing to add).
    Raises:
        ApiError: 404 ``response_not_found``; 400 ``invalid_pagination`` for a bad
            ``limit``, ``order``, ``after`` or ``before``; 400 ``unknown_parameter`` for
            another query parameter.
    """
    for k in args:
        if k not in ("limit", "order", "after", "before", "include"):
            raise ApiError(400, f"unknown query parameter {k!r}", "unknown_parameter", k)
    rec = store.get(rid)
    if rec is None:
        raise ApiError(404, f"no stored response with id {rid!r}", "response_not_found")
    response, history = rec.response, rec.history
    n_out = sum(1 for item in response["output"] if replayable(item))
    items = [_normalized(item) for item in history[:len(history) - n_out]]
    limit, order = args.get("limit", "20"), args.get("order", "desc")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
        raise ApiError(400, "'limit' must be an integer from 1 to 100",
                       "invalid_pagination", "limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "'order' must be asc or desc", "invalid_pagination", "order")
    if order == "desc":
        items.reverse()
    ids = [item.get("id") for item in items]

    def position(name: str) -> int:
        cursor = args.get(name)
        if cursor not in ids:
            raise ApiError(400, f"'{name}' is not an input Item of {rid}: {cursor!r}",
                           "invalid_pagination", name)
        return ids.index(cursor)

    lo = position("after") + 1 if args.get("after") is not None else 0
    end = position("before") if args.get("before") is not None else len(items)
    # paging backwards (before): the page is the Items just before the cursor, and more
    # remain if the page does not reach back to the start (or to after)
    start = max(lo, end - int(limit)) if args.get("before") is not None else lo
    page = items[start:max(start, min(end, start + int(limit)))]
    more = start > lo if args.get("before") is not None else start + len(page) < end
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": more}


# of the ids given to stored input Items that came without one
ID_PREFIX = {"message": "msg", None: "msg", "function_call": "fc",
             "function_call_output": "fco", "reasoning": "rs"}


def _normalized(item: dict) -> dict:
    """An input Item as input_items lists it: a message typed, its string content one part."""
    if item.get("type", "message") != "message":
        return dict(item)
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "output_text" if item.get("role") == "assistant" else "input_text",
                    "text": content}]
    out = {"id": item["id"], "type": "message", "role": item.get("role"), "content": content}
    if item.get("status") is not None:
        out["status"] = item["status"]
    return out


def replayable(item: dict) -> bool:
    """Whether an output Item enters a continued chain's history: a call only when it closed
    with JSON-object arguments (serving contract §7.5)."""
    if item["type"] != "function_call":
        return True
    try:
        return item["status"] == "completed" and isinstance(strict_json(item["arguments"]),
                                                            dict)
    except ValueError:
        return False
