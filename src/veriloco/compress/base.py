"""The codec interface and the registry that maps a spec string to a codec.

A spec is `name` or `name:key=value,key=value` (e.g. `int8:block=64`). It is written into every
packet next to each tensor, so decoding needs no shared state: whatever a codec keeps between
rounds (PowerSGD's warm start, error feedback) lives on the sender only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from ..codecspec import BUILTIN, CodecError, no_params, split_spec

__all__ = ["Codec", "CodecError", "codec_from_spec", "register_codec"]


class Codec(ABC):
    """Encode one fp32 tensor into named parts (tensors) and decode them back.

    Subclasses set `name`, implement the three methods, and accept their spec parameters as
    keyword arguments (strings parsed by `from_params`).
    """

    name: ClassVar[str]

    def spec(self) -> str:
        """The string that `codec_from_spec` turns back into an equivalent codec."""
        params = self.params()
        if not params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={params[k]}" for k in sorted(params))

    def params(self) -> dict[str, str]:
        """Spec parameters; override when the codec has any."""
        return {}

    @classmethod
    def from_params(cls, params: dict[str, str]) -> Codec:
        """Build from parsed spec parameters: a built-in codec's are checked by codecspec.BUILTIN;
        override for a codec of your own that takes any."""
        return cls(**BUILTIN.get(cls.name, no_params)(cls.name, params))

    @abstractmethod
    def encode(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parts that represent `tensor` (named `key` in the model; stateful codecs use it)."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The fp32 tensor of `shape` that `parts` stand for. Parts come from a peer: validate
        names, dtypes and sizes, and raise CodecError rather than crash or allocate unboundedly."""

    @abstractmethod
    def estimate_bytes(self, shape: tuple[int, ...]) -> int:
        """Payload bytes that `encode` produces for a tensor of `shape` (cheap, no encoding)."""


_REGISTRY: dict[str, Callable[[dict[str, str]], Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make `cls` reachable from `codec_from_spec` by its `name`."""
    _REGISTRY[cls.name] = cls.from_params
    return cls


def codec_from_spec(spec: str) -> Codec:
    """Build a codec from `name` or `name:k=v,k=v`; CodecError names what is wrong."""
    name, params = split_spec(spec)
    if name not in _REGISTRY:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](params)


def expect_part(
    parts: dict[str, torch.Tensor], name: str, dtype: torch.dtype, numel: int | None = None
) -> torch.Tensor:
    """Fetch part `name` and check its dtype and (optionally) element count."""
    if name not in parts:
        raise CodecError(f"missing part {name!r}; got {sorted(parts)}")
    t = parts[name]
    if t.dtype != dtype:
        raise CodecError(f"part {name!r} has dtype {t.dtype}, expected {dtype}")
    if numel is not None and t.numel() != numel:
        raise CodecError(f"part {name!r} has {t.numel()} elements, expected {numel}")
    return t


def numel_of(shape: tuple[int, ...]) -> int:
    """Number of elements of a tensor of `shape`."""
    n = 1
    for d in shape:
        n *= int(d)
    return n
