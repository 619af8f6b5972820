"""bench/two_workers.py: 2 workers, worker 1 attacking, the loss-gain screen rejecting."""

from __future__ import annotations

import json
import sys

from conftest import ROOT, bench_arguments

sys.path.insert(0, str(ROOT / "bench"))


def test_a_noop_worker_is_refused_every_round(tmp_path):
    out = tmp_path / "two.json"
    # in-process main(): each run is `veriloco train` in a fresh interpreter of its own
    p = bench_arguments("two_workers.py", "--attacks", "noop", "--seeds", "0", "--rounds", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["old"] is None and [r["side"] for r in result["rows"]] == ["new"]
    (noop,) = result["summary"]
    # the zero update gains nothing on its own batches: refused from the first round
    assert noop["refused"] == 1.0 and noop["rounds_to_detect"] == 1 and noop["honest_submissions"] == 2
    assert "| noop | new | 100.0% | 1 |" in p.stdout


def test_an_honest_pair_counts_both_workers_as_honest():
    from two_workers import summarise

    rows = [{"attack": a, "side": "new", "seed": 0, "refused": 1, "rounds": 5, "first_refused": 3,
             "false_refusals": 2, "eval_loss": 3.0} for a in ("honest", "noise")]
    honest, noise = summarise(rows)
    # honest: worker 1's refusals are false too, and both workers submit every round
    assert (honest["false_refusals"], honest["honest_submissions"]) == (3, 10)
    assert (noise["false_refusals"], noise["honest_submissions"], noise["refused"]) == (2, 5, 0.2)


def test_bad_arguments_exit_2():
    p = bench_arguments("two_workers.py", "--attacks", "honest,teleport")
    assert p.returncode == 2 and "unknown attack(s) teleport" in p.stderr
    p = bench_arguments("two_workers.py", "--seeds", "a")
    assert p.returncode == 2 and "--seeds must be integers" in p.stderr
