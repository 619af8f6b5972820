"""bench/buckets.py: the bucket sizes take turns step by step and must leave the same params."""

from __future__ import annotations

import json
import sys

from conftest import ROOT, TINY, bench_arguments


def test_the_sizes_agree_and_the_table_prints(tmp_path, capsys):
    """In this process, imported by its name (its two replicas, from veriloco's forkserver, import
    it the same way: bench/ is on the path they are given)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import buckets

    out = tmp_path / "buckets.json"
    buckets.main(["--config", str(TINY), "--buckets", "0,0.002", "--steps", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]  # (the bench stops if the sizes' params differ)
    assert [r["bucket_mb"] for r in rows] == [0, 0.002] and rows[0]["vs_first"] == 1
    assert rows[0]["buckets"] == 0 and rows[1]["buckets"] > 5 and "| 0.002 |" in capsys.readouterr().out


def test_bad_arguments_exit_2():
    for args, message in [(("--buckets", "x"), "--buckets must be numbers of MB"),
                          (("--buckets", "-1"), "--buckets must be sizes >= 0")]:
        p = bench_arguments("buckets.py", *args)
        assert p.returncode == 2 and message in p.stderr, p.stderr
