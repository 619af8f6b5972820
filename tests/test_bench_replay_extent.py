"""bench/replay_extent.py: a whole-round replay catches a lazy worker every time it is drawn, a
replay to a drawn segment only when the segment reaches the skipped steps; the tally on made-up
records and one tiny run."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, bench_arguments

sys.path.insert(0, str(ROOT / "bench"))
import replay_extent  # noqa: E402


def _rec(verdicts, evidence, replay_cpu, inner_cpu=(1.0, 1.0, 1.0, 1.0)):
    return {"verdicts": verdicts, "evidence": evidence, "replay_cpu_s": list(replay_cpu),
            "inner_cpu_s": list(inner_cpu), "train_loss": [2.0] * 4}


def test_tally_prices_a_replay_from_the_rounds_that_convicted_no_one():
    recs = [
        _rec(["accept"] * 4, {"1": {"replayed": {"segment": 0, "auditor": 2}}, "3": {"replayed": {"segment": 1}}},
             (0.0, 0.0, 0.5, 0.3)),  # two replays, 0.8 s
        _rec(["accept", "replay_mismatch", "accept", "accept"], {"1": {"segment": 1, "first_mismatch": 2}},
             (2.0, 0.0, 2.0, 2.0)),  # a conviction: every member replayed it, not counted in the price
        _rec(["accept"] * 4, {}, (0.0,) * 4),
    ]
    t = replay_extent.tally(recs)
    assert (t["replays"], t["catches"], t["segments"]) == (2, 1, [0, 1])
    assert (t["pool_replays"], t["pool_replay_cpu_s"], t["worker_rounds"], t["inner_cpu_s"]) == (2, 0.8, 12, 12.0)
    row = replay_extent.summarize("segment", [t])
    assert row["catch_per_replay"] == 0.5 and row["replay_cost_worker_rounds"] == pytest.approx(0.4)
    assert row["catches_per_replayed_round"] == pytest.approx(1.25)


def test_replay_extent_on_a_tiny_run(tmp_path):
    out = tmp_path / "re.json"
    p = bench_arguments("replay_extent.py", "--seeds", "1", "--rounds", "3", "--inner-steps", "4", "--trace-every", "2",
                  "--replay", "1.0", "--out", str(out))
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    whole, seg, state = res["rows"]
    assert (whole["extent"], seg["extent"], state["extent"]) == ("round", "segment", "state")
    # lazy:skip=0.25 trains 3 of 4 steps: segment 1 holds the skipped one
    assert whole["replays"] == whole["catches"] == 3 and set(whole["per_seed"][0]["segments"]) == {1}
    for row in (seg, state):  # from step 0, or from the state at step 2: caught when segment 1 is drawn
        caught = [s == 1 for s in row["per_seed"][0]["segments"]]
        assert row["replays"] == 3 and row["catches"] == sum(caught)
    # segment 1 needs a sent state (segment 0 starts from the round's public start)
    assert state["state_bytes_per_worker_round"] > 0 or state["catches"] == 0
    assert whole["state_bytes_per_worker_round"] == seg["state_bytes_per_worker_round"] == 0


def test_trace_every_must_divide_inner_steps():
    p = bench_arguments("replay_extent.py", "--inner-steps", "10", "--trace-every", "3", timeout=60)
    assert p.returncode == 2 and "--trace-every (3) must divide --inner-steps (10)" in p.stderr.splitlines()[-1]
