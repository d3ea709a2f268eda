"""Offline replay of a JSONL record log through the same folds the live server runs.

``replay_log(path)`` decodes every line, keeps the records of the last server instance in the
file (several runs may append to one file), and folds them into the metrics and telemetry
states; ``metrics_text`` renders the Prometheus text exactly as ``/metrics`` does.

Tolerated: a torn last line (a crash mid-write) and kinds this code does not know — skipped and
counted. Refused: a record whose schema is newer than this code (``SchemaTooNew``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import generate_latest

from .events.codec import decode_line
from .events.dashboard import DashboardState, fold_dashboard
from .events.metrics import MetricsState, fold_metrics, make_registry
from .events.schema import Record, SchemaError, SchemaTooNew, UnknownEventKind
from .events.telemetry import TelemetryState, fold_telemetry, telemetry_snapshot


@dataclass
class ReplayResult:
    """Folded states plus what was skipped. ``instance``: the server instance replayed."""
    metrics: MetricsState
    telemetry: TelemetryState
    instance: str = ""
    records: int = 0
    skipped_unknown: int = 0
    torn_lines: int = 0
    malformed_lines: int = 0
    other_instances: int = 0
    unknown_kinds: dict = field(default_factory=dict)
    dashboard: DashboardState = field(default_factory=DashboardState)


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


def replay_log(path: str | Path, upto_seq: int | None = None) -> ReplayResult:
    """Fold the last server instance's records (up to ``upto_seq`` inclusive when given)."""
    return replay_bytes(Path(path).read_bytes(), upto_seq)


def replay_bytes(data: bytes, upto_seq: int | None = None) -> ReplayResult:
    """``replay_log`` over JSONL bytes (e.g. a file uploaded by the dashboard)."""
    result = ReplayResult(MetricsState(), TelemetryState())
    records = decode_records(data, result)
    starts = [r.instance for r in records if r.kind == "server.started"]
    instance = starts[-1] if starts else (records[-1].instance if records else "")
    result.instance = instance
    m, t, d = result.metrics, result.telemetry, result.dashboard
    for rec in records:
        if rec.instance != instance:
            result.other_instances += 1
            continue
        if upto_seq is not None and rec.seq > upto_seq:
            continue
        try:
            m2 = fold_metrics(m, rec)
            t2 = fold_telemetry(t, rec)
            d2 = fold_dashboard(d, rec)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            # a record of a known kind whose payload does not hold what the kind promises
            # (a hand-edited or foreign log): counted, never a crash; the folds update their
            # state in place, so what one applied before the error stays applied
            result.malformed_lines += 1
            continue
        m, t, d = m2, t2, d2
        result.records += 1
    result.metrics, result.telemetry, result.dashboard = m, t, d
    return result


def metrics_text(state: MetricsState, max_concurrency: int = 0) -> str:
    """The ``/metrics`` body for ``state`` (same registry code as the live endpoint)."""
    return generate_latest(make_registry(lambda: state, max_concurrency)).decode()


def replay_report(path: str | Path) -> tuple[str, dict, ReplayResult]:
    """(metrics text, telemetry snapshot, result) for ``ninfer replay LOG``."""
    return report(replay_log(path))


def report(res: ReplayResult) -> tuple[str, dict, ReplayResult]:
    """(metrics text, telemetry snapshot with a ``replay`` section, result)."""
    snap = telemetry_snapshot(res.telemetry)
    snap["replay"] = {"records": res.records, "skipped_unknown": res.skipped_unknown,
                      "unknown_kinds": res.unknown_kinds, "torn_lines": res.torn_lines,
                      "malformed_lines": res.malformed_lines,
                      "other_instances": res.other_instances,
                      "live_only": ["live"]}
    return metrics_text(res.metrics, res.telemetry.config.get("max_concurrency", 0)), snap, res
