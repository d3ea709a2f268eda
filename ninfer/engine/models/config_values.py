"""Checked reads of a model config's shape fields: whole numbers in range, the field named when
one is not (a hand-written ``config.json`` with a 0 or -4 must not become a division by zero or
a negative size further on)."""
from __future__ import annotations

import numbers
from collections.abc import Mapping


def whole(cfg: Mapping, key: str, default: int | None = None, least: int = 1) -> int:
    """``cfg[key]`` as an int of at least ``least``; ``default`` where it is absent or null, and,
    for a field that has a default, where it is 0 (HF configs and GGUF headers write 0 for
    "unset": a head_dim of 0 is hidden_size / heads).

    Raises:
        ValueError: not a whole number (a bool, a fraction, a non-numeric string), or below
            ``least``.
    """
    v = cfg.get(key)
    if v is None or (default is not None and not isinstance(v, bool) and v == 0):
        v = default
    if isinstance(v, bool) or not (
            isinstance(v, numbers.Integral)
            or (isinstance(v, numbers.Real) and float(v).is_integer())
            or (isinstance(v, str) and v.strip().lstrip("-").isdigit())):
        raise ValueError(f"config {key} is {v!r}: not a whole number")
    n = int(v)
    if n < least:
        raise ValueError(f"config {key} is {n}: must be at least {least}")
    return n


def head_dim(cfg: Mapping, heads: int) -> int:
    """``head_dim``, or, where it is unset, ``hidden_size / heads`` (which must divide).

    Raises:
        ValueError: as ``whole``, or an unset head_dim that ``hidden_size`` does not give.
    """
    hidden = whole(cfg, "hidden_size")
    if not cfg.get("head_dim") and hidden % heads:
        raise ValueError(f"config head_dim is unset and hidden_size {hidden} is not a multiple "
                         f"of num_attention_heads {heads}")
    return whole(cfg, "head_dim", hidden // heads)
