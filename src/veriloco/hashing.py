"""Digests used everywhere: sha256 of bytes, of tensor dicts, and of canonical JSON.

Canonical JSON (sorted keys, no spaces, UTF-8, no NaN) is what gets signed and hashed, so the
same object gives the same bytes on every machine.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding of a JSON object that we sign and hash."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def json_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    return sha256_hex(canonical_json(obj))


def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of `tensors`, in sorted name order.

    Bit-exact: two tensor dicts hash equal iff every tensor is identical, so it is the check that
    all workers hold the same global params and that a replay reproduced a state.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # the raw bytes, read in place (a uint8 view: bf16 has no numpy dtype)
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()
