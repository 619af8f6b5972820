"""bench/elastic_freeze.py, one short trial: a worker frozen in round 2's exchange is left out of
that round (the others give its group up) and the audit passes."""

from __future__ import annotations

import json

from conftest import bench_arguments


def test_one_freeze_trial(tmp_path):
    out = tmp_path / "freeze.json"
    p = bench_arguments("elastic_freeze.py", "--freezes", "3", "--trials", "1", "--delays", "0", "--rounds", "6",
                  "--out", str(out))
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["freeze_s"] == 3.0 and row["trials"] == 1 and row["incomplete_or_audit_failed"] == 0
    assert row["trials_frozen_worker_in_round"] == 0 and row["frozen_round_max_s"] < 3.0
    (trial,) = res["trials"]
    assert trial["frozen_round_members"] == [0, 2] and trial["first_round_without_1"] == 2


def test_bad_arguments_exit_with_one_line():
    p = bench_arguments("elastic_freeze.py", "--freezes", "0", timeout=60)
    assert p.returncode == 2 and "--freezes must be seconds in (0, 60]" in p.stderr.splitlines()[-1]
