"""Codecs: how a delta tensor becomes bytes on the wire, and back.

A codec is three methods (encode, decode, estimate_bytes), after hivemind's compression module.
`codec_from_spec("name:key=value,...")` builds one from the string recorded in a packet, so a
receiver decodes with nothing but the packet itself.

Codecs (spec -> bytes per element n, at the defaults):
  fp32                          4       exact
  fp16 / bf16                   2       relative error <= 2^-11 / 2^-8
  int8:block=64                 1.0625  |error| <= absmax_block / 254
  int4:block=64                 0.5625  |error| <= absmax_block / 14
  topk:bits=8,density=0.01      ~0.021  drops all but the largest 1% (Elias-Fano indices)
  lowrank:rank=4                (2 * 4 * (m + n) + 4) / (m * n)   PowerSGD, one power step
Sender-side helpers: `ErrorFeedback` (residuals), `AdaptiveController` (codec per tensor under a
byte budget), `round_budget_bytes`, `suggest_inner_steps`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import Codec, CodecError, codec_from_spec, register_codec
from .blockquant import Int4Codec, Int8Codec
from .casts import Bf16Codec, Fp16Codec
from .controller import (
    DEFAULT_LADDER,
    AdaptiveController,
    nominal_sq_error,
    round_budget_bytes,
    suggest_inner_steps,
)
from .feedback import ErrorFeedback
from .identity import IdentityCodec
from .lowrank import LowRankCodec
from .topk import TopKCodec


def build_codecs(spec: str, shapes: Mapping[str, Sequence[int]]) -> dict[str, Codec]:
    """One codec object per tensor, all from the same `spec` (a fixed `[compress] codec`).

    Separate objects per key keep any sender state (PowerSGD's warm start) apart; a bad spec
    raises CodecError before anything is encoded.
    """
    codec_from_spec(spec)
    return {key: codec_from_spec(spec) for key in sorted(shapes)}


__all__ = [
    "DEFAULT_LADDER",
    "AdaptiveController",
    "Bf16Codec",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Fp16Codec",
    "IdentityCodec",
    "Int4Codec",
    "Int8Codec",
    "LowRankCodec",
    "TopKCodec",
    "build_codecs",
    "codec_from_spec",
    "nominal_sq_error",
    "register_codec",
    "round_budget_bytes",
    "suggest_inner_steps",
]
