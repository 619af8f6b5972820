"""Top-k sparsification: `topk:density=D,bits=B`.

Keeps the `k = ceil(D * n)` entries of largest magnitude (at least one; ties broken by lower
index, so the choice is deterministic) and drops the rest. Used with error feedback, the dropped
part is sent in later rounds: Stich et al. 2018 (arXiv 1809.07599), DeMo (Peng et al. 2024,
arXiv 2411.19870) and SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) do this for (pseudo-)gradients.

Values, in increasing index order: `bits=8` sends int8 codes with one fp32 scale
`max|kept| / 127` (error <= scale / 2 per kept entry); `bits=16` sends fp16 (relative error
<= 2^-11, clamped to +-65504).

Indices: `k` and `n` are known to both sides (from the spec and the shape), so the index set is
sent in whichever of two codes is smaller for that (n, k); both have a size that depends on n and
k only, which keeps `estimate_bytes` exact:
  * a bitmap of n bits (wins when D > ~1/4);
  * Elias-Fano (Elias 1974, Fano 1971): with `L = floor(log2(n / k))`, the low L bits of each
    sorted index packed back to back (k*L bits) and the high parts in unary
    (k + (n-1 >> L) + 1 bits), i.e. at most L + 3 bits per kept entry, about
    2 + log2(1/D) bits: 1.07 bytes per kept entry at D = 0.01, 1.5 at D = 0.001.
So at D = 0.01, bits=8: about 2.07 bytes per kept entry = 0.0207 bytes per element.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    below_overflow,
    exact_parts,
    flat_fp32,
    pack_bits,
    unpack_bits,
)
from .base import Codec, CodecError, expect_part, numel_of, register_codec
from .casts import FP16_MAX


def kept_count(n: int, density: float) -> int:
    """How many entries top-k keeps of `n`: ceil(density * n), at least 1, at most n."""
    if n == 0:
        return 0
    # The small slack keeps e.g. 0.07 * 100 = 7.000000000000001 from rounding up to 8.
    return max(1, min(n, math.ceil(density * n - 1e-9)))


def ef_low_bits(n: int, k: int) -> int:
    """Elias-Fano low-part width L = floor(log2(n / k)) (0 when k >= n)."""
    return max(0, (n // k).bit_length() - 1)


def index_code(n: int, k: int) -> tuple[str, int]:
    """('bitmap' | 'ef', bytes) for k sorted indices out of n: the smaller code."""
    bitmap = (n + 7) // 8
    low = ef_low_bits(n, k)
    ef = (k * low + 7) // 8 + (k + ((n - 1) >> low) + 1 + 7) // 8
    return ("bitmap", bitmap) if bitmap <= ef else ("ef", ef)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest |x|, ties resolved toward the lower index."""
    mag = x.abs()
    threshold = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > threshold).reshape(-1)
    # torch.topk's choice among equal values is unspecified; take ties in index order instead.
    ties = torch.nonzero(mag == threshold).reshape(-1)[: k - above.numel()]
    return torch.sort(torch.cat((above, ties))).values


def encode_indices(idx: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 bytes of the sorted index set `idx` (see module docstring)."""
    k = idx.numel()
    code, _ = index_code(n, k)
    if code == "bitmap":
        bits = torch.zeros(n, dtype=torch.bool)
        bits[idx] = True
        return pack_bits(bits)
    low = ef_low_bits(n, k)
    low_bits = ((idx[:, None] >> torch.arange(low)) & 1).reshape(-1).bool()
    upper = torch.zeros(k + ((n - 1) >> low) + 1, dtype=torch.bool)
    upper[(idx >> low) + torch.arange(k)] = True
    return torch.cat((pack_bits(low_bits), pack_bits(upper)))


def decode_indices(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Sorted int64 indices from peer bytes; CodecError unless exactly k distinct ones in [0, n)."""
    code, _ = index_code(n, k)
    if code == "bitmap":
        bits = unpack_bits(data, n)
        if int(bits.sum()) != k:
            raise CodecError(f"topk bitmap marks {int(bits.sum())} entries, expected {k}")
        return torch.nonzero(bits).reshape(-1)
    low = ef_low_bits(n, k)
    low_bytes = (k * low + 7) // 8
    upper_len = k + ((n - 1) >> low) + 1
    upper = unpack_bits(data[low_bytes:], upper_len)
    if int(upper.sum()) != k:
        raise CodecError(f"topk index code marks {int(upper.sum())} entries, expected {k}")
    high = torch.nonzero(upper).reshape(-1) - torch.arange(k)
    lows = unpack_bits(data[:low_bytes], k * low).reshape(k, low).long()
    idx = (high << low) | (lows << torch.arange(low)).sum(dim=1)
    if idx[-1] >= n or (k > 1 and not (idx[1:] > idx[:-1]).all()):
        raise CodecError(f"topk indices must be strictly increasing and below {n}")
    return idx


@register_codec
class TopKCodec(Codec):
    """Largest-magnitude `density` fraction of entries; int8 (bits=8) or fp16 (bits=16) values."""

    name = "topk"

    def __init__(self, density: float = 0.01, bits: int = 8) -> None:
        if not (math.isfinite(density) and 0.0 < density <= 1.0):
            raise ValueError(f"topk: density={density} must be in (0, 1]")
        if bits not in (8, 16):
            raise ValueError(f"topk: bits={bits} must be 8 or 16")
        self.density = float(density)
        self.bits = bits

    def params(self) -> dict[str, str]:
        return {"bits": str(self.bits), "density": repr(self.density)}

    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        x = flat_fp32(key, tensor)
        n = x.numel()
        k = kept_count(n, self.density)
        if k == 0:
            return self._empty()
        idx = topk_indices(x, k)
        parts = {"i": encode_indices(idx, n)}
        values = x[idx]
        if self.bits == 16:
            parts["v"] = values.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        else:
            scale = below_overflow(values.abs().max() / 127, 127)
            safe = scale if scale > 0 else torch.ones(())
            parts["v"] = torch.round(values / safe).clamp_(-127, 127).to(torch.int8)
            parts["s"] = scale.reshape(1)
        return parts

    def _empty(self) -> dict[str, torch.Tensor]:
        parts = {"i": torch.zeros(0, dtype=torch.uint8)}
        parts["v"] = torch.zeros(0, dtype=torch.float16 if self.bits == 16 else torch.int8)
        if self.bits == 8:
            parts["s"] = torch.zeros(1, dtype=torch.float32)
        return parts

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        n = numel_of(shape)
        k = kept_count(n, self.density)
        exact_parts(parts, {"i", "v", "s"} if self.bits == 8 else {"i", "v"}, self.name)
        data = expect_part(parts, "i", torch.uint8, index_code(n, k)[1] if k else 0).reshape(-1)
        out = torch.zeros(n, dtype=torch.float32)
        if self.bits == 16:
            values = expect_part(parts, "v", torch.float16, k).reshape(-1).to(torch.float32)
        else:
            codes = expect_part(parts, "v", torch.int8, k).reshape(-1).to(torch.int16)
            scale = expect_part(parts, "s", torch.float32, 1).reshape(())
            if not torch.isfinite(scale) or scale < 0 or (codes.abs() > 127).any():
                raise CodecError(
                    "topk int8 values need a finite scale >= 0 and codes in [-127, 127]"
                )
            values = codes.to(torch.float32) * scale
        if k:
            out[decode_indices(data, n, k)] = values
        return out.reshape(shape)

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        n = numel_of(shape)
        k = kept_count(n, self.density)
        index_bytes = index_code(n, k)[1] if k else 0
        return index_bytes + (2 * k if self.bits == 16 else k + 4)
