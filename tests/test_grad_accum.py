"""`[train] grad_accum`: an inner step's batch run forward and backward in equal parts."""

from __future__ import annotations

import pytest
import torch
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.inner import InnerLoop
from veriloco.model import build_model, lm_loss
from veriloco.run import train

REPLAYED = ("--train.rounds=2", "--train.inner_state=reset", "--verify.replay_probability=1.0",
            "--verify.trace_every=5")


def test_grad_accum_is_checked():
    with pytest.raises(ConfigError, match=r"train.batch_size \(4\) must split into train.grad_accum \(3\)"):
        tiny("--train.grad_accum=3")
    with pytest.raises(ConfigError, match="train.grad_accum needs topology.stages = 1"):
        tiny("--train.grad_accum=2", "--topology.stages=2")
    with pytest.raises(ConfigError, match="train.grad_accum must be >= 1"):
        tiny("--train.grad_accum=0")


def test_an_accumulated_step_is_the_whole_batch_step_up_to_rounding():
    """The first AdamW step moves each param by up to lr = 6e-4 here; accumulating moves them to
    within 1e-5 of that (the params that differ most are those whose gradient is rounding noise,
    as the README's distance calibration found)."""
    cfg = tiny()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.ctx), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.ctx), generator=g)
    after, losses = {}, {}
    for k in (1, 2, 4):
        model = build_model(cfg.model, 0)
        loop = InnerLoop(model, tiny(f"--train.grad_accum={k}").train, 10, lambda m, a, b: lm_loss(m(a), b))
        losses[k] = loop.step(x, y)
        after[k] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for k in (2, 4):
        assert losses[k] == pytest.approx(losses[1], rel=1e-6)
        assert torch.allclose(after[k], after[1], rtol=0, atol=1e-5) and not torch.equal(after[k], after[1])


def test_an_accumulating_run_replays_and_audits_as_it_trained(tmp_path):
    run, summary = train(tiny(*REPLAYED, "--train.grad_accum=2"), str(tmp_path / "k2"), quiet=True)
    _, whole = train(tiny(*REPLAYED), str(tmp_path / "k1"), quiet=True)
    recs = rounds_of(run.root)
    assert all(v == "accept" for rec in recs for v in rec["verdicts"])  # every worker replayed every round
    assert recs[-1]["params_hash"] != rounds_of(tmp_path / "k1")[-1]["params_hash"]
    assert summary["eval_loss_end"] == pytest.approx(whole["eval_loss_end"], rel=1e-3)
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 4


def test_ddp_all_reduces_once_per_accumulated_step(tmp_path):
    from veriloco.baseline import train_ddp

    sums = {}
    for k in (1, 2):
        _, sums[k] = train_ddp(tiny("--train.mode=ddp", "--train.rounds=1", f"--train.grad_accum={k}"),
                               str(tmp_path / f"ddp{k}"), quiet=True)
    assert sums[2]["bytes_sent_per_worker"] == sums[1]["bytes_sent_per_worker"]  # no_sync on all parts but the last
    assert sums[2]["eval_loss_end"] == pytest.approx(sums[1]["eval_loss_end"], rel=1e-3)
