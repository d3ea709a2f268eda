"""The recorded SmolLM2 sessions in tests/fixtures/replay/sessions/ re-execute exactly (greedy,
seeded, 4 concurrent)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.replay import execute_sessions, load_sessions

pytestmark = pytest.mark.slow
REPLAY = Path(__file__).resolve().parent / "fixtures" / "replay" / "sessions"


@pytest.fixture(scope="module")
def runtime(smollm2_gguf, backend):
    from ninfer.server import load_runtime
    return load_runtime(str(smollm2_gguf), backend)


@pytest.mark.parametrize("name,count", [("greedy", 1), ("seeded", 1), ("concurrent4", 4)])
def test_recorded_sessions_replay_exactly(runtime, backend, name, count):
    if backend != "numpy" and name != "greedy":
        # recorded on the NumPy reference; the GPU's kernels round differently, which moves
        # sampled tokens and greedy near-ties (replay reports those as divergences)
        pytest.skip("recorded on the numpy backend")
    sessions, divergences = execute_sessions(REPLAY / name, runtime)
    assert len(sessions) == count
    assert divergences == []
    assert all(s["model"]["sha256"] == runtime.artifact.sha256 for s in sessions)
    assert all(len(s["output_ids"]) > 0 for s in sessions)


def test_a_changed_recording_is_reported_with_position_and_tokens(runtime, tmp_path):
    import json
    src = load_sessions(REPLAY / "greedy")[0]
    doc = {k: v for k, v in src.items() if k != "_path"}
    doc["output_ids"] = list(doc["output_ids"])
    doc["output_ids"][3] += 1
    (tmp_path / "s.json").write_text(json.dumps(doc))
    _, divergences = execute_sessions(tmp_path, runtime)
    assert len(divergences) == 1
    d = divergences[0]
    assert (d.what, d.position, d.recorded) == ("output", 3, src["output_ids"][3] + 1)
    assert d.replayed == src["output_ids"][3]


def test_cli_replay_execute_exits_zero_on_exact_replay():
    r = subprocess.run([sys.executable, "-m", "ninfer", "replay", "--execute",
                        str(REPLAY / "concurrent4")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "4 sessions, 0 divergences" in r.stdout


def test_a_session_the_api_ended_at_its_tool_call_replays_to_its_recorded_length(runtime,
                                                                              tmp_path):
    """A recording whose generation the API ended (finish_reason tool_calls: the one call
    that parallel_tool_calls false allows was complete) replays its recorded tokens exactly,
    not the longer output the engine alone would go on to write."""
    import json
    src = load_sessions(REPLAY / "greedy")[0]
    cut = max(1, len(src["output_ids"]) // 2)
    doc = {k: v for k, v in src.items() if k != "_path"}
    doc.update(output_ids=list(src["output_ids"])[:cut], finish_reason="tool_calls")
    (tmp_path / "s.json").write_text(json.dumps(doc))
    _, divergences = execute_sessions(tmp_path, runtime)
    assert divergences == []
    doc["finish_reason"] = "stop_token"   # the same cut otherwise is a divergence
    (tmp_path / "s.json").write_text(json.dumps(doc))
    _, divergences = execute_sessions(tmp_path, runtime)
    assert [d.position for d in divergences] == [cut]


def test_sessions_of_every_protocol_replay_their_recorded_prompt(runtime, tmp_path):
    """A Messages / Responses / completions session replays the prompt ids it recorded (its
    body reaches the template through its own adapter, which replay does not re-run); only a
    chat session's messages are rendered again (a difference is a prompt divergence; the
    recorded ids still run)."""
    import json
    src = load_sessions(REPLAY / "greedy")[0]
    doc = {k: v for k, v in src.items() if k != "_path"}
    doc.update(protocol="anthropic_messages", body={
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    (tmp_path / "s.json").write_text(json.dumps(doc))
    assert execute_sessions(tmp_path, runtime)[1] == []
    doc.update(protocol="openai_completions", body={"model": "m", "prompt": "Once upon"})
    (tmp_path / "s.json").write_text(json.dumps(doc))
    assert execute_sessions(tmp_path, runtime)[1] == []
    doc.update(protocol="openai_chat_completions", body={
        "model": "m", "messages": [{"role": "user", "content": "Something else entirely"}]})
    (tmp_path / "s.json").write_text(json.dumps(doc))
    (d,) = execute_sessions(tmp_path, runtime)[1]   # the prompt differs; the output replays
    assert d.what == "prompt" and d.recorded == src["prompt_ids"][d.position] != d.replayed
    # content parts are parsed as the chat route parses them (joined), then rendered
    doc["body"] = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Something"}, {"type": "text", "text": "else entirely"}]}]}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    (d,) = execute_sessions(tmp_path, runtime)[1]
    assert d.what == "prompt"
    (question,) = src["body"]["messages"]   # the fixture's one user message, as one part
    doc["body"] = src["body"] | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": question["content"]}]}]}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    assert execute_sessions(tmp_path, runtime)[1] == []
