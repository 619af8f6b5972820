"""bench/startup.py --cold: a fresh `veriloco train` and `veriloco config`, an old revision's src against the working tree's."""

from __future__ import annotations

import json

from conftest import bench_arguments, run_bench


def test_cold_commands_of_both_sides_count_the_processes_they_started(tmp_path):
    out = tmp_path / "startup-cold.json"
    p = run_bench("startup.py", "--cold", "HEAD", "--repeats", "1", "--workers", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    rows = {(r["command"], r["side"]): r for r in result["rows"]}
    commands = ("train", "audit", "audit-replay", "config", "bad-config", "bad-codec")  # (1 worker: nothing to replay)
    assert set(rows) == {(c, s) for c in commands for s in ("old", "new")}
    for side in ("old", "new"):
        train, config = rows["train", side], rows["config", side]
        # a run's CPU includes its forkserver's (and so its worker's), which outlives the command and is
        # reaped by the bench; the config command starts no process
        assert train["orphans"] >= 1 and config["orphans"] == 0 and rows["audit", side]["orphans"] == 0
        assert train["cpu_s"] > config["cpu_s"] + 1.0 and train["wall_s"] > config["wall_s"]
    assert set(result["ratio"]) == set(commands) and "veriloco audit " in p.stdout
    # the one-line errors come before torch's import: far under a run's start (old == new here: both HEAD)
    assert rows["bad-config", "new"]["wall_s"] < rows["train", "new"]["wall_s"] / 4
    assert rows["bad-codec", "new"]["wall_s"] < rows["train", "new"]["wall_s"] / 4


def test_bad_arguments_exit_2():
    p = bench_arguments("startup.py", "--repeats", "0")
    assert p.returncode == 2 and "--repeats and --workers must be >= 1" in p.stderr
