"""Block-wise symmetric integer quantisation: `int8:block=B` and `int4:block=B`.

The flat tensor is cut into blocks of `block` elements (the last one may be shorter; a tensor
smaller than a block is one block). Each block has one fp32 scale `s = absmax / L` with
`L = 127` (int8) or `L = 7` (int4), and each value is sent as `round(x / s)` in [-L, L]. The
dequantised value is `q * s`, so the error per element is at most `s / 2 = absmax_block / (2L)`
(plus fp32 rounding). Scales are fp32 because deltas are small: an fp16 scale would underflow.

Bytes: int8 sends `n + 4 * ceil(n / block)` (1.0625 B/element at block 64); int4 packs two
codes per byte, `ceil(n / 2) + 4 * ceil(n / block)` (0.5625 B/element at block 64).
This is the scheme of bitsandbytes' block-wise quantisation (Dettmers et al. 2022,
arXiv 2110.02861), applied to pseudo-gradients as DiLoCoX (arXiv 2506.21263) and
Streaming DiLoCo (arXiv 2501.18512) do.
"""

from __future__ import annotations

import torch

from ..codecspec import MAX_BLOCK
from ._common import below_overflow, exact_parts, flat_fp32
from .base import Codec, CodecError, expect_part, numel_of, register_codec


class _BlockQuantCodec(Codec):
    """Shared encode/decode of symmetric per-block quantisation with `levels` = L."""

    levels: int

    def __init__(self, block: int = 64) -> None:
        if not 1 <= block <= MAX_BLOCK:
            raise ValueError(f"{self.name}: block={block} is outside [1, {MAX_BLOCK}]")
        self.block = block

    def params(self) -> dict[str, str]:
        return {"block": str(self.block)}

    def _blocks(self, n: int) -> tuple[int, int]:
        """(block size actually used, number of blocks); a small tensor is a single block."""
        b = min(self.block, max(n, 1))
        return b, (n + b - 1) // b

    def _quantise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes in [-L, L] (int8, length n) and per-block fp32 scales."""
        n = x.numel()
        b, nb = self._blocks(n)
        padded = torch.zeros(nb * b, dtype=torch.float32)
        padded[:n] = x
        blocks = padded.reshape(nb, b)
        scales = below_overflow(blocks.abs().amax(dim=1) / self.levels, self.levels)
        # A block of zeros has scale 0; divide by 1 there so its codes are 0, not NaN.
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-self.levels, self.levels)
        return codes.reshape(-1)[:n].to(torch.int8), scales

    def _dequantise(self, codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        b, nb = self._blocks(n)
        if not torch.isfinite(scales).all() or (scales < 0).any():
            raise CodecError(f"{self.name} scales must be finite and >= 0")
        padded = torch.zeros(nb * b, dtype=torch.float32)
        padded[:n] = codes
        return (padded.reshape(nb, b) * scales[:, None]).reshape(-1)[:n]

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.numel() and (codes.abs() > self.levels).any():
            raise CodecError(f"{self.name} codes must lie in [-{self.levels}, {self.levels}]")


@register_codec
class Int8Codec(_BlockQuantCodec):
    """int8 codes with one fp32 absmax scale per block; error <= absmax_block / 254."""

    name = "int8"
    levels = 127

    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales = self._quantise(flat_fp32(key, tensor))
        return {"q": codes, "s": scales}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        n = numel_of(shape)
        exact_parts(parts, {"q", "s"}, self.name)
        codes = expect_part(parts, "q", torch.int8, n).reshape(-1)
        scales = expect_part(parts, "s", torch.float32, self._blocks(n)[1]).reshape(-1)
        self._check_codes(codes.to(torch.int16))  # int16: abs(-128) overflows in int8
        return self._dequantise(codes, scales, n).reshape(shape)

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        n = numel_of(shape)
        return n + 4 * self._blocks(n)[1]


@register_codec
class Int4Codec(_BlockQuantCodec):
    """4-bit codes (two per byte) with one fp32 absmax scale per block; error <= absmax / 14."""

    name = "int4"
    levels = 7

    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales = self._quantise(flat_fp32(key, tensor))
        n = codes.numel()
        # Nibble = code + 8 in [1, 15]; an odd tail is padded with the code for zero.
        nibbles = torch.full((n + n % 2,), 8, dtype=torch.uint8)
        nibbles[:n] = (codes.to(torch.int16) + 8).to(torch.uint8)
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        return {"q": packed, "s": scales}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        n = numel_of(shape)
        exact_parts(parts, {"q", "s"}, self.name)
        packed = expect_part(parts, "q", torch.uint8, (n + 1) // 2).reshape(-1)
        scales = expect_part(parts, "s", torch.float32, self._blocks(n)[1]).reshape(-1)
        nibbles = torch.stack((packed & 15, packed >> 4), dim=1).reshape(-1)[:n]
        codes = nibbles.to(torch.int16) - 8
        self._check_codes(codes)
        return self._dequantise(codes, scales, n).reshape(shape)

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        n = numel_of(shape)
        return (n + 1) // 2 + 4 * self._blocks(n)[1]
