"""``ninfer fleet [MODEL] --replicas N``: N ``ninfer serve`` replicas and the ``smg`` gateway in
front of them, on one host (docs/scale-out.md, "Deployment on one host").

Replica ``i`` listens on ``--replica-port + i``, keeps its L3 store in ``--cache-dir`` under the
namespace ``replica-i`` (its slot files, with ``--slot-dir``, in ``DIR/replica-i``), publishes
KV-cache events on ``--kv-events-port + 10 i`` (replay: ``+ 1``), and sees one GPU of
``--gpus`` (``CUDA_VISIBLE_DEVICES``) or runs on its CPUs of ``--cpus``. The gateway is the
existing one (``smg launch``, cache-aware, with the flags the page recommends); this module only
starts, watches and stops the processes (``fleet_supervisor.py``). Exit status: 0 after a signal
stopped the fleet, 1 when a process failed to start or exited, 2 on bad input.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field

# flags the fleet sets per replica: given in --serve-args they would clash
_OWN_SERVE_FLAGS = ("--host", "--port", "--continuation-cache", "--continuation-cache-dir",
                    "--continuation-cache-namespace", "--kv-events-endpoint",
                    "--kv-events-replay-endpoint", "--slot-save-path")
# the gateway's flags docs/scale-out.md recommends: probes, deep prefills' timeouts
GATEWAY_FLAGS = ("--policy", "cache_aware", "--health-check-interval-secs", "5",
                 "--request-timeout-secs", "1800", "--worker-wedge-secs", "120")


class FleetError(RuntimeError):
    """A process of the fleet could not start, or exited while it ran (one line)."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """One fleet. ``model`` None: the bundled SmolLM2. ``gpus`` / ``cpus``: one entry a
    replica (a device id; a set of CPU ids), or empty. ``kv_events_port`` 0: no KV events.
    ``log_dir`` None: the processes write to this terminal."""
    model: str | None = None
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 29000   # smg's Prometheus endpoint (its own default)
    replica_port: int = 8001
    kv_events_port: int = 5557
    cache_dir: str = "ninfer-fleet-cache"
    slot_dir: str | None = None
    gpus: tuple[str, ...] = ()
    cpus: tuple[frozenset, ...] = ()
    serve_args: tuple[str, ...] = ()
    smg_args: tuple[str, ...] = ()
    smg: str | None = None
    log_dir: str | None = None
    start_timeout_s: float = 600.0
    env: dict = field(default_factory=dict)   # added to every replica's environment

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"--start-timeout must be > 0, got {self.start_timeout_s:g}")
        for name, per in (("--gpus", self.gpus), ("--cpus", self.cpus)):
            if per and len(per) != self.replicas:
                raise ValueError(f"{name} names {len(per)} entries for {self.replicas} "
                                 "replicas (one each)")
        for arg in self.serve_args:
            if arg.split("=")[0] in _OWN_SERVE_FLAGS:
                raise ValueError(f"--serve-args may not set {arg.split('=')[0]} (ninfer fleet "
                                 "sets it per replica)")
        ports = [self.port, self.metrics_port, *self.replica_ports()] + [
            p for i in range(self.replicas) for p in self.kv_ports(i)]
        if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise ValueError(f"ports overlap or leave 1..65535: gateway {self.port}, metrics "
                             f"{self.metrics_port}, replicas {self.replica_ports()}, KV events "
                             f"from {self.kv_events_port}")

    def replica_ports(self) -> list[int]:
        return [self.replica_port + i for i in range(self.replicas)]

    def kv_ports(self, i: int) -> tuple[int, ...]:
        """Replica ``i``'s KV-event publisher and replay ports (none when they are off)."""
        base = self.kv_events_port + 10 * i
        return (base, base + 1) if self.kv_events_port else ()

    def serve_command(self, i: int) -> list[str]:
        """``ninfer serve`` of replica ``i``."""
        name = f"replica-{i}"
        cmd = [sys.executable, "-m", "ninfer", "serve", *([self.model] if self.model else []),
               "--host", "127.0.0.1", "--port", str(self.replica_port + i),
               "--continuation-cache", "l1-l2-l3", "--continuation-cache-dir", self.cache_dir,
               "--continuation-cache-namespace", name]
        if self.kv_events_port:
            pub, replay = self.kv_ports(i)
            cmd += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                    "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
        if self.slot_dir:
            cmd += ["--slot-save-path", os.path.join(self.slot_dir, name)]
        return cmd + list(self.serve_args)

    def serve_env(self, i: int) -> dict:
        """Variables replica ``i`` gets on top of this process's: its GPU; on CPUs, as many
        math-library threads as it has CPUs (unless already set)."""
        env = dict(self.env)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
        if self.cpus:
            for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
                env.setdefault(var, os.environ.get(var, str(len(self.cpus[i]))))
        return env

    def gateway_command(self, smg: str) -> list[str]:
        """``smg launch`` over every replica (``smg_args`` after the recommended flags)."""
        return [smg, "launch", "--host", self.host, "--port", str(self.port),
                "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                "--worker-urls", *[f"http://127.0.0.1:{p}" for p in self.replica_ports()],
                *GATEWAY_FLAGS, *self.smg_args]


