"""Replay: the record log folded offline (``log``), recorded sessions re-executed token for
token (``sessions``), and the script that records the fixtures (``record``)."""
from ..events.metrics import metrics_text
from .log import (ReplayResult, decode_records, read_records, replay_bytes, replay_log,
                  replay_report, replay_request_lines, report)
from .sessions import Divergence, SessionRecorder, execute_sessions, load_sessions

__all__ = ["metrics_text", "ReplayResult", "decode_records", "read_records", "replay_bytes",
           "replay_log", "replay_report", "replay_request_lines", "report", "Divergence",
           "SessionRecorder", "execute_sessions", "load_sessions"]
