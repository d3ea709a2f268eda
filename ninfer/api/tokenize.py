"""``POST /tokenize``: vLLM's tokenize API, which a KV-aware router asks for a request's token ids
before it looks them up in its index of the replicas' KV-cache events (vllm-router's
``kv_aware`` policy; docs/scale-out.md).

Two bodies, as vLLM takes them:

- a chat body (``messages``, and any other field of a chat completion, which is how routers
  forward the request they are routing): the ids are exactly the prompt that request would
  get here (the same parsing, system placement, thinking mode and template);
- ``{"prompt": "..."}``: the text's ids, with BOS first when the model's tokenizer asks for it
  on raw text (as ``/v1/completions``), unless ``add_special_tokens`` is false.

Answer: ``{"count", "max_model_len", "tokens", "token_strs": null}``.
"""
from __future__ import annotations

from .errors import ApiError
from .request_body import field_scope, json_body

# vLLM's tokenize fields that are not chat-completion fields: taken, and answered as vLLM does
# by default (the generation prompt added; a chat prompt's special tokens are the template's)
_VLLM_FIELDS = ("add_generation_prompt", "add_special_tokens", "return_token_strs",
                "continue_final_message")


class TokenizeHandler:
    """``POST /tokenize`` for one server (module docstring); ``chat`` is its ChatHandler."""

    def __init__(self, state, chat):
        self.state, self.chat = state, chat

    async def handle(self) -> dict:
        body = await json_body()
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_request")
        if "messages" in body:
            ids = await self._chat_ids({k: v for k, v in body.items() if k not in _VLLM_FIELDS})
        elif isinstance(body.get("prompt"), str):
            ids = self._text_ids(body["prompt"], body.get("add_special_tokens", True))
        else:
            raise ApiError(400, "give either 'messages' or a string 'prompt'", "invalid_value",
                           "prompt")
        return {"count": len(ids), "max_model_len": self.state.n_ctx, "tokens": ids,
                "token_strs": None}

    async def _chat_ids(self, body: dict) -> list[int]:
        """The prompt ids of a chat body (``chat_prepare.prepare_chat``'s steps, unsubmitted)."""
        chat, prompt = self.chat, self.chat.prompt
        with field_scope(self.state.config):
            creq = chat.parse(body)
            thinking = chat.thinking(creq)
        creq.messages = prompt.placed_system(creq.messages)
        rendered = await prompt.render(creq, thinking.template_kwargs, chat.prompt_param)
        return [int(t) for t in rendered.ids]

    def _text_ids(self, text: str, special: bool) -> list[int]:
        tok = self.state.tokenizer
        ids = [int(t) for t in tok.encode(text)]
        if special and tok.add_bos and tok.bos_id is not None:
            ids = [int(tok.bos_id), *ids]
        return ids
