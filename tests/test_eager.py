"""The eager correction of the one-step delay (round.start_point) against its definition.

Kale et al. 2025 (arXiv 2502.12996): with the exchange one round late, worker m applies at the
end of round t the average in which its own fresh delta stands in for its own stale one,
    theta_m <- theta_m - lr * (own_delta_t + sum over the others of delta_{t-1}) / W.
veriloco keeps one canonical G (the naive delayed sequence) and derives each worker's start
point from it; for outer SGD the two must give the same start point every round.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from veriloco.round import start_point


def test_eager_start_points_equal_the_per_worker_eager_trajectory():
    W, rounds, lr = 3, 6, 0.7
    cfg = tiny("--outer.delay=1", "--outer.correction=eager", "--outer.momentum=0.0", f"--outer.lr={lr}",
               "--outer.nesterov=false")
    gen = torch.Generator().manual_seed(0)
    delta = [[{"w": torch.randn(4, generator=gen)} for _ in range(W)] for _ in range(rounds)]
    zero = {"w": torch.zeros(4)}
    theta = [{"w": torch.zeros(4)} for _ in range(W)]  # each worker's own eager trajectory
    G = {"w": torch.zeros(4)}  # the canonical one: round t's average applied at the end of round t+1
    own: list[list] = [[] for _ in range(W)]
    for t in range(rounds):
        stale = delta[t - 1] if t else [zero] * W
        for m in range(W):
            mixed = (delta[t][m]["w"] + sum(stale[k]["w"] for k in range(W) if k != m)) / W
            theta[m] = {"w": theta[m]["w"] - lr * mixed}
            own[m] = (own[m] + [delta[t][m]])[-2:]
        if t:
            G = {"w": G["w"] - lr * sum(d["w"] for d in delta[t - 1]) / W}
        for m in range(W):  # the start of round t+1
            assert torch.allclose(start_point(cfg, G, own[m], W)["w"], theta[m]["w"], atol=1e-6), (t, m)


def test_no_correction_without_delay_or_when_naive():
    G = {"w": torch.ones(2)}
    own = [{"w": torch.ones(2)}]
    assert start_point(tiny("--outer.delay=0"), G, own, 2) is G
    assert start_point(tiny("--outer.delay=1", "--outer.correction=naive"), G, own, 2) is G


def test_local_correction_takes_an_outer_step_with_the_own_delta():
    cfg = tiny("--outer.delay=1", "--outer.correction=local", "--outer.momentum=0.5", "--outer.lr=0.7")
    G, own = {"w": torch.ones(3)}, [{"w": torch.full((3,), 9.0)}, {"w": torch.full((3,), 2.0)}]
    # Nesterov: the newest delta moves the params by lr * (1 + momentum) at once; not divided by W
    assert torch.allclose(start_point(cfg, G, own, 4)["w"], torch.full((3,), 1 - 0.7 * 1.5 * 2.0))


def test_lookahead_start_is_a_dry_run_of_the_outer_step():
    from veriloco.outer import OuterOptimizer

    gen = torch.Generator().manual_seed(1)
    for nesterov in (True, False):
        cfg = tiny("--outer.delay=1", "--outer.correction=local", "--outer.momentum=0.9", "--outer.lr=0.7",
                   f"--outer.nesterov={str(nesterov).lower()}", "--outer.lookahead=true")
        opt = OuterOptimizer({"w": torch.randn(5, generator=gen)}, cfg.outer)
        for _ in range(3):  # build up momentum
            opt.step({"w": torch.randn(5, generator=gen)})
        own = [{"w": torch.randn(5, generator=gen)}]
        S = start_point(cfg, opt.params, own, 4, opt.state_tensors())
        opt.step(own[-1])  # the real outer step with the own delta as the average
        assert torch.allclose(S["w"], opt.params["w"], atol=1e-6), nesterov
        off = tiny("--outer.delay=1", "--outer.correction=local", "--outer.momentum=0.9", "--outer.lookahead=false")
        assert not torch.allclose(start_point(off, opt.params, own, 4, opt.state_tensors())["w"],
                                  start_point(cfg, opt.params, own, 4, opt.state_tensors())["w"])


def test_one_worker_with_delay_1_and_lookahead_trains_as_delay_0(tmp_path):
    # with one worker its own delta is the average: the lookahead start is exactly where delay 0
    # starts, so the two runs see the same params every round (up to float rounding)
    from conftest import rounds_of

    from veriloco.run import train

    base = ("--topology.workers=1", "--train.rounds=4", "--train.inner_steps=4", "--train.eval_every=1000")
    _, d0 = train(tiny(*base), str(tmp_path / "d0"), quiet=True)
    _, d1 = train(tiny(*base, "--outer.delay=1", "--outer.correction=local", "--outer.lookahead=true"),
                  str(tmp_path / "d1"), quiet=True)
    _, off = train(tiny(*base, "--outer.delay=1", "--outer.correction=local", "--outer.lookahead=false"),
                   str(tmp_path / "off"), quiet=True)
    l0 = [r["train_loss"][0] for r in rounds_of(tmp_path / "d0")]
    l1 = [r["train_loss"][0] for r in rounds_of(tmp_path / "d1")]
    loff = [r["train_loss"][0] for r in rounds_of(tmp_path / "off")]
    assert l1 == pytest.approx(l0, abs=1e-4) and d1["eval_loss_end"] == pytest.approx(d0["eval_loss_end"], abs=1e-4)
    assert loff[2:] != pytest.approx(l0[2:], abs=1e-4)  # without it, delay 1 lags
