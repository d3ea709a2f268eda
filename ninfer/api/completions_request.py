"""Validation of ``POST /v1/completions`` bodies (OpenAI's legacy completions) into a typed
``CompletionRequest``.

Same rules as Chat (``chat_request``): a closed list of fields (an unknown one is handled by the
request's field policy, ``check_fields``), wrong types and out-of-range values are 400
``invalid_value`` naming the parameter, known but unsupported values have their own codes:
``best_of`` other than ``n`` (``best_of_not_supported``: no server-side ranking), ``logit_bias``
(``logit_bias_not_supported``), ``echo`` with ``logprobs`` (``prompt_logprobs_not_supported``:
the engine reports the log-probabilities of generated tokens only). ``suffix`` is checked
against the model's vocabulary by the handler (``suffix_not_supported``).
Source of the wire format: OpenAI's API reference ("Completions", legacy) and vLLM's
``CompletionRequest``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .chat_request import MAX_N
from .validation import (boolean_field, check_fields, echo_only_fields, integer_field, invalid,
                         number_field, object_field, positive_top_p)

KNOWN_FIELDS = {
    "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty",
    "best_of", "logit_bias", "user", "seed", "metadata", "service_tier", "store",
    # vLLM's / llama.cpp's sampling extensions, as on Chat
    "top_k", "min_p", "repetition_penalty", "ignore_eos",
}
MAX_LOGPROBS = 5          # OpenAI's limit on the legacy endpoint
DEFAULT_MAX_TOKENS = 16   # OpenAI's default on the legacy endpoint


@dataclass(slots=True)
class CompletionRequest:
    """A validated completion request.

    ``prompts``: one entry per prompt, each a text (tokenized as is, no chat template) or a
    list of token ids; each prompt gets ``n`` choices (choice index ``prompt_index * n + i``).
    ``max_tokens``: None when the client left it out (OpenAI's default, 16, then applies).
    """
    model: str | None
    prompts: list
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: tuple
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False


def _token_ids(v, path: str) -> list[int] | None:
    """``v`` as a list of token ids (non-negative integers), None when it is not a list of
    integers at all."""
    if not isinstance(v, list) or not v or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    if any(t < 0 for t in v):
        raise invalid("token ids must be non-negative integers", path)
    return list(v)


def _prompts(raw) -> list:
    """``prompt`` as a list of prompts: a string, an array of strings, an array of token ids, or
    an array of arrays of token ids (token ids out of the vocabulary are the handler's to
    refuse)."""
    if raw is None:
        raise invalid("'prompt' is required", "prompt")
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        ids = _token_ids(raw, "prompt")
        if ids is not None:
            return [ids]
        if all(isinstance(p, str) for p in raw):
            return list(raw)
        if all(isinstance(p, list) for p in raw):
            out = []
            for i, p in enumerate(raw):
                ids = _token_ids(p, f"prompt[{i}]")
                if ids is None:
                    raise invalid("each prompt of an array of token-id arrays must be a non-empty "
                               "array of integers", f"prompt[{i}]")
                out.append(ids)
            return out
    raise invalid("'prompt' must be a string, an array of strings, an array of token ids or an "
               "array of arrays of token ids (none empty)", "prompt")


def _stop(raw) -> tuple:
    """``stop`` (a string or up to 16 strings, as on Chat) as a tuple of non-empty strings."""
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        if len(raw) > 16:
            raise invalid("at most 16 stop strings", "stop")
        return tuple(s for s in raw if s)
    raise invalid("'stop' must be a string or an array of strings", "stop")


def parse_completion_request(body) -> CompletionRequest:
    """Validate a decoded JSON body.

    Raises:
        ApiError: 400 with a stable code / param for every client mistake.
    """
    check_fields(body, KNOWN_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    prompts = _prompts(body.get("prompt"))
    n = integer_field(body, "n", 1, MAX_N) or 1
    best_of = integer_field(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of < n:
        raise invalid(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of is not None and best_of != n:
        raise invalid("'best_of' greater than 'n' is not supported (no server-side ranking of "
                   "choices); ask for n choices and compare their logprobs", "best_of",
                   "best_of_not_supported")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("'echo' must be a boolean", "echo")
    logprobs = integer_field(body, "logprobs", 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise invalid("'echo' with 'logprobs' is not supported: the engine reports the "
                   "log-probabilities of generated tokens, not of the prompt's",
                   "logprobs", "prompt_logprobs_not_supported")
    max_tokens = integer_field(body, "max_tokens", 0, 2 ** 31 - 1)
    if max_tokens == 0 and not echo:
        raise invalid("'max_tokens' 0 is only allowed with 'echo': true (it returns the prompt)",
                   "max_tokens")
    if body.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias is not supported", "logit_bias", "logit_bias_not_supported")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise invalid("'suffix' must be a string", "suffix")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    so = object_field(body.get("stream_options"), "stream_options", ("include_usage",))
    if so is not None and stream is not True:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = (so or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("'stream_options.include_usage' must be a boolean",
                   "stream_options.include_usage")
    echo_only_fields(body)   # user, metadata, service_tier, store: as on Chat
    repetition = number_field(body, "repetition_penalty", 0.01, 10.0)
    return CompletionRequest(
        model=model, prompts=prompts, max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 0.0, 2.0), top_p=positive_top_p(body),
        top_k=integer_field(body, "top_k", 0, 2 ** 31 - 1),
        min_p=number_field(body, "min_p", 0.0, 1.0),
        seed=integer_field(body, "seed", 0, 2 ** 64 - 1), stop=_stop(body.get("stop")),
        stream=stream, include_usage=include_usage, n=n, echo=bool(echo), logprobs=logprobs,
        suffix=suffix, presence_penalty=number_field(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=number_field(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition,
        ignore_eos=bool(boolean_field(body, "ignore_eos")))
