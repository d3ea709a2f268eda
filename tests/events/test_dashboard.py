"""The dashboard fold over sparse ``telemetry.sample`` records (written on change, else every
10 s): the worker split is spread over the seconds it accrued in, and the buckets between two
samples keep the earlier one's occupancy."""
from __future__ import annotations

import pytest

from ninfer.events import schema as ev
from ninfer.events.dashboard import dashboard_view
from ninfer.events.fold import ServingState, fold


def _sample(seq: int, ts: float, idle: float, running: int) -> ev.Record:
    worker = {"prefill": 0.0, "decode": 0.0, "admission": 0.0, "upkeep": 0.0, "idle": idle}
    return ev.Record(ev.SCHEMA_VERSION, seq, ts, "i", ev.TelemetrySample(
        interval_s=1.0, gpu={"available": False, "reason": "test"}, scheduler={"running": running,
                                                                               "waiting": 0},
        worker_seconds=worker))


def test_a_heartbeat_interval_is_spread_over_its_buckets():
    state = ServingState()
    for rec in (_sample(1, 100.5, 0.0, 1), _sample(2, 110.5, 10.0, 0)):
        state = fold(state, rec)
    series = dashboard_view(state)["series"]
    assert [s["t"] for s in series] == [100.0 + i for i in range(11)]
    idle = [s["worker"]["idle"] for s in series]
    assert idle == pytest.approx([0.5] + [1.0] * 9 + [0.5])     # seconds per 1 s bucket
    assert sum(idle) == pytest.approx(10.0)
    assert [s["occupancy"]["running"] for s in series] == [1] * 10 + [0]


def test_samples_within_one_bucket_add_up_there():
    state = ServingState()
    for rec in (_sample(1, 100.1, 0.0, 0), _sample(2, 100.6, 0.5, 1),
                _sample(3, 101.2, 1.0, 1)):
        state = fold(state, rec)
    series = dashboard_view(state)["series"]
    assert series[0]["worker"]["idle"] == pytest.approx(0.5 + 0.5 * 0.4 / 0.6)
    assert series[1]["worker"]["idle"] == pytest.approx(0.5 * 0.2 / 0.6)
    assert series[0]["occupancy"]["running"] == 1 and series[1]["occupancy"]["running"] == 1
