"""``POST /v1/chat/completions``: OpenAI chat completions, collected or streamed.

The adapter of the chat protocol: the body parsed by ``chat_request``, prepared by
``chat_prepare`` (shared with Messages and Responses), admitted and released by ``pipeline``.
``n > 1`` runs n engine requests (seeds ``seed + i``). Replies carry OpenAI's ``usage`` and
llama.cpp's ``timings`` and ``id_slot``; streams end with ``data: [DONE]`` (not after an engine
error, which is one in-band error frame).
"""
from __future__ import annotations

from ..engine.requests import ErrorOutput, FinalOutput, TokenOutput
from .admission import Admission
from .chat_prepare import prepare_chat
from .chat_request import ChatRequest, parse_chat_request
from .errors import model_not_found
from .generation import Choice, Generation, engine_error
from .pipeline import AdmittedProtocol
from .prompt import ChatPrompt, Thinking, ThinkingParams
from .streaming import SSE_PING, is_reasoning, next_output, sse_data
from .timings import llama_timings
from .tool_calls import ToolCallParser, parser_for_request


def openai_usage(finals: list[FinalOutput]) -> dict:
    """OpenAI's ``usage`` of a reply's choices (one prompt)."""
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # n > 1: the choices may reuse different prefixes; never over-report
            "prompt_tokens_details": {"cached_tokens": min(f.cached_tokens for f in finals)}}


def chat_logprob_entries(tokenizer, item: TokenOutput) -> list[dict]:
    """A token's ``logprobs.content`` entry (with its ``top_logprobs``)."""
    def entry(tid, lp):
        return {"token": tokenizer.decode([tid]), "logprob": lp,
                "bytes": list(tokenizer.token_bytes(tid))}

    return [{**entry(item.token_id, item.logprob),
             "top_logprobs": [entry(t, lp) for t, lp in item.top_logprobs]}]


def tool_call_deltas(c: Choice) -> list[dict]:
    """Streamed ``delta.tool_calls`` of the calls parsed since the last chunk: the first names
    the call (``id``, ``type``, ``function.name``, empty ``arguments``), the next ones carry
    argument fragments that concatenate to the final ``arguments``."""
    out = []
    for e in c.take_call_events():
        k = e.call
        if e.kind == "start":
            out.append({"tool_calls": [{"index": k.index, "id": k.id, "type": "function",
                                        "function": {"name": k.name, "arguments": ""}}]})
        elif e.kind == "args":
            out.append({"tool_calls": [{"index": k.index, "function": {"arguments": e.text}}]})
    return out


class ChatHandler(AdmittedProtocol):
    """Serves chat completions for one ServerState (module docstring)."""

    protocol = "openai_chat_completions"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"
    thinking_params = ThinkingParams()

    def __init__(self, state, admission: Admission | None = None,
                 prompt: ChatPrompt | None = None):
        super().__init__(state, admission)
        self.prompt = prompt or ChatPrompt(state)   # (the server's, shared by the routes)

    # -- the chat-form request ----------------------------------------------------------------
    def parse(self, body) -> ChatRequest:
        creq = parse_chat_request(body)
        if creq.model is not None and creq.model != self.state.model_id:
            raise model_not_found(creq.model, self.state.model_id)
        return creq

    def thinking(self, creq: ChatRequest) -> Thinking:
        return self.prompt.thinking(creq, self.thinking_params)

    def tool_parser(self, creq: ChatRequest) -> ToolCallParser | None:
        return parser_for_request(creq)

    def _logprob_entries(self, item: TokenOutput) -> list[dict]:
        return chat_logprob_entries(self.state.tokenizer, item)

    async def prepare(self, rid: str, ticket) -> Generation:
        return await prepare_chat(self, self.prompt, rid, ticket, self._logprob_entries)

    # -- replies ------------------------------------------------------------------------------
    async def collect(self, gen: Generation, base: dict) -> dict:
        await gen.receive_all()
        creq, choices = gen.request, gen.choices
        finals = [c.final for c in choices]
        out_choices = []
        for c in choices:
            msg = {"role": "assistant", "content": "".join(c.parts)}
            if "".join(c.reasoning):
                msg["reasoning_content"] = "".join(c.reasoning)
            if c.tools is not None and c.tools.calls:
                msg["content"] = msg["content"] or None
                msg["tool_calls"] = [{"id": k.id, "type": "function",
                                      "function": {"name": k.name, "arguments": k.arguments}}
                                     for k in c.tools.calls]
            ch = {"index": c.index, "message": msg, "finish_reason": c.finish_reason}
            if creq.logprobs is not None:
                ch["logprobs"] = {"content": c.logprobs, "refusal": None}
            out_choices.append(ch)
        return {**base, "object": "chat.completion", "choices": out_choices,
                "usage": openai_usage(finals), "timings": llama_timings(finals),
                "id_slot": finals[0].lane}

    async def stream(self, gen: Generation, base: dict):
        creq, choices = gen.request, gen.choices
        chunk = {**base, "object": "chat.completion.chunk"}
        extra = {"usage": None} if creq.include_usage else {}
        ping_s = self.state.config.sse_ping_interval_s

        def delta(index: int, d: dict, finish=None, logprobs=None, **more) -> str:
            ch = {"index": index, "delta": d, "finish_reason": finish}
            if creq.logprobs is not None:
                ch["logprobs"] = {"content": logprobs} if logprobs else None
            return sse_data({**chunk, "choices": [ch], **extra, **more})

        yield "".join(delta(c.index, {"role": "assistant", "content": ""}) for c in choices)
        while not gen.done:
            got = await next_output(gen.recv, ping_s)
            if got is None:
                yield SSE_PING
                continue
            i, item = got.index, got.output
            c = choices[i]
            n_lp = len(c.logprobs)
            text = gen.absorb(c, item)
            key = "reasoning_content" if is_reasoning(item) else "content"
            calls = "".join(delta(i, d) for d in tool_call_deltas(c))
            if isinstance(item, TokenOutput):
                lps = c.logprobs[n_lp:]
                if text or lps:
                    yield delta(i, {key: text} if text else {}, logprobs=lps) + calls
                elif calls:
                    yield calls
            elif isinstance(item, FinalOutput):
                out = (delta(i, {key: text}) if text else "") + calls
                more = {"timings": llama_timings([item]), "id_slot": item.lane}
                yield out + delta(i, {}, c.finish_reason, **more)
            elif isinstance(item, ErrorOutput):
                yield sse_data(engine_error(item).body())
                return
        if creq.include_usage:
            finals = [c.final for c in choices]
            yield sse_data({**chunk, "choices": [], "usage": openai_usage(finals),
                            "timings": llama_timings(finals)})
        yield "data: [DONE]\n\n"
