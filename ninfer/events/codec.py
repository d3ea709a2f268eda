"""Canonical encodings of a Record: one JSON line (shared by every text sink) and msgpack.

The JSON line is compact (no spaces), UTF-8 (``ensure_ascii=False``), keys in the envelope's
declaration order then the payload's, no trailing newline. Round-trips are lossless:
``decode_line(encode_line(r)) == r`` and likewise for msgpack.
"""
from __future__ import annotations

import json

import msgpack

from .schema import Record, SchemaError


def encode_line(record: Record) -> str:
    """Record -> canonical JSON text (one line, no newline; UTF-8-encodable: a lone surrogate
    in a string, which no UTF-8 file can hold, is written as a ``\\udXXX`` escape)."""
    line = json.dumps(record.to_dict(), ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(record.to_dict(), ensure_ascii=True, separators=(",", ":"),
                          allow_nan=False)
    return line


def decode_line(line: str | bytes) -> Record:
    """One JSON line -> Record.

    Raises:
        SchemaError: not JSON, not an object, or not a valid record (see ``Record.from_dict``).
    """
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"not a JSON record: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError("record is not a JSON object")
    return Record.from_dict(obj)


def encode_msgpack(record: Record) -> bytes:
    """Record -> msgpack bytes (same map as the JSON line)."""
    return msgpack.packb(record.to_dict(), use_bin_type=True)


def decode_msgpack(data: bytes) -> Record:
    """msgpack bytes -> Record. Raises SchemaError like ``decode_line``."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise SchemaError(f"not a msgpack record: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError("record is not a map")
    return Record.from_dict(obj)
