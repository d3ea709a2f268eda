"""Tokenizer built from GGUF metadata vs transformers' own GGUF tokenizer, plus streaming
detokenization."""
from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path

import pytest

from ninfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from ninfer.store.gguf_import import import_gguf

FIXED_VECTORS = [  # models.md C.1 section 6
    ("Hello, we can use", [19556, 28, 392, 416, 722]),
    ("The capital of France is", [504, 3575, 282, 4649, 314]),
    ("Hello world! 123", [19556, 905, 17, 216, 33, 34, 35]),
    ("\n", [198]),
    ("  multiple   spaces", [216, 2701, 256, 5600]),
    ("Café déjà vu.", [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]),
]

_FIXED_STRINGS = [
    "", " ", "  ", "\t", "\n\n", " \n \t ", "a", "A", "hello", "Hello", "HELLO", "hElLo WoRlD",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "<|endoftext|>", "text<|endoftext|>more", "<|im_end|><|im_start|>", "<|im_start", "im_end|>",
    "<file_sep><filename>x.py<gh_stars>10", "<jupyter_code>print(1)<jupyter_output>1",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nprint(np.arange(10).reshape(2, 5))",
    "SELECT * FROM users WHERE id = 42;", "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b"}}',
    "3.14159265358979", "1,234,567.89", "0x1F 0b1010 0o777", "2024-01-31T12:34:56Z",
    "+1 (555) 123-4567", "100%", "$9.99", "1e-5", "v1.2.3-rc.4", "12345678901234567890",
    "日本語のテキスト", "中文测试，包含标点。", "한국어 문장입니다", "Привет, мир!", "Γειά σου Κόσμε",
    "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "Tiếng Việt có dấu",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "emoji 🎉 in 🚀 text ✨", "❤️", "a😀b",
    "don't won't I'll they're we've she'd it's", "DON'T I'LL", "O'Reilly's",
    "!!!???...", "—–-", "«quotes» “curly” ‘single’", "(parens) [brackets] {braces}",
    "a\tb\tc", "line1\nline2\r\nline3\r", "trailing spaces   ", "   leading", "mixed \t\n  ws",
    "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Windows\\System32",
    "naïve façade coöperate", "Ångström", "e\u0301 vs é", "ﬁ ligature", "Ｆｕｌｌｗｉｄｔｈ",
    "\u200b zero width", "\u00a0nbsp", "tab\u3000ideographic space",
]

