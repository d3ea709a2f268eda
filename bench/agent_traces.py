"""Agent-session traces for ``bench/agent_trace.py``: request bodies shaped like what coding
agents send, turn after turn, so that prefix reuse is measured on what defeats it.

Each trace is a list of ``Step``s, the requests in the order they are sent: a session name and
an OpenAI Chat Completions body (the same client code drives ninfer and llama.cpp's
``llama-server``). Assistant turns are scripted (the history a client replays is fixed), so the
prompts, and therefore the reuse ceilings, do not depend on what the server generates. Sizes
scale with ``scale`` (1: CI-sized on SmolLM2; 8 or more on a GPU).

- ``tool-loop``: one session, a growing tool loop; every turn the reminder on the newest user
  message is rewritten (OpenCode's habit) and the previous one is dropped from history.
- ``mid-edit``: a session whose older tool result is trimmed every ``k`` turns (compaction).
- ``volatile-header``: three sessions whose system prompt opens with Claude Code's billing line,
  its suffix per session (sent on the Anthropic route, where Claude Code sends it).
- ``siblings``: four sessions sharing one system prompt and tools, turns interleaved (more
  sessions than lanes on a 2-lane server).
- ``subagent``: a parent session, then a sub-agent that starts from the parent's history.
- ``ring-edit`` (not in ``TRACES``): one tool loop without reminders whose tool result of two
  turns back is cut to a summary every third turn (compaction older than the last turn, in
  history built by earlier requests: what the turn-checkpoint ring rewinds to on a hybrid
  model).
- ``rotation`` (not in ``TRACES``: it needs ``--slot-save-path``): four sessions on two slots,
  turns interleaved; each session saves its slot file after its first turn and restores it
  before every later one (what a client of ``--auto-save-evicted`` does: it never saves the
  session it displaces). ``save_each_turn``: save after every turn (a server without auto-save).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

TRACES = ("tool-loop", "mid-edit", "volatile-header", "siblings", "subagent")
EXTRA = ("ring-edit", "rotation")   # selectable by name, never by default
TOOLS = [{"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
    for name, desc in (("read_file", "Read a file of the project and return its text."),
                       ("list_dir", "List the entries of a directory of the project."),
                       ("run_tests", "Run the project's tests under a path."))]


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a trace: ``route`` ``chat`` (``/v1/chat/completions``) or ``messages``
    (``/v1/messages``, its body in the Anthropic form)."""
    session: str
    body: dict
    route: str = "chat"
    # slot-file actions around the request: (action, filename, slot or None: the slot the
    # request was served on)
    before: tuple = ()
    after: tuple = ()


def _words(rng: random.Random, n: int) -> str:
    vocab = ("function", "module", "returns", "value", "the", "test", "error", "line", "file",
             "class", "import", "config", "request", "server", "cache", "token", "lane", "page")
    return " ".join(rng.choice(vocab) for _ in range(n))


def _system(rng: random.Random, scale: int) -> str:
    rules = "\n".join(f"- Rule {i}: {_words(rng, 12)}." for i in range(8 * scale))
    return f"You are a coding agent working in a repository.\n\n# Rules\n{rules}"


