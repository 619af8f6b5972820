"""Digests used everywhere: sha256 of bytes, of tensor dicts, and of canonical JSON.

Canonical JSON (sorted keys, no spaces, UTF-8, no NaN) is what gets signed and hashed, so the
same object gives the same bytes on every machine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
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


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of `tensors`, in sorted name order.

    Bit-exact: two tensor dicts hash equal iff every tensor is identical, so it is the check that
    all workers hold the same global params and that a replay reproduced a state.
    """
    h = TensorsHasher()
    for name in sorted(tensors):
        h.add(name, tensors[name])
    return h.hexdigest()


class TensorsHasher:
    """`tensors_hash`, fed one tensor at a time in sorted name order (by a writer that holds one
    tensor at a time: run.prepare_run's G_0)."""

    def __init__(self) -> None:
        self._h, self._last = hashlib.sha256(), None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._last is not None and name <= self._last:
            raise ValueError(f"tensors_hash takes names in sorted order: {name!r} after {self._last!r}")
        self._last = name
        t = tensor.detach().contiguous().cpu()
        self._h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # the raw bytes, read in place (a uint8 view: bf16 has no numpy dtype)
        self._h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")

    def hexdigest(self) -> str:
        return self._h.hexdigest()
