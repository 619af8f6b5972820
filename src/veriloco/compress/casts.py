"""Half-precision casts: `fp16` and `bf16`, 2 bytes per element.

fp16 keeps 11 significant bits (relative error <= 2^-11 for |x| in [2^-14, 65504]) but has a
narrow range: values below 2^-14 lose precision (absolute error <= 2^-25) and values beyond
+-65504 are clamped to it, so that a packet never carries inf. bf16 keeps fp32's range with 8
significant bits (relative error <= 2^-8). Pseudo-gradients of small learning rates are often
tiny, so bf16 is the safer default; fp16 is the more precise one when the range fits.
"""

from __future__ import annotations

import torch

from ._common import exact_parts, flat_fp32
from .base import Codec, expect_part, numel_of, register_codec

FP16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


class _CastCodec(Codec):
    """Send the values in a 2-byte float dtype."""

    dtype: torch.dtype
    limit: float

    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        x = flat_fp32(key, tensor)
        # Clamp so an out-of-range value becomes the largest finite one, never inf
        # (receivers reject non-finite packets; error feedback carries the remainder).
        return {"v": x.clamp(-self.limit, self.limit).to(self.dtype)}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        exact_parts(parts, {"v"}, self.name)
        v = expect_part(parts, "v", self.dtype, numel_of(shape))
        return v.to(torch.float32).reshape(shape)

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        return 2 * numel_of(shape)


@register_codec
class Fp16Codec(_CastCodec):
    """IEEE half: 2 bytes per element, relative error <= 2^-11 within [2^-14, 65504]."""

    name = "fp16"
    dtype = torch.float16
    limit = FP16_MAX


@register_codec
class Bf16Codec(_CastCodec):
    """bfloat16: 2 bytes per element, relative error <= 2^-8, fp32's range."""

    name = "bf16"
    dtype = torch.bfloat16
    limit = BF16_MAX
