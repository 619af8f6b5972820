"""bench/corpus_roots.py refuses a --before that is not a checkout's src directory."""

from __future__ import annotations

from conftest import bench_arguments


def test_a_before_that_is_no_checkout_exits_2(tmp_path):
    p = bench_arguments("corpus_roots.py", "--before", str(tmp_path))
    assert p.returncode == 2 and "not a checkout's src directory" in p.stderr
