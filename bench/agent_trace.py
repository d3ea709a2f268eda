"""Replay agent-session traces (``bench/agent_traces.py``) against a running server and report
prefix reuse per request: prompt tokens, tokens reused, the ceiling, tokens prefilled, latency.

Usage:
    python bench/agent_trace.py --url http://127.0.0.1:8080 [--traces tool-loop,siblings]
        [--scale 1] [--turns 4] [--tokenizer MODEL] [--api-key KEY] [--json OUT]

The same client drives ninfer and llama.cpp's ``llama-server`` (``--cache-reuse``,
``--ctx-checkpoints`` as its docs recommend): OpenAI Chat Completions, and the Anthropic
Messages route for the trace that carries Claude Code's billing line. Reused tokens are the
server's own count (``prompt_tokens_details.cached_tokens``, else llama.cpp's ``timings.cache_n``;
Messages: ``cache_read_input_tokens``). The ceiling of a request is the longest token prefix it
shares with any earlier request of the run (of any trace), as sent; on a server that served
other runs before, give each run its own ``--seed`` (the default) (rendered with ``--tokenizer``'s chat template
and tokenizer, the bundled SmolLM2 by default: exact for a server of that model). Every request
asks for one token, so its latency is close to its time to first token.

``--traces ring-edit,rotation`` adds the traces outside the default set (``agent_traces.py``);
``rotation`` saves and restores slot files (``POST /slots/{id}``, both servers need
``--slot-save-path``). ``bench/agent_trace_compare.py`` prints two runs' ``--json`` side by
side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from agent_traces import EXTRA, TRACES, Step, make_traces  # noqa: E402


@dataclass(frozen=True, slots=True)
class Row:
    """One request's reuse."""
    trace: str
    session: str
    prompt_tokens: int
    reused: int
    ceiling: int
    prefilled: int
    latency_s: float