def find_smg(given: str | None) -> str:
    """The ``smg`` executable: ``given``, else on PATH, else beside this Python.

    Raises:
        FleetError: none is installed (one line of advice).
    """
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise FleetError(f"--smg {given}: not an executable file")
        return given
    beside = os.path.join(os.path.dirname(sys.executable), "smg")
    found = shutil.which("smg") or (beside if os.access(beside, os.X_OK) else None)
    if found is None:
        raise FleetError("smg is not installed: pip install 'smg==1.13.0' (the gateway "
                         "docs/scale-out.md tests), or give --smg PATH")
    return found


def _cpu_sets(text: str) -> tuple[frozenset, ...]:
    """``0,1`` or ``0-3,4-7``: one CPU or range of CPUs per replica."""
    out = []
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected CPU ids or ranges like 0,1 or 0-3,4-7, "
                                             f"got {text!r}") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"bad CPU range {item!r}")
        out.append(frozenset(range(first, last + 1)))
    return tuple(out)


def add_parser(sub) -> None:
    """The ``fleet`` subcommand on ``ninfer``'s subparsers."""
    d = FleetConfig()
    p = sub.add_parser("fleet", help="N serve replicas behind the smg gateway on this host "
                       "(docs/scale-out.md)")
    p.add_argument("model", nargs="?", default=None,
                   help=".ninfer or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas (default: one per --gpus / --cpus entry, else 2)")
    p.add_argument("--host", default=d.host, help=f"the gateway's address (default {d.host}; "
                   "replicas listen on 127.0.0.1)")
    p.add_argument("--port", type=int, default=d.port, help=f"the gateway's port ({d.port})")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help=f"the gateway's Prometheus metrics port ({d.metrics_port})")
    p.add_argument("--replica-port", type=int, default=d.replica_port,
                   help=f"replica i listens on this + i (default {d.replica_port})")
    p.add_argument("--kv-events-port", type=int, default=d.kv_events_port,
                   help="replica i publishes KV events on this + 10 i, replays on + 1 "
                   f"(default {d.kv_events_port}; 0: off)")
    p.add_argument("--cache-dir", default=d.cache_dir, help="L3 directory; replica i's "
                   f"namespace is replica-i (default ./{d.cache_dir})")
    p.add_argument("--slot-dir", default=None, help="slot files: replica i's in DIR/replica-i")
    p.add_argument("--gpus", default=None, help="one device id per replica, e.g. 0,1 "
                   "(CUDA_VISIBLE_DEVICES)")
    p.add_argument("--cpus", type=_cpu_sets, default=(), help="one CPU or range per replica, "
                   "e.g. 0,1 or 0-7,8-15 (affinity, and that many math-library threads)")
    p.add_argument("--serve-args", default="", help="more `ninfer serve` flags for every "
                   "replica, one string after = (e.g. --serve-args='--max-concurrency 8')")
    p.add_argument("--smg-args", default="", help="more `smg launch` flags, one string after "
                   "= (e.g. --smg-args='--health-check-interval-secs 1')")
    p.add_argument("--smg", default=None, help="the smg executable (default: on PATH, else beside "
                   "this Python)")
    p.add_argument("--log-dir", default=None, help="write each process's output to "
                   "DIR/replica-i.log and DIR/smg.log (default: this terminal)")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout_s,
                   help=f"seconds a process may take to answer (default {d.start_timeout_s:g})")
    p.set_defaults(fn=run)


def config_of(ns) -> FleetConfig:
    """The FleetConfig of parsed ``fleet`` arguments.

    Raises:
        ValueError: bad input (one line).
    """
    gpus = tuple(g.strip() for g in ns.gpus.split(",")) if ns.gpus else ()
    if any(not g for g in gpus):
        raise ValueError(f"--gpus {ns.gpus!r}: expected device ids like 0,1")
    replicas = ns.replicas if ns.replicas is not None else (len(gpus) or len(ns.cpus) or 2)
    try:
        serve_args, smg_args = shlex.split(ns.serve_args), shlex.split(ns.smg_args)
    except ValueError as exc:
        raise ValueError(f"--serve-args / --smg-args: {exc}") from None
    return FleetConfig(model=ns.model, replicas=replicas, host=ns.host, port=ns.port,
                       metrics_port=ns.metrics_port,
                       replica_port=ns.replica_port, kv_events_port=ns.kv_events_port,
                       cache_dir=ns.cache_dir, slot_dir=ns.slot_dir, gpus=gpus, cpus=ns.cpus,
                       serve_args=tuple(serve_args), smg_args=tuple(smg_args), smg=ns.smg,
                       log_dir=ns.log_dir, start_timeout_s=ns.start_timeout)


def run(ns) -> int:
    from .fleet_supervisor import Fleet

    config = config_of(ns)
    try:
        fleet = Fleet(config, find_smg(config.smg))
        try:
            fleet.check_ports()
        except OSError as exc:   # (its strerror names the address)
            print(f"ninfer fleet: {exc.strerror}", file=sys.stderr, flush=True)
            return 2
        if fleet.start():   # (False: a signal came first, and everything is stopped)
            print(f"ninfer fleet: {config.replicas} replicas behind smg on "
                  f"http://{config.host}:{config.port}/v1", file=sys.stderr, flush=True)
            fleet.wait()
    except FleetError as exc:
        print(f"ninfer fleet: {exc}", file=sys.stderr, flush=True)
        return 1
    print("ninfer fleet: stopped", file=sys.stderr, flush=True)
    return 0
