"""bench/replicas.py: the one-process and the replicas' runs, side by side, must agree bit for bit."""

from __future__ import annotations

import json

from conftest import TINY, bench_arguments


def test_the_ways_agree_and_the_table_prints(tmp_path):
    out = tmp_path / "replicas.json"
    p = bench_arguments("replicas.py", "--config", str(TINY), "--workers", "2", "--rounds", "2", "--repeats", "1",
                        "--bucket-mb", "0.002", "--out", str(out))
    assert p.returncode == 0, p.stderr  # the bench stops if the ways' params or eval losses differ
    result = json.loads(out.read_text())
    assert [r["way"] for r in result["rows"]] == ["1 process", "2 replicas", "2 replicas, whole optimizer",
                                                  "2 replicas, reduce after the backward"]
    assert result["speedup"] > 0
    assert "| 2 replicas |" in p.stdout and len(result["final"]) == 2


def test_pipelined_ways_agree(tmp_path):
    out = tmp_path / "replicas.json"
    p = bench_arguments("replicas.py", "--config", str(TINY), "--workers", "1", "--stages", "2", "--rounds", "2",
                        "--repeats", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert [r["way"] for r in json.loads(out.read_text())["rows"]] == [
        "2 stages", "2 stages x 2 replicas", "2 stages x 2 replicas, whole optimizer"]


def test_bad_arguments_exit_2():
    p = bench_arguments("replicas.py", "--replicas", "1")
    assert p.returncode == 2 and "--replicas >= 2" in p.stderr
    p = bench_arguments("replicas.py", "--bucket-mb", "-1")
    assert p.returncode == 2 and "--bucket-mb must be >= 0, got -1.0" in p.stderr
