"""The per-request stderr line of a real server on SmolLM2: a chat request's line carries the
counts its response reports (prompt, reused, computed and generated tokens, finish), a second
turn's line the prefix it reused; ``--no-log-requests`` prints none."""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

LINE = re.compile(
    r"ninfer: request (?P<id>\S+) /v1/chat/completions lane (?P<lane>\d+): "
    r"prompt (?P<prompt>[\d,]+) tokens \((?P<reused>[\d,]+) reused: (?P<reuse>[a-z0-9_ ]+)\), "
    r"queued [\d.]+ ms, prefill (?P<prefill>[\d,]+) in [\d.]+ m?s \([\d,.]+ tok/s\), "
    r"first token [\d.]+ m?s, (?P<generated>[\d,]+) generated in [\d.]+ m?s "
    r"\([\d.,]+ tok/s\), total [\d.]+ m?s, (?P<finish>\w+)")
FINISH = {"length": "output_limit", "stop": "stop_token"}


def _int(text: str) -> int:
    return int(text.replace(",", ""))


async def _chat(server, client, messages: list, capsys) -> tuple[dict, list[str]]:
    """POST one greedy chat request; (its response, the request lines printed for it). The
    engine emits ``request.finished`` before it delivers the answer, so flushing the bus once
    the response is in dispatches it to the line sink."""
    r = await client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    server.bus.flush()
    err = capsys.readouterr().err
    return r.json(), [line for line in err.splitlines() if line.startswith("ninfer: request ")]


def _check(line: str, body: dict) -> re.Match:
    """``line`` names ``body``'s request and carries the counts its usage reports."""
    m = LINE.fullmatch(line)
    assert m, line
    usage = body["usage"]
    prompt, reused = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert m["id"] == body["id"]
    assert (_int(m["prompt"]), _int(m["reused"])) == (prompt, reused)
    assert _int(m["prefill"]) == prompt - reused
    assert _int(m["generated"]) == usage["completion_tokens"]
    assert m["finish"] == FINISH[body["choices"][0]["finish_reason"]]
    return m


async def test_each_chat_request_prints_its_line_and_a_second_turn_its_reuse(
        server_factory, capsys):
    server, client = await server_factory()
    assert server.config.log_requests is True   # (on by default)
    turn1 = [{"role": "user", "content": "Name three colours."}]
    body1, lines1 = await _chat(server, client, turn1, capsys)
    assert len(lines1) == 1
    m1 = _check(lines1[0], body1)
    assert (m1["reused"], m1["reuse"]) == ("0", "full_reset")
    answer = body1["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And three fruits?"}]
    body2, lines2 = await _chat(server, client, turn2, capsys)
    assert len(lines2) == 1
    m2 = _check(lines2[0], body2)
    # the second turn extends the first one's conversation on the lane that served it
    assert m2["lane"] == m1["lane"] and m2["reuse"].startswith("l1 ")
    assert _int(m2["reused"]) >= body1["usage"]["prompt_tokens"]


async def test_no_log_requests_prints_no_line(server_factory, capsys):
    server, client = await server_factory(log_requests=False)
    assert "request_lines" not in [s.name for s in server.bus.sinks]
    body, lines = await _chat(server, client, [{"role": "user", "content": "Hi"}], capsys)
    assert body["usage"]["completion_tokens"] >= 1 and lines == []
