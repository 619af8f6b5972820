"""PowerSGD low-rank compression: `lowrank:rank=R`.

PowerSGD (Vogels, Karimireddy, Jaggi 2019, arXiv 1905.13727), Algorithm 1, for one worker: a
tensor of ndim >= 2 is viewed as the matrix `M` of shape (m, n) = (shape[0], prod(rest)), and
with `r = min(R, m, n)`:

    P = M Q            (Q: n x r, warm-started from the previous round for this key)
    P = orthogonalise(P)   (reduced QR)
    Q = M^T P
    send P, Q;  the receiver decodes  M_hat = P Q^T  (= P P^T M, M projected on span P).

One power iteration per round; repeated rounds on a slowly changing `M` are subspace iteration,
so the error approaches that of the best rank-r approximation. The warm start Q lives in this
codec object, per key, on the sender only (`state_dict` / `load_state_dict` checkpoint it); the
receiver needs nothing but the parts. The first Q of a key is drawn from a generator seeded by
sha256(key), so runs are reproducible.

P and Q are sent as fp16, Q divided by its absmax, which is sent as one fp32 scale `s` (P is
orthonormal; Q has the scale of M, and small deltas would otherwise fall into fp16's subnormal
range): 2 * r * (m + n) + 4 bytes. Where that saves nothing (2r(m + n) + 4 >= 2mn, about
r(m + n) >= mn) and for tensors with ndim < 2 (biases, norms), the codec sends the values as
fp16 instead (2 bytes per element), in a part named `v` rather than `p`/`q`/`s`; which form to
expect follows from the shape and rank, so a peer cannot choose.
DiLoCoX (arXiv 2506.21263) combines such low-rank compression with quantisation for
pseudo-gradients.
"""

from __future__ import annotations

import hashlib

import torch

from ..codecspec import MAX_RANK
from ._common import exact_parts, flat_fp32
from .base import Codec, CodecError, expect_part, numel_of, register_codec
from .casts import FP16_MAX


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(m, n) for a tensor of ndim >= 2, None for scalars and vectors."""
    if len(shape) < 2:
        return None
    return int(shape[0]), numel_of(tuple(shape[1:]))


def _key_seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") >> 1


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


@register_codec
class LowRankCodec(Codec):
    """Rank-`rank` PowerSGD with a per-key warm start; fp16 P and Q, fp32 scale of Q."""

    name = "lowrank"

    def __init__(self, rank: int = 4) -> None:
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"lowrank: rank={rank} is outside [1, {MAX_RANK}]")
        self.rank = rank
        self._q: dict[str, torch.Tensor] = {}  # warm start per key (sender only)

    def params(self) -> dict[str, str]:
        return {"rank": str(self.rank)}

    def _plan(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(m, n, r) when the low-rank form is smaller than the fp16 fallback, else None."""
        mn = matrix_view(shape)
        if mn is None:
            return None
        m, n = mn
        r = min(self.rank, m, n)
        if r == 0 or 2 * r * (m + n) + 4 >= 2 * m * n:  # low rank must save bytes
            return None
        return m, n, r

    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        x = flat_fp32(key, tensor)
        plan = self._plan(tuple(tensor.shape))
        if plan is None:
            return {"v": _fp16(x)}
        m, n, r = plan
        matrix = x.reshape(m, n)
        q = self._q.get(key)
        if q is None or q.shape != (n, r):
            gen = torch.Generator().manual_seed(_key_seed(key))
            q = torch.randn(n, r, generator=gen, dtype=torch.float32)
        p, _ = torch.linalg.qr(matrix @ q)
        q = matrix.T @ p
        self._q[key] = q
        scale = q.abs().max()
        safe = scale if scale > 0 else torch.ones(())
        return {"p": _fp16(p).reshape(-1), "q": _fp16(q / safe).reshape(-1), "s": scale.reshape(1)}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        plan = self._plan(shape)
        if plan is None:
            exact_parts(parts, {"v"}, f"{self.name} (fp16 fallback for shape {list(shape)})")
            v = expect_part(parts, "v", torch.float16, numel_of(shape))
            return v.to(torch.float32).reshape(shape)
        m, n, r = plan
        exact_parts(parts, {"p", "q", "s"}, self.name)
        p = expect_part(parts, "p", torch.float16, m * r).to(torch.float32).reshape(m, r)
        q = expect_part(parts, "q", torch.float16, n * r).to(torch.float32).reshape(n, r)
        scale = expect_part(parts, "s", torch.float32, 1).reshape(())
        if not (torch.isfinite(p).all() and torch.isfinite(q).all() and torch.isfinite(scale)):
            raise CodecError("lowrank factors and scale must be finite")
        return (p @ (q * scale).T).reshape(shape)

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        plan = self._plan(shape)
        if plan is None:
            return 2 * numel_of(shape)
        m, n, r = plan
        return 2 * r * (m + n) + 4

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sender's warm-start Q per key (safetensors-compatible)."""
        return {k: v.clone() for k, v in self._q.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore warm starts saved by `state_dict`."""
        for k, v in state.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor) or v.ndim != 2:
                raise ValueError(f"lowrank state: {k!r:.60} must map to a 2-D tensor")
        self._q = {k: v.to(torch.float32).clone() for k, v in state.items()}
