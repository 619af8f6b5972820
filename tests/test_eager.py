"""The eager correction of the one-step delay (round.start_point) against its definition.

Kale et al. 2025 (arXiv 2502.12996): with the exchange one round late, worker m applies at the
end of round t the average in which its own fresh delta stands in for its own stale one,
    theta_m <- theta_m - lr * (own_delta_t + sum over the others of delta_{t-1}) / W.
veriloco keeps one canonical G (the naive delayed sequence) and derives each worker's start
point from it; for outer SGD the two must give the same start point every round.
"""

from __future__ import annotations

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
