"""The dashboard in a real browser (Debian's Chromium driven by playwright-core): live values
equal /metrics, the same page replays the JSONL log offline to the same numbers, live-only
panels say so, no console errors. Screenshots go to test-artifacts/dashboard/."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def _need(ok: bool, what: str):
    if not ok:
        if os.environ.get("CI") or os.environ.get("NINFER_REQUIRE_MODEL"):
            pytest.fail(f"{what} is missing (the README's test command installs it)")
        pytest.skip(f"{what} is missing")


@pytest.fixture
def dashboard_server(smollm2_gguf, tmp_path):
    _need(Path(CHROMIUM).exists(), "Debian's chromium")
    _need((ROOT / "web" / "node_modules" / "playwright-core").is_dir(), "web/node_modules")
    _need((ROOT / "web" / "dist" / "index.html").is_file(), "the built dashboard (web/dist)")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "requests.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "ninfer", "serve", str(smollm2_gguf),
                             "--port", str(port), "--request-log-jsonl", str(log),
                             "--max-context", "2048", "--telemetry-interval-ms", "200"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1500):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield base, log
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _metrics(base):
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            out[s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")] = s.value
    return out


def _until_logged_and_sampled_idle(log, finished: int) -> None:
    """Wait until the JSONL log holds ``finished`` ``request.finished`` records and, after the
    last, a ``telemetry.sample`` of the idle engine (running 0, so its final prefill and decode
    seconds): no record is due after it but the heartbeat. Fails after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        text = log.read_text(encoding="utf-8")
        lines = text.splitlines()[:None if text.endswith("\n") else -1]   # (not a torn line)
        records = [json.loads(x) for x in lines]
        ends = [i for i, r in enumerate(records) if r["kind"] == "request.finished"]
        if len(ends) >= finished and any(
                r["kind"] == "telemetry.sample" and r["scheduler"]["running"] == 0
                for r in records[ends[-1] + 1:]):
            return
        assert time.monotonic() < deadline, \
            f"no idle sample after {finished} finished requests: {len(ends)} finished"
        time.sleep(0.05)


def test_dashboard_live_and_offline_show_the_metrics_values(dashboard_server, tmp_path):
    base, log = dashboard_server
    for i, stream in enumerate((False, True, False)):
        r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": f"Name {i + 2} fruits."}],
            "max_tokens": 12, "temperature": 0, "stream": stream})
        assert r.status_code == 200
    _until_logged_and_sampled_idle(log, finished=3)
    m = _metrics(base)
    # an offline copy with an unknown kind and a torn last line
    offline_log = tmp_path / "offline.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines()
    unknown = json.loads(lines[-1])
    unknown["kind"] = "request.from_the_future"
    offline_log.write_text("\n".join(lines + [json.dumps(unknown)]) + "\n" + lines[-1][:30],
                           encoding="utf-8")
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    r = subprocess.run(["node", str(ROOT / "web" / "tests" / "dashboard.mjs"), base,
                        str(offline_log), str(ARTIFACTS)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "CHROMIUM": CHROMIUM})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["errors"] == []
    expected = {"tokens_predicted": m["llamacpp:tokens_predicted_total"],
                "prompt_tokens": m["llamacpp:prompt_tokens_total"],
                "requests_finished": m['ninfer:requests_total{"finish": "finished"}']}
    assert expected["requests_finished"] == 3
    for view in ("live", "offline"):
        kpis = seen[view]["kpis"]
        for key, value in expected.items():
            assert float(kpis[key]["value"]) == value, (view, key)
        assert all(k["title"] for k in kpis.values()), "every reading has a glossary tooltip"
        assert seen[view]["requests"] == 3
    assert float(seen["offline"]["kpis"]["decode_tok_s"]["value"]) == \
        float(seen["live"]["kpis"]["decode_tok_s"]["value"])
    assert "No GPU" in seen["live"]["gpu"]
    assert "live-only" in seen["offline"]["gpu"] and "live-only" in seen["offline"]["vram"]
    assert "1 torn line skipped" in seen["offline"]["status"]
    assert "1 unknown records skipped" in seen["offline"]["status"]
    assert all(title for _, title in seen["live"]["panel_titles"])
    assert seen["live"]["chart_canvases"] == 3
    assert (ARTIFACTS / "live.png").stat().st_size > 10_000
    assert (ARTIFACTS / "offline.png").stat().st_size > 10_000
