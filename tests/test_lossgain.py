"""Shared loss gains (verify/lossgain.py): each packet's gain is computed by its drawn checker, not
by every worker; a failing, missing or disputed number is recomputed by everyone, a checker whose
number does not reproduce is convicted, and the offline audit names one that vouched falsely."""

from __future__ import annotations

import math

import pytest
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import train
from veriloco.verify.lossgain import (
    assign_checkers,
    gain_floor,
    misreports,
    reports_from_json,
    reports_to_json,
    settle,
)
from veriloco.verify.screen import LossGain


def g(before: float, after: float) -> LossGain:
    return LossGain.on_own_batches(before, after)


TRUE = {0: g(5.0, 4.6), 1: g(5.0, 4.5), 2: g(5.0, 4.55), 3: g(5.0, 4.7)}


def computer(true=TRUE):
    calls: list[int] = []

    def compute(j: int) -> LossGain:
        calls.append(j)
        return true[j]

    return compute, calls


def test_checkers_are_distinct_others_and_the_draw_depends_on_the_seed():
    workers = [0, 1, 2, 3, 4, 5]
    for n in (1, 2, 5, 9):
        a = assign_checkers("seed", workers, workers, n)
        assert a == assign_checkers("seed", workers, workers, n)
        for w, cs in a.items():
            assert w not in cs and len(cs) == len(set(cs)) == min(n, 5)
    draws = {tuple(assign_checkers(f"s{i}", workers, workers, 1)[0]) for i in range(40)}
    assert len(draws) == 5  # every other worker gets drawn for worker 0 sooner or later
    assert assign_checkers("s", [0], [0, 1, 3], 2)[0] == [1, 3]
    assert assign_checkers("s", [0], [0], 1) == {0: []}  # nobody else: everyone computes it
    assert 2 not in sum(assign_checkers("s", [0, 1, 3], [0, 1, 3], 3).values(), [])  # banned: not eligible


def test_honest_reports_are_taken_without_computing_anything():
    checkers = assign_checkers("s", [0, 1, 2, 3], [0, 1, 2, 3], 1)
    reports = {c[0]: {} for c in checkers.values()}
    for j, (c,) in checkers.items():
        reports[c][j] = TRUE[j]
    compute, calls = computer()
    out = settle([0, 1, 2, 3], checkers, reports, compute)
    assert out.gains == TRUE and calls == [] and out.false_reports == {}


def test_a_missing_or_disputed_report_is_computed_by_everyone():
    checkers = {0: [1], 1: [2, 3], 2: [3], 3: [0]}
    reports = {1: {}, 2: {1: TRUE[1]}, 3: {1: g(5.0, 4.4), 2: TRUE[2]}, 0: {3: TRUE[3]}}  # 0: missing
    compute, calls = computer()
    out = settle([0, 1, 2, 3], checkers, reports, compute)
    assert sorted(calls) == [0, 1] and out.gains == TRUE
    assert list(out.false_reports) == [3]  # of the two that disagree on 1, worker 3's number is wrong
    assert out.false_reports[3]["accused"] == 1


def test_a_failing_report_counts_only_once_recomputed_and_a_false_one_convicts_its_checker():
    checkers = {0: [1], 1: [2], 2: [3], 3: [0]}
    reports = {1: {0: TRUE[0]}, 2: {1: g(5.0, 6.0)}, 3: {2: TRUE[2]}, 0: {3: TRUE[3]}}  # 2 lies about 1
    compute, calls = computer()
    out = settle([0, 1, 2, 3], checkers, reports, compute)
    assert calls == [1] and out.gains[1] == TRUE[1] and list(out.false_reports) == [2]
    # an honestly failing delta stays failing, and its honest checker is not convicted
    true = dict(TRUE) | {1: g(5.0, 5.2)}
    reports[2][1] = true[1]
    compute, calls = computer(true)
    out = settle([0, 1, 2, 3], checkers, reports, compute)
    assert calls == [1] and out.gains[1] == true[1] and out.false_reports == {}
    assert out.gains[1].own_gain <= gain_floor(out.gains)


