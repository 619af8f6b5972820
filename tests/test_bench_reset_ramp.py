"""bench/reset_ramp.py on a tiny model: keep, reset and reset with a ramp are three different runs,
compared with keep."""

from __future__ import annotations

import json

from conftest import bench_arguments, set_args

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.ctx=32", "train.batch_size=4",
        "train.eval_batches=2"]


def test_reset_ramp_on_a_tiny_model(tmp_path):
    out = tmp_path / "rr.json"
    sets = set_args(TINY)
    p = bench_arguments("reset_ramp.py", "--rounds", "2", "--inner-steps", "6", "--ramps", "2,3", *sets, "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["inner_state"], r["round_warmup_steps"]) for r in rows] == [
        ("keep", "keep", 0), ("reset", "reset", 0), ("reset+ramp2", "reset", 2), ("reset+ramp3", "reset", 3)]
    assert rows[0]["vs_keep_pct"] == 0.0 and len({r["eval_loss"] for r in rows}) == 4


def test_a_ramp_longer_than_a_round_exits_2_with_one_line():
    p = bench_arguments("reset_ramp.py", "--inner-steps", "5", "--ramps", "9", timeout=60)
    assert p.returncode == 2 and "round_warmup_steps must be in [0, train.inner_steps = 5], got 9" in p.stderr
