"""Error feedback: what a lossy codec dropped this round is added to the next round's delta.

Per key, the sender keeps a residual `e` (zero at first) and each round does

    compensated = delta + e          # compensate(key, delta)
    decoded     = decode(encode(compensated))
    e           = compensated - decoded   # update(key, compensated, decoded)

so the sum of what was sent over rounds equals the sum of the true deltas minus the current
residual: nothing is lost, only delayed. This is "memory" in Stich et al. 2018 (arXiv 1809.07599)
and Karimireddy et al. 2019 (arXiv 1901.09847), PowerSGD's error feedback (arXiv 1905.13727), and
the local accumulator of DeMo (arXiv 2411.19870) and SparseLoCo (arXiv 2508.15706) with their
decay set to 1. `decoded` must be what receivers decode (decode the bytes actually sent), or the
residual drifts away from the truth.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Per-key residuals of a sender; `state_dict()` is a plain {str: tensor} for safetensors."""

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, delta: torch.Tensor) -> torch.Tensor:
        """`delta + residual[key]` in fp32 (a copy; `delta` itself is untouched)."""
        delta = delta.detach().to(torch.float32)
        residual = self._residual.get(key)
        if residual is None:
            return delta.clone()
        if residual.shape != delta.shape:
            raise ValueError(
                f"error feedback for {key!r}: delta shape {list(delta.shape)} does not match "
                f"the residual's {list(residual.shape)}"
            )
        return delta + residual

    def update(self, key: str, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep `compensated - decoded`: what the codec failed to send this round."""
        if compensated.shape != decoded.shape:
            raise ValueError(
                f"error feedback for {key!r}: compensated shape {list(compensated.shape)} "
                f"!= decoded shape {list(decoded.shape)}"
            )
        self._residual[key] = (
            compensated.detach().to(torch.float32) - decoded.detach().to(torch.float32)
        ).contiguous()

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual kept for `key` (None before its first update)."""
        return self._residual.get(key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{key: residual} copies, ready for `safetensors.torch.save`."""
        return {k: v.clone() for k, v in sorted(self._residual.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with those of `state` (as saved by `state_dict`)."""
        for k, v in state.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise ValueError(f"error feedback state: {k!r:.60} must map a str to a tensor")
            if not torch.isfinite(v).all():
                raise ValueError(f"error feedback state: residual {k!r:.60} is not finite")
        self._residual = {k: v.to(torch.float32).clone().contiguous() for k, v in state.items()}
