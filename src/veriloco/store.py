"""Content-addressed blob store: a blob's name is the sha256 of its bytes.

Writes are atomic (write to a temporary file, fsync, rename), so a crash leaves either the whole
blob or nothing; every read checks the hash, so a flipped byte on disk is an error, not data.
Used for the corpus, packets, checkpoints and traces.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .hashing import sha256_hex

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class StoreError(Exception):
    """A blob is missing, corrupt, or a name is not a sha256 hex digest."""


def check_digest(digest: str) -> str:
    """Return `digest` if it is a lowercase 64-char sha256 hex string, else raise StoreError."""
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise StoreError(f"not a sha256 digest: {digest!r:.80}")
    return digest


class LocalStore:
    """Blobs under `root/ab/cdef...` on local disk."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        check_digest(digest)
        return self.root / digest[:2] / digest[2:]

    def put(self, data: bytes) -> str:
        """Store `data`; return its sha256. Idempotent: an existing blob is not rewritten."""
        digest = sha256_hex(data)
        path = self._path(digest)
        if path.exists():
            return digest
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return digest

    def get(self, digest: str, max_bytes: int | None = None) -> bytes:
        """Bytes of blob `digest`; StoreError if missing, larger than `max_bytes`, or corrupt."""
        path = self._path(digest)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreError(f"blob {digest} is missing from {self.root}") from None
        if max_bytes is not None and size > max_bytes:
            raise StoreError(f"blob {digest} is {size} bytes, over the limit {max_bytes}")
        data = path.read_bytes()
        if sha256_hex(data) != digest:
            raise StoreError(f"blob {digest} is corrupt: its bytes hash to {sha256_hex(data)}")
        return data

    def has(self, digest: str) -> bool:
        """True when blob `digest` is present (its hash is checked on `get`, not here)."""
        return self._path(digest).exists()

    def path_of(self, digest: str) -> Path:
        """Where blob `digest` lives on disk (for tests and tools that corrupt it on purpose)."""
        return self._path(digest)

    def digests(self) -> list[str]:
        """All blob names, sorted."""
        out = []
        for sub in sorted(self.root.iterdir()):
            if sub.is_dir() and len(sub.name) == 2:
                out += [sub.name + p.name for p in sorted(sub.iterdir()) if not p.name.startswith(".")]
        return out
