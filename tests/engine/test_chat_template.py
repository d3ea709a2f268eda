"""Chat-template rendering: SmolLM2's ChatML, jinja environment details, OpenAI history shapes."""
from __future__ import annotations

import copy
import json
from datetime import datetime

import gguf
import pytest

from ninfer.engine.chat_template import ChatTemplate, TemplateError, normalize_messages

SMOL_DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                       "trained by Hugging Face<|im_end|>\n")

# A Qwen-style tool template (iterates arguments|items, prints tools with tojson).
TOOL_TEMPLATE = """
{%- if tools %}
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
{% endif %}
{%- for m in messages %}
<|im_start|>{{ m.role }}
{{ m.content }}
{%- if m.tool_calls is defined and m.tool_calls %}
{%- for tc in m.tool_calls %}
<tool_call>{{ tc.function.name }}(
{%- if tc.function.arguments is mapping %}
{%- for k, v in tc.function.arguments | items %}{{ k }}={{ v | tojson }};{% endfor %}
{%- else %}RAW:{{ tc.function.arguments }}{% endif %})</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def smol_source(smollm2_gguf):
    reader = gguf.GGUFReader(smollm2_gguf)
    return reader.fields["tokenizer.chat_template"].contents()


@pytest.fixture(scope="module")
def smol(smol_source):
    return ChatTemplate(smol_source, bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_smollm2_without_system(smol):
    msgs = [{"role": "user", "content": "Hi there"}]
    assert smol.render(msgs) == (SMOL_DEFAULT_SYSTEM + "<|im_start|>user\nHi there<|im_end|>\n"
                                 "<|im_start|>assistant\n")
    assert smol.render(msgs, add_generation_prompt=False) == (
        SMOL_DEFAULT_SYSTEM + "<|im_start|>user\nHi there<|im_end|>\n")


def test_smollm2_with_system_and_history(smol):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}]
    assert smol.render(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_smollm2_assistant_content_none(smol):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
    out = smol.render(msgs, add_generation_prompt=False)
    assert "None" not in out
    assert out.endswith("<|im_start|>assistant\n<|im_end|>\n")


def test_raise_exception_message():
    t = ChatTemplate("{% if messages[0].role != 'user' %}"
                     "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                     "{% endif %}ok")
    assert t.render([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(TemplateError) as ei:
        t.render([{"role": "assistant", "content": "a"}])
    assert str(ei.value) == ("the chat template refused the conversation: Conversation roles "
                             "must alternate user/assistant")
    # a failure inside the template names it once (the API's template_error message is this)
    t = ChatTemplate("{% for k, v in messages[0].content|items %}{% endfor %}")
    with pytest.raises(TemplateError) as ei:
        t.render([{"role": "user", "content": "x"}])
    assert str(ei.value).count("chat template") == 1


def test_tojson_no_html_escaping_and_key_order():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ 'é' | tojson }}")
    x = {"zeta": "<b>&'\"</b>", "alpha": [1, 2.5, None, True], "mid": {"y": 1, "b": 2}}
    out = t.render([], x=x)
    compact, pretty, uni = out.split("|")
    assert compact == json.dumps(x, ensure_ascii=False)
    assert "<b>&'" in compact and "\\u003c" not in compact
    assert compact.index("zeta") < compact.index("alpha") < compact.index("mid")
    assert pretty == json.dumps(x, ensure_ascii=False, indent=2)
    assert uni == '"é"'


def test_tool_call_history_with_none_content():
    t = ChatTemplate(TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "<w>",
                                               "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
            {"id": "c2", "type": "function", "function": {"name": "noargs", "arguments": ""}},
            {"id": "c3", "type": "function", "function": {"name": "bad", "arguments": "{oops"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    original = copy.deepcopy(messages)
    out = t.render(messages, tools=tools)
    assert "None" not in out
    assert messages == original  # the caller's history is not modified
    assert '<tool_call>get_weather(city="Paris";unit="C";)</tool_call>' in out
    assert "<tool_call>noargs()</tool_call>" in out
    assert "<tool_call>bad(RAW:{oops)</tool_call>" in out
    assert json.dumps(tools[0], ensure_ascii=False) in out
    assert out.endswith("<|im_start|>assistant\n")


def test_normalize_messages():
    msgs = [{"role": "assistant", "content": None, "tool_calls": []},
            {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": None}}]},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    out = normalize_messages(msgs)
    assert out[0] == {"role": "assistant", "content": ""}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert out[2] == msgs[2]
    assert msgs[0]["content"] is None


def test_strftime_now():
    t = ChatTemplate("Today: {{ strftime_now('%Y') }}")
    year = datetime.now().year
    assert t.render([]) in (f"Today: {year}", f"Today: {year + 1}")


def test_sandbox_blocks_dunder_access():
    for src in ("{{ ''.__class__.__mro__ }}",
                "{{ ''.__class__.__mro__[1].__subclasses__() }}",
                "{{ messages.__class__.__init__.__globals__ }}"):
        with pytest.raises(TemplateError, match="unsafe|sandbox"):
            ChatTemplate(src).render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set x = messages.append(1) %}").render([])  # immutable sandbox


def test_errors_become_template_errors():
    with pytest.raises(TemplateError, match="syntax"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(TemplateError, match="undefined"):
        ChatTemplate("{{ nope.attr }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 'a' + messages[0].content }}").render([{"role": "user", "content": None}])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 1 / 0 }}").render([])


def test_environment_options_and_variables():
    src = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}\n"
           "  {{ m.content }}\n{% endfor %}{{ bos_token }}|{{ eos_token }}|"
           "{{ enable_thinking }}|{{ tools | length if tools else 'none' }}"
           "{% generation %}G{% endgeneration %}")
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                   enable_thinking=False)
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it
    assert out == "  a\n<s>|</s>|False|noneG"
    assert t.render([], bos_token="[B]", enable_thinking=True).startswith("[B]|</s>|True")
