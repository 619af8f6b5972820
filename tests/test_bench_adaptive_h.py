"""bench/adaptive_h.py, shrunk to a tiny model: the adaptive row's H grows where the fixed row's
cannot hide its exchange, and the third row matches the adaptive row's tokens at fixed H."""

from __future__ import annotations

import json

from conftest import bench_arguments, set_args

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.ctx=32", "train.batch_size=4",
        "train.eval_batches=2", "topology.workers=2", "train.warmup_steps=5"]


def test_adaptive_h_on_a_tiny_model(tmp_path):
    out = tmp_path / "ah.json"
    sets = set_args(TINY)
    p = bench_arguments("adaptive_h.py", "--rounds", "4", "--inner-steps", "5", "--bandwidth", "2mbit", "--max", "20",
                  *sets, "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fixed", "adaptive", "fixed, same tokens", "fixed, same wall", "adaptive codec",
                          "adaptive codec + H"]
    fixed, adaptive, same = list(rows.values())[:3]
    assert fixed["inner_steps"] == [None] * 4 and fixed["hide_steps"][0] > 5  # H = 5 cannot hide it
    assert adaptive["inner_steps"][:2] == [5, 5] and adaptive["inner_steps"][-1] > 5
    assert adaptive["tokens"] > fixed["tokens"] and same["rounds"] > 4
    assert abs(same["tokens"] - adaptive["tokens"]) <= fixed["tokens"] / 4 / 2  # within half a round
    assert adaptive["exchange_wait_s"] < same["exchange_wait_s"]  # fewer, hidden exchanges for the same tokens
    assert rows["adaptive codec"]["codecs_last_round"] and "fp32" not in rows["adaptive codec"]["codecs_last_round"]
    assert rows["fixed"]["loss_vs_fixed_pct"] == 0.0


def test_a_bad_override_exits_2_with_one_line():
    p = bench_arguments("adaptive_h.py", "--set", "train.nope=1", timeout=60)
    assert p.returncode == 2 and "nope" in p.stderr.splitlines()[-1]
