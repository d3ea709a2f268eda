"""Tool calls parsed out of the model's answer as it streams (serving contract §7.5).

The model writes calls as text; no decoding is constrained and no tool is ever executed. Two
spellings are recognised inside ``<tool_call>`` … ``</tool_call>``:

- Qwen3.x XML: ``<function=NAME>`` then ``<parameter=ARG>`` value ``</parameter>`` … then
  ``</function>``. Exactly one framing newline is stripped at each end of a value. Values are
  typed by the declared tool's JSON schema: ``string`` parameters stream as an escaped JSON string
  as written; anything else (objects, arrays, numbers, booleans, undeclared parameters) is
  emitted at ``</parameter>`` as the model's text when that is strict JSON (RFC 8259: no
  ``NaN``), else as a JSON string — so a complete call's arguments always parse. The closing ``}`` of the
  arguments is emitted only at ``</function>`` (or a bare ``</tool_call>``).
- Hermes JSON (``{"name": …, "arguments": {…}}``): validated whole at ``</tool_call>`` and
  emitted as one argument fragment.

A call is announced (``ToolEvent`` kind ``start``) once its name is known and valid (1 to
``max_name`` of ``[A-Za-z0-9_-]``; it need not be a declared tool); its argument fragments
(``args``) concatenate to the final ``arguments``; ``end`` closes it. Text before the first call
streams as content (only trailing whitespace and a possible ``<tool_call>`` prefix are held
back, and whitespace right before a call is dropped). Malformed markup before any call is
released as text, nothing lost; after the first call, output that is not a call is dropped and
counted in ``discarded_bytes``. A call the output ends inside stays incomplete
(``ToolCall.complete`` False) with exactly the fragments streamed so far.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_CLOSE = "<function=", "</function>"
PARAM, PARAM_CLOSE = "<parameter=", "</parameter>"
VALUE_END = "\n" + PARAM_CLOSE
HERMES_MAX = 1 << 20   # a JSON call body still unparsed after this many chars is text


@dataclass(slots=True)
class ToolCall:
    """One parsed call. ``arguments``: the JSON text streamed so far (the whole object once
    ``complete``)."""
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def parsed_arguments(self) -> dict | None:
        """The arguments as a dict, or None when incomplete, not JSON or not an object."""
        if not self.complete:
            return None
        try:
            v = strict_json(self.arguments)
        except ValueError:
            return None
        return v if isinstance(v, dict) else None


@dataclass(frozen=True, slots=True)
class ToolEvent:
    """``kind``: ``text`` (content ``text``), ``start`` / ``end`` (``call``), ``args``
    (``text``: the next argument fragment of ``call``)."""
    kind: str
    text: str = ""
    call: ToolCall | None = None


def _held_prefix(s: str, token: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``token``."""
    for n in range(min(len(s), len(token) - 1), 0, -1):
        if s.endswith(token[:n]):
            return n
    return 0


def _could_be(s: str, *tokens: str) -> bool:
    """``s`` is a proper prefix of one of ``tokens`` (more input may complete it)."""
    return any(len(s) < len(t) and t.startswith(s) for t in tokens)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(s: str):
    """``json.loads`` without Python's ``NaN`` / ``Infinity`` extensions (RFC 8259 only).

    Raises:
        ValueError: not JSON."""
    return json.loads(s, parse_constant=_reject_constant)


