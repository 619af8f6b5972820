"""bench/audit_memory.py: one run stopped, copied and resumed; each length audited by an old and the new code."""

from __future__ import annotations

import json

from conftest import TINY, bench_arguments, run_bench

SMALL = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=1", "--set", "train.inner_steps=2"]


def test_both_sides_audit_both_lengths_and_the_slope_prints(tmp_path):
    out = tmp_path / "audit_memory.json"
    p = run_bench("audit_memory.py", "--old", "HEAD", "--rounds", "2,3", "--config", str(TINY), *SMALL, "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())  # (the bench stops if an audit fails)
    assert sorted((r["side"], r["rounds"]) for r in result["rows"]) == [("new", 2), ("new", 3), ("old", 2), ("old", 3)]
    assert all(r["peak_rss_mb"] > 100 and r["seconds"] > 0 for r in result["rows"])
    assert set(result["mb_per_round"]) == {"old", "new"} and "peak memory added per round" in p.stdout


def test_bad_arguments_exit_2():
    for rounds in ("4", "3,3", "1,4", "a,b"):
        p = bench_arguments("audit_memory.py", "--rounds", rounds)
        assert p.returncode == 2 and "--rounds must be" in p.stderr, (rounds, p.stderr)
