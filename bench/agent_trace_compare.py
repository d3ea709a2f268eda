"""Side by side: the agent traces' reuse on two servers, from ``bench/agent_trace.py --json``
outputs of one seed (the same prompts, so the same ceilings).

Usage:
    python bench/agent_trace_compare.py NAME=RUN.json OTHER=RUN.json [--markdown]

Per trace: prompt tokens, the ceiling, each run's reused tokens and the share of the ceiling,
the ratio of the first run's reused tokens to the second's, and each run's "cold" later turns:
requests of a session after its first that reused less than half their ceiling (the
re-prefills that more sessions than lanes, or an edit a server cannot rewind to, cause).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def cold_turns(rows: list[dict]) -> int:
    """Requests of an already-seen session that reused less than half their ceiling."""
    seen, cold = set(), 0
    for r in rows:
        if r["session"] in seen and r["reused"] < 0.5 * r["ceiling"]:
            cold += 1
        seen.add(r["session"])
    return cold


def table(runs: dict[str, dict]) -> list[dict]:
    """One dict per trace both runs hold: the numbers the header of ``render`` names."""
    (a, ra), (b, rb) = runs.items()
    for knob in ("seed", "scale", "turns"):   # (different prompts: the reuse is not comparable)
        if ra.get(knob) != rb.get(knob):
            print(f"the runs differ in {knob} ({ra.get(knob)} against {rb.get(knob)})",
                  file=sys.stderr)
    out = []
    for trace, ta in ra["traces"].items():
        tb = rb["traces"].get(trace)
        if tb is None:
            continue
        sa, sb = ta["total"], tb["total"]
        if sa["ceiling"] != sb["ceiling"]:
            print(f"{trace}: the ceilings differ ({sa['ceiling']} against {sb['ceiling']}): "
                  "not the same seed, or not the same rendering", file=sys.stderr)
        out.append({
            "trace": trace, "prompt": sa["prompt_tokens"], "ceiling": sa["ceiling"],
            f"{a} reused": sa["reused"], f"{b} reused": sb["reused"],
            f"{a} / ceiling": _pct(sa["reused"], sa["ceiling"]),
            f"{b} / ceiling": _pct(sb["reused"], sb["ceiling"]),
            f"{a} / {b}": f"{sa['reused'] / sb['reused']:.2f}x" if sb["reused"] else "-",
            f"{a} cold": cold_turns(ta["rows"]), f"{b} cold": cold_turns(tb["rows"]),
            f"{a} s": sa["latency_s"], f"{b} s": sb["latency_s"]})
    return out


def _pct(n: int, d: int) -> str:
    return f"{100 * n / d:.1f} %" if d else "-"


def _cell(v) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def render(rows: list[dict], markdown: bool) -> str:
    if not rows:
        return "(no trace in both runs)"
    head = list(rows[0])
    lines = [[h for h in head]] + [[_cell(r[h]) for h in head] for r in rows]
    if markdown:
        out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(x) + " |" for x in lines[1:]])
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs=2, metavar="NAME=RUN.json")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    runs = {}
    for spec in a.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"{spec!r}: expected NAME=RUN.json")
        runs[name] = json.loads(Path(path).read_text())
    print(render(table(runs), a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
