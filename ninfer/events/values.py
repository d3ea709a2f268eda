"""Read-only mappings for fold states, and the few updates folds make to them.

A fold never changes a state in place: each update below returns a new read-only mapping
(``types.MappingProxyType`` over a fresh dict), so a state handed to a reader (an HTTP handler,
a test) stays as it was whatever the fold does next. Insertion order is kept: views render
these mappings as JSON in that order.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from types import MappingProxyType

EMPTY: Mapping = MappingProxyType({})


def frozen(items=(), **more) -> Mapping:
    """A read-only copy of ``items`` (a mapping or key-value pairs) and ``more``."""
    return MappingProxyType(dict(items, **more))


def no_entries():
    """A dataclass field defaulting to the shared empty mapping (a mapping cannot be a plain
    dataclass default)."""
    return field(default_factory=lambda: EMPTY)


def with_item(m: Mapping, key, value) -> Mapping:
    """``m`` with ``key`` set to ``value`` (an existing key keeps its place)."""
    d = dict(m)
    d[key] = value
    return MappingProxyType(d)


def without(m: Mapping, key) -> Mapping:
    """``m`` without ``key`` (``m`` itself when it has no such key)."""
    if key not in m:
        return m
    d = dict(m)
    del d[key]
    return MappingProxyType(d)


def counted(m: Mapping, key, n: int = 1) -> Mapping:
    """``m`` with ``n`` added to the count under ``key`` (absent counts as 0)."""
    return with_item(m, key, m.get(key, 0) + n)


def updated(m: Mapping, **items) -> Mapping:
    """``m`` with ``items`` set, as ``dict.update`` would (new keys go last, in order)."""
    return MappingProxyType({**m, **items})


def evolve(obj, **changes):
    """A copy of the frozen dataclass ``obj`` with ``changes`` (fields by name).

    The fold runs once per record on the trio thread: this copies the instance ``__dict__`` in
    one step instead of calling ``__init__`` field by field as ``dataclasses.replace`` does
    (about 10x faster). State classes are therefore frozen dataclasses without ``slots``."""
    new = object.__new__(type(obj))
    d = new.__dict__
    d.update(obj.__dict__)
    d.update(changes)
    return new
