"""The processes of ``ninfer fleet`` (``fleet.py``): start the replicas, then the gateway once
every replica answers ``/health``, watch them, and stop them in order on a signal.

Each child runs in its own session, so a terminal's Ctrl-C reaches the fleet alone, which stops
the gateway first (no new requests routed) and then the replicas (SIGINT: ``ninfer serve``'s
graceful stop), each killed after ``STOP_S``. A child also gets SIGTERM if the fleet itself
dies (Linux's parent-death signal), so none is left behind.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

from .fleet import FleetConfig, FleetError

STOP_S = 30
_PR_SET_PDEATHSIG = 1


def _child_setup(cpus) -> None:
    """In the child, before exec: SIGTERM when the fleet dies; the replica's CPUs."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):   # not Linux: the signal forwarding alone
        pass
    if cpus:
        os.sched_setaffinity(0, cpus)


def _get_json(url: str):
    """``url``'s JSON answer, or None (no answer yet, or not 200)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (OSError, ValueError):   # (URLError and refused connections are OSErrors)
        return None


class Proc:
    """One child: its command, environment, CPUs and where its output goes."""

    def __init__(self, name: str, cmd: list[str], env: dict, cpus=None, log_dir=None):
        self.name, self.cmd, self.env, self.cpus = name, cmd, env, cpus
        self.log = os.path.join(log_dir, f"{name}.log") if log_dir else None
        self.popen: subprocess.Popen | None = None

    def start(self) -> None:
        out = open(self.log, "ab") if self.log else None
        try:
            self.popen = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                env={**os.environ, **self.env}, start_new_session=True,
                preexec_fn=lambda: _child_setup(self.cpus))
        except OSError as exc:
            raise FleetError(f"{self.name}: cannot run {self.cmd[0]}: {exc.strerror}") from None
        finally:
            if out is not None:
                out.close()

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def where(self) -> str:
        """Where its output is, with the last line of a log file (the reason, mostly)."""
        if not self.log:
            return "its output is above"
        try:
            with open(self.log, "rb") as f:
                f.seek(max(os.path.getsize(self.log) - 4096, 0))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines()
                         if ln.strip()]
        except OSError:
            lines = []
        return f"its output: {self.log}" + (f"; last: {lines[-1].strip()[:300]}" if lines
                                            else "")

    def interrupt(self) -> None:
        if self.exited() is None and self.popen is not None:
            self.popen.send_signal(signal.SIGINT)

    def reap(self, deadline: float) -> None:
        """Wait for the child until ``deadline`` (monotonic), then kill it."""
        if self.popen is None:
            return
        try:
            self.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class Fleet:
    """The replicas and the gateway of ``config``, ``smg`` the gateway's executable."""

    def __init__(self, config: FleetConfig, smg: str):
        self.config = config
        self.replicas = [Proc(f"replica-{i}", config.serve_command(i), config.serve_env(i),
                              config.cpus[i] if config.cpus else None, config.log_dir)
                         for i in range(config.replicas)]
        self.gateway = Proc("smg", config.gateway_command(smg), {}, None, config.log_dir)
        self.stop_signal: int | None = None
        self._handlers: dict = {}   # the signal handlers before start(), put back by stop()
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        self.url = f"http://{host}:{config.port}"

    def check_ports(self) -> None:
        """Every port is free before anything starts.

        Raises:
            OSError: one is in use (it is named).
        """
        from .cli import _check_listen

        c = self.config
        _check_listen(c.host, c.port)
        _check_listen(c.host, c.metrics_port)
        for i, port in enumerate(c.replica_ports()):
            for p in (port, *c.kv_ports(i)):
                _check_listen("127.0.0.1", p)

    def _on_signal(self, signum, _frame) -> None:
        self.stop_signal = signum

    def start(self, handle_signals: bool = True) -> bool:
        """Start the replicas, then the gateway; False when a signal came first (everything
        is stopped then).

        Raises:
            FleetError: a process exited or did not answer in time (the others are stopped).
        """
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._handlers[sig] = signal.signal(sig, self._on_signal)
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
        try:
            for r in self.replicas:
                r.start()
            for r, port in zip(self.replicas, self.config.replica_ports()):
                url = f"http://127.0.0.1:{port}/health"
                if not self._wait(r, lambda: _get_json(url), f"{r.name} (port {port})"):
                    return False
            self.gateway.start()
            return self._wait(self.gateway, self._all_routed, f"smg (port {self.config.port})")
        except BaseException:
            self.stop()
            raise

    def _all_routed(self) -> bool:
        """The gateway routes to every replica."""
        got = _get_json(self.url + "/workers") or {}
        healthy = [w for w in got.get("workers", ()) if w.get("is_healthy")]
        return len(healthy) == len(self.replicas)

    def _wait(self, proc: Proc, check, what: str) -> bool:
        """Poll ``check`` until true (True), a signal (False, all stopped), ``proc``'s exit or
        the start timeout (FleetError)."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while not check():
            if self.stop_signal is not None:
                self.stop()
                return False
            if (status := proc.exited()) is not None:
                raise FleetError(f"{what} exited with status {status} before it answered "
                                 f"({proc.where()})")
            if time.monotonic() > deadline:
                raise FleetError(f"{what} did not answer within {self.config.start_timeout_s:g}"
                                 f" s ({proc.where()})")
            time.sleep(0.25)
        return True

    def wait(self) -> None:
        """Run until a signal (then stop everything) or a child's exit.

        Raises:
            FleetError: a child exited on its own (the others are stopped).
        """
        while self.stop_signal is None:
            for p in (*self.replicas, self.gateway):
                if (status := p.exited()) is not None:
                    self.stop()
                    raise FleetError(f"{p.name} exited with status {status}; the fleet is "
                                     f"stopped ({p.where()})")
            time.sleep(0.25)
        self.stop()

    def stop(self) -> None:
        """The gateway first, then every replica: SIGINT, then SIGKILL after ``STOP_S``."""
        self.gateway.interrupt()
        self.gateway.reap(time.monotonic() + STOP_S)
        for r in self.replicas:
            r.interrupt()
        deadline = time.monotonic() + STOP_S
        for r in self.replicas:
            r.reap(deadline)
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()