def _tool_turn(rng: random.Random, i: int, scale: int) -> list[dict]:
    """An assistant tool call and its result (the tool loop's unit)."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "read_file", "arguments": f'{{"path": "src/m{i}.py"}}'}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}",
             "content": "\n".join(_words(rng, 10) for _ in range(6 * scale))}]


def _chat(system: str, messages: list[dict], max_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": system}, *messages], "tools": TOOLS,
            "max_tokens": max_tokens, "temperature": 0}


def tool_loop(rng, turns: int, scale: int, max_tokens: int, name: str = "tool-loop",
              edit_every: int = 0, edit_back: int | None = None,
              reminder: bool = True) -> list[Step]:
    """The user's task, then per turn a tool call, its result and a short user nudge; the
    newest user message carries a reminder rewritten every turn (gone once it is older);
    ``edit_every``: every so many turns the oldest tool result (``edit_back``: the one of so
    many turns back) is cut to a summary."""
    system = _system(rng, scale)
    history = [{"role": "user", "content": f"Fix the failing test. {_words(rng, 20)}"}]
    steps = []
    for t in range(turns):
        note = f"\n<system-reminder>turn {t}: {_words(rng, 8)}</system-reminder>"
        newest = {**history[-1], "content": history[-1]["content"] + (note if reminder else "")}
        steps.append(Step(name, _chat(system, history[:-1] + [newest], max_tokens)))
        history += _tool_turn(rng, t, scale) + [{"role": "user", "content": "Continue."}]
        if edit_every and t and t % edit_every == 0:
            at = 2 if edit_back is None else 2 + 3 * (t - edit_back)   # a tool result
            history[at] = {**history[at], "content": f"(trimmed) {_words(rng, 6)}"}
    return steps


def volatile_header(rng, sessions: int, scale: int, max_tokens: int) -> list[Step]:
    system = _system(rng, scale)
    steps = []
    for s in range(sessions):
        line = f"x-anthropic-billing-header: cc_version=2.1.332.{rng.randrange(4096):03x}; " \
               "cc_entrypoint=sdk-cli;"
        body = {"system": [{"type": "text", "text": line}, {"type": "text", "text": system}],
                "messages": [{"role": "user", "content": f"Task {s}: {_words(rng, 15)}"}],
                "max_tokens": max_tokens, "temperature": 0}
        steps.append(Step(f"session-{s}", body, route="messages"))
    return steps


def siblings(rng, sessions: int, turns: int, scale: int, max_tokens: int) -> list[Step]:
    system = _system(rng, scale)
    tasks = [{"role": "user", "content": f"Agent {s}: {_words(rng, 20)}"}
             for s in range(sessions)]
    history: list[list[dict]] = [[] for _ in range(sessions)]
    steps = []
    for t in range(turns):
        for s in range(sessions):
            steps.append(Step(f"sibling-{s}", _chat(system, [tasks[s], *history[s]],
                                                     max_tokens)))
            history[s] += _tool_turn(rng, 100 * s + t, scale)
    return steps


def subagent(rng, turns: int, scale: int, max_tokens: int) -> list[Step]:
    parent = tool_loop(rng, turns, scale, max_tokens, name="parent")
    base = parent[-1].body["messages"]
    child = [*base[1:-1], {"role": "user", "content": f"Sub-task: {_words(rng, 20)}"}]
    return parent + [Step("subagent", _chat(base[0]["content"], child, max_tokens))]


def rotation(rng, sessions: int, lanes: int, turns: int, scale: int, max_tokens: int,
             save_each_turn: bool = False) -> list[Step]:
    """``sessions`` tool loops sharing a system prompt, one turn each in turn; session ``s``
    lives in file ``rotation-s`` and is restored into slot ``s % lanes`` (the body's
    ``id_slot`` pins its first turn there on llama-server; ninfer ignores the field)."""
    system = _system(rng, scale)
    history = [[{"role": "user", "content": f"Agent {s}: {_words(rng, 20)}"}]
               for s in range(sessions)]
    steps = []
    for t in range(turns):
        for s in range(sessions):
            name, slot = f"rotation-{s}", s % lanes
            body = {**_chat(system, history[s], max_tokens), "id_slot": slot}
            steps.append(Step(f"session-{s}", body,
                              before=(("restore", name, slot),) if t else (),
                              after=(("save", name, None),) if save_each_turn or not t else ()))
            history[s] += _tool_turn(rng, 100 * s + t, scale) + [
                {"role": "user", "content": "Continue."}]
    return steps


def make_traces(names=TRACES, scale: int = 1, turns: int = 4, max_tokens: int = 1,
                seed: int = 0, save_each_turn: bool = False) -> dict[str, list[Step]]:
    """The named traces (``TRACES``, ``EXTRA``), reproducible from ``seed``."""
    out = {}
    for name in names:
        rng = random.Random(f"{seed}:{name}")
        if name == "tool-loop":
            out[name] = tool_loop(rng, turns, scale, max_tokens)
        elif name == "mid-edit":
            out[name] = tool_loop(rng, turns + 2, scale, max_tokens, name="mid-edit",
                                  edit_every=2)
        elif name == "volatile-header":
            out[name] = volatile_header(rng, 3, scale, max_tokens)
        elif name == "siblings":
            out[name] = siblings(rng, 4, max(2, turns // 2), scale, max_tokens)
        elif name == "subagent":
            out[name] = subagent(rng, turns, scale, max_tokens)
        elif name == "ring-edit":
            out[name] = tool_loop(rng, 2 * turns + 1, scale, max_tokens, name="ring-edit",
                                  edit_every=3, edit_back=2, reminder=False)
        elif name == "rotation":
            out[name] = rotation(rng, 4, 2, turns, scale, max_tokens,
                                 save_each_turn)
        else:
            raise ValueError(f"unknown trace {name!r} "
                             f"(expected one of {', '.join(TRACES + EXTRA)})")
    return out
