"""``ninfer fleet`` (``ninfer/fleet.py``, ``fleet_supervisor.py``): two SmolLM2 replicas and the
smg gateway started together, a chat request through the gateway, a clean stop on SIGINT; and
its one-line errors on bad input, a missing gateway and a replica that does not start."""
from __future__ import annotations

import signal
import socket
import sys

import httpx
import pytest
from fleet_procs import spawn, wait_until

from ninfer import fleet
from ninfer.cli import main
from ninfer.ports import free_ports


def _fleet_args(tmp, port, base, kv, *extra):
    return ["fleet", "--replicas", "2", "--port", str(port), "--metrics-port", str(free_ports()),
            "--replica-port", str(base),
            "--kv-events-port", str(kv), "--cache-dir", str(tmp / "l3"),
            "--log-dir", str(tmp / "logs"), "--serve-args=--max-context 2048", *extra]


@pytest.mark.slow
def test_a_fleet_of_two_serves_through_smg_and_stops_on_sigint(smollm2_gguf, tmp_path):
    # replicas on base + i, their KV events on kv + 10 i and kv + 10 i + 1
    port, base, kv = free_ports(), free_ports(2), free_ports(12)
    out = tmp_path / "fleet.out"
    proc = spawn([sys.executable, "-m", "ninfer", *_fleet_args(
        tmp_path, port, base, kv, str(smollm2_gguf),
        "--smg-args=--worker-warmup-secs 0 --health-check-interval-secs 1")],
        out)
    gw = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: "behind smg" in out.read_text(), "the fleet's start", proc=proc,
                   out_path=out)
        assert out.read_text().splitlines()[-1] == \
            f"ninfer fleet: 2 replicas behind smg on {gw}/v1"
        workers = httpx.get(gw + "/workers", timeout=10).json()["workers"]
        assert sorted(w["url"] for w in workers) == [f"http://127.0.0.1:{base}",
                                                     f"http://127.0.0.1:{base + 1}"]
        model = httpx.get(gw + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(gw + "/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        # each replica: its own L3 namespace, its own KV-event sockets
        assert sorted(p.name for p in (tmp_path / "l3").iterdir()) == ["replica-0", "replica-1"]
        for i in range(2):
            log = (tmp_path / "logs" / f"replica-{i}.log").read_text()
            assert f"on http://127.0.0.1:{base + i}" in log
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.read_text().splitlines()[-1] == "ninfer fleet: stopped"
    for p in (port, base, base + 1, kv, kv + 1, kv + 10, kv + 11):   # every process is gone
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (past TIME_WAIT)
            s.bind(("127.0.0.1", p))
    for i in range(2):
        assert "ninfer: stopped" in (tmp_path / "logs" / f"replica-{i}.log").read_text()


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0", "--replicas", "2"], "ninfer: --gpus names 1 entries for 2 replicas "
     "(one each)"),
    (["--cpus", "0,1,2", "--replicas", "2"], "ninfer: --cpus names 3 entries for 2 replicas "
     "(one each)"),
    (["--serve-args=--port 9000"], "ninfer: --serve-args may not set --port (ninfer fleet "
     "sets it per replica)"),
    (["--serve-args=--continuation-cache-namespace=x"], "ninfer: --serve-args may not set "
     "--continuation-cache-namespace (ninfer fleet sets it per replica)"),
    (["--replicas", "0"], "ninfer: --replicas must be >= 1, got 0"),
    (["--serve-args", "'unclosed"], "ninfer: --serve-args / --smg-args: No closing quotation"),
    (["--port", "8001"], "ninfer: ports overlap or leave 1..65535: gateway 8001, metrics "
     "29000, replicas [8001, 8002], KV events from 5557"),
    (["--metrics-port", "8000"], "ninfer: ports overlap or leave 1..65535: gateway 8000, "
     "metrics 8000, replicas [8001, 8002], KV events from 5557"),
    (["--start-timeout", "0"], "ninfer: --start-timeout must be > 0, got 0"),
    (["--smg", "/nonexistent/smg"], "ninfer fleet: --smg /nonexistent/smg: not an executable "
     "file"),
])
def test_bad_input_is_one_line(args, message, capsys, tmp_path):
    rc = main(["fleet", "--cache-dir", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert (rc, err) == (1 if "ninfer fleet:" in message else 2, message)


def test_bad_cpu_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fleet", "--cpus", "0,x"])
    assert exc.value.code == 2
    assert "expected CPU ids or ranges like 0,1 or 0-3,4-7, got '0,x'" in capsys.readouterr().err


def test_no_smg_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(fleet.shutil, "which", lambda _: None)
    monkeypatch.setattr(fleet.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(fleet.FleetError, match=r"^smg is not installed: pip install "
                       r"'smg==1\.13\.0' \(the gateway docs/scale-out\.md tests\), or give "
                       r"--smg PATH$"):
        fleet.find_smg(None)


def test_a_port_in_use_is_named(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        rc = main(_fleet_args(tmp_path, free_ports(), busy, 0))
    assert rc == 2
    assert capsys.readouterr().err.strip() == \
        f"ninfer fleet: cannot listen on 127.0.0.1:{busy}: Address already in use"


def test_a_replica_that_does_not_start_stops_the_fleet(capsys, tmp_path):
    # (serve refuses its options before it loads a model: no model is needed)
    base = free_ports()
    rc = main(_fleet_args(tmp_path, free_ports(), base, 0, 
                          "--serve-args=--max-concurrency 0", "--start-timeout", "120"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1] == (f"ninfer fleet: replica-0 (port {base}) exited with status 2 before it "
                       f"answered (its output: {tmp_path}/logs/replica-0.log; last: ninfer: "
                       "--max-concurrency must be >= 1, got 0)")
    assert (tmp_path / "logs" / "replica-0.log").read_text() == \
        "ninfer: --max-concurrency must be >= 1, got 0\n"