def test_the_floor_is_a_configurable_share_of_the_median_gain():
    assert gain_floor(TRUE) == pytest.approx(0.25 * 0.45)  # gains 0.4, 0.5, 0.45, 0.3: median 0.45
    assert gain_floor(TRUE, 0.9) == pytest.approx(0.9 * 0.45) and gain_floor(TRUE, 0.0) == 0.0
    assert gain_floor({0: TRUE[0], 1: TRUE[1]}, 0.9) == 0.0  # fewer than 3 deltas: more than nothing
    checkers = {0: [1], 1: [2], 2: [3], 3: [0]}
    reports = {1: {0: TRUE[0]}, 2: {1: TRUE[1]}, 3: {2: TRUE[2]}, 0: {3: TRUE[3]}}
    compute, calls = computer()
    assert settle([0, 1, 2, 3], checkers, reports, compute).gains == TRUE and calls == []
    # at 0.9 of the median, the two deltas below it fail, so every member computes them itself
    out = settle([0, 1, 2, 3], checkers, reports, compute, 0.9)
    assert sorted(calls) == [0, 3] and out.gains == TRUE and out.false_reports == {}


def test_a_delta_that_breaks_the_model_breaks_it_for_everyone():
    true = dict(TRUE) | {2: g(5.0, math.inf)}
    checkers = {0: [1], 1: [2], 2: [3], 3: [0]}
    reports = {1: {0: true[0]}, 2: {1: true[1]}, 3: {2: g(5.0, math.nan)}, 0: {3: true[3]}}
    compute, calls = computer(true)
    out = settle([0, 1, 2, 3], checkers, reports, compute)
    assert calls == [2] and out.false_reports == {}


def test_reports_survive_the_record_and_bad_records_are_refused():
    checkers = {0: [1], 1: [2, 3], 2: [3]}
    reports = {1: {0: g(5.0, 4.5)}, 2: {1: g(5.0, math.inf)}, 3: {1: g(5.0, math.inf)}}  # 3 said nothing on 2
    back_checkers, back = reports_from_json(reports_to_json(checkers, reports), 4)
    assert back_checkers == checkers
    assert back[1][0] == reports[1][0] and back[3][2] is None and math.isnan(back[2][1].own_after)
    assert misreports(checkers, reports, {0: g(5.0, 4.5), 1: g(5.0, 4.0)}) == [(2, 1), (3, 1)]
    for bad in ([], {"9": []}, {"x": []}, {"0": [[1, "a", 2.0]]}, {"0": [[7, 1.0, 2.0]]}, {"0": [[1, 1.0]]},
                {"0": [[1], [1]]}, {"0": "x"}):
        with pytest.raises(ValueError, match="loss_gain_reports"):
            reports_from_json(bad, 4)


LG = ("--topology.workers=4", "--train.rounds=3", "--train.inner_steps=4", "--verify.trace_every=4",
      "--train.inner_state=reset", "--verify.replay_probability=0.25", "--verify.loss_gain_batches=1")


def test_each_gain_is_computed_once_by_a_drawn_checker_and_the_audit_agrees(tmp_path):
    run, _ = train(tiny(*LG), str(tmp_path / "a"), quiet=True)
    for rec in rounds_of(run.root):
        assert rec["verdicts"] == ["accept"] * 4
        reports = rec["loss_gain_reports"]
        assert sorted(reports) == ["0", "1", "2", "3"]
        for j, rows in reports.items():
            assert len(rows) == 1 and rows[0][0] != int(j) and rows[0][2] < rows[0][1]
        assert all(s >= 0 for s in rec["loss_gain_s"])
    assert audit_run(run.root, replay=100).ok


def test_every_worker_computes_every_gain_with_zero_checkers(tmp_path):
    run, _ = train(tiny(*LG, "--verify.loss_gain_checkers=0"), str(tmp_path / "a"), quiet=True)
    recs = rounds_of(run.root)
    assert all("loss_gain_reports" not in r for r in recs)
    assert all(r["verdicts"] == ["accept"] * 4 for r in recs)
    assert audit_run(run.root, replay=100).ok


