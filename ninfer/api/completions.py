"""``POST /v1/completions``: OpenAI's legacy text completions (``request.received`` protocol
``openai_completions``; the same admission, engine, prefix reuse, events and error envelope as
chat).

- Prompts: ``completion_prompts`` (no chat template; ``suffix`` as fill-in-the-middle when the
  vocabulary has FIM tokens, else 400 ``suffix_not_supported``; an empty suffix asks for
  nothing and is ignored). Each prompt of a list gets ``n`` choices: choice index
  ``prompt_index * n + i`` (OpenAI, vLLM), seeds ``seed + i`` as on Chat.
- ``echo``: the prompt's text (a token prompt decoded) before the completion; ``max_tokens``
  0 (only with ``echo``) returns just that, with no engine request. ``echo`` with ``logprobs``
  is refused (``prompt_logprobs_not_supported``): the engine reports generated tokens only.
- ``logprobs`` k (0-5): the legacy shape ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, ``top_logprobs`` the k most likely tokens plus the sampled one (so up to
  k + 1, as OpenAI's); ``text_offset`` counts characters of the token strings from the start
  of the choice's text (the echoed prompt included).
- ``max_tokens``: OpenAI's default 16 (cut to what the context leaves); an explicit one past the
  context as on Chat (``admission.output_cap``: clamped, ``client_clamped``, unless
  ``--strict-max-tokens``).
- ``usage`` sums the prompts (each counted once, whatever ``n``) and the choices; ``timings``
  as Chat's (llama.cpp), prompt figures summed over the prompts.
"""
from __future__ import annotations

from dataclasses import dataclass

import trio
from quart import g

from ..engine.requests import ErrorOutput, FinalOutput, Request, TokenOutput
from .admission import Admission, output_cap, request_seed, sampling_params
from .breakpoints import with_siblings
from .completion_prompts import (CompletionPrompt, fim_ids, prompt_param, tokenize_prompts)
from .completions_request import DEFAULT_MAX_TOKENS, CompletionRequest, parse_completion_request
from .errors import ApiError, model_not_found
from .generation import Choice, Generation, engine_error
from .pipeline import AdmittedProtocol
from .prompt import PROMPT_THREADS
from .request_body import field_scope, json_body
from .streaming import SSE_PING, next_output, sse_data
from .timings import llama_timings


@dataclass
class CompletionChoice(Choice):
    """A choice with its echoed prompt text and the ``text_offset`` of its next token."""
    prefix: str = ""
    offset: int = 0


@dataclass(frozen=True, slots=True)
class LegacyLogprob:
    """One generated token's logprob and the most likely tokens at its place."""
    token: str
    logprob: float
    top: dict   # token text -> logprob


