"""``bench/fleet_trace.py`` CI-sized: the same agent traces through smg in front of 1 replica,
then 2 (SmolLM2 on the CPU); what the rows must hold (the requests, the reuse, where they went),
never how fast."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import fleet_trace  # noqa: E402

pytestmark = pytest.mark.slow


def test_one_then_two_replicas_send_the_same_trace(smollm2_gguf, tmp_path):
    lines = []
    a = fleet_trace.parse(["--model", str(smollm2_gguf), "--traces", "tool-loop", "--turns",
                           "3", "--parallel", "2", "--max-tokens", "2", "--lanes", "2",
                           "--max-context", "2048", "--cpus", "0,1"])
    one, two = fleet_trace.measure(a, log=lines.append)
    assert [one["replicas"], two["replicas"]] == [1, 2]
    for r in (one, two):
        assert r["requests"] == 6 and sum(r["per_replica"]) == 6
        assert r["generated"] <= 6 * 2
        assert r["prefilled"] == r["prompt_tokens"] - r["reused"]
        # every later turn reuses what its session sent before (on whichever replica; a
        # first turn's ceiling may be the other copy's, sent at the same moment)
        later = [x for i, x in enumerate(r["rows"])
                 if x["session"] in {y["session"] for y in r["rows"][:i]}]
        assert len(later) == 4 and all(x["reused"] >= x["ceiling"] >= 200 for x in later), r
        assert r["reused_share"] == round(r["reused"] / r["prompt_tokens"], 4)
    # the same requests both times: same seed, fresh stores
    assert (one["prompt_tokens"], one["ceiling"]) == (two["prompt_tokens"], two["ceiling"])
    # each copy's session names its routing key: one session a replica
    assert one["per_replica"] == [6] and two["per_replica"] == [3, 3]
    assert one["x"] == 1.0 and two["x"] == round(two["tok_s"] / one["tok_s"], 2)
    assert [line.split()[:3] for line in lines] == [["fleet-trace", "1", "replica"],
                                                    ["fleet-trace", "2", "replicas"]]


def test_bad_arguments_are_usage_errors(capsys):
    for argv, message in ((["--replicas", "0,2"], "replica counts must be >= 1"),
                          (["--traces", "nope"], "unknown trace 'nope'"),
                          (["--replicas", "1,3", "--cpus", "0,1"],
                           "--cpus names 2 CPU sets for 3 replicas")):
        with pytest.raises(SystemExit) as exc:
            fleet_trace.parse(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
