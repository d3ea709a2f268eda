"""The prompts of a legacy completion as token ids: no chat template; text tokenized as is
(special-token text included, as llama.cpp's and vLLM's), BOS first when the vocabulary asks
for it on raw text (GGUF ``add_bos_token``); token ids used as given; ``suffix`` as
fill-in-the-middle (``PRE prompt SUF suffix MID``, llama.cpp's ``format_infill`` order)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .completions_request import CompletionRequest
from .errors import ApiError
from .prompt import prompt_too_long

FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


class FimTokens(NamedTuple):
    """The fill-in-the-middle token ids of a vocabulary."""
    prefix: int
    suffix: int
    middle: int


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """One prompt of a request: its token ids, and its text (echoed with ``echo``)."""
    ids: list
    text: str


def fim_ids(tok) -> FimTokens | None:
    """The FIM token ids of the vocabulary, or None when it has none."""
    for names in FIM_TOKENS:
        ids = [tok.encode(s) for s in names]
        if all(len(x) == 1 and tok.decode(x) == s for x, s in zip(ids, names)):
            return FimTokens(*(x[0] for x in ids))
    return None


def prompt_param(creq: CompletionRequest, p: int) -> str:
    """The parameter an error of prompt ``p`` names (``prompt`` or ``prompt[p]``)."""
    return "prompt" if len(creq.prompts) == 1 else f"prompt[{p}]"


def tokenize_prompts(tok, n_ctx: int, creq: CompletionRequest,
                     fim: FimTokens | None) -> list[CompletionPrompt]:
    """Every prompt of ``creq`` as token ids (run on a worker thread).

    Raises:
        ApiError: 400 ``context_length_exceeded`` (more text than the context could hold),
            ``invalid_value`` (a token id outside the vocabulary, an empty prompt).
    """
    out = []
    for p, prompt in enumerate(creq.prompts):
        param = prompt_param(creq, p)
        if isinstance(prompt, str):
            n_bytes = len(prompt.encode("utf-8")) + len((creq.suffix or "").encode("utf-8"))
            if n_bytes > n_ctx * tok.max_token_bytes:
                raise prompt_too_long(n_bytes, n_ctx, param)
            ids, text = tok.encode(prompt), prompt
        else:
            bad = next((t for t in prompt if t >= tok.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is not in the vocabulary (0 to "
                               f"{tok.vocab_size - 1})", "invalid_value", param)
            ids, text = list(prompt), tok.decode(prompt)
        if creq.suffix and fim is not None:
            ids = [fim.prefix, *ids, fim.suffix, *tok.encode(creq.suffix), fim.middle]
        if isinstance(prompt, str) and tok.add_bos and tok.bos_id is not None:
            ids = [int(tok.bos_id), *ids]
        if not ids:
            raise ApiError(400, "the prompt is empty (no tokens)", "invalid_value", param)
        out.append(CompletionPrompt(ids=ids, text=text))
    return out
