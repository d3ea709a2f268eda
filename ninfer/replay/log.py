"""Offline replay of a JSONL record log through the serving fold the live server runs.

``replay_log(path)`` decodes every line, keeps the records of the last server instance in the
file (several runs may append to one file) and folds them, with the live error policy
(``events.fold.fold_or_skip``), into one ``ServingState``; ``report`` renders it as
``/metrics`` and ``/telemetry`` do; ``replay_request_lines(path)`` the per-request stderr lines.

Tolerated: a torn last line (a crash mid-write) and kinds this code does not know — skipped and
counted. Refused: a record whose schema is newer than this code (``SchemaTooNew``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..events.codec import decode_line
from ..events.fold import ServingState, fold_or_skip
from ..events.metrics import metrics_text
from ..events.request_line import request_lines
from ..events.schema import Record, SchemaError, SchemaTooNew, UnknownEventKind
from ..events.telemetry import telemetry_snapshot


@dataclass
class ReplayResult:
    """The folded state plus what was skipped. ``instance``: the server instance replayed;
    ``records``: records folded; ``malformed_lines``: lines that did not decode and records the
    fold skipped (``state.fold_errors`` of them; ``fold_failures``: their seq and error)."""
    state: ServingState = field(default_factory=ServingState)
    instance: str = ""
    records: int = 0
    skipped_unknown: int = 0
    torn_lines: int = 0
    malformed_lines: int = 0
    other_instances: int = 0
    unknown_kinds: dict = field(default_factory=dict)
    fold_failures: list = field(default_factory=list)


def read_records(path: str | Path, result: ReplayResult) -> list[Record]:
    """Decode a JSONL log file, counting what is skipped into ``result``.

    Raises:
        SchemaTooNew: a record was written by a newer schema.
        OSError: the file cannot be read.
    """
    return decode_records(Path(path).read_bytes(), result)


def decode_records(data: bytes, result: ReplayResult) -> list[Record]:
    """Decode JSONL bytes (blank lines ignored), counting what is skipped into ``result``.

    Raises:
        SchemaTooNew: a record was written by a newer schema.
    """
    raw = data.split(b"\n")
    while raw and not raw[-1].strip():
        raw.pop()
    out = []
    for i, line in enumerate(raw):
        if not line.strip():
            continue
        try:
            rec = decode_line(line)
        except SchemaTooNew:
            raise
        except UnknownEventKind as exc:
            result.skipped_unknown += 1
            kind = str(exc).split("'")[1] if "'" in str(exc) else "?"
            result.unknown_kinds[kind] = result.unknown_kinds.get(kind, 0) + 1
            continue
        except SchemaError:
            if i == len(raw) - 1:
                result.torn_lines += 1
            else:
                result.malformed_lines += 1
            continue
        out.append(rec)
    return out


def last_instance(records: list[Record]) -> str:
    """The server instance a log is replayed for: the last that started in it (else the last
    record's; "" for no records)."""
    starts = [r.instance for r in records if r.kind == "server.started"]
    return starts[-1] if starts else (records[-1].instance if records else "")


def replay_request_lines(path: str | Path) -> tuple[list[str], ReplayResult]:
    """(the per-request lines the live servers printed, ``events.request_line``, every
    instance's in the log's order, with an ``unfinished`` line for a request no record ended;
    the result with what was skipped counted) of a JSONL log."""
    result = ReplayResult()
    records = decode_records(Path(path).read_bytes(), result)
    result.instance = last_instance(records)
    result.records = len(records)
    skipped: list[Record] = []
    lines = request_lines(records, skipped)
    result.malformed_lines += len(skipped)
    return lines, result


def replay_log(path: str | Path, upto_seq: int | None = None) -> ReplayResult:
    """Fold the last server instance's records (up to ``upto_seq`` inclusive when given)."""
    return replay_bytes(Path(path).read_bytes(), upto_seq)


def replay_bytes(data: bytes, upto_seq: int | None = None) -> ReplayResult:
    """``replay_log`` over JSONL bytes (e.g. a file uploaded by the dashboard)."""
    result = ReplayResult()
    records = decode_records(data, result)
    instance = result.instance = last_instance(records)
    state = result.state
    for rec in records:
        if rec.instance != instance:
            result.other_instances += 1
            continue
        if upto_seq is not None and rec.seq > upto_seq:
            continue
        state, error = fold_or_skip(state, rec)
        if error is None:
            result.records += 1
        else:   # skipped as the live server skips it (counted in state.fold_errors)
            result.malformed_lines += 1
            result.fold_failures.append((rec.seq, rec.kind, f"{type(error).__name__}: {error}"))
    result.state = state
    return result


def replay_report(path: str | Path) -> tuple[str, dict, ReplayResult]:
    """(metrics text, telemetry snapshot, result) for ``ninfer replay LOG``."""
    return report(replay_log(path))


def report(res: ReplayResult) -> tuple[str, dict, ReplayResult]:
    """(metrics text, telemetry snapshot with a ``replay`` section, result)."""
    snap = telemetry_snapshot(res.state)
    snap["replay"] = {"records": res.records, "skipped_unknown": res.skipped_unknown,
                      "unknown_kinds": res.unknown_kinds, "torn_lines": res.torn_lines,
                      "malformed_lines": res.malformed_lines,
                      "other_instances": res.other_instances,
                      "live_only": ["live"]}
    return metrics_text(res.state, res.state.config.get("max_concurrency", 0)), snap, res