def test_a_checker_that_fails_honest_deltas_is_convicted_and_one_that_stays_mute_costs_nothing(tmp_path):
    # 5 rounds: worker 2 is drawn to check no packet of a round with probability (2/3)^3; with the
    # salts in the seed (the commit-reveal), 4 rounds drew it none
    run, _ = train(tiny(*LG, "--train.rounds=5", "--adversary.2=false_accuser", "--adversary.3=red_team:Mute"),
                   str(tmp_path / "a"), quiet=True)
    recs = rounds_of(run.root)
    # the first round whose draw gives worker 2 a packet to check (the draw mixes the run id and the
    # salts, so it moves whenever the manifest does): convicted there, banned from the next round on
    drawn = [r for r, rec in enumerate(recs) if any(rows[0][0] == 2 for rows in rec["loss_gain_reports"].values())]
    assert drawn, [rec["loss_gain_reports"] for rec in recs]
    first = drawn[0]
    assert [rec["verdicts"][2] for rec in recs] == ["accept"] * first + ["false_report"] + ["banned"] * (4 - first)
    assert "loss_gain" in recs[first]["evidence"]["2"]
    for j in (0, 1, 3):
        assert [r["verdicts"][j] for r in recs] == ["accept"] * 5
    assert any(rows[0][0] == 3 and len(rows[0]) == 1 for r in recs for rows in r["loss_gain_reports"].values())
    assert audit_run(run.root, replay=100).ok


def test_the_audit_names_a_checker_that_vouched_for_a_number_that_does_not_reproduce(tmp_path):
    # 4 rounds: in 3 the draw (with the commit-reveal's salts) gave worker 0 no packet to check
    run, _ = train(tiny(*LG, "--train.rounds=4", "--adversary.0=red_team:Vouch"), str(tmp_path / "a"), quiet=True)
    recs = rounds_of(run.root)
    assert any(rows[0][0] == 0 for r in recs for rows in r["loss_gain_reports"].values())
    assert all(v == "accept" for r in recs for v in r["verdicts"])  # the round cannot see it
    report = audit_run(run.root, replay=100)
    assert not report.ok
    assert "worker 0 reported a loss gain" in report.first_failure, report.first_failure


def test_the_tested_batches_are_drawn_from_the_seed_not_the_first_ones():
    from veriloco.verify.lossgain import gain_steps

    draws = [gain_steps(f"seed{i}", 20, 2) for i in range(400)]
    assert all(len(set(d)) == 2 and d == sorted(d) and 0 <= d[0] < d[1] < 20 for d in draws)
    assert gain_steps("seed0", 20, 2) == draws[0]  # deterministic: every member and the audit agree
    assert sum(d == [0, 1] for d in draws) <= 10 and len({tuple(d) for d in draws}) > 150  # 1/190 each
    assert max(s for d in draws for s in d) >= 15  # late batches get tested too
    assert gain_steps("s", 3, 5) == [0, 1, 2]  # more asked than there are: all of them


@pytest.mark.parametrize("floor", [0.0, 0.9])
def test_the_floor_decides_who_is_replayed_as_a_suspect_and_the_audit_uses_the_same(tmp_path, floor):
    run, _ = train(tiny(*LG, "--verify.replay_probability=0.01", f"--verify.loss_gain_floor={floor}"),
                   str(tmp_path / "a"), quiet=True)
    recs = rounds_of(run.root)
    suspects = [sorted(int(j) for j, e in r["evidence"].items() if "suspect" in e) for r in recs]
    assert all(v == "accept" for r in recs for v in r["verdicts"])  # honest: a suspect's replay clears it
    expected = []  # the deltas whose recorded gain is under `floor` of the round's median gain
    for r in recs:
        gains = {int(j): rows[0][1] - rows[0][2] for j, rows in r["loss_gain_reports"].items()}
        median = sorted(gains.values())[len(gains) // 2]
        expected.append(sorted(j for j, x in gains.items() if x <= floor * median))
    assert suspects == expected
    # every honest delta gains something; 0.9 of the median makes honest suspects in this run
    assert any(suspects) == (floor > 0), suspects
    assert audit_run(run.root, replay=100).ok
