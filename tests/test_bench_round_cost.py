"""bench/round_cost.py: an old revision and the working tree train the same run, alternately."""

from __future__ import annotations

import json

from conftest import TINY, bench_arguments, run_bench

SMALL = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=1"]


def test_old_and_new_send_the_same_packets_and_the_table_prints(tmp_path):
    out = tmp_path / "round_cost.json"
    p = run_bench("round_cost.py", "--old", "HEAD", "--repeats", "1", "--rounds", "2", "--config", str(TINY), *SMALL,
                  "--no-fsync", "--out", str(out))  # (the new side without fsync: the same run, only not durable)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())  # (the bench stops if the two sides sent other packets)
    assert result["old"] == "HEAD" and set(result["median"]) == {"old", "new"}
    assert result["no_fsync"] is True and "new without fsync" in p.stdout
    for side in ("old", "new"):
        m = result["median"][side]
        assert m["round_s"] > m["inner_s"] > 0
        assert abs(m["round_s"] - m["inner_s"] - m["wait_s"] - m["verify_s"] - m["other_s"]) < 1e-9
        assert 0 < m["hash_s"] < m["round_s"]  # G's, the trace's and the aggregate's hashes, timed on both sides
        assert m["write_mb"] > 0.1  # every worker's own file writes, read as it ended (its bundles alone are 0.1 MB)
    assert "new/old" in p.stdout and "model.d_model=32" in result["overrides"]


def test_bad_arguments_exit_2():
    for args, message in [(("--repeats", "0"), "--repeats must be >= 1"), (("--rounds", "1"), "--rounds >= 2")]:
        p = bench_arguments("round_cost.py", *args)
        assert p.returncode == 2 and message in p.stderr, p.stderr
