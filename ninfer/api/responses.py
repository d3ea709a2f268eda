"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``: the core of OpenAI's Responses API over the chat-form
path (same admission, template, engine and events; serving contract §1.6).

The body: ``responses_request``; the response object and its Items: ``responses_output``; the
stream: ``responses_stream``; the store: ``response_store``. Storing is the commit point: the
terminal event is sent after the record is stored.
"""
from __future__ import annotations

from quart import g, request

from ..engine.requests import ErrorOutput, FinalOutput
from .admission import Admission
from .chat_prepare import prepare_chat
from .chat_request import ChatRequest
from .errors import ApiError, error_record, model_not_found
from .generation import Choice, Generation, engine_error
from .pipeline import AdmittedProtocol
from .prompt import ChatPrompt, Thinking, ThinkingParams
from .response_store import ID_PREFIX, ResponseStore, input_items_page, replayable
from .responses_output import (call_item, message_item, new_item_id, reasoning_item,
                               response_shell, response_status, response_usage)
from .responses_request import ResponsesRequest, parse_responses_request
from .responses_stream import OutputItemStream
from .streaming import SSE_PING, HttpSite, is_reasoning, next_output
from .tool_calls import ToolCallParser, parser_for_request


class ResponsesHandler(AdmittedProtocol):
    """Serves ``/v1/responses`` for one ServerState (module docstring)."""

    protocol = "openai_responses"
    id_prefix = "resp_"
    prompt_param = "input"
    thinking_params = ThinkingParams(reasoning_effort="reasoning.effort",
                                     enable_thinking="reasoning.effort")

    def __init__(self, state, admission: Admission | None = None,
                 prompt: ChatPrompt | None = None, max_records: int = 1024,
                 max_bytes: int | None = None):
        super().__init__(state, admission)
        self.prompt = prompt or ChatPrompt(state)
        self.store = ResponseStore(max_records, max_bytes)

    # -- the chat-form request ----------------------------------------------------------------
    def parse(self, body) -> ChatRequest:
        creq = parse_responses_request(body, self.store)
        if creq.model is not None and creq.model != self.state.model_id:
            raise model_not_found(creq.model, self.state.model_id)
        return creq

    def thinking(self, creq: ChatRequest) -> Thinking:
        if creq.preserve_thinking is None:   # a continuation keeps its chain's setting
            creq.preserve_thinking = creq.inherited_preserve
        return self.prompt.thinking(creq, self.thinking_params)

    def tool_parser(self, creq: ChatRequest) -> ToolCallParser | None:
        return parser_for_request(creq)

    async def prepare(self, rid: str, ticket) -> Generation:
        return await prepare_chat(self, self.prompt, rid, ticket)

    # -- the response object ------------------------------------------------------------------
    def _shell(self, creq: ResponsesRequest, base: dict, status: str) -> dict:
        return response_shell(creq, base, self.state.model_id, status)

    def _finish(self, creq: ResponsesRequest, base: dict, c: Choice, output: list) -> dict:
        """The final response object; stored (the commit point) when ``store``."""
        status = response_status(c)
        resp = {**self._shell(creq, base, status), "output": output,
                "usage": response_usage(c)}
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        if creq.store:
            # input Items without an id get one, so that input_items can page through them
            suffix = base["id"].split("_", 1)[-1]
            history = [item if isinstance(item.get("id"), str) else
                       {**item, "id": f"{ID_PREFIX.get(item.get('type'), 'msg')}_{suffix}_{i}"}
                       for i, item in enumerate(creq.items)]
            history += [item for item in output if replayable(item)]
            self.store.put(resp, history, self.state.config.preserve_thinking
                           if creq.preserve_thinking is None else creq.preserve_thinking)
        return resp

    def _failed(self, creq: ResponsesRequest, base: dict, output: list, err: ApiError) -> dict:
        return {**self._shell(creq, base, "failed"), "output": output,
                "error": {"code": err.code, "message": err.message}}

    # -- replies ------------------------------------------------------------------------------
    async def collect(self, gen: Generation, base: dict) -> dict:
        await gen.receive_all()
        c = gen.choices[0]
        output = []
        if "".join(c.reasoning):
            output.append(reasoning_item(new_item_id("reasoning"), "".join(c.reasoning)))
        calls = c.tools.calls if c.tools is not None else []
        if "".join(c.parts) or not calls:
            output.append(message_item(new_item_id("message"), "".join(c.parts),
                                       "completed" if calls else response_status(c)))
        output += [call_item(new_item_id("function_call"), k) for k in calls]
        return self._finish(gen.request, base, c, output)

    async def stream(self, gen: Generation, base: dict):
        creq, c = gen.request, gen.choices[0]
        # (this runs at the first __anext__, inside the request: its line and x-request-id for
        # the log)
        site = HttpSite(request_id=g.get("request_id", ""), method=request.method,
                        path=request.path)
        ping_s = self.state.config.sse_ping_interval_s
        items = OutputItemStream(c)
        yield items.event("response.created", response=self._shell(creq, base, "in_progress"))
        yield items.event("response.in_progress",
                          response=self._shell(creq, base, "in_progress"))
        while not c.done:
            got = await next_output(gen.recv, ping_s)
            if got is None:
                yield SSE_PING
                continue
            item = got.output
            kind = "reasoning" if is_reasoning(item) else "message"
            text = gen.absorb(c, item)
            if isinstance(item, ErrorOutput):
                done = [o for o in items.output if o.get("status") != "in_progress"]
                yield items.event("response.failed", response=self._failed(
                    creq, base, done, engine_error(item)))
                return
            out = (items.text_delta(kind, text) if text else "") + items.call_events()
            if isinstance(item, FinalOutput):
                out += items.finish_answer()
                try:
                    resp = self._finish(creq, base, c, list(items.output))
                except ApiError as err:   # not stored: the stream fails instead
                    # (the 200 went out: the log says why it failed all the same)
                    self.state.bus.emit(error_record(err, site.request_id, site.method,
                                                     site.path))
                    yield out + items.event("response.failed", response=self._failed(
                        creq, base, items.output, err))
                    return
                out += items.event(f"response.{resp['status']}", response=resp)
            if out:
                yield out

    # -- stored responses ---------------------------------------------------------------------
    async def retrieve(self, rid: str) -> dict:
        rec = self.store.get(rid)
        if rec is None:
            raise ApiError(404, f"no stored response with id {rid!r}", "response_not_found")
        return rec.response

    async def delete(self, rid: str) -> dict:
        if not self.store.delete(rid):
            raise ApiError(404, f"no stored response with id {rid!r}", "response_not_found")
        return {"id": rid, "object": "response", "deleted": True}

    async def input_items(self, rid: str) -> dict:
        """``GET /v1/responses/{id}/input_items`` (``response_store.input_items_page``)."""
        return input_items_page(self.store, rid, request.args)
