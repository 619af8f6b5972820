"""The outer optimizer is torch.optim.SGD's step (foreach=False) bit for bit, without a torch optimizer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from veriloco.config import OuterConfig
from veriloco.outer import OuterOptimizer


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(7, 5, generator=g), "a.bias": torch.randn(5, generator=g), "c": torch.randn(3, 2, 4, generator=g)}


@pytest.mark.parametrize("lr,momentum,nesterov", [(0.7, 0.9, True), (0.7, 0.9, False), (1.0, 0.0, True), (0.4, 0.5, True)])
def test_steps_and_momenta_equal_torch_sgd_and_survive_a_reload(lr, momentum, nesterov):
    start = _params(0)
    ours = OuterOptimizer(start, OuterConfig(lr=lr, momentum=momentum, nesterov=nesterov))
    theirs = {k: v.clone() for k, v in start.items()}
    names = sorted(theirs)
    sgd = torch.optim.SGD([theirs[k] for k in names], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0,
                          foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        aggregate = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in start.items()}
        kept = {k: v.clone() for k, v in aggregate.items()}
        ours.step(aggregate)
        for k in names:
            theirs[k].grad = aggregate[k].clone()
        sgd.step()
        assert all(torch.equal(aggregate[k], kept[k]) for k in names)  # the aggregate is not written
        assert all(torch.equal(ours.params[k], theirs[k]) for k in names), step
        momenta = ours.state_tensors()
        if momentum:
            assert sorted(momenta) == [f"outer/{k}/momentum" for k in names]
            assert all(torch.equal(momenta[f"outer/{k}/momentum"], sgd.state[theirs[k]]["momentum_buffer"]) for k in names)
        else:
            assert momenta == {}
        if step == 2:  # a resume: G and the momenta from a checkpoint
            ours = OuterOptimizer({k: v.clone() for k, v in ours.params.items()}, ours.cfg)
            ours.load_state_tensors(momenta)


def test_a_step_imports_no_dynamo():
    """What the change is for: an audit or an export that only re-applies outer steps does not pay
    for importing torch._dynamo, which constructing any torch optimizer does."""
    code = """
import sys, torch
from veriloco.config import OuterConfig
from veriloco.outer import OuterOptimizer
o = OuterOptimizer({"w": torch.ones(3)}, OuterConfig())
o.step({"w": torch.ones(3)}); o.step({"w": torch.ones(3)})
print(o.params["w"].tolist(), "torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.split()[-1] == "False", done.stdout
