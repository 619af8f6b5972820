"""bench/verify.py's overhead split, on made-up records and on one real (tiny) run's, so a change
in the records the bench reads shows up here rather than 20 minutes into a bench run."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, tiny

from veriloco.run import train

sys.path.insert(0, str(ROOT / "bench"))
import verify  # noqa: E402


def rec(inner, compute, wall, replay, loss_gain, replayed=()):
    return {"inner_s": inner, "verify_compute_s": compute, "verify_s": wall, "replay_s": replay,
            "loss_gain_s": loss_gain, "evidence": {str(j): {"replayed": {"segment": 0}} for j in replayed}}


def test_overhead_splits_into_checks_loss_gains_and_replays():
    recs = [rec([10.0, 10.0], [1.0, 3.0], [2.0, 3.0], [0.0, 2.0], [0.2, 0.2], replayed=[0]),
            rec([10.0, 10.0], [0.5, 0.5], [0.5, 0.5], [0.0, 0.0], [0.2, 0.2])]
    out = verify.overhead_of([recs], 0.1)
    assert out["inner_s"] == 40.0 and out["worker_rounds"] == 4 and out["replays"] == 1
    assert out["overhead"] == pytest.approx(5.0 / 40) and out["overhead_wall"] == pytest.approx(6.0 / 40)
    assert out["replay"] == pytest.approx(2.0 / 40) and out["loss_gain"] == pytest.approx(0.8 / 40)
    assert out["checks"] == pytest.approx((5.0 - 2.0 - 0.8) / 40)
    assert out["replay_cost_per_worker_round"] == pytest.approx(2.0 / 10.0)  # one replay, 10 s per worker-round
    assert out["overhead_expected"] == pytest.approx(out["checks"] + out["loss_gain"] + 0.1)
    assert "cpu" not in out  # records without CPU seconds


def test_the_cpu_split_reads_the_cpu_seconds():
    recs = [rec([10.0, 10.0], [1.0, 3.0], [2.0, 3.0], [0.0, 2.0], [0.2, 0.2], replayed=[0])
            | {"inner_cpu_s": [5.0, 5.0], "verify_cpu_s": [0.5, 1.5], "replay_cpu_s": [0.0, 1.0],
               "loss_gain_cpu_s": [0.1, 0.1]}]
    cpu = verify.overhead_of([recs], 0.1)["cpu"]
    assert cpu["overhead"] == pytest.approx(2.0 / 10) and cpu["replay"] == pytest.approx(1.0 / 10)
    assert cpu["checks"] == pytest.approx((2.0 - 1.0 - 0.2) / 10) and cpu["loss_gain"] == pytest.approx(0.2 / 10)
    assert cpu["replay_cost_per_worker_round"] == pytest.approx(1.0 / 5.0)
    assert cpu["overhead_expected"] == pytest.approx(cpu["checks"] + cpu["loss_gain"] + 0.1)


def test_the_records_of_a_real_run_have_what_the_split_reads(tmp_path):
    run, _ = train(tiny("--topology.workers=3", "--train.rounds=2", "--train.inner_steps=3", "--verify.trace_every=3",
                        "--train.inner_state=reset", "--verify.replay_probability=0.5",
                        "--verify.loss_gain_batches=1"), str(tmp_path / "r"), quiet=True)
    recs = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
    out = verify.overhead_of([recs], 0.5)
    assert out["worker_rounds"] == 6 and out["inner_s"] > 0
    assert 0 < out["loss_gain"] < out["overhead"] and out["checks"] > 0
    cpu = out["cpu"]  # CPU seconds: each at most its wall seconds, give or take the clocks' ticks
    assert 0 < cpu["inner_s"] <= out["inner_s"] + 0.05 and 0 < cpu["loss_gain"] < cpu["overhead"] and cpu["checks"] > 0
    for r in recs:
        assert all(c <= s + 0.05 for c, s in zip(r["verify_cpu_s"], r["verify_compute_s"], strict=True))
    assert all(len(verify.recorded_gains(r)) == 3 for r in recs)  # what the floor what-if reads


def test_until_caught_stops_at_the_first_refusal_and_matches_the_whole_run(tmp_path):
    """--until-caught continues a run one round at a time and stops at the first round that
    refuses worker 1: the records up to there are the uninterrupted run's, bit for bit."""
    base = ["--topology.workers=3", "--train.rounds=4", "--train.inner_steps=3", "--verify.trace_every=3",
            "--train.inner_state=reset", "--model.d_model=16", "--train.eval_every=1000"]
    stale = ["--adversary.1=stale"]  # accepted in round 0 (nothing older to resend), refused from round 1
    whole = verify.run_one(base, stale, tmp_path / "whole")
    assert [r["verdicts"][1] != "accept" for r in whole] == [False, True, True, True]
    short = verify.run_one(base, stale, tmp_path / "short", until_refused=1)
    assert len(short) == 2
    for a, b in zip(short, whole, strict=False):
        assert (a["params_hash"], a["verdicts"], a["bundles"]) == (b["params_hash"], b["verdicts"], b["bundles"])
    honest = verify.run_one(base, [], tmp_path / "honest", until_refused=1)  # never refused: every round
    assert len(honest) == 4 and all(v == "accept" for r in honest for v in r["verdicts"])


def test_the_attack_list_keeps_each_attacks_parameters():
    assert verify.split_attacks("lazy:skip=0.25,scale=none,lazy:skip=0.5, noop,,alie:z=2") == [
        "lazy:skip=0.25,scale=none", "lazy:skip=0.5", "noop", "alie:z=2"]
    assert verify.split_attacks("") == []


def gains_rec(gains: dict[int, float | None]) -> dict:
    """A record whose drawn checkers reported these own-batch gains (None: reported nothing)."""
    return {"loss_gain_reports": {str(j): [[(j + 1) % 4] if g is None else [(j + 1) % 4, 5.0, 5.0 - g]]
                                  for j, g in gains.items()}}


def test_the_floor_whatif_counts_honest_suspects_and_the_attackers_first_failing_round():
    # r0's median gain (index 2 of 4) is 0.4: floors 0.1 / 0.2 / 0.3 at shares 0.25 / 0.5 / 0.75
    r0 = gains_rec({0: 0.4, 1: 0.35, 2: 0.5, 3: 0.15})  # worker 3 (honest) fails from 0.5 on
    r1 = gains_rec({0: 0.4, 1: 0.25, 2: 0.5, 3: 0.45})  # the attacker fails at 0.75 only
    r2 = gains_rec({0: 0.4, 1: 0.05, 2: 0.5, 3: None})  # 3 unreported; median of 3 is 0.4: 1 fails at all
    out = verify.floor_whatif([(r0, 1), (r1, 1), (r2, 1), (gains_rec({0: 1.0, 1: 1.0, 2: 1.0}), None)],
                              {"lazy": [[r0, r1, r2], [r0]]})
    assert out["0.25"]["honest_suspects"] == 0 and out["0.25"]["honest_worker_rounds"] == 3 + 3 + 2 + 3
    assert out["0.5"]["honest_suspects"] == 1 and out["0.75"]["honest_suspects"] == 1
    assert out["0.25"]["attacker_first_suspect_round"] == {"lazy": [3, None]}
    assert out["0.75"]["attacker_first_suspect_round"] == {"lazy": [2, None]}
    assert verify.recorded_gains(r2)[1].own_gain == pytest.approx(0.05) and 3 not in verify.recorded_gains(r2)