def _escape(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


@dataclass
class ToolCallParser:
    """Streaming parser over the answer channel.

    Args:
        tools: the request's tools (OpenAI ``{"type": "function", "function": {"name",
            "parameters"}}`` or flat ``{"name", "input_schema" | "parameters"}``), for typing
            parameter values.
        max_name: longest accepted function name (64 on Chat, 128 on Messages).
        new_id: makes call ids (default ``call_`` + 24 hex digits).
        max_calls: most calls an answer may hold (None: any number; 1 for Chat's
            ``parallel_tool_calls: false``, Responses' likewise and Messages'
            ``disable_parallel_tool_use``): whatever follows the last allowed complete call is
            dropped (counted in ``discarded_bytes``), as a model's second call would be.
    """
    tools: list | None = None
    max_name: int = 64
    new_id: Callable[[], str] = field(default=lambda: "call_" + secrets.token_hex(12))
    max_calls: int | None = None
    calls: list = field(default_factory=list)
    discarded_bytes: int = 0
    _buf: str = ""
    _state: str = "text"
    _types: dict = field(default_factory=dict)
    _arg: str = ""
    _value_start: bool = False
    _first_param: bool = True
    _ws: str = ""          # whitespace before a <tool_call> that may turn out not to be a call

    def __post_init__(self):
        self._name_re = re.compile(r"[A-Za-z0-9_-]{1,%d}" % self.max_name)
        for t in self.tools or ():
            if not isinstance(t, dict):
                continue
            fn = t.get("function", t)
            schema = (fn.get("parameters") or fn.get("input_schema") or {}) \
                if isinstance(fn, dict) else {}
            props = schema.get("properties") if isinstance(schema, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str) and \
                    isinstance(props, dict):
                self._types[fn["name"]] = {k: _type_of(v) for k, v in props.items()}

    # -- public ---------------------------------------------------------------------------------
    @property
    def incomplete(self) -> bool:
        """The output so far ends inside an announced call."""
        return bool(self.calls) and not self.calls[-1].complete

    @property
    def saturated(self) -> bool:
        """Every call ``max_calls`` allows is complete: whatever the answer goes on with is
        dropped."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls and \
            not self.incomplete

    def feed(self, text: str) -> list[ToolEvent]:
        """Parse the next piece of answer text; returns the events it completes."""
        self._buf += text
        out: list[ToolEvent] = []
        while self._step(out, final=False):
            pass
        return out

    def close(self) -> list[ToolEvent]:
        """End of generation: release held text; a call still open stays incomplete."""
        out: list[ToolEvent] = []
        while self._step(out, final=True):
            pass
        if self._state == "text" and self._buf:
            self._text(out, self._buf)
        elif self._state in ("header", "hermes"):  # never announced: give the text back
            self._text(out, self._ws + OPEN + self._buf)
        self._buf = ""
        return out

    # -- the state machine ----------------------------------------------------------------------
    def _text(self, out: list, s: str) -> None:
        if not s:
            return
        if self.calls:  # whitespace between calls is not counted (whatever the chunking)
            self.discarded_bytes += len(re.sub(r"\s", "", s).encode())
        else:
            out.append(ToolEvent("text", s))

    def _args(self, out: list, s: str) -> None:
        call = self.calls[-1]
        call.arguments += s
        out.append(ToolEvent("args", s, call))

    def _start(self, out: list, name: str) -> None:
        call = ToolCall(len(self.calls), self.new_id(), name)
        self.calls.append(call)
        out.append(ToolEvent("start", call=call))
        self._first_param = True

    def _end(self, out: list) -> None:
        call = self.calls[-1]
        call.complete = True
        out.append(ToolEvent("end", call=call))

    def _step(self, out: list, final: bool) -> bool:
        """One transition; False when more input is needed."""
        st, buf = self._state, self._buf
        if st == "text" and self.max_calls is not None and len(self.calls) >= self.max_calls:
            # the calls allowed are all complete: the rest is dropped (whitespace not counted,
            # as between calls)
            self.discarded_bytes += len(re.sub(r"\s", "", buf).encode())
            self._buf = ""
            return False
        if st == "text":
            i = buf.find(OPEN)
            if i >= 0:
                pre = buf[:i].rstrip()
                self._text(out, pre)
                self._ws = buf[len(pre):i]
                self._buf, self._state = buf[i + len(OPEN):], "header"
                return True
            if final:
                return False
            keep = _held_prefix(buf, OPEN)
            safe = buf[:len(buf) - keep]
            ws = len(safe) - len(safe.rstrip())
            self._text(out, safe[:len(safe) - ws])
            self._buf = buf[len(safe) - ws:]
            return False
        if st == "header":
            s = buf.lstrip()
            if s.startswith(FUNC):
                j = s.find(">")
                if j < 0:
                    if len(s) <= len(FUNC) + self.max_name and not final:
                        return False
                    return self._malformed(out)
                name = s[len(FUNC):j]
                if not self._name_re.fullmatch(name):
                    return self._malformed(out)
                self._start(out, name)
                self._args(out, "{")
                self._buf, self._state = s[j + 1:], "params"
                return True
            if s.startswith("{"):
                self._state = "hermes"  # the whole body waits for </tool_call>
                return True
            if (not s or _could_be(s, FUNC)) and not final:
                return False
            return self._malformed(out)
        if st == "hermes":
            # the first </tool_call> after which the body is a valid call (a string value may
            # itself contain "</tool_call>"); none yet: wait, up to the end of the output
            j, call = buf.find(CLOSE), None
            while j >= 0:
                call = _hermes(buf[:j])
                if call is not None and self._name_re.fullmatch(call.name):
                    break
                j, call = buf.find(CLOSE, j + 1), None
            if call is None:
                if not final and len(buf) <= HERMES_MAX:
                    return False
                return self._malformed(out)
            self._start(out, call.name)
            self._args(out, call.arguments)
            self._end(out)
            self._buf, self._state = buf[j + len(CLOSE):], "text"
            return True
        if st == "params":
            s = buf.lstrip()
            if s.startswith(PARAM):
                j = s.find(">")
                if j < 0:
                    return False
                self._arg = s[len(PARAM):j]
                self._buf, self._state, self._value_start = s[j + 1:], "value", True
                if self._arg_type() == "string":
                    self._args(out, self._sep() + json.dumps(self._arg, ensure_ascii=False)
                               + ': "')
                return True
            for closer in (FUNC_CLOSE, CLOSE):
                if s.startswith(closer):
                    self._args(out, "}")
                    self._end(out)
                    self._buf = s[len(closer):]
                    self._state = "after" if closer == FUNC_CLOSE else "text"
                    return True
            if not s or (_could_be(s, PARAM, FUNC_CLOSE, CLOSE) and not final):
                self._buf = s
                return False
            # stray output inside a function: dropped up to the next tag
            k = s.find("<", 1)
            skip = s if k < 0 else s[:k]
            self.discarded_bytes += len(skip.encode())
            self._buf = s[len(skip):]
            return True
        if st == "value":
            if self._value_start:
                if not buf:
                    return False
                if buf[0] == "\n":
                    buf = self._buf = buf[1:]
                self._value_start = False
            j = buf.find(PARAM_CLOSE)
            string = self._arg_type() == "string"
            if j >= 0:
                raw = buf[:j]
                if raw.endswith("\n"):
                    raw = raw[:-1]
                if string:
                    self._args(out, _escape(raw) + '"')
                else:
                    self._args(out, self._sep() + json.dumps(self._arg, ensure_ascii=False)
                               + ": " + _json_value(raw, self._arg_type()))
                self._first_param = False
                self._buf, self._state = buf[j + len(PARAM_CLOSE):], "params"
                return True
            if string and not final:
                keep = max(_held_prefix(buf, VALUE_END), _held_prefix(buf, PARAM_CLOSE))
                if buf.endswith("\n"):
                    keep = max(keep, 1)
                piece = buf[:len(buf) - keep]
                if piece:
                    self._args(out, _escape(piece))
                self._buf = buf[len(piece):]
            return False
        if st == "after":  # after </function>: expect </tool_call>
            s = buf.lstrip()
            if s.startswith(CLOSE):
                self._buf, self._state = s[len(CLOSE):], "text"
                return True
            if (not s or _could_be(s, CLOSE)) and not final:
                self._buf = s
                return False
            self._buf, self._state = s, "text"  # the call is closed; the rest is text
            return True
        raise AssertionError(st)

    def _malformed(self, out: list) -> bool:
        """Not a call after all: ``<tool_call>`` and what followed are text again."""
        self._text(out, self._ws + OPEN)
        self._state = "text"
        return True

    def _arg_type(self) -> str | None:
        return self._types.get(self.calls[-1].name, {}).get(self._arg)

    def _sep(self) -> str:
        sep = "" if self._first_param else ", "
        self._first_param = False
        return sep


def _type_of(schema) -> str | None:
    """The declared JSON type of a parameter schema, ignoring ``null`` in a union."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        t = [x for x in t if x != "null"]
        t = t[0] if len(t) == 1 else None
    return t if isinstance(t, str) else None


def _json_value(raw: str, declared: str | None) -> str:
    """A non-string parameter value as JSON text: the model's text when it is JSON (strict:
    no NaN / Infinity), else the text as a JSON string, so complete arguments always parse."""
    s = raw.strip()
    try:
        strict_json(s)
        return s
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class HermesCall:
    """A Hermes-style call body: the function's name and its arguments as a JSON object."""
    name: str
    arguments: str


def _hermes(body: str) -> HermesCall | None:
    """The call a Hermes-style body holds, or None when it is invalid."""
    try:
        obj = strict_json(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return HermesCall(name=obj["name"],
                      arguments=json.dumps(args, ensure_ascii=False, allow_nan=False))


def parser_for_request(creq, **options) -> ToolCallParser | None:
    """A parser of the answer's tool calls when the request declared tools (at most one call
    without ``parallel_tool_calls``; ``options``: ToolCallParser's, by route)."""
    if not creq.tools:
        return None
    return ToolCallParser(creq.tools, **{"max_name": 64, **options},
                          max_calls=None if creq.parallel_tool_calls else 1)
