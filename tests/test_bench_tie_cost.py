"""bench/tie_cost.py refuses sizes it cannot run before training anything."""

from __future__ import annotations

from conftest import bench_arguments


def test_bad_arguments_exit_2():
    p = bench_arguments("tie_cost.py", "--vocab", "100")
    assert p.returncode == 2 and "--vocab must be >= 256" in p.stderr
