"""The outer optimizer: Nesterov momentum on the averaged pseudo-gradient (DiLoCo).

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) treats `delta = G_r - theta_local` as a
gradient and applies SGD with Nesterov momentum: defaults `lr` 0.7, `momentum` 0.9. With lr 1,
no momentum and one inner step, a round is exactly synchronous data-parallel SGD on the average
of the workers' steps (the golden-equivalence test pins this).
"""

from __future__ import annotations

import torch

from .config import OuterConfig


class OuterOptimizer:
    """Holds the global params G and moves them by the aggregated delta."""

    def __init__(self, global_params: dict[str, torch.Tensor], cfg: OuterConfig) -> None:
        # on the CPU, whatever device the model trains on (`[run] device`): codecs, packets and hashes are there
        self.params = {k: v.detach().cpu().clone().float() for k, v in global_params.items()}
        self.cfg = cfg
        self._order = sorted(self.params)
        self._opt = torch.optim.SGD(
            [self.params[k] for k in self._order],
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov and cfg.momentum > 0,
            foreach=False,
        )

    def step(self, aggregate: dict[str, torch.Tensor]) -> None:
        """G <- outer_sgd(G, grad = aggregate)."""
        for k in self._order:
            self.params[k].grad = aggregate[k].to(self.params[k].dtype).clone()
        self._opt.step()
        for k in self._order:
            self.params[k].grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Momentum buffers as named tensors (for the checkpoint)."""
        out = {}
        for k in self._order:
            buf = self._opt.state.get(self.params[k], {}).get("momentum_buffer")
            if buf is not None:
                out[f"outer/{k}/momentum"] = buf.detach().clone()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore momentum buffers written by state_tensors."""
        for k in self._order:
            name = f"outer/{k}/momentum"
            if name in tensors:
                self._opt.state[self.params[k]]["momentum_buffer"] = tensors[name].clone()
