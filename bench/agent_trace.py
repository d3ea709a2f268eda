"""Replay agent-session traces (``bench/agent_traces.py``) against a running server and report
prefix reuse per request: prompt tokens, tokens reused, the ceiling, tokens prefilled, latency.

Usage:
    python bench/agent_trace.py --url http://127.0.0.1:8080 [--traces tool-loop,siblings]
        [--scale 1] [--turns 4] [--parallel 1] [--max-tokens 1] [--tokenizer MODEL]
        [--api-key KEY] [--json OUT]

The same client drives ninfer and llama.cpp's ``llama-server`` (``--cache-reuse``,
``--ctx-checkpoints`` as its docs recommend): OpenAI Chat Completions, and the Anthropic
Messages route for the trace that carries Claude Code's billing line. Reused tokens are the
server's own count (``prompt_tokens_details.cached_tokens``, else llama.cpp's ``timings.cache_n``;
Messages: ``cache_read_input_tokens``). The ceiling of a request is the longest token prefix it
shares with any earlier request of the run (of any trace, of any copy), as sent; on a server
that served other runs before, give each run its own ``--seed`` (the default) (rendered with
``--tokenizer``'s chat template and tokenizer, the bundled SmolLM2 by default: exact for a
server of that model). Every request asks for one token (``--max-tokens``), so its latency is
close to its time to first token. ``--parallel N`` replays N copies of the traces at once
(``bench/fleet_trace.py`` loads replicas behind a gateway with it).

``--traces ring-edit,rotation`` adds the traces outside the default set (``agent_traces.py``);
``rotation`` saves and restores slot files (``POST /slots/{id}``, both servers need
``--slot-save-path``). ``bench/agent_trace_compare.py`` prints two runs' ``--json`` side by
side.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
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
    completion_tokens: int = 0


class Renderer:
    """Prompt token ids as a server of ``model`` renders a step's body (the ceiling's view)."""

    def __init__(self, model: str | None):
        from ninfer.api.messages_content import SEP
        from ninfer.engine.chat_template import ChatTemplate
        from ninfer.engine.tokenizer import Tokenizer
        from ninfer.server import DEFAULT_CHATML, resolve_model_path
        from ninfer.store import gguf_import
        from ninfer.store.artifact import load_model_file

        path = resolve_model_path(model)
        if str(path).endswith(".gguf"):   # metadata only: a 27B GGUF's weights stay on disk
            _, _, _, tok_dict, template, _ = gguf_import.read_metadata(path)
        else:
            art = load_model_file(path)
            tok_dict, template = art.tokenizer, art.chat_template
        self.tok = Tokenizer.from_dict(tok_dict)
        tok = self.tok
        self.template = ChatTemplate(
            template or DEFAULT_CHATML,
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


def _reused(step: Step, reply: dict) -> tuple[int, int, int]:
    """(prompt tokens, reused tokens, generated tokens) as the server reports them."""
    u = reply.get("usage") or {}
    if step.route == "messages":
        reused = int(u.get("cache_read_input_tokens") or 0)
        return (int(u.get("input_tokens", 0)) + reused
                + int(u.get("cache_creation_input_tokens") or 0)), reused, \
            int(u.get("output_tokens", 0))
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = (reply.get("timings") or {}).get("cache_n", 0)
    return int(u.get("prompt_tokens", 0)), int(cached or 0), int(u.get("completion_tokens", 0))


async def _slot_actions(client, actions, served_on: int | None) -> None:
    """POST ``/slots/{id}?action=...`` for each (action, filename, slot) of a step; a slot of
    None is the one the request was served on (``id_slot`` of the reply)."""
    for action, filename, slot in actions:
        slot = served_on if slot is None else slot
        r = await client.post(f"/slots/{slot}?action={action}", json={"filename": filename})
        r.raise_for_status()


async def run_trace(client, name: str, steps: list[Step], ids: list[list[int]], sent: list,
                    model: str, copy: str = "", session_header: str | None = None) -> list[Row]:
    """Send ``steps`` in order through ``client`` (an ``httpx.AsyncClient`` at the server's
    base URL); ``ids``: their token ids as rendered; ``sent``: every request's ids of the run,
    in the order sent (extended here; the ceilings are computed from it afterwards, so that
    concurrent traces do not spend their client's time on them). Rows' ceilings are their
    request's index in ``sent`` here. ``session_header``: a header naming each request's
    session (a gateway's routing key)."""
    rows = []
    for step, step_ids in zip(steps, ids):
        index = len(sent)   # (taken before the request: other traces send meanwhile)
        sent.append(step_ids)
        path = "/v1/messages" if step.route == "messages" else "/v1/chat/completions"
        await _slot_actions(client, step.before, None)
        t0 = time.perf_counter()
        headers = {session_header: step.session + copy} if session_header else {}
        r = await client.post(path, json={"model": model, **step.body, "stream": False},
                              headers=headers)
        latency = time.perf_counter() - t0
        if r.is_error:   # (the server's own words: a context limit, a refused field)
            raise RuntimeError(f"{name} step {len(rows)}: HTTP {r.status_code} from {path}: "
                               f"{r.text[:500]}")
        reply = r.json()
        prompt, reused, completion = _reused(step, reply)
        # llama-server's OpenAI routes omit id_slot: the slot the body pinned
        await _slot_actions(client, step.after, reply.get("id_slot", step.body.get("id_slot")))
        rows.append(Row(name, step.session + copy, prompt, reused, index,
                        prompt - reused, round(latency, 4), completion))
    return rows


def with_ceilings(rows: list[Row], sent: list) -> list[Row]:
    """``rows`` (their ``ceiling`` the index of their request in ``sent``) with the ceiling:
    the longest prefix the request shares with any request sent before it, at most its
    prompt."""
    out = []
    for r in rows:
        ids = sent[r.ceiling]
        ceiling = max((common_prefix(ids, s) for s in sent[:r.ceiling]), default=0)
        out.append(replace(r, ceiling=min(ceiling, r.prompt_tokens)))
    return out


def summary(rows: list[Row]) -> dict:
    """Totals of some rows: prompt, reused, ceiling, prefilled tokens, reused / ceiling."""
    tot = {k: sum(getattr(r, k) for r in rows)
           for k in ("prompt_tokens", "reused", "ceiling", "prefilled", "completion_tokens")}
    tot["latency_s"] = round(sum(r.latency_s for r in rows), 3)
    tot["reused_of_ceiling"] = round(tot["reused"] / tot["ceiling"], 4) if tot["ceiling"] else None
    return tot


async def replay(url: str, names, scale: int, turns: int, tokenizer: str | None,
                 api_key: str | None = None, seed: int = 0, log=print, parallel: int = 1,
                 max_tokens: int = 1, session_header: str | None = None,
                 save_each_turn: bool = False) -> dict:
    """Replay the named traces in turn against the server at ``url``; per trace its rows and
    their totals. ``parallel`` > 1: that many copies of the traces (seeds ``seed``,
    ``seed + 1``, ...; sessions suffixed ``#copy``), replayed concurrently, each copy's traces
    in turn; ``wall_s``: the whole replay's time. ``max_tokens``: each request's;
    ``session_header``: see ``run_trace``."""
    import httpx
    import trio

    renderer = Renderer(tokenizer)
    copies = [make_traces(names, scale=scale, turns=turns, seed=seed + c, max_tokens=max_tokens,
                          save_each_turn=save_each_turn) for c in range(parallel)]
    ids = [{n: [renderer.ids(s) for s in steps] for n, steps in c.items()} for c in copies]
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    out = {"url": url, "scale": scale, "turns": turns, "seed": seed, "parallel": parallel,
           "max_tokens": max_tokens, "traces": {}}
    rows: dict[str, list[Row]] = {n: [] for n in names}
    sent: list = []   # (the server keeps what earlier traces left: they count too)
    limits = httpx.Limits(max_connections=parallel + 1, max_keepalive_connections=parallel + 1)
    async with httpx.AsyncClient(base_url=url, timeout=3600, headers=headers,
                                 limits=limits) as client:
        models = await client.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]   # the server's (first) model

        async def one_copy(c: int):
            for name, steps in copies[c].items():
                rows[name] += await run_trace(client, name, steps, ids[c][name], sent, model,
                                              f"#{c}" if parallel > 1 else "", session_header)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for c in range(parallel):
                nursery.start_soon(one_copy, c)
        out["wall_s"] = round(time.perf_counter() - t0, 3)
    log("trace / session, then per request: prompt tokens; reused (the server's cached count); "
        "ceiling (the longest prefix an earlier request shared, as sent: the template's shared "
        "opening can make reused exceed it); prefilled (computed); latency ~ TTFT")
    for name in names:
        got = with_ceilings(rows[name], sent)
        for r in got:
            log(f"{name:16s} {r.session:12s} prompt {r.prompt_tokens:6d}  reused "
                f"{r.reused:6d}  ceiling {r.ceiling:6d}  prefilled {r.prefilled:6d}  "
                f"{r.latency_s:.3f} s")
        out["traces"][name] = {"rows": [asdict(r) for r in got], "total": summary(got)}
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
    ap.add_argument("--parallel", type=int, default=1, help="copies of the traces (seeds "
                    "seed, seed + 1, ...) replayed concurrently (default 1)")
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens each request asks for "
                    "(default 1: its latency is close to its time to first token)")
    ap.add_argument("--session-header", default=None, help="send each request's session name "
                    "in this header (a gateway's routing key, e.g. x-smg-routing-key)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.parallel < 1 or a.max_tokens < 1:
        ap.error("--parallel and --max-tokens must be >= 1")
    names = a.traces.split(",")
    unknown = [n for n in names if n not in TRACES + EXTRA]
    if unknown:
        ap.error(f"unknown trace {unknown[0]!r} (expected some of {', '.join(TRACES + EXTRA)})")
    seed = a.seed if a.seed is not None else time.time_ns() % 2 ** 31
    try:
        import httpx
    except ImportError:
        print("agent_trace: needs httpx: pip install httpx (or install ninfer with '.[dev]')",
              file=sys.stderr)
        return 2
    try:
        res = trio.run(functools.partial(replay, a.url, names, a.scale, a.turns, a.tokenizer,
                                         a.api_key, seed, parallel=a.parallel,
                                         max_tokens=a.max_tokens,
                                         session_header=a.session_header,
                                         save_each_turn=a.save_each_turn))
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"agent_trace: {a.url}: {type(e).__name__}: {e} (a server's base URL, e.g. "
              "http://127.0.0.1:8080?)", file=sys.stderr)
        return 2
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
