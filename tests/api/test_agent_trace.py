"""``bench/agent_trace.py`` on a fresh SmolLM2 server (and the tiny Qwen3.5 hybrid) with 2
lanes, CI-sized: every trace's reuse measured against its ceiling (what the numbers must be,
never how fast)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import agent_trace  # noqa: E402


async def test_agent_traces_reuse_their_ceiling(server_factory, smollm2_gguf, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=2, max_context=4096,
                                          request_log_jsonl=str(log))
    res = await agent_trace.replay(str(client.base_url), agent_trace.TRACES, scale=1, turns=4,
                                   tokenizer=str(smollm2_gguf), log=lambda *_: None)
    renderer = agent_trace.Renderer(str(smollm2_gguf))
    traces = agent_trace.make_traces(scale=1, turns=4)
    for name, got in res["traces"].items():
        rows, total = got["rows"], got["total"]
        for row, step in zip(rows, traces[name]):
            assert row["prefilled"] == row["prompt_tokens"] - row["reused"]
            if step.route == "chat":   # the ceiling's rendering is the server's
                assert row["prompt_tokens"] == len(renderer.ids(step))
        if name == "volatile-header":
            # Claude Code's billing line differs per session and is dropped: each later
            # session reuses the system prompt, far past the as-sent ceiling
            assert all(r["reused"] > 5 * r["ceiling"] for r in rows[1:]), rows
        else:
            assert total["reused"] >= 0.95 * total["ceiling"], (name, total)
        assert total["reused"] > 0.5 * total["prompt_tokens"], (name, total)
        # after its first turn no session prefills from zero (4 siblings on 2 lanes too)
        seen = set()
        for row in rows:
            assert row["session"] not in seen or row["reused"] >= row["ceiling"] > 0, row
            seen.add(row["session"])
    # the tool loop's turn 2 keeps lane 0's 200 tokens (its own session by the root digest)
    # instead of an empty lane and L2's 174-token image of the system prompt
    loop = res["traces"]["tool-loop"]["rows"]
    assert [r["reused"] for r in loop] == [r["ceiling"] for r in loop], loop
    server.state.bus.flush()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    looks = [r for r in recs if r["kind"] == "cache.lookup"][:len(loop)]
    assert [(r["lane"], r["source"]) for r in looks[1:]] == [(looks[0]["lane"], "l1")] * 3
    assert all(r["routed"] and r["session"] == "root" for r in looks[1:]), looks


async def test_rotation_with_auto_save_never_reprefills_a_session(server_factory, smollm2_gguf,
                                                                  tmp_path):
    # 4 sessions on 2 lanes, no L2: only the slot files auto-save writes keep them
    log = tmp_path / "log.jsonl"
    slots = tmp_path / "slots"
    slots.mkdir()
    server, client = await server_factory(max_concurrency=2, max_context=4096,
                                          continuation_cache="l1", slot_save_path=str(slots),
                                          auto_save_evicted=True, request_log_jsonl=str(log))
    res = await agent_trace.replay(str(client.base_url), ["rotation"], scale=1, turns=4,
                                   tokenizer=str(smollm2_gguf), log=lambda *_: None)
    rows = res["traces"]["rotation"]["rows"]
    assert len(rows) == 16
    # every turn after a session's first reuses all it shares with earlier requests: the
    # session's whole last prompt, restored from the file auto-save wrote when it was displaced
    later = rows[4:]
    assert all(r["reused"] == r["ceiling"] > 0 for r in later), later
    server.engine.spiller.flush()
    server.state.bus.flush()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    spills = [r for r in recs if r["kind"] == "slot.spilled"]
    # the first turns of sessions 2 and 3 displace sessions 0 and 1, and each restore before
    # turns 2-4 displaces the bound session it replaces
    assert len(spills) == 14, [(r["filename"], r["reason"]) for r in spills]
    assert sum(r["reason"] == "restored" for r in spills) == 12
    assert not [r for r in recs if r["kind"] == "slot.spill_failed"]


async def test_an_edit_older_than_the_last_turn_keeps_its_own_lane(server_factory, smollm2_gguf):
    # ring-edit's tool result of two turns back is cut: the prompt still carries the turns
    # after the one that opened lane 0 (its root-keyed session), so it cuts that lane back
    # rather than taking the empty one and L2's system prompt
    server, client = await server_factory(max_concurrency=2, max_context=4096)
    res = await agent_trace.replay(str(client.base_url), ["ring-edit"], scale=1, turns=4,
                                   tokenizer=str(smollm2_gguf), log=lambda *_: None)
    rows = res["traces"]["ring-edit"]["rows"]
    assert [r["reused"] for r in rows] == [r["ceiling"] for r in rows], rows


def _q35(gen, smollm2_gguf, out: Path, mtp: bool) -> Path:
    """The benchmark's tiny Qwen3.5 hybrid (``gen``: ``make_qwen35_gguf.py``'s module, its
    ``tiny`` shape; ``mtp``: with its MTP head) with SmolLM2's chat template, written to
    ``out``."""
    gen.write(str(out), "tiny", chat_template=gen.chat_template_of(str(smollm2_gguf)), mtp=mtp)
    return out


@pytest.fixture(scope="module")
def q35_gguf(bench_script, smollm2_gguf, tmp_path_factory):
    return _q35(bench_script("make_qwen35_gguf"), smollm2_gguf,
                tmp_path_factory.mktemp("q35") / "q35.gguf", mtp=False)


async def _replay_on(model: Path, backend, nursery, traces: list[str], **cfg) -> dict:
    """``traces`` replayed against a fresh ``ninfer serve model`` (2 lanes of 4,096 tokens and
    ``cfg``), CI-sized."""
    import httpx

    from ninfer.config import ServeConfig
    from ninfer.server import build_server, load_runtime, serve

    rt = load_runtime(str(model), backend)
    server = build_server(ServeConfig(model=str(model), port=0, backend=backend,
                                      max_concurrency=2, max_context=4096, **cfg), rt)
    binds = await nursery.start(serve, server)
    async with httpx.AsyncClient(base_url=binds[0], timeout=120) as client:
        return await agent_trace.replay(str(client.base_url), traces, scale=1, turns=4,
                                        tokenizer=str(model), log=lambda *_: None)


@pytest.mark.slow
async def test_speculative_sessions_reuse_what_plain_ones_do(bench_script, smollm2_gguf,
                                                             backend, nursery, tmp_path):
    # --spec mtp: a session that left its lane (siblings and mid-edit: L2; rotation: the slot
    # files auto-save writes) comes back with its MTP rows, so it is resumed, never prefilled
    # from zero again (before, only a lane's own frontier was)
    model = _q35(bench_script("make_qwen35_gguf"), smollm2_gguf, tmp_path / "q35mtp.gguf",
                 mtp=True)
    got, plain = [await _replay_on(model, backend, nursery, ["siblings", "mid-edit"],
                                   spec=spec, temperature=0.0) for spec in ("mtp", "none")]
    for name in ("siblings", "mid-edit"):
        reused = [r["reused"] for r in got["traces"][name]["rows"]]
        assert reused == [r["reused"] for r in plain["traces"][name]["rows"]], name
        total = got["traces"][name]["total"]
        assert total["reused"] >= 0.85 * total["ceiling"], (name, total)
    (tmp_path / "slots").mkdir()
    res = await _replay_on(model, backend, nursery, ["rotation"], spec="mtp", temperature=0.0,
                           continuation_cache="l1", slot_save_path=str(tmp_path / "slots"),
                           auto_save_evicted=True)
    later = res["traces"]["rotation"]["rows"][4:]
    assert all(r["reused"] >= r["ceiling"] - 32 and r["reused"] > 0 for r in later), later


@pytest.mark.slow
async def test_hybrid_edits_inside_older_messages_resume_at_their_boundary(q35_gguf, backend,
                                                                           nursery):
    # the ring on: each prefill also checkpoints where the request's last messages begin, so
    # mid-edit's trimmed tool result (older than the last turn) resumes at its message's start
    res = await _replay_on(q35_gguf, backend, nursery, ["mid-edit", "ring-edit"],
                           turn_checkpoints=32)
    edit = res["traces"]["mid-edit"]
    assert edit["total"]["reused"] >= 0.95 * edit["total"]["ceiling"], edit["total"]
    rows = edit["rows"]
    # turns 3 and 5 diverge inside the first tool result: at most its header is recomputed
    assert all(r["ceiling"] - 16 <= r["reused"] <= r["ceiling"] for r in (rows[3], rows[5]))
    ring = res["traces"]["ring-edit"]["total"]
    assert ring["reused"] >= 0.99 * ring["ceiling"], ring
