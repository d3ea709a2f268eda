"""A chat-form request (chat, Messages, Responses) into engine requests: the body parsed by the
protocol, its prompt rendered, its output capped, and one engine request per choice (seeds
``seed + i``) submitted."""
from __future__ import annotations

from typing import Protocol

from quart import g

from ..engine.requests import Request
from .admission import AdmissionTicket, output_cap, request_seed, sampling_params
from .breakpoints import with_siblings
from .chat_request import ChatRequest
from .generation import Choice, Generation
from .prompt import ChatPrompt, Thinking
from .request_body import field_scope, json_body
from .session_key import session_key
from .tool_calls import ToolCallParser

# the last messages whose boundaries a hybrid lane's ring may checkpoint (each one a render)
BOUNDARY_MESSAGES = 8


class ChatFormAdapter(Protocol):
    """The protocol's part of preparing a chat-form request."""
    protocol: str
    prompt_param: str   # the parameter a too-long prompt is blamed on

    def parse(self, body) -> ChatRequest: ...

    def thinking(self, creq: ChatRequest) -> Thinking: ...

    def tool_parser(self, creq: ChatRequest) -> ToolCallParser | None: ...


async def prepare_chat(adapter: ChatFormAdapter, prompt: ChatPrompt, rid: str,
                       ticket: AdmissionTicket, logprob_entries=None) -> Generation:
    """Read the current request's body through ``adapter`` and submit its engine requests.

    Raises:
        ApiError: the body's, the prompt's or the admission's refusal.
    """
    state = prompt.state
    cfg = state.config
    body = await json_body()
    with field_scope(cfg) as policy:
        creq = adapter.parse(body)
        thinking = adapter.thinking(creq)
    creq.messages = prompt.placed_system(creq.messages)
    key, key_kind = session_key(creq.prompt_cache_key, creq.session_user, creq.messages,
                                creq.tools)
    ecfg = state.engine.config
    checkpoint = state.engine.recurrent and ecfg.turn_checkpoint and ecfg.prefix_reuse
    rendered = await prompt.render(
        creq, thinking.template_kwargs, adapter.prompt_param, checkpoint=checkpoint,
        breakpoints=state.engine.publishes,
        boundaries=min(ecfg.turn_checkpoints, BOUNDARY_MESSAGES) if checkpoint else 0)
    cap = output_cap(state, creq.max_tokens, len(rendered.ids), adapter.prompt_param)
    seed = request_seed(cfg, creq)
    ticket.reserve_choices(creq.n)
    gen = Generation(state, body, creq, logprob_entries)
    # only the first choice carries the queue deadline: the others wait for lanes behind it
    # (n > max_concurrency) and fail with it, never on their own (a 503 after choice 0 ran)
    for i in range(creq.n):
        ereq = Request(request_id=rid if creq.n == 1 else f"{rid}-{i}",
                       prompt_ids=rendered.ids, params=sampling_params(cfg, creq, seed + i),
                       max_tokens=cap.max_tokens, deliver=gen.deliver_to(i), stop=creq.stop,
                       protocol=adapter.protocol, model=state.model_id, stream=creq.stream,
                       message_count=len(creq.messages), max_tokens_source=cap.source,
                       deadline=ticket.deadline if i == 0 else None,
                       logprobs=creq.logprobs,
                       think_budget=thinking.budget, think_end_id=prompt.think_end_id,
                       cache_key=key, session_kind=key_kind,
                       checkpoint_at=rendered.checkpoint_at, anchor_at=rendered.anchor_at,
                       boundaries=rendered.boundaries,
                       publish_at=with_siblings(rendered.publish_at, len(rendered.ids), creq.n),
                       http_request_id=g.get("request_id", ""),
                       ignored_fields=tuple(policy.names()),
                       volatile_spans=creq.volatile_spans, ignore_eos=creq.ignore_eos)
        gen.choices.append(Choice(index=i, ereq=ereq, tools=adapter.tool_parser(creq)))
    gen.submit()
    return gen
