"""bench/screen_memory.py: one round's screen of model-sized deltas, an old revision against the tree."""

from __future__ import annotations

import json

from conftest import bench_arguments


def test_both_sides_screen_the_same_deltas_to_the_same_evidence(tmp_path):
    out = tmp_path / "screen_memory.json"
    # 1.6M params a delta: longer than one fold, so the new side reads the deltas a chunk at a time.
    # In-process main(): each call is measured in a fresh interpreter of its own
    p = bench_arguments("screen_memory.py", "--old", "HEAD", "--workers", "3", "--calls", "screen,median",
                        "--repeats", "1", "--d-model", "256", "--layers", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]  # (the bench stops if the results differ)
    assert [(r["call"], r["workers"]) for r in rows] == [("screen", 3), ("median", 3)]
    assert all(r["params"] > 1 << 20 for r in rows)
    assert all(r["old_s"] > 0 and r["new_s"] > 0 and r["new_held_mb"] >= 0 for r in rows)
    assert p.stdout.count("results identical") == 2


def test_bad_arguments_exit_2():
    for args in (["--workers", "a"], ["--workers", "0"], ["--d-model", "100"], ["--repeats", "0"], ["--calls", "sort"]):
        p = bench_arguments("screen_memory.py", *args)
        assert p.returncode == 2 and "screen_memory.py: error:" in p.stderr, (args, p.stderr)