def legacy_logprobs(entries: list[LegacyLogprob], offset: int) -> dict:
    """The legacy logprobs object of ``entries``, the first token at ``offset`` characters."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.token)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(e.top)
        out["text_offset"].append(offset)
        offset += len(e.token)
    return out


def _by_prompt(creq: CompletionRequest, choices: list) -> list[list[Choice]]:
    """The choices grouped by prompt (``n`` each)."""
    return [choices[k:k + creq.n] for k in range(0, len(choices), creq.n)]


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
    out = llama_timings([c.final for g in groups for c in g])
    if len(groups) > 1:
        firsts = [g[0].final for g in groups]
        out["prompt_n"] = sum(f.prompt_tokens - f.cached_tokens for f in firsts)
        prefill_s = sum(f.timings["prefill_compute_s"] for f in firsts)
        out["prompt_ms"] = prefill_s * 1000.0
        out.pop("prompt_per_second", None)
        if prefill_s > 0:
            out["prompt_per_second"] = out["prompt_n"] / prefill_s
        cache_n = sum(f.cached_tokens for f in firsts)
        out.pop("cache_n", None)
        if cache_n:
            out["cache_n"] = cache_n
    return out


class CompletionsHandler(AdmittedProtocol):
    """Serves ``/v1/completions`` for one ServerState (module docstring)."""

    protocol = "openai_completions"
    id_prefix = "cmpl-"

    def __init__(self, state, admission: Admission | None = None):
        super().__init__(state, admission)
        self.fim = fim_ids(state.tokenizer)

    def tokenize(self, creq: CompletionRequest) -> list[CompletionPrompt]:
        """``completion_prompts.tokenize_prompts`` with this server's vocabulary."""
        return tokenize_prompts(self.state.tokenizer, self.state.n_ctx, creq, self.fim)

    def _logprob_entries(self, item: TokenOutput) -> list[LegacyLogprob]:
        tok = self.state.tokenizer
        token = tok.decode([item.token_id])
        top = {tok.decode([t]): lp for t, lp in item.top_logprobs}
        top.setdefault(token, item.logprob)   # the sampled token is always there (OpenAI)
        return [LegacyLogprob(token=token, logprob=item.logprob, top=top)]

    async def prepare(self, rid: str, ticket) -> Generation:
        state, cfg = self.state, self.state.config
        body = await json_body()
        with field_scope(cfg) as policy:
            creq = parse_completion_request(body)
            if creq.model is not None and creq.model != state.model_id:
                raise model_not_found(creq.model, state.model_id)
        if creq.suffix and self.fim is None:
            raise ApiError(400, "'suffix' (fill-in-the-middle) needs a model whose vocabulary "
                           "has FIM tokens; this one has none", "suffix_not_supported",
                           "suffix")
        prompts = await trio.to_thread.run_sync(self.tokenize, creq, limiter=PROMPT_THREADS)
        caps = [output_cap(state, creq.max_tokens, len(p.ids), prompt_param(creq, k),
                           default=DEFAULT_MAX_TOKENS) for k, p in enumerate(prompts)]
        seed = request_seed(cfg, creq)
        ticket.reserve_choices(creq.n, len(prompts))
        gen = Generation(state, body, creq, self._logprob_entries)
        for p, (prompt, cap) in enumerate(zip(prompts, caps)):
            for i in range(creq.n):
                index = p * creq.n + i
                c = CompletionChoice(index=index, ereq=None,
                                     prefix=prompt.text if creq.echo else "",
                                     offset=len(prompt.text) if creq.echo else 0)
                gen.choices.append(c)
                if cap.max_tokens == 0:   # echo only: nothing to generate
                    c.final = FinalOutput(finish_reason="length", engine_reason="output_limit",
                                          text="", lane=-1, prompt_tokens=len(prompt.ids),
                                          cached_tokens=0, completion_tokens=0, timings={})
                    continue
                c.ereq = Request(
                    request_id=rid if len(prompts) * creq.n == 1 else f"{rid}-{index}",
                    prompt_ids=prompt.ids, params=sampling_params(cfg, creq, seed + i),
                    max_tokens=cap.max_tokens, deliver=gen.deliver_to(index), stop=creq.stop,
                    protocol=self.protocol, model=state.model_id, stream=creq.stream,
                    message_count=1, max_tokens_source=cap.source,
                    deadline=ticket.deadline if index == 0 else None,
                    logprobs=creq.logprobs, http_request_id=g.get("request_id", ""),
                    publish_at=with_siblings((), len(prompt.ids), creq.n),
                    ignored_fields=tuple(policy.names()), ignore_eos=creq.ignore_eos)
        gen.submit()
        return gen

    def _tail(self, creq: CompletionRequest, choices: list) -> dict:
        """``usage``, and ``timings`` / ``id_slot`` unless nothing was generated."""
        groups = _by_prompt(creq, choices)
        out = {"usage": _usage(groups)}
        if choices[0].ereq is not None:
            out.update(timings=_all_timings(groups), id_slot=choices[0].final.lane)
        return out

    async def collect(self, gen: Generation, base: dict) -> dict:
        await gen.receive_all()
        creq, out = gen.request, []
        for c in gen.choices:
            lp = legacy_logprobs(c.logprobs, c.offset) if creq.logprobs is not None else None
            out.append({"text": c.prefix + "".join(c.parts), "index": c.index, "logprobs": lp,
                        "finish_reason": c.finish_reason})
        return {**base, "object": "text_completion", "choices": out,
                **self._tail(creq, gen.choices)}

    async def stream(self, gen: Generation, base: dict):
        creq, choices = gen.request, gen.choices
        chunk = {**base, "object": "text_completion"}
        extra = {"usage": None} if creq.include_usage else {}
        ping_s = self.state.config.sse_ping_interval_s

        def piece(c: CompletionChoice, text: str, entries=(), finish=None, **more) -> str:
            lp = None
            if entries:
                lp = legacy_logprobs(entries, c.offset)
                c.offset += sum(len(e.token) for e in entries)
            return sse_data({**chunk, "choices": [{"text": text, "index": c.index,
                                                   "logprobs": lp, "finish_reason": finish}],
                             **extra, **more})

        # the echoed prompts (or an empty opening chunk each); echo-only choices end here
        yield "".join(piece(c, c.prefix) + (piece(c, "", finish=c.finish_reason)
                                            if c.done else "") for c in choices)
        while not gen.done:
            got = await next_output(gen.recv, ping_s)
            if got is None:
                yield SSE_PING
                continue
            item, c = got.output, choices[got.index]
            n_lp = len(c.logprobs)
            text = gen.absorb(c, item)
            if isinstance(item, TokenOutput):
                if text or c.logprobs[n_lp:]:
                    yield piece(c, text, c.logprobs[n_lp:])
            elif isinstance(item, FinalOutput):
                more = {"timings": llama_timings([item]), "id_slot": item.lane}
                yield (piece(c, text) if text else "") + piece(
                    c, "", finish=c.finish_reason, **more)
            elif isinstance(item, ErrorOutput):
                yield sse_data(engine_error(item).body())
                return
        if creq.include_usage:
            yield sse_data({**chunk, "choices": [], **self._tail(creq, choices)})
        yield "data: [DONE]\n\n"
