"""Render a model's jinja chat template the way transformers / vLLM do.

Environment: ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[loopcontrols, generation-tag no-op])`` with globals ``raise_exception`` and
``strftime_now`` and a ``tojson`` filter that is ``json.dumps(ensure_ascii=False)`` (no HTML
escaping, key order kept). OpenAI-shaped histories are normalised first (assistant ``content:
None`` -> ``""``; ``tool_calls[].function.arguments`` JSON strings -> dicts).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    """The chat template could not be compiled or rendered (message says why)."""


def _raise_exception(message: Any = "") -> None:
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker)
    and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of an OpenAI-style message list shaped for chat templates.

    - assistant ``content: None`` -> ``""`` (so templates never print "None");
    - each ``tool_calls[].function.arguments`` that is a JSON string is parsed (a dict for
      templates that iterate ``arguments|items``); ``None``/``""`` -> ``{}``; invalid JSON is
      left as the original string;
    - an empty ``tool_calls`` list is dropped.

    The input is not modified.
    """
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            out.append(msg)
            continue
        m = copy.deepcopy(msg)
        if m.get("role") == "assistant" and "content" in m and m["content"] is None:
            m["content"] = ""
        if "tool_calls" in m:
            calls = m["tool_calls"]
            if not calls:
                del m["tool_calls"]
            elif isinstance(calls, list):
                for call in calls:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if not isinstance(fn, dict) or "arguments" not in fn:
                        continue
                    args = fn["arguments"]
                    if args is None or args == "":
                        fn["arguments"] = {}
                    elif isinstance(args, str):
                        try:
                            fn["arguments"] = json.loads(args)
                        except ValueError:
                            pass
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the jinja template text (e.g. GGUF ``tokenizer.chat_template``).
        bos_token / eos_token: token text exposed to the template as ``bos_token`` /
            ``eos_token``.

    Raises:
        TemplateError: the template does not compile (syntax error).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _make_env().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text (to be tokenized with special tokens parsed
        and without adding BOS).

        Args:
            messages: OpenAI-style messages (normalised with ``normalize_messages``).
            tools: OpenAI tool dicts, or None.
            add_generation_prompt: append the assistant turn opener.
            **kwargs: extra template variables (e.g. ``enable_thinking``); they may override
                ``bos_token`` / ``eos_token``.

        Raises:
            TemplateError: ``raise_exception`` was called (its message), or any other error
                while rendering (undefined operation, sandbox violation, type error, ...).
        """
        context: dict[str, Any] = {
            "messages": normalize_messages(list(messages)),
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        context.update(kwargs)
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from e
        except RecursionError as e:
            raise TemplateError("chat template error: recursion too deep") from e
        except Exception as e:  # TypeError ('str' + None), KeyError, ZeroDivisionError, ...
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e
