"""bench/state_replay.py: the replay probability each extent needs for the lazy target, and what it
costs; the arithmetic, and one quick run."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, bench_arguments

sys.path.insert(0, str(ROOT / "bench"))
import state_replay  # noqa: E402


def test_catch_share_counts_the_segments_that_end_past_the_steps_done():
    assert state_replay.catch_share(100, 5, 0.25) == 0.25  # 75 steps done: segments 15-19 of 20
    assert state_replay.catch_share(100, 10, 0.25) == pytest.approx(0.3)  # segment 7 ends at 80 > 75
    assert state_replay.catch_share(20, 1, 0.5) == 0.5
    assert state_replay.catch_share(20, 20, 0.25) == 1.0  # one segment: the whole round


def test_probability_for_the_target():
    p = state_replay.probability_for(0.95, 30)
    assert p == pytest.approx(0.0950, abs=1e-4) and 1 - (1 - p) ** 30 == pytest.approx(0.95)
    assert state_replay.probability_for(0.95, 30, 0.25) == pytest.approx(4 * p)
    assert state_replay.probability_for(0.95, 30, 0.01) == 1.0


def test_quick_run(tmp_path):
    out = tmp_path / "sr.json"
    p = bench_arguments("state_replay.py", "--quick", "--out", str(out), timeout=600)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["no replays", "round", "state"]
    assert rows["state"]["p"] == pytest.approx(2 * rows["round"]["p"], abs=1e-3)  # H = 10, k = 5: c = 1/2
    assert len({r["eval_loss"] for r in rows.values()}) == 1  # replays never change training
    assert rows["no replays"]["state_bytes_per_worker_round"] == rows["round"]["state_bytes_per_worker_round"] == 0
    assert rows["state"]["caught_within"] == pytest.approx(0.95, abs=1e-3)


def test_trace_every_must_divide_inner_steps():
    p = bench_arguments("state_replay.py", "--inner-steps", "10", "--trace-every", "3", timeout=60)
    assert p.returncode == 2 and "--trace-every (3) must divide --inner-steps (10)" in p.stderr.splitlines()[-1]


def test_quick_keep_states(tmp_path):
    out = tmp_path / "ks.json"
    p = bench_arguments("state_replay.py", "--quick", "--keep-states-only", "--out", str(out), timeout=600)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    mem, disk = res["rows"]
    assert (mem["keep_states"], disk["keep_states"]) == ("memory", "disk")
    assert mem["eval_loss"] == disk["eval_loss"]  # where the states wait changes nothing else
    assert mem["kept_files_left"] == disk["kept_files_left"] == 0
    assert all(r["peak_rss_mb_median"] > 0 for r in res["rows"])
