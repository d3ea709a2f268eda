"""The record log's registry: the schema version, the event decorator and kind registry, and the
record envelope (the event kinds themselves are in ``schema.py``).

Every record is ``Record(schema_version, seq, ts, instance, event)``. ``seq`` is assigned once by
the bus (gap-free per instance), ``ts`` is unix seconds taken when the producer emitted it, and
``event`` is one of the dataclasses of ``schema.py``, registered by its dotted ``kind``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 2  # 2: lane.*, cache.* (prefix reuse, L2), request.tool_calls. Additions
# that older readers can skip (a new kind, a new field with a default: slot.action,
# lane.checkpointed, lane.retained's checkpoint and ring fields, cache.lookup's
# resumed_from and session, cache.published,
# request.received's, request.rejected's and slot.action's http_request_id, request.error,
# slot.spilled, slot.spill_failed, lane.retained's and cache.published's token_ids,
# cache.evicted's and store.persisted's session_digest, store.persisted's
# deleted_digests, store.entry_dropped's session_digest, store.opened's token_ids,
# request.prefill_chunk's prefill_lanes and prefill_queued)
# keep the version.

REGISTRY: dict[str, type] = {}


class SchemaError(ValueError):
    """A record that cannot be decoded: unknown kind, newer schema, or malformed fields."""


class UnknownEventKind(SchemaError):
    """The record's ``kind`` is not registered in this version of the code."""


class SchemaTooNew(SchemaError):
    """The record was written by a newer schema than this code understands."""


def event(kind: str):
    """Class decorator: make a frozen slotted dataclass and register it under ``kind``."""

    def wrap(cls):
        cls = dataclass(frozen=True, slots=True, kw_only=True)(cls)
        cls.kind = kind
        if kind in REGISTRY:
            raise ValueError(f"duplicate event kind {kind!r}")
        REGISTRY[kind] = cls
        return cls

    return wrap


@dataclass(frozen=True, slots=True)
class Record:
    """One log record: the envelope plus its event payload."""
    schema_version: int
    seq: int
    ts: float
    instance: str
    event: Any

    @property
    def kind(self) -> str:
        return self.event.kind

    def to_dict(self) -> dict:
        """Envelope then payload, in declaration order (the canonical key order)."""
        out = {"schema_version": self.schema_version, "seq": self.seq, "ts": self.ts,
               "instance": self.instance, "kind": self.event.kind}
        for f in dataclasses.fields(self.event):
            out[f.name] = getattr(self.event, f.name)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        """Inverse of ``to_dict``.

        Raises:
            SchemaTooNew: ``schema_version`` greater than SCHEMA_VERSION.
            UnknownEventKind: ``kind`` not registered.
            SchemaError: missing envelope fields or payload fields that do not match.
        """
        try:
            version = int(d["schema_version"])
            kind = d["kind"]
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"record without a valid envelope: {exc}") from None
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"record schema_version {version} is newer than this code's "
                               f"{SCHEMA_VERSION}; upgrade ninfer to read it")
        cls_ = REGISTRY.get(kind)
        if cls_ is None:
            raise UnknownEventKind(f"unknown event kind {kind!r}")
        names = {f.name for f in dataclasses.fields(cls_)}
        payload = {k: v for k, v in d.items() if k in names}
        try:
            ev = cls_(**payload)
            return cls(version, int(d["seq"]), float(d["ts"]), str(d["instance"]), ev)
        except (TypeError, KeyError, ValueError) as exc:
            raise SchemaError(f"malformed {kind} record: {exc}") from None


def all_kinds() -> list[str]:
    """Every registered kind, sorted."""
    return sorted(REGISTRY)
