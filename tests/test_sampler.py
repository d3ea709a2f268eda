"""The telemetry sampler: a sample when a reading changed, else a heartbeat every 10 s
(trio's autojump clock: no wall time)."""
from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from ninfer.engine.engine import EngineStats
from ninfer.events.schema import TelemetrySample
from ninfer.sampler import HEARTBEAT_S, run_sampler, sample_changed

GPU = {"available": True, "name": "H200", "uuid": "GPU-1", "driver_version": "1",
       "temperature_c": 35, "power_watts": 78.8, "power_limit_watts": 700.0,
       "sm_clock_mhz": 345, "memory_clock_mhz": 3201, "utilization_gpu_percent": 0,
       "utilization_memory_percent": 0, "memory_used_bytes": 0,
       "memory_total_bytes": 150 << 30, "throttle_reasons": ["gpu_idle"]}
WORKER = {"prefill": 1.0, "decode": 2.0, "admission": 0.1, "upkeep": 0.1, "idle": 5.0}


def _sample(gpu=None, worker=None, **occupancy) -> TelemetrySample:
    return TelemetrySample(interval_s=1.0, gpu=dict(gpu or GPU), scheduler={"running": 0,
                                                                            "waiting": 0,
                                                                            **occupancy},
                           worker_seconds=dict(worker or WORKER))


def test_what_counts_as_a_change():
    base = _sample()
    assert sample_changed(None, base)
    # an idle board's drift and the idle thread's clock are no change
    assert not sample_changed(base, _sample(
        gpu=GPU | {"power_watts": 78.6, "temperature_c": 34, "sm_clock_mhz": 350},
        worker=WORKER | {"idle": 15.0, "upkeep": 0.2, "admission": 0.2}))
    for gpu in (GPU | {"power_watts": 78.8 + 35}, GPU | {"temperature_c": 37},
                GPU | {"sm_clock_mhz": 1980}, GPU | {"utilization_gpu_percent": 5},
                GPU | {"throttle_reasons": []}, GPU | {"memory_used_bytes": 64 << 20},
                {"available": False, "reason": "NVML read failed"}):
        assert sample_changed(base, _sample(gpu=gpu)), gpu
    assert sample_changed(base, _sample(running=1))
    assert sample_changed(base, _sample(worker=WORKER | {"decode": 2.01}))
    nogpu = _sample(gpu={"available": False, "reason": "x"})
    assert not sample_changed(nogpu, _sample(gpu={"available": False, "reason": "x"}))


class _Engine:
    def __init__(self):
        self.stats = EngineStats(total_pages=8, free_pages=8,
                                 worker_seconds=tuple(WORKER.items()))


class _Gpu:
    def read(self):
        return {"available": False, "reason": "test"}


class _Bus:
    def __init__(self):
        self.emitted = []

    def emit(self, event):
        self.emitted.append((trio.current_time(), event))


@pytest.mark.parametrize("interval_s", [0.05, 1.0])
async def test_an_idle_engine_gets_a_heartbeat_and_a_change_is_sampled_at_once(
        autojump_clock, interval_s):
    bus, engine = _Bus(), _Engine()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_sampler, bus, engine, interval_s, _Gpu())
        await trio.sleep(55)
        idle = len(bus.emitted)
        assert idle == 6           # the first reading, then one per HEARTBEAT_S (not 55 / interval)
        gaps = [b[0] - a[0] for a, b in zip(bus.emitted, bus.emitted[1:])]
        assert all(g == pytest.approx(HEARTBEAT_S, abs=interval_s * 1.01) for g in gaps)
        t = trio.current_time()
        engine.stats = dataclasses.replace(engine.stats, running=1, free_pages=6)
        await trio.sleep(interval_s * 1.5)
        assert len(bus.emitted) == idle + 1 and bus.emitted[-1][0] - t <= interval_s + 1e-6
        assert bus.emitted[-1][1].scheduler["running"] == 1
        nursery.cancel_scope.cancel()