class Renderer:
    """Prompt token ids as a server of ``model`` renders a step's body (the ceiling's view)."""

    def __init__(self, model: str | None):
        from ninfer.api.messages_content import SEP
        from ninfer.engine.chat_template import ChatTemplate
        from ninfer.engine.tokenizer import Tokenizer
        from ninfer.server import DEFAULT_CHATML, resolve_model_path
        from ninfer.store.artifact import load_model_file

        art = load_model_file(resolve_model_path(model))
        self.tok = Tokenizer.from_dict(art.tokenizer)
        tok = self.tok
        self.template = ChatTemplate(
            art.chat_template or DEFAULT_CHATML,
            bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
        self.sep = SEP

    def ids(self, step: Step) -> list[int]:
        body = step.body
        messages, tools = body["messages"], body.get("tools")
        if step.route == "messages":
            system = self.sep.join(b["text"] for b in body.get("system", []))
            messages = [{"role": "system", "content": system}, *messages]
        return self.tok.encode(self.template.render(messages, tools))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _reused(step: Step, reply: dict) -> tuple[int, int]:
    """(prompt tokens, reused tokens) as the server reports them."""
    u = reply.get("usage") or {}
    if step.route == "messages":
        reused = int(u.get("cache_read_input_tokens") or 0)
        return (int(u.get("input_tokens", 0)) + reused
                + int(u.get("cache_creation_input_tokens") or 0)), reused
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = (reply.get("timings") or {}).get("cache_n", 0)
    return int(u.get("prompt_tokens", 0)), int(cached or 0)


async def _slot_actions(client, actions, served_on: int | None) -> None:
    """POST ``/slots/{id}?action=...`` for each (action, filename, slot) of a step; a slot of
    None is the one the request was served on (``id_slot`` of the reply)."""
    for action, filename, slot in actions:
        slot = served_on if slot is None else slot
        r = await client.post(f"/slots/{slot}?action={action}", json={"filename": filename})
        r.raise_for_status()


async def run_trace(client, name: str, steps: list[Step], renderer: Renderer, seen: list,
                    model: str) -> list[Row]:
    """Send ``steps`` in order through ``client`` (an ``httpx.AsyncClient`` at the server's
    base URL); ``seen``: the token ids of every earlier request of the run (extended here)."""
    rows = []
    for step in steps:
        ids = renderer.ids(step)
        ceiling = max((common_prefix(ids, s) for s in seen), default=0)
        seen.append(ids)
        path = "/v1/messages" if step.route == "messages" else "/v1/chat/completions"
        await _slot_actions(client, step.before, None)
        t0 = time.perf_counter()
        r = await client.post(path, json={"model": model, **step.body, "stream": False})
        latency = time.perf_counter() - t0
        r.raise_for_status()
        reply = r.json()
        prompt, reused = _reused(step, reply)
        # llama-server's OpenAI routes omit id_slot: the slot the body pinned
        await _slot_actions(client, step.after, reply.get("id_slot", step.body.get("id_slot")))
        rows.append(Row(name, step.session, prompt, reused, min(ceiling, prompt),
                        prompt - reused, round(latency, 4)))
    return rows


def summary(rows: list[Row]) -> dict:
    """Totals of some rows: prompt, reused, ceiling, prefilled tokens, reused / ceiling."""
    tot = {k: sum(getattr(r, k) for r in rows)
           for k in ("prompt_tokens", "reused", "ceiling", "prefilled")}
    tot["latency_s"] = round(sum(r.latency_s for r in rows), 3)
    tot["reused_of_ceiling"] = round(tot["reused"] / tot["ceiling"], 4) if tot["ceiling"] else None
    return tot


async def replay(url: str, names, scale: int, turns: int, tokenizer: str | None,
                 api_key: str | None = None, seed: int = 0, log=print,
                 save_each_turn: bool = False) -> dict:
    """Replay the named traces in turn against the server at ``url``; per trace its rows and
    their totals."""
    import httpx

    renderer = Renderer(tokenizer)
    traces = make_traces(names, scale=scale, turns=turns, seed=seed,
                         save_each_turn=save_each_turn)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    out = {"url": url, "scale": scale, "turns": turns, "seed": seed, "traces": {}}
    async with httpx.AsyncClient(base_url=url, timeout=3600, headers=headers) as client:
        models = await client.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]   # the server's (first) model
        seen: list = []   # (the server keeps what earlier traces left: they count too)
        for name, steps in traces.items():
            rows = await run_trace(client, name, steps, renderer, seen, model)
            for r in rows:
                log(f"{name:16s} {r.session:12s} prompt {r.prompt_tokens:6d}  reused "
                    f"{r.reused:6d}  ceiling {r.ceiling:6d}  prefilled {r.prefilled:6d}  "
                    f"{r.latency_s:.3f} s")
            out["traces"][name] = {"rows": [asdict(r) for r in rows], "total": summary(rows)}
            log(f"{name}: {out['traces'][name]['total']}")
    return out


def main(argv=None) -> int:
    import trio

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--traces", default=",".join(TRACES),
                    help=f"some of {', '.join(TRACES + EXTRA)} (rotation needs the server's "
                    "--slot-save-path)")
    ap.add_argument("--save-each-turn", action="store_true", help="rotation: save the slot "
                    "file after every turn, not only the first (a server without auto-save)")
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokenizer", default=None, help="model file whose chat template and "
                    "tokenizer render the ceilings (default: the bundled SmolLM2)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=None, help="the traces' text (default: new "
                    "each run, so a server's earlier runs share nothing but the template's "
                    "opening with this one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    names = a.traces.split(",")
    unknown = [n for n in names if n not in TRACES + EXTRA]
    if unknown:
        ap.error(f"unknown trace {unknown[0]!r} (expected some of {', '.join(TRACES + EXTRA)})")
    seed = a.seed if a.seed is not None else time.time_ns() % 2 ** 31
    import httpx
    try:
        res = trio.run(replay, a.url, names, a.scale, a.turns, a.tokenizer, a.api_key, seed,
                       print, a.save_each_turn)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"agent_trace: {a.url}: {type(e).__name__}: {e} (a server's base URL, e.g. "
              "http://127.0.0.1:8080?)", file=sys.stderr)
        return 2
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
