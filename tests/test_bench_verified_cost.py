"""configs/verified.toml and bench/verified_cost.py: the verified job is valid, and the bench runs
the three rows side by side (shrunk to a tiny model here)."""

from __future__ import annotations

import json

from conftest import ROOT, bench_arguments, set_args

from veriloco.config import load_config

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.ctx=32", "train.inner_steps=10",
        "verify.trace_every=5", "train.batch_size=4", "train.eval_batches=2"]


def test_the_verified_config_turns_every_layer_on():
    cfg = load_config(ROOT / "configs" / "verified.toml")
    default = load_config(ROOT / "configs" / "default.toml")
    assert cfg.train.inner_state == "reset" and cfg.train.round_warmup_steps == 10
    assert cfg.verify.replay_probability == 0.1
    assert cfg.verify.loss_gain_batches == 1 and cfg.verify.aggregator == "trimmed_mean"
    assert cfg.verify.replay_extent == "round" and cfg.verify.ban
    # the same job as `make run` otherwise
    for section in ("model", "outer", "topology"):
        assert cfg.to_dict()[section] == default.to_dict()[section]
    mine, theirs = ({k: v for k, v in c.to_dict()["train"].items() if k not in ("inner_state", "round_warmup_steps")}
                    for c in (cfg, default))
    assert mine == theirs


def test_verified_cost_on_a_tiny_model(tmp_path):
    out = tmp_path / "vc.json"
    sets = set_args(TINY)
    p = bench_arguments("verified_cost.py", "--rounds", "2", *sets, "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "reset", "reset+ramp", "keep+ramp", "verified"]
    assert all(r["rejections"] == 0 and r["submissions"] == 8 for r in rows.values())  # 4 honest workers x 2
    assert rows["plain"]["loss_vs_plain_pct"] == 0.0
    assert len({r["eval_loss"] for r in rows.values()}) == 5  # five different runs
    assert rows["verified"]["verify_cpu"]["loss_gain"] > 0 and rows["plain"]["verify_cpu"]["loss_gain"] == 0


def test_a_bad_override_exits_2_with_one_line():
    p = bench_arguments("verified_cost.py", "--set", "train.nope=1", timeout=60)
    assert p.returncode == 2 and "nope" in p.stderr.splitlines()[-1]
