"""Byte-level BPE tokenizer built from GGUF-style vocabulary metadata (no network, ever).

``Tokenizer.from_dict`` takes the artifact's tokenizer dict (``model pre tokens token_types
merges bos_token_id eos_token_id pad_token_id unk_token_id add_bos_token``) and builds a HF
``tokenizers.Tokenizer``:

- model: ``BPE(vocab, merges, fuse_unk=False, byte_fallback=False)``;
- pre-tokenizer by ``pre``: ``smollm`` = Sequence([Digits(individual_digits=True),
  ByteLevel(add_prefix_space=False, use_regex=True)]); ``gpt2``/``default`` = ByteLevel only;
  ``qwen2``/``qwen35``/``llama-bpe`` = Split(regex, isolated) + ByteLevel(use_regex=False);
- decoder: ByteLevel; no post-processor (BOS is never added here);
- CONTROL tokens (type 3) are special added tokens, USER_DEFINED (type 4) non-special ones.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# texts at least this long are encoded with the GIL released (Tokenizer.encode)
RELEASE_GIL_CHARS = 1 << 15

# Control tokens that end a generation when the model emits them (besides eos_token_id).
END_OF_GENERATION = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>",
    "<end_of_turn>", "<|end|>", "<|return|>", "<|call|>", "<eos>", "<|END_OF_TURN_TOKEN|>",
})

_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                   r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerError(ValueError):
    """The tokenizer metadata cannot be turned into a tokenizer."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_CHAR_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return None, pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "gpt-2"):
        return None, byte_level
    patterns = {"qwen2": _QWEN2_PATTERN, "qwen35": _QWEN35_PATTERN, "llama-bpe": _LLAMA3_PATTERN,
                "llama3": _LLAMA3_PATTERN}
    if pre in patterns:
        normalizer = normalizers.NFC() if pre.startswith("qwen") else None
        return normalizer, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise TokenizerError(f"unsupported pre-tokenizer {pre!r} "
                         f"(supported: smollm, gpt2, qwen2, qwen35, llama-bpe)")


