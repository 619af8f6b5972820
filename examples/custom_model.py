"""Train your own nn.Module and data with veriloco's DiLoCo engine (2 workers on this machine).

    python examples/custom_model.py [OUT_DIR]

A Task is four things: a model factory (same init every call), a loss, a pure batch function
(worker, round, step) -> (inputs, targets), and fixed held-out batches. Everything else —
inner AdamW steps, packets, the exchange over torch.distributed, the outer Nesterov step,
content-addressed checkpoints, rounds.jsonl — is the same as for the built-in GPT, and so is the
offline audit: `audit_task(task, out)` redoes every round with this Task (`veriloco audit` on the
command line rebuilds only the built-in tasks).
On GPUs add "--run.device=cuda" (and "--train.precision=bf16") to the overrides: the models are
built on the GPU and the batches copied there; the four functions stay as they are.
"""

import sys

import torch
from torch import nn

from veriloco import Task, audit_task, load_config, train_task


def make_model() -> nn.Module:  # a small MLP regressor; the seed makes every worker's G_0 equal
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def batch(worker: int, round: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(hash((worker, round, step)) % 2**31)  # pure in its arguments
    x = torch.randn(32, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))  # the function to learn


def eval_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(-1, -1, i) for i in range(4)]


if __name__ == "__main__":  # worker processes import this file: keep the launch under the guard
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/custom-model"
    cfg = load_config(overrides=["--topology.workers=2", "--train.rounds=8", "--train.inner_steps=20",
                                 "--train.warmup_steps=10", "--train.lr=0.01", "--train.eval_batches=4"])
    task = Task(make_model, loss, batch, eval_batches)
    summary = train_task(task, cfg, out)
    print(f"eval loss {summary['eval_loss_start']:.4f} -> {summary['eval_loss_end']:.4f}; run in {out}")
    report = audit_task(task, out)  # anyone holding the run directory and this file can check it
    print(f"audit {'ok' if report.ok else 'FAILED: ' + str(report.first_failure)}: {report.rounds} rounds redone")
