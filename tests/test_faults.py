"""Faults: a worker that dies mid-run ends the run with a clear error, never a hang or a half-applied round."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import train


def test_dead_worker_is_an_error_not_a_hang(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    cfg = tiny("--topology.workers=3", "--train.rounds=4", "--run.timeout_s=20", "--adversary.2=red_team:Dies:at=2")
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="exit code 9|exited|terminated"):
        train(cfg, str(tmp_path / "run"), quiet=True)
    assert time.perf_counter() - t0 < 120
    recs = rounds_of(tmp_path / "run")
    assert [r["round"] for r in recs] == [0, 1]  # round 2 never recorded: nothing half-applied
    assert audit_run(tmp_path / "run").ok  # what was recorded is whole and verifies
