"""The identity codec: the delta as plain fp32 (what DiLoCo sends without compression)."""

from __future__ import annotations

import torch

from .base import Codec, CodecError, expect_part, numel_of, register_codec


@register_codec
class IdentityCodec(Codec):
    """fp32 values, 4 bytes per element, exact."""

    name = "fp32"

    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"v": tensor.detach().to(torch.float32).contiguous().reshape(-1)}

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        if set(parts) != {"v"}:
            raise CodecError(f"fp32 packet parts must be ['v'], got {sorted(parts)}")
        return expect_part(parts, "v", torch.float32, numel_of(shape)).reshape(shape).clone()

    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        return 4 * numel_of(shape)
