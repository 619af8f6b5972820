"""bench/two_workers.py: 2 workers, worker 1 attacking, the loss-gain screen rejecting."""

from __future__ import annotations

import json

from conftest import bench_arguments


def test_a_noop_worker_is_refused_every_round_and_an_honest_pair_is_counted_twice(tmp_path):
    out = tmp_path / "two.json"
    # in-process main(): each run is `veriloco train` in a fresh interpreter of its own
    p = bench_arguments("two_workers.py", "--attacks", "honest,noop", "--seeds", "0", "--rounds", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["old"] is None and {r["side"] for r in result["rows"]} == {"new"}
    summary = {s["attack"]: s for s in result["summary"]}
    noop, honest = summary["noop"], summary["honest"]
    # the zero update gains nothing on its own batches: refused from the first round
    assert noop["refused"] == 1.0 and noop["rounds_to_detect"] == 1 and noop["honest_submissions"] == 2
    # both workers of the honest run are honest: 2 submissions a round
    assert honest["honest_submissions"] == 4 and 0 <= honest["false_refusals"] <= 4
    assert "| noop | new | 100.0% | 1 |" in p.stdout


def test_bad_arguments_exit_2():
    p = bench_arguments("two_workers.py", "--attacks", "honest,teleport")
    assert p.returncode == 2 and "unknown attack(s) teleport" in p.stderr
    p = bench_arguments("two_workers.py", "--seeds", "a")
    assert p.returncode == 2 and "--seeds must be integers" in p.stderr
