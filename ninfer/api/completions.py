"""``POST /v1/completions``: OpenAI's legacy text completions over the chat path (the same
admission, engine, prefix reuse, events and error envelope; ``request.received`` protocol
``openai_completions``).

- Prompt: no chat template. A text is tokenized as is, special-token text included (``<|im_start|>``
  becomes its token, as llama.cpp's and vLLM's), with BOS first when the vocabulary asks for it
  on raw text (GGUF ``add_bos_token``, as llama.cpp's); token ids are used as given. Each
  prompt of a list gets ``n`` choices: choice index ``prompt_index * n + i`` (OpenAI, vLLM),
  seeds ``seed + i`` as on Chat.
- ``suffix``: fill-in-the-middle when the vocabulary has FIM tokens (``<|fim_prefix|>`` … or
  ``<fim_prefix>`` …): the prompt becomes ``PRE prompt SUF suffix MID`` (llama.cpp's
  ``format_infill`` order); else 400 ``suffix_not_supported`` (an empty suffix asks for
  nothing and is ignored).
- ``echo``: the prompt's text (a token prompt decoded) before the completion; ``max_tokens``
  0 (only with ``echo``) returns just that, with no engine request. ``echo`` with ``logprobs``
  is refused (``prompt_logprobs_not_supported``): the engine reports generated tokens only.
- ``logprobs`` k (0-5): the legacy shape ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, ``top_logprobs`` the k most likely tokens plus the sampled one (so up to
  k + 1, as OpenAI's); ``text_offset`` counts characters of the token strings from the start
  of the choice's text (the echoed prompt included).
- ``max_tokens``: OpenAI's default 16 (cut to what the context leaves); an explicit one past the
  context as on Chat (``ChatHandler._max_tokens``: clamped, ``client_clamped``, unless
  ``--strict-max-tokens``).
- ``usage`` sums the prompts (each counted once, whatever ``n``) and the choices; ``timings``
  as Chat's (llama.cpp), prompt figures summed over the prompts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import trio
from quart import g

from ..engine.requests import ErrorOutput, FinalOutput, Request, TokenOutput
from . import fields
from .chat import (_PROMPT_THREADS, ChatHandler, Choice, _engine_error, _sse, _timings, json_body,
                   next_output)
from .completions_request import DEFAULT_MAX_TOKENS, CompletionRequest, parse_completion_request
from .errors import ApiError

FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


@dataclass
class CompletionChoice(Choice):
    """A choice with its echoed prompt text and the ``text_offset`` of its next token."""
    prefix: str = ""
    offset: int = 0


def fim_ids(tok) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) FIM token ids of the vocabulary, or None."""
    for names in FIM_TOKENS:
        ids = [tok.encode(s) for s in names]
        if all(len(x) == 1 and tok.decode(x) == s for x, s in zip(ids, names)):
            return tuple(x[0] for x in ids)
    return None


def _legacy_logprobs(entries: list, offset: int) -> tuple[dict, int]:
    """The legacy logprobs object of ``entries`` (``(token, logprob, {token: logprob})``), the
    first token at ``offset`` characters; returns it and the offset after the last token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        out["tokens"].append(token)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


def _usage(groups: list[list[Choice]]) -> dict:
    prompt = sum(g[0].final.prompt_tokens for g in groups)
    completion = sum(c.final.completion_tokens for g in groups for c in g)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # n > 1: a prompt's choices may reuse different prefixes; never over-report
            "prompt_tokens_details": {"cached_tokens": sum(
                min(c.final.cached_tokens for c in g) for g in groups)}}


def _all_timings(groups: list[list[Choice]]) -> dict:
    """Chat's ``timings`` over every choice, the prompt figures summed over the prompts."""
    out = _timings([c.final for g in groups for c in g])
    if len(groups) > 1:
        firsts = [g[0].final for g in groups]
        out["prompt_n"] = sum(f.prompt_tokens - f.cached_tokens for f in firsts)
        prefill_s = sum(f.timings["prefill_s"] for f in firsts)
        out["prompt_ms"] = prefill_s * 1000.0
        out.pop("prompt_per_second", None)
        if prefill_s > 0:
            out["prompt_per_second"] = out["prompt_n"] / prefill_s
        cache_n = sum(f.cached_tokens for f in firsts)
        out.pop("cache_n", None)
        if cache_n:
            out["cache_n"] = cache_n
    return out


