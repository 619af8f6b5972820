"""The outer optimizer: Nesterov momentum on the averaged pseudo-gradient (DiLoCo).

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) treats `delta = G_r - theta_local` as a
gradient and applies SGD with Nesterov momentum: defaults `lr` 0.7, `momentum` 0.9. With lr 1,
no momentum and one inner step, a round is exactly synchronous data-parallel SGD on the average
of the workers' steps (the golden-equivalence test pins this).
"""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

from .config import OuterConfig
from .hashing import tensors_hash


class OuterOptimizer:
    """Holds the global params G and moves them by the aggregated delta: `torch.optim.SGD`'s step
    (foreach=False), called as the function that step calls, with the momentum buffers held here.
    The same arithmetic bit for bit (tests/test_outer.py), without constructing a torch optimizer,
    whose first construction in a process imports torch._dynamo (~1 s: an audit, an export)."""

    def __init__(self, global_params: dict[str, torch.Tensor], cfg: OuterConfig) -> None:
        # on the CPU, whatever device the model trains on (`[run] device`): codecs, packets and hashes are there
        self.params = {k: v.detach().cpu().clone().float() for k, v in global_params.items()}
        self.cfg = cfg
        self._order = sorted(self.params)
        self._momenta: dict[str, torch.Tensor | None] = dict.fromkeys(self._order)
        self._hash: str | None = None

    def params_hash(self) -> str:
        """`tensors_hash(params)`, kept until the next step: a round's record hashes the G its outer
        step made, and the next round's inner steps begin from that same G."""
        if self._hash is None:
            self._hash = tensors_hash(self.params)
        return self._hash

    def step(self, aggregate: dict[str, torch.Tensor]) -> None:
        """G <- outer_sgd(G, grad = aggregate)."""
        self._hash = None
        momenta = [self._momenta[k] for k in self._order]  # None before the first step: sgd starts them
        with torch.no_grad():
            sgd([self.params[k] for k in self._order], [aggregate[k].to(self.params[k].dtype) for k in self._order],
                momenta, foreach=False, weight_decay=0.0, momentum=self.cfg.momentum, lr=self.cfg.lr, dampening=0.0,
                nesterov=self.cfg.nesterov and self.cfg.momentum > 0, maximize=False)
        if self.cfg.momentum != 0:  # as SGD.step keeps them
            self._momenta = dict(zip(self._order, momenta, strict=True))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Momentum buffers as named tensors (for the checkpoint)."""
        return {f"outer/{k}/momentum": buf.detach().clone() for k, buf in self._momenta.items() if buf is not None}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore momentum buffers written by state_tensors."""
        for k in self._order:
            name = f"outer/{k}/momentum"
            if name in tensors:
                self._momenta[k] = tensors[name].clone()
