"""Worker processes start from the forkserver (procs.py) or, where there is none, with spawn;
the run is the same either way."""

from __future__ import annotations

from conftest import rounds_of, tiny

from veriloco import procs
from veriloco.run import train


def test_forkserver_and_spawn_runs_are_bit_identical(tmp_path, monkeypatch):
    cfg = tiny("--train.rounds=2", "--train.inner_steps=2")
    assert procs.START_METHOD == "forkserver"  # Linux: the fast path is the one CI takes
    train(cfg, str(tmp_path / "fork"), quiet=True)
    monkeypatch.setattr(procs, "START_METHOD", "spawn")  # the fallback where there is no forkserver
    train(cfg, str(tmp_path / "spawn"), quiet=True)
    a, b = rounds_of(tmp_path / "fork"), rounds_of(tmp_path / "spawn")
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
