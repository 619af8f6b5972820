"""safetensors files a tensor at a time: read (`TensorFile`) and written (`write_tensors`).

A model's weights are the largest thing veriloco reads and writes: a 7B checkpoint is 14 GB in
bf16 and its G_0 28 GB in fp32. `safetensors.torch.load_file` and `save` hold the whole file (and
`save` its bytes beside the tensors), and `safe_open` maps the file, so every tensor read stays
resident. Here a tensor is read with plain file reads when asked for, and the canonical G_0 blob
is written one tensor at a time, so a reader or writer holds one tensor, not the model:

- `TensorFile(path, label)`: the header is validated when the file is opened (the length, JSON,
  every entry's dtype, shape and offsets inside the data, its byte count equal to its shape's);
  `file[name]` reads that tensor. A dtype outside `dtypes` is malformed.
- `write_tensors(f, layout, tensor_of, metadata)`: the bytes `safetensors.torch.save(tensors,
  metadata)` makes for tensors of one dtype (tests/test_tensorfile.py checks it byte for byte):
  what the store keeps as G_0 (`weights.init_blob`) and what `veriloco export` writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import save as st_save

from .store import LocalStore, StagedBlob, StoreError, atomic_write

FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPES = {**FLOATS, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 64 << 20  # bytes; larger is not a file veriloco reads (the format caps it at 100 MB)
MAX_DIMS = 64  # a tensor's dimensions at most; more is no tensor veriloco writes (and the product's cost grows)
MAX_ELEMENTS = 1 << 60  # elements of one tensor at most, a zero-sized one's other dims included: torch.empty's limit

Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]  # name -> (dtype, shape)


def _elements(shape: object) -> int | None:
    """The element count of a header's shape, or None unless it is a list of at most MAX_DIMS
    non-negative ints (not bools) whose non-zero ones multiply to at most MAX_ELEMENTS: a zero-sized
    tensor with a dimension of 2**63 passes a byte count and then fails torch.empty."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d or 1
        if n > MAX_ELEMENTS:
            return None
    return 0 if 0 in shape else n


def header_entry(entry: object, dtypes: Mapping[str, torch.dtype] = DTYPES) -> tuple[torch.dtype, list[int], int, int] | None:
    """(dtype, shape, begin, end) of one tensor's entry in a safetensors header, or None if it is
    malformed: an unknown dtype, a shape that is not a list of non-negative ints (`_elements`), offsets
    that are not two ints, or a byte count that is not the shape's (end < begin among them)."""
    try:
        dtype, shape, (begin, end) = dtypes[entry["dtype"]], entry["shape"], entry["data_offsets"]  # type: ignore[index]
        n = _elements(shape)
        ok = n is not None and type(begin) is int and type(end) is int and end - begin == n * dtype.itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return (dtype, shape, begin, end) if ok else None


