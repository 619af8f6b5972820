"""bench/archs.py on a tiny model: one row per architecture, compared with the first (run in this
process: the bench's main() takes its arguments)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, set_args

pytest.importorskip("transformers")

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.ctx=32", "train.batch_size=4",
        "train.eval_batches=2", "train.inner_steps=4", "topology.workers=2"]


@pytest.fixture
def archs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import archs as module

    yield module
    sys.modules.pop("archs", None)


def test_archs_on_a_tiny_model(tmp_path, archs):
    out = tmp_path / "archs.json"
    archs.main(["--rounds", "1", "--archs", "gpt,qwen3", *set_args(TINY), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["arch"] for r in rows] == ["gpt", "qwen3"]
    assert rows[0]["vs_first_pct"] == 0.0 and rows[0]["speed_vs_first"] == 1.0
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"] and rows[0]["params"] != rows[1]["params"]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_an_unknown_arch_exits_2_with_one_line(archs, capsys):
    with pytest.raises(SystemExit) as e:
        archs.main(["--archs", "gpt,bert"])
    assert e.value.code == 2 and "model.arch must be gpt, llama, mistral, qwen2, qwen3, olmo2, smollm3, got 'bert'" in capsys.readouterr().err
