"""Recorded sessions: each request's full input and output token ids, and their re-execution.

``--record-sessions DIR`` (off by default, separate from the observability log because it holds
prompts) writes one ``<request_id>.json`` per finished request: the request body as received,
the resolved sampling parameters (with the seed actually used), the prompt token ids, the output
token ids and the server sizing. ``execute_sessions(DIR, model)`` re-runs every session of a
directory through a fresh engine — all submitted at once, so concurrent sessions batch again —
and reports each divergence (first differing position and both tokens).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

FORMAT = "ninfer-session/1"


class SessionRecorder:
    """Writes session files atomically (temp file + rename) into ``directory``."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def record(self, *, request_id: str, protocol: str, body: dict, prompt_ids: list,
               params: dict, max_tokens: int, stop: tuple, output_ids: list,
               finish_reason: str, text: str, model: dict, server: dict) -> Path:
        doc = {"format": FORMAT, "request_id": request_id, "protocol": protocol,
               "model": model, "server": server, "body": body, "params": params,
               "max_tokens": max_tokens, "stop": list(stop), "prompt_ids": list(prompt_ids),
               "output_ids": list(output_ids), "finish_reason": finish_reason, "text": text}
        path = self.dir / f"{request_id}.json"
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, ensure_ascii=False)
        os.replace(tmp, path)
        return path


def load_sessions(directory: str | os.PathLike) -> list[dict]:
    """Every session document in ``directory`` (sorted by file name).

    Raises:
        ValueError: a file that is not a session of this format (names the file).
    """
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path}: not a session file: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} session file")
        doc["_path"] = str(path)
        out.append(doc)
    return out


@dataclass(frozen=True)
class Divergence:
    """Where a re-execution differed. ``position``: first differing output index (or -1 for the
    prompt); ``recorded`` / ``replayed``: the tokens there (None past the end)."""
    request_id: str
    what: str
    position: int
    recorded: int | None
    replayed: int | None


def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _chat_prompt(runtime, session: dict) -> list | None:
    """The prompt ids an OpenAI chat session's messages render to today (the template's part of
    replay: the body parsed as the chat route parses it), or None for the other protocols:
    their bodies reach the template through their own adapters (system blocks, content
    blocks, stored responses), so only the recorded ids are replayed. A body the parser or the
    template now refuses renders to no ids: a divergence at 0."""
    from ..api.chat_request import parse_chat_request
    from ..api.errors import ApiError
    from ..api.fields import field_policy
    from ..engine.chat_template import TemplateError
    if session.get("protocol") != "openai_chat_completions":
        return None
    try:
        with field_policy(strict=False):   # (the fields the server ignored, ignored again)
            creq = parse_chat_request(session["body"])
        return runtime.tokenizer.encode(runtime.template.render(
            creq.messages, tools=creq.tools, add_generation_prompt=True))
    except (ApiError, TemplateError):
        return []


def execute_sessions(directory, runtime, max_concurrency: int | None = None
                     ) -> tuple[list[dict], list[Divergence]]:
    """Re-run every session in ``directory`` on ``runtime`` (a ``server.Runtime``).

    Returns (sessions, divergences); an empty divergence list means an exact replay.
    """
    from ..engine.engine import Engine, EngineConfig
    from ..engine.requests import Request, TokenOutput
    from ..engine.sampling import SamplingParams
    from ..events.bus import EventBus

    sessions = load_sessions(directory)
    if not sessions:
        raise ValueError(f"{directory}: no session files")
    srv = sessions[0]["server"]
    conc = max_concurrency or max(int(s["server"].get("max_concurrency", 1)) for s in sessions)
    engine = Engine(runtime.model, runtime.tokenizer, EventBus(), EngineConfig(
        max_concurrency=conc, max_context=int(srv.get("max_context", 2048)),
        prefill_chunk=int(srv.get("prefill_chunk", 512)),
        # (sessions recorded before the flag existed: one prompt's prefill at a time)
        max_prefill_lanes=int(srv.get("max_prefill_lanes", 1)),
        page_size=int(srv.get("page_size", 16))))
    divergences, outputs = [], {}
    for s in sessions:
        prompt = list(s["prompt_ids"])   # what the engine ran, whatever the protocol
        rendered = _chat_prompt(runtime, s)
        pos = None if rendered is None else _first_difference(prompt, rendered)
        if pos is not None:   # the chat template no longer renders the body as recorded
            divergences.append(Divergence(
                s["request_id"], "prompt", pos, prompt[pos] if pos < len(prompt) else None,
                rendered[pos] if pos < len(rendered) else None))
        outputs[s["request_id"]] = []
        max_tokens = int(s["max_tokens"])
        if s.get("finish_reason") == "tool_calls":   # ended by the API after its one call
            max_tokens = min(max_tokens, max(1, len(s["output_ids"])))
        body = s.get("body")
        engine.submit(Request(s["request_id"], prompt, SamplingParams(**s["params"]),
                              max_tokens, outputs[s["request_id"]].append,
                              stop=tuple(s["stop"]), ignore_eos=isinstance(body, dict)
                              and body.get("ignore_eos") is True))
    while engine.step():
        pass
    for s in sessions:
        got = [o.token_id for o in outputs[s["request_id"]] if isinstance(o, TokenOutput)]
        pos = _first_difference(s["output_ids"], got)
        if pos is not None:
            rec = s["output_ids"]
            divergences.append(Divergence(s["request_id"], "output", pos,
                                          rec[pos] if pos < len(rec) else None,
                                          got[pos] if pos < len(got) else None))
    return sessions, divergences
