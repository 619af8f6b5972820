"""Small helpers shared by the codecs: input checks and bit packing (specs: codecspec.py)."""

from __future__ import annotations

import math

import torch

from ..codecspec import CodecError


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of `x` is finite, as `torch.isfinite(x).all()` says, in one read of
    `x` and without a bool tensor as large as it: a NaN or inf element makes the sum NaN or inf,
    so a finite sum proves every element finite; only a sum that is not finite (a NaN or inf, or
    finite elements whose sum overflowed) is looked at element by element."""
    if not x.numel() or not x.is_floating_point():
        return True
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def flat_fp32(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a flat, contiguous fp32 copy-free view where possible; rejects NaN/inf.

    A non-finite delta is a bug on the sender; failing here names it instead of letting every
    receiver reject the packet.
    """
    x = tensor.detach().to(torch.float32).reshape(-1).contiguous()
    if not all_finite(x):
        raise ValueError(f"{name}: cannot encode a tensor with NaN or inf values")
    return x


def exact_parts(parts: dict[str, torch.Tensor], names: set[str], codec: str) -> None:
    """Parts from a peer must be exactly `names`: nothing missing, nothing extra."""
    if set(parts) != names:
        raise CodecError(f"{codec} parts must be {sorted(names)}, got {sorted(parts)[:8]}")


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool vector -> uint8 bytes, little-endian within each byte, zero padded."""
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
    padded[:n] = bits.to(torch.uint8)
    return (padded.reshape(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_bits(data: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` bits of uint8 `data` as a bool vector (inverse of `pack_bits`)."""
    return ((data.reshape(-1, 1) >> _BIT_SHIFTS) & 1).reshape(-1)[:n].bool()


def below_overflow(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """`scales`, each one ulp lower where `levels * scale` rounds past fp32's largest value (an
    absmax within an ulp of it): its top code would decode to inf, which every receiver refuses."""
    over = torch.isinf(scales * levels)
    return torch.where(over, torch.nextafter(scales, torch.zeros_like(scales)), scales) if over.any() else scales
