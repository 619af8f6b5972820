"""bench/archs.py on a tiny model: one row per architecture, compared with the first."""

from __future__ import annotations

import json

import pytest
from conftest import run_bench, set_args

pytest.importorskip("transformers")

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.ctx=32", "train.batch_size=4",
        "train.eval_batches=2", "train.inner_steps=4", "topology.workers=2"]


def test_archs_on_a_tiny_model(tmp_path):
    out = tmp_path / "archs.json"
    p = run_bench("archs.py", "--rounds", "2", "--archs", "gpt,qwen3", *set_args(TINY), "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["arch"] for r in rows] == ["gpt", "qwen3"]
    assert rows[0]["vs_first_pct"] == 0.0 and rows[0]["speed_vs_first"] == 1.0
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"] and rows[0]["params"] != rows[1]["params"]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_an_unknown_arch_exits_2_with_one_line():
    p = run_bench("archs.py", "--archs", "gpt,bert", timeout=60)
    assert p.returncode == 2 and "model.arch must be gpt, llama, mistral, qwen2, qwen3, got 'bert'" in p.stderr
