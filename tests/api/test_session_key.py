"""A chat-form request's session key (``api/session_key.py``): ``prompt_cache_key``, then
Anthropic's ``metadata.user_id``, else the conversation's root digest (reminders dropped)."""
from __future__ import annotations

from ninfer.api.messages_request import parse_messages_request
from ninfer.api.session_key import root_digest, session_key


def test_the_session_key_is_the_clients_else_the_conversations_root():
    system = {"role": "system", "content": "You are an agent."}
    first = {"role": "user", "content": "Fix the test.\n<system-reminder>turn 0</system-reminder>"}
    later = [system, {"role": "user", "content": "Fix the test."},
             {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "Go on.\n<system-reminder>turn 1</system-reminder>"}]
    # the first turn and the next share a root: the reminder moved on, the task stayed
    key, kind = session_key(None, None, [system, first], None)
    assert kind == "root" and key == session_key(None, None, later, None)[0]
    assert len(key) == 16 and int(key, 16) >= 0
    other = [system, {"role": "user", "content": "Write the docs."}]
    assert session_key(None, None, other, None)[0] != key          # a sibling's own root
    assert root_digest([system, first], [{"type": "function"}]) != key   # other tools
    # the client's own keys come first, and never equal a root digest
    pck, kind = session_key("conv-1", "user_x", later, None)
    assert kind == "prompt_cache_key" and pck not in (key, session_key(None, "conv-1", later,
                                                                       None)[0])
    uid, kind = session_key(None, "user_x_session_1", later, None)
    assert kind == "user_id" and uid != key
    assert session_key(None, None, [system], None) == ("", "")


def test_messages_metadata_user_id_is_the_session_key():
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with_id = parse_messages_request({**body, "metadata": {"user_id": "user_1_session_9"}})
    assert with_id.session_user == "user_1_session_9"
    assert parse_messages_request(body).session_user is None
    assert parse_messages_request({**body, "metadata": {"user_id": ""}}).session_user is None
