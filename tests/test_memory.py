"""Less activation memory: `[train] grad_accum` (an inner step's batch forward and backward in
equal parts) and `[model] checkpoint` (blocks recomputed in the backward)."""

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


def test_checkpointing_keeps_less_for_the_backward_and_steps_bit_for_bit():
    """Bytes the autograd graph saves for the backward, counted by a saved-tensors hook, in one
    inner step of a 4-layer GPT: the checkpointed model keeps each block's input only."""
    steps, saved = {}, {}
    for on in (False, True):
        cfg = tiny("--model.n_layer=4", "--model.d_model=64", "--model.ctx=64", f"--model.checkpoint={str(on).lower()}")
        x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
        y = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
        model = build_model(cfg.model, 0)
        loop = InnerLoop(model, cfg.train, 10, lambda m, a, b: lm_loss(m(a), b))
        total = [0]

        def pack(t: torch.Tensor, total: list = total) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loop.step(x, y)
        steps[on] = (loss, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        saved[on] = total[0]
    assert steps[True][0] == steps[False][0] and torch.equal(steps[True][1], steps[False][1])
    assert saved[True] < saved[False] / 4, saved


def test_a_checkpointed_pipelined_run_is_the_plain_one_bit_for_bit(tmp_path):
    staged = ("--train.rounds=2", "--topology.stages=2", "--topology.microbatches=2")
    plain, _ = train(tiny(*staged), str(tmp_path / "plain"), quiet=True)
    ckpt, _ = train(tiny(*staged, "--model.checkpoint=true"), str(tmp_path / "ckpt"), quiet=True)
    assert [r["params_hash"] for r in rounds_of(ckpt.root)] == [r["params_hash"] for r in rounds_of(plain.root)]
