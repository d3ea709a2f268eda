"""The checks every request parser shares: a 400 naming the parameter, typed and bounded
fields, closed allow-lists (an unknown key refused or ignored by the request's field policy,
``fields``), the required ``model``, ``preserve_thinking`` and the fields Chat and Completions
accept only where they ask for nothing this server does not do."""
from __future__ import annotations

import math

from . import fields
from .errors import ApiError


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A 400 for a client mistake, naming the parameter (dotted path) it is about."""
    return ApiError(400, message, code, param)


def number_field(body: dict, name: str, lo: float, hi: float) -> float | None:
    """``body[name]`` as a finite number in ``[lo, hi]``, or None when absent."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"'{name}' must be a number", name)
    if not lo <= v <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return float(v)


def integer_field(body: dict, name: str, lo: int, hi: int) -> int | None:
    """``body[name]`` as an integer in ``[lo, hi]`` (not a boolean), or None when absent."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{name}' must be an integer", name)
    if not lo <= v <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def boolean_field(body: dict, name: str) -> bool | None:
    """``body[name]`` as a boolean, or None when absent."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise invalid(f"'{name}' must be a boolean", name)
    return v


def check_keys(obj: dict, path: str, allowed) -> None:
    """A key of ``obj`` not in ``allowed`` is refused or ignored as ``path.key``
    (``fields.current()``: 400 ``unknown_parameter`` when strict)."""
    for k in obj:
        if k not in allowed:
            fields.current().unknown(f"{path}.{k}")


def tool_entries(raw) -> list[tuple[str, object]] | None:
    """A request's ``tools`` as ``(path, tool)`` pairs, None when absent; 400 unless an array."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid("'tools' must be an array", "tools")
    return [(f"tools[{i}]", t) for i, t in enumerate(raw)]


def object_field(v, path: str, allowed) -> dict | None:
    """``v`` (None, or an object with only ``allowed`` keys) or 400 naming ``path``."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"'{path}' must be an object", path)
    check_keys(v, path, allowed)
    return v


def positive_top_p(body: dict) -> float | None:
    """``top_p`` in ``(0, 1]``, or None when absent."""
    v = number_field(body, "top_p", 0.0, 1.0)
    if v is not None and v <= 0.0:
        raise invalid("'top_p' must be greater than 0", "top_p")
    return v


def check_fields(body, known) -> dict:
    """``body`` as a JSON object; a key not in ``known`` is refused or ignored
    (``fields.current()``).

    Raises:
        ApiError: 400 ``invalid_value`` (not an object) / ``unknown_parameter`` naming the key
            (strict).
    """
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    for k in body:
        if k not in known:
            fields.current().unknown(k)
    return body


def required_model(body: dict) -> str:
    """The body's ``model`` (a non-empty string, required).

    Raises:
        ApiError: 400 ``invalid_value`` naming ``model``."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required (a string)", "model")
    return model


def preserve_thinking(body: dict) -> bool | None:
    """The request's ``preserve_thinking``: top-level, or the one key ``chat_template_kwargs``
    may hold (serving contract §1.5; both present must agree); None when neither is given.

    Raises:
        ApiError: 400 ``chat_template_option_not_supported`` (another ``chat_template_kwargs``
            key), ``conflicting_template_option`` (the two spellings differ), ``invalid_value``
            (not a boolean).
    """
    top = body.get("preserve_thinking")
    if top is not None and not isinstance(top, bool):
        raise invalid("'preserve_thinking' must be a boolean", "preserve_thinking")
    ctk = body.get("chat_template_kwargs")
    if ctk is None:
        return top
    if not isinstance(ctk, dict):
        raise invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for k in ctk:
        if k != "preserve_thinking":
            raise invalid(f"'chat_template_kwargs.{k}' is not supported (only preserve_thinking; "
                       "use 'enable_thinking' or 'reasoning_effort')",
                       f"chat_template_kwargs.{k}", "chat_template_option_not_supported")
    inner = ctk.get("preserve_thinking")
    if inner is not None and not isinstance(inner, bool):
        raise invalid("'chat_template_kwargs.preserve_thinking' must be a boolean",
                   "chat_template_kwargs.preserve_thinking")
    if top is not None and inner is not None and top != inner:
        raise invalid("'preserve_thinking' and 'chat_template_kwargs.preserve_thinking' differ",
                   "preserve_thinking", "conflicting_template_option")
    return top if top is not None else inner


def echo_only_fields(body: dict) -> None:
    """``store``, ``modalities``, ``service_tier``, ``metadata``, ``user``: accepted where they
    ask for nothing this server does not do (serving contract §1.3).

    Raises:
        ApiError: 400 ``invalid_value`` for a wrong type; ``store_not_supported`` (``store``
            true: no stored completions), ``modality_not_supported`` (other than
            ``["text"]``), ``service_tier_not_supported`` (other than auto / default)."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("'store' must be a boolean", "store")
    if store:
        raise invalid("stored chat completions are not supported", "store", "store_not_supported")
    mods = body.get("modalities")
    if mods is not None:
        if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
            raise invalid("'modalities' must be an array of strings", "modalities")
        if mods != ["text"]:
            raise invalid("only the text modality is supported", "modalities",
                       "modality_not_supported")
    tier = body.get("service_tier")
    if tier is not None:
        if not isinstance(tier, str):
            raise invalid("'service_tier' must be a string", "service_tier")
        if tier not in ("auto", "default"):
            raise invalid("'service_tier' can only be auto or default", "service_tier",
                       "service_tier_not_supported")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in meta.items())):
        raise invalid("'metadata' must be an object of at most 16 string pairs (keys <= 64, "
                   "values <= 512 characters)", "metadata")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("'user' must be a string", "user")
