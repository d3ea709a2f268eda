"""Processes of a scale-out test: ``ninfer serve`` replicas and the ``smg`` gateway in front of
them, each a real process on 127.0.0.1 (docs/scale-out.md describes the same deployment)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

from ninfer.ports import free_ports

# a deep prefill on a loaded 2-core machine: ample, and only ever waited on, never asserted
START_S = 300


def spawn(args, out_path, env=None) -> subprocess.Popen:
    """``args`` as a process writing its output to ``out_path`` (a pipe nobody reads would fill
    and stall it); ``env``: variables added to this process's environment."""
    with open(out_path, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})


def wait_until(check, what: str, timeout_s: float = START_S, proc=None, out_path=None):
    """``check()``'s first truthy value, polled; fails after ``timeout_s`` (or when ``proc``
    exits: with the end of its output file ``out_path``) with ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            tail = open(out_path, errors="replace").read()[-4000:] if out_path else ""
            raise AssertionError(f"{what}: the process exited:\n{tail}")
        try:
            got = check()
            if got:
                return got
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        time.sleep(0.25)



def interrupt(proc) -> None:
    """SIGINT ``proc`` (None or ended: nothing), then SIGKILL it after 30 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

class Replica:
    """One ``ninfer serve`` with its own L3 namespace and KV-event sockets; ``start()`` again
    after ``kill()`` restarts it on the same port, store and sockets."""

    def __init__(self, model, tmp, name: str):
        self.name, self.port = name, free_ports()
        self.out = tmp / f"{name}.out"
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_pub = f"tcp://127.0.0.1:{free_ports()}"
        self.kv_replay = f"tcp://127.0.0.1:{free_ports()}"
        self.args = [
            sys.executable, "-m", "ninfer", "serve", str(model), "--port", str(self.port),
            "--max-context", "2048", "--max-concurrency", "4",
            "--continuation-cache", "l1-l2-l3", "--continuation-cache-dir", str(tmp / "l3"),
            "--continuation-cache-namespace", name,
            "--continuation-cache-persist-min-tokens", "16",
            "--continuation-cache-min-restore-tokens", "16",
            "--kv-events-endpoint", self.kv_pub, "--kv-events-replay-endpoint", self.kv_replay,
            "--request-log-jsonl", str(tmp / f"{name}.jsonl")]
        self.proc = None

    def start(self) -> "Replica":
        self.proc = spawn(self.args, self.out)
        wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200,
                   f"replica {self.name} /health", proc=self.proc, out_path=self.out)
        return self

    def get(self, path: str):
        return httpx.get(self.url + path, timeout=30).json()

    def requests_received(self) -> int:
        """``request.received`` records of this process (its ``/telemetry`` admissions and
        rejections would miss requests still queued)."""
        t = self.get("/telemetry")["scheduler"]
        return t["admitted_requests"] + t["rejected_overloaded"] + t["rejected_queue_timeout"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        interrupt(self.proc)


class Gateway:
    """``smg launch`` (pinned in pyproject's dev extra) over ``replicas``, cache-aware, with
    health probes every second so that a dead replica leaves routing quickly."""

    def __init__(self, replicas, tmp, *extra: str):
        self.port = free_ports()
        self.out = tmp / "smg.out"
        self.url = f"http://127.0.0.1:{self.port}"
        smg = os.path.join(os.path.dirname(sys.executable), "smg")
        self.args = [
            smg, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_ports()),
            "--worker-urls", *[r.url for r in replicas], "--policy", "cache_aware",
            # a later turn goes where its prefix is: no cache hit diverted to warm a replica
            "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--load-monitor-interval", "1",
            "--request-timeout-secs", "600", "--log-level", "warn", *extra]
        self.proc = None

    def start(self, n_workers: int) -> "Gateway":
        self.proc = spawn(self.args, self.out)
        wait_until(lambda: len(self.healthy()) == n_workers, "smg's workers", proc=self.proc,
                   out_path=self.out)
        return self

    def healthy(self) -> set[str]:
        """URLs of the workers smg routes to now."""
        workers = httpx.get(self.url + "/workers", timeout=10).json()["workers"]
        return {w["url"] for w in workers if w["is_healthy"] and w["status"] == "ready"}

    def stop(self) -> None:
        interrupt(self.proc)


class KvRouter:
    """``vllm-router`` (pinned in the dev extra) with its ``kv_aware`` policy over
    ``replicas``: it subscribes to each one's KV-event stream (vLLM's ZeroMQ format) and asks
    ``POST /tokenize`` for a request's ids, then routes to the replica holding most of them.
    Logs at debug level: its routing decisions (``credited_prefix_tokens``) are read there."""

    def __init__(self, replicas, tmp, model_id: str):
        self.port = free_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = tmp / "vllm-router.out"
        router = os.path.join(os.path.dirname(sys.executable), "vllm-router")
        self.args = [router, "--host", "127.0.0.1", "--port", str(self.port),
                     "--worker-urls", *[r.url for r in replicas], "--policy", "kv_aware",
                     "--kv-event-block-size", "16", "--kv-event-model", model_id,
                     "--log-level", "debug"]
        for r in replicas:
            self.args += ["--kv-event-source", f"{r.url}={r.kv_pub}",
                          "--kv-event-replay-source", f"{r.url}={r.kv_replay}"]
        self.proc = None

    def start(self) -> "KvRouter":
        # (its kv_aware decisions are logged at debug level only when RUST_LOG asks)
        self.proc = spawn(self.args, self.out, env={"RUST_LOG": "debug"})
        wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200,
                   "vllm-router /health", proc=self.proc, out_path=self.out)
        return self

    def credited_prefix_tokens(self) -> list[int]:
        """``credited_prefix_tokens`` of each routing decision logged (the log is complete once
        the router stopped; its colour codes are left out)."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", open(self.out, errors="replace").read())
        return [int(m) for m in re.findall(r"credited_prefix_tokens=(\d+)", text)]

    def stop(self) -> None:
        interrupt(self.proc)
