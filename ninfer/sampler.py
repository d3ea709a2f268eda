"""Instantaneous readings that enter the log as ``telemetry.sample`` events.

``read_gpu()`` reads the board through NVML (pynvml, from the ``nvidia-ml-py`` package) when a
GPU and the library exist, else returns ``{"available": False, "reason": ...}``.
``run_sampler`` is the trio task that reads, every interval, the NVML readings and the engine's
latest published ``EngineStats`` (occupancy and the execution thread's wall-clock split), and
emits a sample when they changed (``sample_changed``), or ``HEARTBEAT_S`` after the last one
when nothing did: an idle server logs one record per 10 s, not one per interval. It never waits
on the execution thread.
"""
from __future__ import annotations

import trio

from .events.schema import TelemetrySample

# NVML clocks-event (throttle) reason bits -> names (nvml.h, nvmlClocksEventReason*)
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_throttle_reasons(mask: int) -> list[str]:
    """NVML throttle bitmask -> sorted list of reason names (unknown bits as ``bit_0x...``)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    names += [f"bit_{1 << i:#x}" for i in range(64) if rest & (1 << i)]
    return names


class GpuReader:
    """Holds the NVML handle of device ``index``; ``read()`` never raises."""

    def __init__(self, index: int = 0):
        self.handle = None
        self.reason = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except ImportError:
            self.reason = "pynvml (nvidia-ml-py) is not installed"
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {exc}"

    def read(self) -> dict:
        if self.handle is None:
            return {"available": False, "reason": self.reason}
        n, h = self.nvml, self.handle
        try:
            util = n.nvmlDeviceGetUtilizationRates(h)
            mem = n.nvmlDeviceGetMemoryInfo(h)
            name = n.nvmlDeviceGetName(h)
            return {
                "available": True,
                "name": name.decode() if isinstance(name, bytes) else name,
                "uuid": _str(n.nvmlDeviceGetUUID(h)),
                "driver_version": _str(n.nvmlSystemGetDriverVersion()),
                "temperature_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                "power_watts": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "power_limit_watts": n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                "sm_clock_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                "memory_clock_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                "utilization_gpu_percent": util.gpu,
                "utilization_memory_percent": util.memory,
                "memory_used_bytes": int(mem.used),
                "memory_total_bytes": int(mem.total),
                "throttle_reasons": decode_throttle_reasons(
                    n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
            }
        except Exception as exc:
            return {"available": False, "reason": f"NVML read failed: {exc}"}


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def sample_event(engine, gpu: GpuReader, interval_s: float) -> TelemetrySample:
    st = engine.stats
    return TelemetrySample(
        interval_s=interval_s, gpu=gpu.read(),
        scheduler={"running": st.running, "prefilling": st.prefilling,
                   "decode_ready": st.decode_ready, "waiting": st.waiting,
                   "free_pages": st.free_pages, "total_pages": st.total_pages,
                   "retained_lanes": st.retained_lanes, "retained_pages": st.retained_pages},
        worker_seconds=dict(st.worker_seconds))


# a sample is emitted at least this often (seconds) while no reading changes
HEARTBEAT_S = 10.0
# NVML readings that drift while nothing happens (an idle H200: power +-0.2 W and the
# temperature +-1 C from one second to the next) count as changed only beyond these; every
# other field (occupancy, throttle reasons, ...) on any difference
GPU_TOLERANCES = {
    "temperature_c": lambda last: 2,                                     # C
    "power_watts": lambda last: 0.05 * (last.get("power_limit_watts") or 200.0),   # 5 % of limit
    "sm_clock_mhz": lambda last: 0.05 * last["sm_clock_mhz"],
    "memory_clock_mhz": lambda last: 0.05 * last["memory_clock_mhz"],
    "utilization_gpu_percent": lambda last: 5,
    "utilization_memory_percent": lambda last: 5,
    "memory_used_bytes": lambda last: 64 << 20,
}
# worker_seconds activities whose growth is a change (idle, upkeep and admission time grow on
# an idle server too: the thread wakes every 0.5 s)
BUSY_ACTIVITIES = ("prefill", "decode")


def sample_changed(last: TelemetrySample | None, new: TelemetrySample) -> bool:
    """Whether ``new``'s readings differ from those of ``last`` (the last emitted sample):
    any occupancy count (``scheduler``), prefill or decode seconds (``worker_seconds``), or GPU
    field, the drifting NVML readings only beyond ``GPU_TOLERANCES``. Timestamps and the idle /
    upkeep / admission seconds are no change."""
    if last is None or last.scheduler != new.scheduler or last.interval_s != new.interval_s:
        return True
    if any(last.worker_seconds.get(a) != new.worker_seconds.get(a) for a in BUSY_ACTIVITIES):
        return True
    old, cur = last.gpu, new.gpu
    if old.keys() != cur.keys():
        return True
    for key, value in cur.items():
        tol = GPU_TOLERANCES.get(key)
        if tol is None or not cur.get("available"):
            if value != old[key]:
                return True
        elif abs(value - old[key]) >= max(tol(old), 1e-9):
            return True
    return False


async def run_sampler(bus, engine, interval_s: float, gpu: GpuReader | None = None,
                      heartbeat_s: float = HEARTBEAT_S) -> None:
    """Read every ``interval_s`` seconds until cancelled; emit ``telemetry.sample`` when the
    readings changed since the last one emitted (``sample_changed``), else once
    ``max(heartbeat_s, interval_s)`` seconds have passed since it (trio's clock)."""
    gpu = gpu or GpuReader()
    last, last_t = None, 0.0
    while True:
        await trio.sleep(interval_s)
        sample = sample_event(engine, gpu, interval_s)
        now = trio.current_time()
        if sample_changed(last, sample) or now - last_t >= max(heartbeat_s, interval_s):
            bus.emit(sample)
            last, last_t = sample, now