class CompletionsHandler(ChatHandler):
    """Serves ``/v1/completions`` for one ServerState (module docstring)."""

    protocol = "openai_completions"
    id_prefix = "cmpl-"
    prompt_param = "prompt"

    def __init__(self, state, admission: ChatHandler | None = None):
        super().__init__(state, admission)
        self.fim = fim_ids(state.tokenizer)

    def _parse(self, body) -> CompletionRequest:
        return parse_completion_request(body)

    def _tokenize(self, creq: CompletionRequest) -> list[tuple[list[int], str]]:
        """(prompt ids, echo text) per prompt (on a worker thread).

        Raises:
            ApiError: 400 ``context_length_exceeded`` (more text than the context could hold),
                ``invalid_value`` (a token id outside the vocabulary, an empty prompt).
        """
        state, tok = self.state, self.state.tokenizer
        out = []
        for p, prompt in enumerate(creq.prompts):
            param = "prompt" if len(creq.prompts) == 1 else f"prompt[{p}]"
            if isinstance(prompt, str):
                n_bytes = len(prompt.encode("utf-8")) + len((creq.suffix or "").encode("utf-8"))
                if n_bytes > state.n_ctx * tok.max_token_bytes:
                    raise ApiError(400, f"the prompt is {n_bytes} bytes of text, more than the "
                                   f"context window of {state.n_ctx} tokens can hold",
                                   "context_length_exceeded", param,
                                   {"n_prompt_bytes": n_bytes, "n_ctx": state.n_ctx})
                ids, text = tok.encode(prompt), prompt
            else:
                bad = next((t for t in prompt if t >= tok.vocab_size), None)
                if bad is not None:
                    raise ApiError(400, f"token id {bad} is not in the vocabulary (0 to "
                                   f"{tok.vocab_size - 1})", "invalid_value", param)
                ids, text = list(prompt), tok.decode(prompt)
            if creq.suffix and self.fim is not None:
                pre, suf, mid = self.fim
                ids = [pre, *ids, suf, *tok.encode(creq.suffix), mid]
            if isinstance(prompt, str) and tok.add_bos and tok.bos_id is not None:
                ids = [int(tok.bos_id), *ids]
            if not ids:
                raise ApiError(400, "the prompt is empty (no tokens)", "invalid_value", param)
            out.append((ids, text))
        return out

    def _output_cap(self, creq: CompletionRequest, n_prompt: int, param: str) -> tuple[int, str]:
        """(max_tokens, its source) for a prompt of ``n_prompt`` tokens: Chat's rule
        (``ChatHandler._max_tokens``), OpenAI's default of 16 when the client gave none.

        Raises:
            ApiError: 400 ``context_length_exceeded`` naming ``param``.
        """
        try:
            cap, source = self._max_tokens(creq.max_tokens, n_prompt)
        except ApiError as exc:
            exc.param = param
            raise
        if creq.max_tokens is None:
            cap = min(DEFAULT_MAX_TOKENS, self.state.n_ctx - n_prompt)
        return cap, source

    async def _prepare(self, rid: str, deadline: float, reserve):
        state, cfg = self.state, self.state.config
        body = await json_body()
        with fields.field_policy(cfg.strict_request_fields) as policy:
            creq = self._parse(body)
            self._check_model(creq)
        g.ignored_fields = policy.names()   # the response header (app)
        if creq.suffix and self.fim is None:
            raise ApiError(400, "'suffix' (fill-in-the-middle) needs a model whose vocabulary "
                           "has FIM tokens; this one has none", "suffix_not_supported",
                           "suffix")
        prompts = await trio.to_thread.run_sync(self._tokenize, creq, limiter=_PROMPT_THREADS)
        caps = [self._output_cap(creq, len(ids), "prompt" if len(prompts) == 1 else
                                 f"prompt[{p}]") for p, (ids, _) in enumerate(prompts)]
        seed = self._seed(creq)
        reserve(len(prompts) * creq.n)
        send, recv = trio.open_memory_channel(math.inf)
        choices = []
        for p, ((ids, text), (max_tokens, source)) in enumerate(zip(prompts, caps)):
            for i in range(creq.n):
                index = p * creq.n + i
                c = CompletionChoice(index, None, body, prefix=text if creq.echo else "",
                                     offset=len(text) if creq.echo else 0)
                choices.append(c)
                if max_tokens == 0:   # echo only: nothing to generate
                    c.final = FinalOutput("length", "output_limit", "", -1, len(ids), 0, 0, {})
                    continue
                params = self._sampling(creq, seed + i)
                c.ereq = Request(
                    request_id=rid if len(prompts) * creq.n == 1 else f"{rid}-{index}",
                    prompt_ids=ids, params=params, max_tokens=max_tokens,
                    deliver=lambda item, k=index: send.send_nowait((k, item)),
                    stop=creq.stop, protocol=self.protocol, model=state.model_id,
                    stream=creq.stream, message_count=1, max_tokens_source=source,
                    deadline=deadline, logprobs=creq.logprobs,
                    http_request_id=g.get("request_id", ""),
                    ignored_fields=tuple(policy.names()))
        for c in choices:
            if c.ereq is not None:
                state.engine.submit(c.ereq)
        return body, creq, choices, send, recv

    def _logprob_entries(self, item: TokenOutput) -> list[tuple]:
        tok = self.state.tokenizer
        token = tok.decode([item.token_id])
        top = {tok.decode([t]): lp for t, lp in item.top_logprobs}
        top.setdefault(token, item.logprob)   # the sampled token is always there (OpenAI)
        return [(token, item.logprob, top)]

    @staticmethod
    def _groups(creq: CompletionRequest, choices: list) -> list[list[Choice]]:
        return [choices[k:k + creq.n] for k in range(0, len(choices), creq.n)]

    def _tail(self, creq: CompletionRequest, choices: list) -> dict:
        """``usage``, and ``timings`` / ``id_slot`` unless nothing was generated."""
        groups = self._groups(creq, choices)
        out = {"usage": _usage(groups)}
        if choices[0].ereq is not None:
            out.update(timings=_all_timings(groups), id_slot=choices[0].final.lane)
        return out

    async def _collect(self, creq, body, choices, recv, base):
        await self._receive_all(choices, recv)
        out = []
        for c in choices:
            lp = _legacy_logprobs(c.logprobs, c.offset)[0] if creq.logprobs is not None \
                else None
            out.append({"text": c.prefix + "".join(c.parts), "index": c.index, "logprobs": lp,
                        "finish_reason": c.finish_reason})
        return {**base, "object": "text_completion", "choices": out,
                **self._tail(creq, choices)}

    async def _stream(self, creq, body, choices, recv, base, release):
        chunk = {**base, "object": "text_completion"}
        extra = {"usage": None} if creq.include_usage else {}
        ping_s = self.state.config.sse_ping_interval_s

        def piece(c: CompletionChoice, text: str, entries=(), finish=None, **more) -> str:
            lp = None
            if entries:
                lp, c.offset = _legacy_logprobs(entries, c.offset)
            return _sse({**chunk, "choices": [{"text": text, "index": c.index, "logprobs": lp,
                                               "finish_reason": finish}], **extra, **more})

        try:
            # the echoed prompts (or an empty opening chunk each); echo-only choices end here
            yield "".join(piece(c, c.prefix) + (piece(c, "", finish=c.finish_reason)
                                                if c.done else "") for c in choices)
            async with recv:
                while not all(c.done for c in choices):
                    got = await next_output(recv, ping_s)
                    if got is None:
                        yield ": ping\n\n"
                        continue
                    i, item = got
                    c = choices[i]
                    n_lp = len(c.logprobs)
                    text = self._absorb(c, item)
                    if isinstance(item, TokenOutput):
                        if text or c.logprobs[n_lp:]:
                            yield piece(c, text, c.logprobs[n_lp:])
                    elif isinstance(item, FinalOutput):
                        more = {"timings": _timings([item]), "id_slot": item.lane}
                        yield (piece(c, text) if text else "") + piece(
                            c, "", finish=c.finish_reason, **more)
                    elif isinstance(item, ErrorOutput):
                        yield _sse(_engine_error(item).body())
                        return
            if creq.include_usage:
                yield _sse({**chunk, "choices": [], **self._tail(creq, choices)})
            yield "data: [DONE]\n\n"
        finally:
            self._cancel_unfinished(choices)
            release()
