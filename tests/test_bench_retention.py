"""bench/retention.py: the same run keeping every checkpoint and the newest N, each audited."""

from __future__ import annotations

import json

from conftest import TINY, bench_arguments, run_bench

SMALL = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=1"]


def test_the_pruned_run_holds_fewer_checkpoints_and_audits(tmp_path):
    out = tmp_path / "retention.json"
    p = run_bench("retention.py", "--keep", "2", "--rounds", "3", "--config", str(TINY), *SMALL, "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())  # (the bench stops if the params or the audits differ)
    full, kept = result["rows"]
    assert (full["keep"], full["checkpoints_held"], kept["keep"], kept["checkpoints_held"]) == (0, 3, 2, 2)
    assert kept["store_bytes"] < full["store_bytes"] and "1 pruned from the store" in kept["audit"]
    assert "ratio" in p.stdout and "audit, keep 2: audit ok" in p.stdout


def test_bad_arguments_exit_2():
    for args, message in [(("--keep", "1"), "--keep must be >= 2"), (("--keep", "3", "--rounds", "3"), "--rounds > --keep")]:
        p = bench_arguments("retention.py", *args)
        assert p.returncode == 2 and message in p.stderr, p.stderr