_FRAGMENTS = [
    "the", "The", "quick", "BROWN", "fox", "jumps", "über", "naïve", "résumé", "straße",
    "0", "7", "42", "1999", "3.5", "-17", "1e9", "007",
    "日本", "東京", "漢字", "中文", "你好", "한국", "カタカナ", "ひらがな",
    "😀", "🎉", "🚀", "✨", "🤖", "👍🏽", "🇯🇵",
    "def", "return", "x+=1", "f(x)", "a[i]", "{}", "=>", "::", "->", "//", "/*", "*/", "#",
    "!", "?", ".", ",", ";", ":", "'", '"', "`", "~", "@", "$", "%", "^", "&", "*", "(", ")",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "system",
    "'s", "'t", "'re", "'ll", "'ve", "'m", "'d",
]
_SEPARATORS = ["", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\t\t", "    ", "\r\n", "_", "-"]


def generated_strings(n_random: int = 300, seed: int = 20240611) -> list[str]:
    """Deterministic mix of fixed edge cases, fragment combinations and random code points."""
    rng = random.Random(seed)
    out = list(_FIXED_STRINGS)
    for _ in range(n_random):
        parts = []
        for _ in range(rng.randint(1, 12)):
            parts.append(rng.choice(_FRAGMENTS))
            parts.append(rng.choice(_SEPARATORS))
        s = "".join(parts)
        if rng.random() < 0.3:
            s = s.upper() if rng.random() < 0.5 else s.title()
        out.append(s)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x3040, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F), (0x1F900, 0x1F9FF)]
    for _ in range(60):
        chars = []
        for _ in range(rng.randint(1, 20)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
            if rng.random() < 0.2:
                chars.append(rng.choice(" \n\t"))
        out.append("".join(chars))
    return out


_WS_RUN_BEFORE_NUMERIC = re.compile(r"\s\s\d")


def _diverges_from_transformers_gguf(s: str) -> bool:
    """Strings where transformers' GGUF tokenizer is known to differ from SmolLM2's real one.

    transformers' GGUF converter drops SmolLM2's ``Digits(individual_digits=True)`` step (it
    uses ByteLevel's GPT-2 regex alone). llama.cpp (first regex pass ``\\p{N}``) and SmolLM2's
    own tokenizer.json split every numeric character out first. Since the vocabulary has no
    merges involving ASCII digits, the two only disagree when (a) a numeric character follows a
    run of two or more whitespace characters (``\\s+(?!\\S)`` then sees the run end before a
    piece boundary, e.g. " \\n007" -> " \\n" | "0" ... vs " " | "\\n" | "007"), or (b) a
    non-ASCII numeric (², ½, Ⅻ, ①) is involved.
    """
    return bool(_WS_RUN_BEFORE_NUMERIC.search(s)) or any(
        ord(c) > 127 and unicodedata.category(c).startswith("N") for c in s)


STRINGS = generated_strings()
COMPARABLE = [s for s in STRINGS if not _diverges_from_transformers_gguf(s)]


@pytest.fixture(scope="module")
def tok_dict(smollm2_gguf):
    header, _ = import_gguf(smollm2_gguf)
    return header["tokenizer"]


@pytest.fixture(scope="module")
def tok(tok_dict):
    return Tokenizer.from_dict(tok_dict)


@pytest.fixture(scope="session")
def hf_tok(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    path = Path(smollm2_gguf)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_fixed_vectors(tok):
    for text, ids in FIXED_VECTORS:
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text


def test_a_long_text_takes_the_batch_path_with_the_same_ids(tok, monkeypatch):
    """Texts of ``RELEASE_GIL_CHARS`` or more go through the library's batch path (which
    releases the GIL); the ids are those of the single-text path, special tokens included."""
    from ninfer.engine import tokenizer as tk
    text = "".join(COMPARABLE) * (tk.RELEASE_GIL_CHARS // len("".join(COMPARABLE)) + 1)
    assert len(text) >= tk.RELEASE_GIL_CHARS
    batch_path = tok.encode(text)
    monkeypatch.setattr(tk, "RELEASE_GIL_CHARS", len(text) + 1)
    assert batch_path == tok.encode(text) and len(batch_path) > 1000
    assert tok.encode(text, parse_special=False) != batch_path   # "<|im_start|>" as text


def test_string_set_is_big_and_varied():
    assert len(COMPARABLE) >= 200
    joined = "".join(COMPARABLE)
    for needle in ("<|im_start|>", "😀", "日本", "\t", "\n\n", "   ", "42", "def"):
        assert needle in joined


@pytest.mark.slow
def test_ids_match_transformers_gguf_tokenizer(tok, hf_tok):
    mismatches = []
    for s in COMPARABLE:
        ours = tok.encode(s)
        theirs = hf_tok.encode(s, add_special_tokens=False)
        if ours != theirs:
            mismatches.append((s, ours, theirs))
    assert not mismatches, mismatches[:5]
    for text, ids in FIXED_VECTORS:
        assert hf_tok.encode(text, add_special_tokens=False) == ids


@pytest.mark.slow
def test_ids_match_transformers_with_smollm2_pre_tokenizer_on_all_strings(tok, hf_tok):
    """With transformers' GGUF tokenizer given SmolLM2's real pre-tokenizer (Digits, then
    ByteLevel) the vocab, merges, special tokens and decoding it read from the GGUF agree with
    ours on every generated string, including the ones excluded above."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    backend = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    diverging = [s for s in STRINGS if _diverges_from_transformers_gguf(s)]
    assert len(diverging) >= 20
    for s in STRINGS:
        assert tok.encode(s) == backend.encode(s, add_special_tokens=False).ids, s
    # and the exclusion is real: unpatched transformers differs on such strings
    assert hf_tok.encode(" \n007", add_special_tokens=False) != tok.encode(" \n007")


@pytest.mark.slow
def test_decode_matches_transformers(tok, hf_tok):
    for s in COMPARABLE[::3]:
        ids = tok.encode(s)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, skip_special=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_non_ascii_numerics_are_split_like_llama_cpp(tok):
    """smollm pre-tokenization splits every \\p{N} character on its own first (llama.cpp's
    first regex pass; SmolLM2's tokenizer.json Digits(individual_digits=True))."""
    for s in (" ²³ ½", "x² + y²", " ①②", " ٣٤٥", "Ⅻ"):
        pieces, cur = [], ""
        for c in s:
            if unicodedata.category(c).startswith("N"):
                if cur:
                    pieces.append(cur)
                pieces.append(c)
                cur = ""
            else:
                cur += c
        if cur:
            pieces.append(cur)
        assert tok.encode(s) == [i for p in pieces for i in tok.encode(p)], s
        assert tok.decode(tok.encode(s)) == s


def test_round_trip_all_strings(tok):
    for s in STRINGS:
        assert tok.decode(tok.encode(s)) == s, s


def test_special_tokens(tok):
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    plain = tok.encode("<|im_start|>user\nhi<|im_end|>", parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|endoftext|>", parse_special=False) != [0]
    assert tok.decode([1, 4093, 198, 6004, 2], skip_special=True) == "user\nhi"
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.pad_id == 2
    assert tok.stop_ids == frozenset({0, 2})
    assert tok.vocab_size == 49152
    assert tok.add_bos is False
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.token_text(19556) == "Hello"
    assert tok.token_text(28) == ","
    assert tok.token_bytes(216) == b" "
    assert tok.is_special(1) and not tok.is_special(19556)
    assert tok.encode_batch(["Hello, we can use", "\n"]) == [FIXED_VECTORS[0][1], [198]]


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError):
        tok.decode([49152])
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_unsupported_tokenizer_metadata(tok_dict):
    with pytest.raises(TokenizerError):
        Tokenizer.from_dict(dict(tok_dict, model="llama"))
    with pytest.raises(TokenizerError):
        Tokenizer.from_dict(dict(tok_dict, pre="no-such-pre"))


def test_other_pre_tokenizers_build():
    d = {"model": "gpt2", "tokens": ["a", "b", "ab", "Ġ", "Ġa", "1", "2"],
         "token_types": [1] * 7, "merges": ["a b", "Ġ a"], "eos_token_id": None}
    for pre in ("gpt2", "qwen2", "qwen35", "llama-bpe"):
        t = Tokenizer.from_dict(dict(d, pre=pre))
        assert t.encode("ab a") == [2, 4]
        assert t.decode([2, 4]) == "ab a"
    user = Tokenizer.from_dict(dict(d, pre="gpt2", token_types=[1, 1, 1, 1, 1, 1, 4]))
    assert user.encode("a2a") == [0, 6, 0]  # USER_DEFINED tokens are matched atomically
    assert user.stop_ids == frozenset()


# ------------------------------------------------------------------ incremental detokenizer

def _stream(tok, ids, skip_special):
    d = IncrementalDetokenizer(tok, skip_special=skip_special)
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_detokenizer_over_strings(tok, skip_special):
    for s in STRINGS:
        ids = tok.encode(s)
        full = tok.decode(ids, skip_special=skip_special)
        pieces = _stream(tok, ids, skip_special)
        assert "".join(pieces) == full, s
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), (s, pieces)


def test_incremental_detokenizer_holds_partial_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # split across byte-level tokens
    d = IncrementalDetokenizer(tok)
    outs = [d.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "😀"
    assert d.flush() == ""
    # an unfinished character at the end becomes one U+FFFD, like decode
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push(i) for i in ids[:-1]) == ""
    assert d.flush() == tok.decode(ids[:-1]) == "\ufffd"


def test_incremental_detokenizer_random_ids_match_decode(tok):
    """Arbitrary id sequences (invalid UTF-8 included) still concatenate to decode()."""
    rng = random.Random(7)
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1
                and tok.token_bytes(i)[0] >= 0x80]
    assert byte_ids
    for _ in range(300):
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), ids
