"""Volatile prompt spans (``api.volatile``) on the real request bodies Claude Code sent
(``tests/fixtures/agents``): the billing line that opens its system prompt differs between two
sessions of one user, and is dropped, so the second session reuses the first one's system
prompt and tools; ``--keep-volatile-spans`` serves it as sent, and the second session misses
nearly all of it."""
from __future__ import annotations

import json
from pathlib import Path

from ninfer.api.volatile import strip_system

FIX = Path(__file__).parents[1] / "fixtures" / "agents"
BILLING = "claude_code_billing_header"


def recorded(name: str) -> dict:
    return json.loads((FIX / f"claude-code-2.1.332-{name}.json").read_text())


def test_the_billing_line_is_what_sessions_differ_in_and_is_dropped():
    a, b = recorded("session-a-turn-1"), recorded("session-b-turn-1")
    line = a["system"][0]["text"]
    assert line.startswith("x-anthropic-billing-header: cc_version=2.1.332.")
    assert b["system"][0]["text"] != line                      # per session
    assert recorded("session-a-turn-2")["system"][0]["text"] == line   # stable within one
    assert a["system"][1:] == b["system"][1:] and a["tools"] == b["tools"]
    sa, names = strip_system(a)
    assert names == (BILLING,) and sa["system"] == a["system"][1:]
    assert len(a["system"]) == 3 and a["system"][0]["text"] == line   # the body is untouched
    assert strip_system(b)[0]["system"] == sa["system"]


def test_other_system_forms():
    line = "x-anthropic-billing-header: cc_version=2.1.332.573; cc_entrypoint=cli;"
    base = {"model": "m", "messages": []}
    assert strip_system({**base, "system": f"{line}\nBe brief."}) == (
        {**base, "system": "Be brief."}, (BILLING,))
    assert strip_system({**base, "system": line}) == (base, (BILLING,))
    assert strip_system({**base, "system": [{"type": "text", "text": line}]}) == (
        base, (BILLING,))
    for kept in (f"Be brief.\n{line}",                                  # not the first line
                 [{"type": "text", "text": line, "cache_control": {"type": "ephemeral"}}],
                 [{"type": "text", "text": f"{line} and more\nrules"}],    # not the line alone
                 5, [line], None):                                      # not well formed
        body = {**base, "system": kept}
        assert strip_system(body) == (body, ())
    assert strip_system(base) == (base, ())


async def test_a_second_session_reuses_the_first_sessions_system_prompt(server_factory,
                                                                       tmp_path):
    """Session a's first turn, then session b's, on one lane: b reuses everything the two
    prompts share (the system prompt, tools and the reminder before the user's words: the
    ceiling ``cache.lookup`` reports as ``shared_tokens``); with the spans kept, the prompts
    part inside their first line and b reuses only those few tokens. The log names the span dropped."""
    import trio

    a, b = recorded("session-a-turn-1"), recorded("session-b-turn-1")
    for keep in (False, True):
        log = tmp_path / f"keep-{keep}.jsonl"
        server, client = await server_factory(max_context=16384, max_concurrency=1,
                                              keep_volatile_spans=keep,
                                              request_log_jsonl=str(log))
        usage = []
        for body in (a, b):
            r = await client.post("/v1/messages", json={**body, "max_tokens": 1,
                                                        "stream": False})
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        records: list = []
        with trio.move_on_after(30):
            while len([r for r in records if r["kind"] == "cache.lookup"]) < 2:
                await trio.sleep(0.05)
                records = [json.loads(x) for x in log.read_text().splitlines() if x]
        received = [r for r in records if r["kind"] == "request.received"]
        lookup = [r for r in records if r["kind"] == "cache.lookup"][1]
        assert [r["volatile_spans"] for r in received] == [[] if keep else [BILLING]] * 2
        prompt = usage[1]["input_tokens"] + usage[1]["cache_read_input_tokens"]
        if keep:
            # (the prompts part inside the billing line: the template's opening and the line's
            # first words are all they share)
            assert usage[1]["cache_read_input_tokens"] == lookup["shared_tokens"] < 40
        else:
            assert lookup["cached_tokens"] == lookup["shared_tokens"] > 0.4 * prompt
            assert usage[1]["cache_read_input_tokens"] == lookup["cached_tokens"]
