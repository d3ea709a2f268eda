"""Instantaneous readings that enter the log as ``telemetry.sample`` events.

``read_gpu()`` reads the board through NVML (pynvml, from the ``nvidia-ml-py`` package) when a
GPU and the library exist, else returns ``{"available": False, "reason": ...}``.
``run_sampler`` is the trio task that emits one sample every interval: NVML readings, the
engine's latest published ``EngineStats`` (occupancy and the execution thread's wall-clock
split). It never waits on the execution thread.
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


async def run_sampler(bus, engine, interval_s: float, gpu: GpuReader | None = None) -> None:
    """Emit ``telemetry.sample`` every ``interval_s`` seconds until cancelled."""
    gpu = gpu or GpuReader()
    while True:
        await trio.sleep(interval_s)
        bus.emit(sample_event(engine, gpu, interval_s))
