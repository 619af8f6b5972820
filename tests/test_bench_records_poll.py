"""bench/records_poll.py: whole reads of rounds.jsonl against the follower's polls."""

from __future__ import annotations

import json

from conftest import TINY, bench_arguments, run_bench


def test_the_follower_reads_the_same_records_and_the_table_prints(tmp_path):
    out = tmp_path / "records_poll.json"
    p = run_bench("records_poll.py", "--rounds", "10,50", "--workers", "2", "--config", str(TINY), "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())  # (the bench stops if the follower reads other records)
    assert [r["records"] for r in result["rows"]] == [10, 50] and result["record_bytes"] > 500
    assert all(r["whole_read_ms"] > 0 and r["poll_idle_us"] > 0 for r in result["rows"])
    assert "then a poll" in p.stdout


def test_bad_arguments_exit_2():
    for args in (("--rounds", "x"), ("--rounds", "0"), ("--workers", "1")):
        p = bench_arguments("records_poll.py", *args)
        assert p.returncode == 2 and ("--rounds must be" in p.stderr or "--workers" in p.stderr), p.stderr
