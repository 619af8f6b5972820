"""bench/buckets.py: the bucket sizes take turns step by step and must leave the same params."""

from __future__ import annotations

import json

from conftest import TINY, bench_arguments, run_bench


def test_the_sizes_agree_and_the_table_prints(tmp_path):
    out = tmp_path / "buckets.json"
    p = run_bench("buckets.py", "--config", str(TINY), "--buckets", "0,0.002", "--steps", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr  # the bench stops if the sizes' params differ
    rows = json.loads(out.read_text())["rows"]
    assert [r["bucket_mb"] for r in rows] == [0, 0.002] and rows[0]["vs_first"] == 1
    assert rows[0]["buckets"] == 0 and rows[1]["buckets"] > 5 and "| 0.002 |" in p.stdout


def test_bad_arguments_exit_2():
    for args, message in [(("--buckets", "x"), "--buckets must be numbers of MB"),
                          (("--buckets", "-1"), "--buckets must be sizes >= 0")]:
        p = bench_arguments("buckets.py", *args)
        assert p.returncode == 2 and message in p.stderr, p.stderr
