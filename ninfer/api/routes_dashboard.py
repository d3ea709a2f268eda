"""The dashboard: its static page and assets (``web/dist``), its folded state, and the replay
of an uploaded event log through the same folds."""
from __future__ import annotations

from pathlib import Path

from quart import Response, request, send_from_directory

from ..events.dashboard import dashboard_view
from ..events.metrics import counters
from ..events.schema import SchemaTooNew
from ..events.telemetry import telemetry_snapshot
from ..replay import replay_bytes, report
from .errors import ApiError
from .routes_status import live_readings

DEFAULT_WEB_DIR = Path(__file__).resolve().parents[2] / "web" / "dist"


class DashboardRoutes:
    """The dashboard routes of one ServerState (``--web-dir``, else the built ``web/dist``)."""

    def __init__(self, state):
        self.state = state
        cfg = state.config
        self.web_dir = Path(cfg.web_dir) if cfg.web_dir else DEFAULT_WEB_DIR

    async def page(self):
        index = self.web_dir / "index.html"
        if not index.is_file():
            return Response(f"The dashboard is not built ({index} is missing): run "
                            f"npm ci --prefix web && npm run build --prefix web",
                            status=404, content_type="text/plain")
        return await send_from_directory(self.web_dir, "index.html")

    async def asset(self, name: str, ext: str):
        return await send_from_directory(self.web_dir, f"{name}.{ext}")

    async def folded_state(self):
        state = self.state
        state.bus.flush()
        folded = state.folds.state
        return {"dashboard": dashboard_view(folded),
                "telemetry": telemetry_snapshot(folded, live_readings(state)),
                "counters": counters(folded)}

    async def replay(self):
        """``POST /dashboard/replay``: a JSONL event log folded as the live server folds."""
        data = await request.get_data()
        try:
            res = replay_bytes(data)
        except SchemaTooNew as exc:
            raise ApiError(400, str(exc), "schema_too_new") from None
        if res.records == 0:
            raise ApiError(400, "no ninfer records in this file", "invalid_log")
        _, snapshot, _ = report(res)   # (ninfer.replay's: metrics text, telemetry, result)
        return {"dashboard": dashboard_view(res.state), "telemetry": snapshot,
                "counters": counters(res.state), "replay": snapshot.pop("replay")}
