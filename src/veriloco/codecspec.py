"""Codec specs without torch: `name` or `name:key=value,...`, as `[compress] codec` and every
packet's header name a codec, split and checked here.

The config checks its codecs with `check_spec` before anything imports torch (a typo in a codec
answers in a fraction of a second, not after torch's 1.5 s import), and `compress/` builds every
codec from the values `BUILTIN` returns, so a spec is judged by one set of rules either way.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

MAX_SPEC_CHARS = 200
MAX_BLOCK = 1 << 20  # int8/int4: elements per scale
MAX_RANK = 4096  # lowrank
# the adaptive controller's rungs when `[compress] ladder` is empty (config.codec_specs)
DEFAULT_LADDER: tuple[str, ...] = (
    "fp32",
    "bf16",
    "int8:block=64",
    "int4:block=64",
    "lowrank:rank=16",
    "lowrank:rank=4",
    "lowrank:rank=1",
    "topk:bits=8,density=0.01",
    "topk:bits=8,density=0.001",
)


class CodecError(ValueError):
    """A spec is unknown or malformed, or encoded parts do not decode to the expected tensor."""


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name:k=v,k=v` -> (name, {k: v}); CodecError if it is not of that form."""
    if not isinstance(spec, str) or not spec or len(spec) > MAX_SPEC_CHARS:
        raise CodecError(f"bad codec spec {spec!r:.80}")
    name, _, rest = spec.partition(":")
    params: dict[str, str] = {}
    if rest:
        for item in rest.split(","):
            k, eq, v = item.partition("=")
            if not eq or not k or k in params:
                raise CodecError(f"bad codec spec {spec!r}: expected name:key=value,...")
            params[k] = v
    return name, params


def parse_int(codec: str, params: dict[str, str], key: str, default: int, lo: int, hi: int) -> int:
    """Integer spec parameter `key` in [lo, hi]."""
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise CodecError(f"{codec}: {key}={raw!r:.40} is not an integer") from None
    if not lo <= value <= hi:
        raise CodecError(f"{codec}: {key}={value} is outside [{lo}, {hi}]")
    return value


def parse_float(codec: str, params: dict[str, str], key: str, default: float) -> float:
    """Finite float spec parameter `key` (range checks are the caller's)."""
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CodecError(f"{codec}: {key}={raw!r:.40} is not a number") from None
    if not math.isfinite(value):
        raise CodecError(f"{codec}: {key}={raw!r:.40} is not finite")
    return value


def check_keys(codec: str, params: dict[str, str], allowed: set[str]) -> None:
    """Reject spec parameters the codec does not know."""
    extra = sorted(set(params) - allowed)
    if extra:
        raise CodecError(f"{codec}: unknown parameter(s) {extra}; known: {sorted(allowed)}")


def no_params(name: str, params: dict[str, str]) -> dict:
    """A codec without parameters (fp32, fp16, bf16)."""
    if params:
        raise CodecError(f"codec {name!r} takes no parameters, got {sorted(params)}")
    return {}


def block_params(name: str, params: dict[str, str]) -> dict:
    """int8, int4: `block`, the elements per scale."""
    check_keys(name, params, {"block"})
    return {"block": parse_int(name, params, "block", 64, 1, MAX_BLOCK)}


def topk_params(name: str, params: dict[str, str]) -> dict:
    """topk: `density` in (0, 1], the values' `bits` 8 or 16."""
    check_keys(name, params, {"bits", "density"})
    density = parse_float(name, params, "density", 0.01)
    bits = parse_int(name, params, "bits", 8, 8, 16)
    if not 0.0 < density <= 1.0 or bits not in (8, 16):
        raise CodecError(f"topk: density={density} must be in (0, 1], bits={bits} 8 or 16")
    return {"density": density, "bits": bits}


def rank_params(name: str, params: dict[str, str]) -> dict:
    """lowrank: `rank`."""
    check_keys(name, params, {"rank"})
    return {"rank": parse_int(name, params, "rank", 4, 1, MAX_RANK)}


# the built-in codecs: name -> its parameters checked, as the codec class's keyword arguments
BUILTIN: dict[str, Callable[[str, dict[str, str]], dict]] = {
    "fp32": no_params, "fp16": no_params, "bf16": no_params, "int8": block_params, "int4": block_params,
    "topk": topk_params, "lowrank": rank_params,
}


def check_spec(spec: str) -> None:
    """CodecError unless `spec` names a codec with valid parameters; no torch for a built-in codec's
    spec or an unknown name. A name registered in this process (`compress.register_codec`; then
    `veriloco.compress` is imported) is checked by building it."""
    name, params = split_spec(spec)
    if name in BUILTIN:
        BUILTIN[name](name, params)
        return
    base = sys.modules.get("veriloco.compress.base")
    if base is not None:
        base.codec_from_spec(spec)
        return
    raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(BUILTIN))}")