class TensorFile(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file, each read when asked for (module docstring). ValueError,
    one line starting with `label`, for a file that is not one."""

    def __init__(self, path: str | os.PathLike[str], label: str, dtypes: Mapping[str, torch.dtype] = DTYPES) -> None:
        self.path, self.label = Path(path), label
        with self.path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= n <= min(size - 8, MAX_HEADER):
                raise ValueError(f"{label} is not a safetensors file: its header length is {n}")
            try:
                header = json.loads(f.read(n))
            except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, a 5000-digit int; deep nesting
                raise ValueError(f"{label} is not a safetensors file: its header is not JSON") from None
        if not isinstance(header, dict):
            raise ValueError(f"{label} is not a safetensors file: its header is not an object")
        data = size - 8 - n
        self.index: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}  # name -> dtype, shape, offset, bytes
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            got = header_entry(entry, dtypes)
            if got is None or not 0 <= got[2] <= got[3] <= data:
                raise ValueError(f"{label} is not a safetensors file veriloco reads: tensor {name!r:.60} is malformed")
            dtype, shape, begin, end = got
            self.index[name] = (dtype, tuple(shape), 8 + n + begin, end - begin)

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape) of every tensor, from the header alone."""
        return {k: (dtype, shape) for k, (dtype, shape, _, _) in self.index.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, offset, nbytes = self.index[name]
        buf = bytearray(nbytes)
        with self.path.open("rb") as f:
            f.seek(offset)
            if f.readinto(buf) != nbytes:
                raise ValueError(f"{self.label}: tensor {name} is cut short")
        return torch.frombuffer(buf, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.index))

    def __len__(self) -> int:
        return len(self.index)


class FileTensors(Mapping[str, torch.Tensor]):
    """Tensors under names of the caller's, each read when asked for from the `TensorFile` that
    holds it, under its key there: `where` = {name: (file, key)} (several files merged, a
    checkpoint's tensors renamed). A file that changed since its header was read raises `error`
    (the caller's one-line error type), its message prefixed with `prefix`."""

    def __init__(self, where: dict[str, tuple[TensorFile, str]], error: type[Exception] = ValueError,
                 prefix: str = "") -> None:
        self.where, self._error, self._prefix = where, error, prefix

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {name: file.index[key][:2] for name, (file, key) in self.where.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        file, key = self.where[name]
        try:
            return file[key]
        except (ValueError, OSError) as e:
            raise self._error(f"{self._prefix}{str(e).splitlines()[0][:200]}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.where))

    def __len__(self) -> int:
        return len(self.where)


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape): a lazy mapping's own `layout()` (nothing read), else the tensors'."""
    layout = getattr(tensors, "layout", None)
    return layout() if callable(layout) else {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def write_tensors(f: BinaryIO, layout: Layout, tensor_of: Callable[[str], torch.Tensor],
                  metadata: dict[str, str] | None = None, any_dtypes: bool = False) -> int:
    """Write a safetensors file of the tensors `layout` names (one dtype for all) to `f`, asking
    `tensor_of(name)` for each in turn, in name order; returns the bytes written. The bytes equal
    `safetensors.torch.save` of the same tensors and `metadata`. `any_dtypes`: tensors of several
    dtypes, still in name order: a file safetensors reads as any other, though not `save`'s bytes
    (it puts larger dtypes first)."""
    dtypes = {dtype for dtype, _ in layout.values()}
    if len(dtypes) > 1 and not any_dtypes:  # safetensors orders mixed dtypes by its own enum; G_0 is all float32
        raise ValueError(f"write_tensors takes one dtype, got {sorted(map(str, dtypes))}")
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(layout):
        dtype, shape = layout[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little") + raw)
    for name in sorted(layout):
        t = tensor_of(name).detach()
        if (t.dtype, tuple(t.shape)) != layout[name]:
            raise ValueError(f"tensor {name} is {t.dtype} {tuple(t.shape)}, the layout says {layout[name]}")
        if t.numel():
            f.write(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
    return 8 + len(raw) + offset


def write_tensors_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
                       metadata: dict[str, str] | None = None) -> None:
    """`store.atomic_write(path, safetensors.torch.save(tensors, metadata))` without those bytes
    in memory (a worker's private state each round: its inner AdamW state is twice the model): the
    tensors written one at a time, in name order whatever their dtypes."""
    layout = layout_of(tensors)
    atomic_write(path, lambda f: write_tensors(f, layout, tensors.__getitem__, metadata, any_dtypes=True))


class _Digest:
    """A write-only file that keeps the sha256 of what is written to it, and nothing else."""

    def __init__(self) -> None:
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self.sha256.update(data)
        return len(data)


def _written_digest(layout: Layout, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None) -> str | None:
    """The sha256 of the file `write_tensors` writes of `tensors` (hashed as it goes, nothing kept),
    or None when they are of several dtypes (`save`'s bytes are not that file then)."""
    if len({dtype for dtype, _ in layout.values()}) != 1:
        return None
    sink = _Digest()
    write_tensors(sink, layout, tensors.__getitem__, metadata)
    return sink.sha256.hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """`sha256_hex(safetensors.torch.save(tensors, metadata))` without those bytes in memory (one
    dtype: the file `write_tensors` writes, hashed as it goes; several go through `save`)."""
    return _written_digest(layout_of(tensors), tensors, metadata) or \
        hashlib.sha256(st_save(dict(tensors), metadata=metadata)).hexdigest()


def put_tensors(store: LocalStore, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None,
                fresh: bool = False) -> str:
    """`store.put(safetensors.torch.save(tensors, metadata))`: the same blob under the same
    digest, without those bytes in memory (a round's checkpoint is the model and its outer
    momentum: 56 GB for a 7B model, twice over while the bytes were built beside the tensors).
    The file is hashed as `write_tensors` would write it; a blob the store already holds is not
    written again, else it is written tensor by tensor to a staged file, hashed on the way, and
    moved in. Tensors of more than one dtype go through `save`. `fresh`: the caller knows the store
    does not hold the blob (it alone stores it): written and hashed in one pass, not hashed first."""
    layout = layout_of(tensors)
    if fresh and len({dtype for dtype, _ in layout.values()}) == 1:
        with StagedBlob(store.root) as blob:
            write_tensors(blob, layout, tensors.__getitem__, metadata)
            return store.adopt(blob)
    digest = _written_digest(layout, tensors, metadata)
    if digest is None:
        return store.put(st_save(dict(tensors), metadata=metadata))
    if store.has(digest):
        return digest
    with StagedBlob(store.root) as blob:
        write_tensors(blob, layout, tensors.__getitem__, metadata)
        if blob.close() != digest:
            raise StoreError(f"tensors changed while they were stored (hashed as {digest[:12]}, written as {blob.digest[:12]})")
        return store.adopt(blob)


__all__ = ["DTYPES", "FLOATS", "FileTensors", "Layout", "TensorFile", "layout_of", "put_tensors", "tensors_digest", "write_tensors", "write_tensors_file"]
