"""bench/torchft_diloco.py: torchft's DiLoCo, the peer `bench/comm.py` compares with, runs here and
trains what veriloco's DiLoCo (fp32 packets, delay 0) trains from the same config.

Until this test, nothing ran torchft's row in CI: when the inner loop's optimizer stopped being a
`torch.optim.Optimizer` (edc6ed5), torchft's step hook failed and the bench printed the row as
skipped, unnoticed until a bench run."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT, tiny

sys.path.insert(0, str(ROOT / "bench"))

from torchft_diloco import run_torchft_diloco, torch_adamw  # noqa: E402


def test_torchft_s_diloco_trains_what_veriloco_s_delay_0_trains(tmp_path):
    """2 workers, 2 rounds of H = 4, outer Nesterov 0.5: torchft's row is not skipped, commits
    every round with one all-reduce of the whole model, and ends at veriloco's eval loss (the
    same init, batches, inner AdamW and outer step; only the average's summation differs)."""
    from veriloco.plan import PARAM_BYTES, make_plan
    from veriloco.run import train

    cfg = tiny("--train.rounds=2", "--train.inner_steps=4", "--train.eval_every=2", "--outer.momentum=0.5",
               "--outer.delay=0", "--compress.codec=fp32")
    row = run_torchft_diloco(cfg, None)
    assert "skipped" not in row, row.get("skipped")
    assert row["commits"] == 2 and row["allreduces_per_worker"] == 2
    assert row["bytes_handed_per_worker"] == 2 * make_plan(cfg).params * PARAM_BYTES
    _, summary = train(cfg, str(tmp_path / "run"), quiet=True)
    assert row["eval_loss"] == pytest.approx(summary["eval_loss_end"], rel=1e-5)
    assert 0 < row["utilisation"] <= 1 and row["tokens"] == summary["tokens"]


def test_torch_adamw_is_the_inner_loop_s_optimizer_as_torch_s_class():
    """The groups, lr, betas and eps carry over; an optimizer that has stepped is refused (its
    moments would be lost)."""
    from veriloco.config import TrainConfig
    from veriloco.inner import InnerLoop

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    loop = InnerLoop(model, TrainConfig(), 10, lambda m, x, y: ((m(x) - y) ** 2).mean())
    twin = torch_adamw(loop.opt)
    assert isinstance(twin, torch.optim.Optimizer)
    for ours, theirs in zip(loop.opt.param_groups, twin.param_groups, strict=True):
        assert [id(p) for p in ours["params"]] == [id(p) for p in theirs["params"]]
        for k in ("lr", "betas", "eps", "weight_decay"):
            assert ours[k] == theirs[k], k
    loop.step(torch.randn(5, 4), torch.randn(5, 2))
    with pytest.raises(ValueError, match="already stepped"):
        torch_adamw(loop.opt)