def _is_index(x) -> bool:
    """Whether ``x`` is an integer (a Python or NumPy one), not a bool."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, bool)


class Tokenizer:
    """Text <-> token ids for a byte-level BPE vocabulary.

    Attributes:
        bos_id / eos_id / pad_id / unk_id: token ids or None.
        add_bos: whether callers should prepend BOS to raw prompts (GGUF ``add_bos_token``);
            ``encode`` never adds it.
        stop_ids: frozenset of ids that end a generation (eos plus end-of-turn control tokens
            such as ``<|im_end|>`` / ``<|endoftext|>`` when present).
        vocab_size: number of token ids (len of the token list).
        special_ids: frozenset of CONTROL token ids (what ``skip_special`` drops).
    """

    def __init__(self, d: dict[str, Any]):
        model = d.get("model", "gpt2")
        if model != "gpt2":
            raise TokenizerError(f"unsupported tokenizer model {model!r} (only byte-level BPE "
                                 f"'gpt2' vocabularies are supported)")
        tokens: list[str] = list(d["tokens"])
        types: list[int] = list(d.get("token_types") or [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError(f"{len(tokens)} tokens but {len(types)} token types")
        self._tokens = tokens
        self._types = types
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []
        for m in d.get("merges") or []:
            left, sep, right = m.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed merge {m!r}")
            merges.append((left, right))
        self.vocab_size = len(tokens)
        for name in ("bos", "eos", "pad", "unk"):   # (a damaged file's id: refused here, once)
            tid = d.get(f"{name}_token_id")
            if tid is not None and not (_is_index(tid) and 0 <= tid < len(tokens)):
                raise TokenizerError(f"{name}_token_id {tid!r} is not a token id of this "
                                     f"{len(tokens)}-token vocabulary")
        self.bos_id = d.get("bos_token_id")
        self.eos_id = d.get("eos_token_id")
        self.pad_id = d.get("pad_token_id")
        self.unk_id = d.get("unk_token_id")
        self.add_bos = bool(d.get("add_bos_token", False))
        self.pre = d.get("pre", "gpt2")

        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                      byte_fallback=False))
        normalizer, pre_tok = _pre_tokenizer(self.pre)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == USER_DEFINED]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        self._tok = tok
        # Same tokenizer, but special tokens' text is tokenized as plain text.
        self._tok_plain = _HFTokenizer.from_str(tok.to_str())
        self._tok_plain.encode_special_tokens = True

        self.special_ids = frozenset(i for i, t in enumerate(types) if t == CONTROL)
        stops = {i for i in self.special_ids if tokens[i] in END_OF_GENERATION}
        if self.eos_id is not None:
            stops.add(int(self.eos_id))
        self.stop_ids = frozenset(stops)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Tokenizer":
        """Build from an artifact's tokenizer dict (see module docstring).

        Raises:
            TokenizerError (a ValueError): unsupported model/pre-tokenizer or malformed data.
        """
        return cls(d)

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added).

        Args:
            parse_special: when True, special-token text such as ``<|im_start|>`` becomes the
                special id; when False it is tokenized as ordinary text.
        """
        tok = self._tok if parse_special else self._tok_plain
        if len(text) >= RELEASE_GIL_CHARS:
            # the library's encode holds the GIL for the whole call (seconds for megabytes:
            # the event loop and the engine thread would stall); encode_batch releases it
            return tok.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str], parse_special: bool = True) -> list[list[int]]:
        """``encode`` over several texts (parallel inside the tokenizers library)."""
        tok = self._tok if parse_special else self._tok_plain
        return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD.

        Args:
            skip_special: drop CONTROL tokens (e.g. ``<|im_end|>``).
        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` contributes to decoded text (as the ByteLevel
        decoder maps it: byte-level symbols to bytes; other text as its UTF-8)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            s = self._tokens[token_id]
            try:
                b = bytes(_CHAR_TO_BYTE[c] for c in s)
            except KeyError:
                b = s.encode("utf-8")
            self._bytes_cache[token_id] = b
        return b

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for (the UTF-8 length of the
        longest token string): a text of more than ``n * max_token_bytes`` bytes has more
        than ``n`` tokens."""
        return max(len(s.encode("utf-8")) for s in self._tokens)

    def token_text(self, token_id: int) -> str:
        """Display text of one token (its bytes decoded, U+FFFD for partial UTF-8)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a CONTROL (special) token."""
        return token_id in self.special_ids

    def __len__(self) -> int:
        return self.vocab_size


def _incomplete_tail(buf: bytearray) -> int:
    """Length of a trailing incomplete UTF-8 sequence in ``buf`` that more bytes could complete
    (0 if the buffer ends on a character boundary or with bytes that can never be valid)."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        b = buf[n - back]
        if 0x80 <= b <= 0xBF:  # continuation byte: keep looking for the lead
            continue
        if 0xC2 <= b <= 0xDF:
            need = 2
        elif 0xE0 <= b <= 0xEF:
            need = 3
        elif 0xF0 <= b <= 0xF4:
            need = 4
        else:
            return 0
        return back if back < need else 0
    return 0


class IncrementalDetokenizer:
    """Streams text for a sequence of generated ids, never splitting a UTF-8 character.

    ``push(id)`` returns the newly complete text (possibly ""); ``flush()`` returns whatever
    remains (an unfinished character becomes U+FFFD). The concatenation of all pushes plus the
    flush equals ``tok.decode(all_ids, skip_special=skip_special)``.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = True):
        self.tok = tok
        self.skip_special = skip_special
        self._pending = bytearray()

    def push(self, token_id: int) -> str:
        """Add one token id; return the text that is now complete."""
        token_id = int(token_id)
        if not 0 <= token_id < self.tok.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.tok.vocab_size})")
        if self.skip_special and token_id in self.tok.special_ids:
            return ""
        self._pending += self.tok.token_bytes(token_id)
        hold = _incomplete_tail(self._pending)
        cut = len(self._pending) - hold
        if cut == 0:
            return ""
        out = bytes(self._pending[:cut]).decode("utf-8", errors="replace")
        del self._pending[:cut]
        return out

    def flush(self) -> str:
        """Return the held-back bytes (an unfinished character as U+FFFD) and reset."""
        out = bytes(self._pending).decode("utf-8", errors="replace")
        self._pending.clear()
        return out
