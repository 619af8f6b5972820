"""The inner loop's AdamW is torch.optim.AdamW's step bit for bit, without a torch optimizer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from veriloco.inner import AdamW


@pytest.mark.parametrize("foreach", [False, True])
def test_the_inner_adamw_takes_torch_adamw_s_steps_bit_for_bit(foreach):
    """Two param groups (decay and none), the lr changed every step, a param without a gradient in
    one step, gradients zeroed both ways, and the state forgotten and made again (a round's reset):
    the params and every state tensor equal torch's after each step."""
    torch.manual_seed(0)
    shapes = {"w1": (5, 4), "b1": (4,), "w2": (4, 3), "b2": (3,)}
    start = {k: torch.randn(s) for k, s in shapes.items()}
    ours, theirs = ({k: torch.nn.Parameter(v.clone()) for k, v in start.items()} for _ in range(2))

    def groups(p):
        return [{"params": [p["w1"], p["w2"]], "weight_decay": 0.1}, {"params": [p["b1"], p["b2"]], "weight_decay": 0.0}]

    mine = AdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), foreach=foreach)
    torch_opt = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), foreach=foreach)
    for step in range(8):
        grads = {k: torch.randn(s) for k, s in shapes.items()}
        for opt, params in ((mine, ours), (torch_opt, theirs)):
            for g in opt.param_groups:
                g["lr"] = 3e-3 * (step + 1) / 8
            opt.zero_grad(set_to_none=step % 2 == 0)
            for k, p in params.items():
                if step == 3 and k == "b2":  # no gradient this step: AdamW leaves it, and its state, alone
                    p.grad = None
                elif p.grad is None:
                    p.grad = grads[k].clone()
                else:
                    p.grad.add_(grads[k])
            opt.step()
            if step == 5:  # train.inner_state = "reset": the moments forgotten, made again at the next step
                opt.state.clear()
        for k in shapes:
            assert torch.equal(ours[k], theirs[k]), (step, k)
            assert list(mine.state[ours[k]]) == list(torch_opt.state[theirs[k]])
            for name, v in mine.state[ours[k]].items():
                assert torch.equal(v, torch_opt.state[theirs[k]][name]) and v.dtype == torch_opt.state[theirs[k]][name].dtype
    # the same order of the state's entries (the private state and the trace hash list them in it)
    name_of = {**{id(p): k for k, p in ours.items()}, **{id(p): k for k, p in theirs.items()}}
    assert [name_of[id(p)] for p in mine.state] == [name_of[id(p)] for p in torch_opt.state]


def test_an_inner_loop_imports_no_dynamo():
    """What it is for: an audit's replays build inner loops; torch's optimizer imports torch._dynamo
    (about 0.9 s) the first time one is constructed in a process."""
    code = """
import sys, torch
from veriloco.config import TrainConfig
from veriloco.inner import InnerLoop
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
loop = InnerLoop(model, TrainConfig(), 10, lambda m, x, y: ((m(x) - y) ** 2).mean())
print(loop.step(torch.randn(3, 4), torch.randn(3, 2)) > 0, "torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.split() == ["True", "False"], done.stdout


@pytest.mark.parametrize("bad", [{"lr": -1e-3}, {"betas": (1.0, 0.95)}, {"betas": (0.9, -0.1)}, {"eps": -1.0},
                                 {"weight_decay": -0.1}])
def test_the_inner_adamw_refuses_what_torch_s_refuses(bad):
    """torch.optim.AdamW's constructor checks its arguments; the inner loop's class did not (a beta of
    1.5 from the config trained on: tests/test_config.py now refuses it there too)."""
    p = torch.nn.Parameter(torch.zeros(2))
    group = {"params": [p], "weight_decay": bad.get("weight_decay", 0.1)}
    kwargs = {"lr": bad.get("lr", 1e-3), "betas": bad.get("betas", (0.9, 0.95)), "eps": bad.get("eps", 1e-8)}
    if "weight_decay" not in bad:  # torch checks its default's, not a group's: ours checks every group's
        with pytest.raises(ValueError):
            torch.optim.AdamW([dict(group)], **kwargs)
    with pytest.raises(ValueError, match="AdamW: invalid"):
        AdamW([dict(group)], foreach=False, **kwargs)
