"""Content-addressed blob store: a blob's name is the sha256 of its bytes.

Writes are atomic (write to a temporary file, fsync, rename), so a crash leaves either the whole
blob or nothing; every read checks the hash, so a flipped byte on disk is an error, not data.
Used for the corpus, packets, checkpoints and traces.

Beside the blobs a store holds a few *refs* (`refs/<name>`, as in git): small named files that
say where to start reading. A finished run publishes its signed checkpoint manifest as the ref
`runs/<run id>.sig.json` (run.py `publish_run`), so `veriloco audit --ledger ... --store URL`
finds the run in a store from its run id alone. A ref is not content-addressed: whoever reads
one checks what it says (a signature, the digests it lists) before trusting it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .hashing import sha256_hex

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REF = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(/[a-z0-9][a-z0-9._-]{0,127}){0,3}$")
MAX_REF_BYTES = 1 << 20


def atomic_write(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """Write `data` to `path` via a private temporary file, fsync, chmod `mode`, rename: readers
    see the old file or the whole new one, never a part (a crash leaves no partial file). `data`
    may be a function that writes the file's bytes to the file it is given (a piece at a time)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # created 0600
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


STAGED_PREFIX = ".tmp-blob-"
LEFTOVER_AGE_S = 60.0  # a staged file this old whose lock is free was left by a process that died


def remove_leftovers(directory: Path, exclude: Path | None = None) -> list[Path]:
    """Delete the `StagedBlob` files in `directory` that a killed process left (SIGKILL, power
    loss: no cleanup ran): those whose lock is free and that were not written for LEFTOVER_AGE_S
    (a file just created, before its owner locks it, is spared). Returns what it deleted."""
    gone = []
    for path in directory.glob(f"{STAGED_PREFIX}*"):
        if path == exclude:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if time.time() - os.fstat(fd).st_mtime > LEFTOVER_AGE_S:
                path.unlink(missing_ok=True)
                gone.append(path)
        except OSError:
            pass  # locked: its process is staging it now
        finally:
            os.close(fd)
    return gone


class StagedBlob:
    """A blob written as a stream to a private temporary file in `directory`, hashed as it is
    written, for a store that does not exist yet (run.prepare_run writes G_0 before the run id,
    which names the run directory, is known); `LocalStore.adopt` moves it in. As a context
    manager, a blob that was not adopted is deleted on the way out. The file is locked (flock)
    while its process lives, so the next StagedBlob in the directory deletes one a killed process
    left (`remove_leftovers`)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=STAGED_PREFIX)  # created 0600
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives: how a later one tells a leftover
        self.path, self._f, self._h, self.digest = Path(tmp), os.fdopen(fd, "wb"), hashlib.sha256(), ""
        remove_leftovers(Path(directory), exclude=self.path)

    def write(self, data: bytes | memoryview) -> int:
        self._h.update(data)
        return self._f.write(data)

    def close(self) -> str:
        """Flush and fsync the file; its sha256. The file stays open, and so locked, until it is
        adopted or the blob is left: closing it here let the next StagedBlob in the directory
        delete a G_0 whose run was still preparing (storing the corpus) as a killed process's."""
        if not self.digest:
            self._f.flush()
            os.fsync(self._f.fileno())
            self.digest = self._h.hexdigest()
        return self.digest

    def release(self) -> None:
        """Let go of the file (and its lock): once it is adopted, or dropped."""
        self._f.close()

    def __enter__(self) -> StagedBlob:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)


class StoreError(Exception):
    """A blob is missing, corrupt, or a name is not a sha256 hex digest."""


def _open_regular(path: Path, what: str) -> int:
    """A read-only fd of `path`; StoreError unless it is a regular file. O_NONBLOCK: opening a FIFO
    for reading waits for a writer otherwise (forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{what} at {path} is not a regular file")
    return fd


def _read_regular(path: Path, max_bytes: int | None, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them (StoreError past that, or
    for anything else at the path: a FIFO's read waited forever and /dev/zero's never ended, both
    of size 0; a directory was an IsADirectoryError). FileNotFoundError passes through."""
    fd = _open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if max_bytes is not None and st.st_size > max_bytes:
            raise StoreError(f"{what} is {st.st_size} bytes, over the limit {max_bytes}")
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:  # grown since its size was read
        raise StoreError(f"{what} is over the limit {max_bytes} bytes")
    return data


def check_ref(name: str) -> str:
    """Return `name` if it is a ref name (lowercase path segments, no `..`), else StoreError."""
    if not isinstance(name, str) or not _REF.fullmatch(name) or ".." in name:
        raise StoreError(f"not a ref name: {name!r:.80}")
    return name


def run_ref(run_id: str) -> str:
    """The ref under which a finished run publishes its signed checkpoint manifest."""
    return f"runs/{check_digest(run_id)}.sig.json"


def check_digest(digest: str) -> str:
    """Return `digest` if it is a lowercase 64-char sha256 hex string, else raise StoreError."""
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise StoreError(f"not a sha256 digest: {digest!r:.80}")
    return digest


_VERIFIED: set[tuple[str, str, int, int]] = set()  # (path, digest, size, mtime) hashed here: LocalStore.verified_path


def _check_stream(digest: str, f: BinaryIO) -> None:
    """StoreError unless what is left to read of `f` hashes to `digest` (read 4 MiB at a time)."""
    h = hashlib.sha256()
    while chunk := f.read(1 << 22):
        h.update(chunk)
    if h.hexdigest() != digest:
        raise StoreError(f"blob {digest} is corrupt: its bytes hash to {h.hexdigest()}")


class LocalStore:
    """Blobs under `root/ab/cdef...` on local disk; refs under `root/refs/`.

    `create=False` opens an existing store only (StoreError if `root` is not a directory).
    `bytes_written` counts the bytes this object wrote (blobs and refs; `put` of a blob the store
    already holds writes nothing): what the store cost this process in writes."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        self.root = Path(root)
        if not create and not self.root.is_dir():
            raise StoreError(f"store {self.root} does not exist")
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store {self.root} is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_written = 0

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
        atomic_write(path, data)
        self.bytes_written += len(data)
        return digest

    def get(self, digest: str, max_bytes: int | None = None) -> bytes:
        """Bytes of blob `digest`; StoreError if missing, not a regular file, larger than
        `max_bytes`, or corrupt."""
        path = self._path(digest)
        try:
            data = _read_regular(path, max_bytes, f"blob {digest}")
        except FileNotFoundError:
            raise StoreError(f"blob {digest} is missing from {self.root}") from None
        if sha256_hex(data) != digest:
            raise StoreError(f"blob {digest} is corrupt: its bytes hash to {sha256_hex(data)}")
        return data

    def has(self, digest: str) -> bool:
        """True when blob `digest` is present (its hash is checked on `get`, not here)."""
        return self._path(digest).exists()

    def verified_path(self, digest: str) -> Path:
        """Where blob `digest` lives, after hashing its bytes as a stream (StoreError if missing
        or corrupt): for readers that map a large blob instead of holding it (`task.StoredParams`).
        A process hashes a blob once, and again if its file was written since (size or mtime)."""
        path = self._path(digest)
        try:
            with os.fdopen(_open_regular(path, f"blob {digest}"), "rb") as f:
                st = os.fstat(f.fileno())
                seen = (str(path), digest, st.st_size, st.st_mtime_ns)
                if seen in _VERIFIED:
                    return path
                _check_stream(digest, f)
        except FileNotFoundError:
            raise StoreError(f"blob {digest} is missing from {self.root}") from None
        _VERIFIED.add(seen)
        return path

    def verify(self, digest: str) -> None:
        """StoreError unless blob `digest` is present and its bytes hash to its name (read as a
        stream: a checkpoint need not fit in memory)."""
        self.verified_path(digest)

    def delete(self, digest: str) -> bool:
        """Remove blob `digest`; True when it was there. Content addressing lets two names share
        bytes, so a caller deletes only what nothing it keeps names (`prune_checkpoints`)."""
        try:
            self._path(digest).unlink()
        except FileNotFoundError:
            return False
        return True

    def path_of(self, digest: str) -> Path:
        """Where blob `digest` lives on disk (for tests and tools that corrupt it on purpose)."""
        return self._path(digest)

    def adopt(self, blob: StagedBlob) -> str:
        """Move a `StagedBlob` in under its digest (a rename within one filesystem); return it."""
        digest = blob.close()
        path = self._path(digest)
        self.bytes_written += blob.path.stat().st_size  # written, if only to be dropped
        try:
            if path.exists():
                blob.path.unlink()
                return digest
            path.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(blob.path, 0o644)
            try:
                os.rename(blob.path, path)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                # another filesystem (--out a mount point): copied under a temporary name and renamed, as
                # `put` writes, so a full disk or a kill mid-copy leaves no partial blob under its name
                with blob.path.open("rb") as src:
                    atomic_write(path, lambda f: shutil.copyfileobj(src, f, 1 << 20), mode=0o644)
                blob.path.unlink()
        finally:
            blob.release()
        return digest

    def put_ref(self, name: str, data: bytes) -> None:
        """Point ref `name` at `data` (atomically replacing what it held)."""
        path = self.root / "refs" / check_ref(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
        self.bytes_written += len(data)

    def get_ref(self, name: str) -> bytes:
        """What ref `name` holds; StoreError if it is missing or over MAX_REF_BYTES."""
        path = self.root / "refs" / check_ref(name)
        try:
            return _read_regular(path, MAX_REF_BYTES, f"ref {name}")
        except (FileNotFoundError, NotADirectoryError):
            raise StoreError(f"ref {name} is missing from {self.root}") from None

    def digests(self) -> list[str]:
        """All blob names, sorted."""
        out = []
        for sub in sorted(self.root.iterdir()):
            if sub.is_dir() and len(sub.name) == 2:
                out += [sub.name + p.name for p in sorted(sub.iterdir()) if not p.name.startswith(".")]
        return out


PEERS_DIR = ".peers"  # markers of the processes that open a store together (`mark_peer`), none kept
_TOKEN = re.compile(r"^[0-9a-f]{32}$")


def mark_peer(store: LocalStore, token: str) -> Path:
    """Leave an empty marker named `token` (32 hex digits) in `store`, for `seen_peers` in the
    processes it shares the store with; its path (the caller removes it)."""
    if not _TOKEN.fullmatch(token):
        raise StoreError(f"not a peer token: {token!r:.40}")
    path = store.root / PEERS_DIR / token
    path.parent.mkdir(exist_ok=True)
    path.touch()
    return path


def seen_peers(store: LocalStore, tokens: list[str]) -> list[int]:
    """Which of `tokens` (every process's, in its group's order; from peers: checked here, a
    malformed one is not seen) have a marker in `store`: the processes that write into the same
    directory, be it on one machine or on a file system they share."""
    return [i for i, t in enumerate(tokens) if isinstance(t, str) and _TOKEN.fullmatch(t)
            and (store.root / PEERS_DIR / t).exists()]


# ---- remote stores (fsspec) -------------------------------------------------------------------

# Object stores publish an object whole or not at all on a single PUT, so a blob is written in
# place there (with a conditional "create" where the backend supports it); everywhere else we
# write a temporary name and rename, which is atomic on a local disk and on in-memory filesystems.
_ATOMIC_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


class FsspecStore:
    """Content-addressed blobs under any fsspec URL (`memory://`, `file://`, `s3://bucket/p`...).

    Same layout as LocalStore (`<root>/ab/cdef...`) and the same guarantees:
    - every `get` checks the size against `max_bytes` *before* reading, then the sha256;
    - publication is atomic: on object stores (s3, gcs, azure) one PUT with mode="create"
      (a conditional put: an existing blob, which has the same bytes by construction, is kept);
      on other filesystems the bytes go to `ab/.tmp-<random>` and are then `fs.mv`-ed into place.
    `storage_options` are passed to fsspec (credentials, endpoints); `create=False` opens an
    existing store only (StoreError if nothing is at `url`).
    """

    def __init__(self, url: str, create: bool = True, **storage_options: object) -> None:
        import fsspec  # imported here so LocalStore users need not have it

        self.url = url
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as e:
            raise StoreError(f"cannot open store {url}: {e}") from None
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.atomic_put = any(p in _ATOMIC_PUT_PROTOCOLS for p in protocols)
        if not create and not self.fs.exists(self.root):
            raise StoreError(f"store {url} does not exist")
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, digest: str) -> str:
        check_digest(digest)
        return f"{self.root}/{digest[:2]}/{digest[2:]}"

    def put(self, data: bytes) -> str:
        """Store `data`; return its sha256. Idempotent: an existing blob is not rewritten."""
        digest = sha256_hex(data)
        path = self._path(digest)
        if self.fs.exists(path):
            return digest
        if self.atomic_put:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                pass  # someone published the same bytes first
            return digest
        parent = f"{self.root}/{digest[:2]}"
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{os.urandom(8).hex()}"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)
            raise
        return digest

    def get(self, digest: str, max_bytes: int | None = None) -> bytes:
        """Bytes of blob `digest`; StoreError if missing, larger than `max_bytes`, or corrupt."""
        path = self._path(digest)
        try:
            size = int(self.fs.info(path)["size"])
        except FileNotFoundError:
            raise StoreError(f"blob {digest} is missing from {self.url}") from None
        if max_bytes is not None and size > max_bytes:
            raise StoreError(f"blob {digest} is {size} bytes, over the limit {max_bytes}")
        try:
            # read at most one byte past the limit, in case the size we were told was a lie
            end = None if max_bytes is None else max_bytes + 1
            data = self.fs.cat_file(path, start=0, end=end)
        except FileNotFoundError:
            raise StoreError(f"blob {digest} is missing from {self.url}") from None
        if max_bytes is not None and len(data) > max_bytes:
            raise StoreError(f"blob {digest} is over the limit {max_bytes} bytes")
        if sha256_hex(data) != digest:
            raise StoreError(f"blob {digest} is corrupt: its bytes hash to {sha256_hex(data)}")
        return data

    def has(self, digest: str) -> bool:
        """True when blob `digest` is present (its hash is checked on `get`, not here)."""
        return bool(self.fs.exists(self._path(digest)))

    def verify(self, digest: str) -> None:
        """StoreError unless blob `digest` is present and its bytes hash to its name (read as a
        stream: a checkpoint need not fit in memory)."""
        try:
            with self.fs.open(self._path(digest), "rb") as f:
                _check_stream(digest, f)
        except FileNotFoundError:
            raise StoreError(f"blob {digest} is missing from {self.url}") from None

    def delete(self, digest: str) -> bool:
        """Remove blob `digest`; True when it was there (see LocalStore.delete)."""
        try:
            self.fs.rm_file(self._path(digest))
        except FileNotFoundError:
            return False
        return True

    def path_of(self, digest: str) -> str:
        """The blob's path inside `self.fs` (for tests and tools that corrupt it on purpose)."""
        return self._path(digest)

    def put_ref(self, name: str, data: bytes) -> None:
        """Point ref `name` at `data`: one PUT on object stores, write-then-rename elsewhere."""
        path = f"{self.root}/refs/{check_ref(name)}"
        if self.atomic_put:
            self.fs.pipe_file(path, data)
            return
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{os.urandom(8).hex()}"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)  # replaces the old ref whole
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)
            raise

    def get_ref(self, name: str) -> bytes:
        """What ref `name` holds; StoreError if it is missing or over MAX_REF_BYTES."""
        path = f"{self.root}/refs/{check_ref(name)}"
        try:
            if int(self.fs.info(path)["size"]) > MAX_REF_BYTES:
                raise StoreError(f"ref {name} is over the limit {MAX_REF_BYTES} bytes")
            return self.fs.cat_file(path, start=0, end=MAX_REF_BYTES + 1)
        except FileNotFoundError:
            raise StoreError(f"ref {name} is missing from {self.url}") from None

    def digests(self) -> list[str]:
        """All blob names, sorted (temporary files are skipped)."""
        out = []
        for p in self.fs.find(self.root):
            sub, _, name = self.fs._strip_protocol(p)[len(self.root) + 1 :].partition("/")
            if len(sub) == 2 and _HEX64.fullmatch(sub + name):
                out.append(sub + name)
        return sorted(out)


def open_store(url_or_path: str | os.PathLike[str], create: bool = True) -> LocalStore | FsspecStore:
    """A LocalStore for a plain path or a `file://` URL (it fsyncs); an FsspecStore otherwise.
    `create=False`: StoreError unless a store is already there."""
    s = os.fspath(url_or_path)
    if s.startswith("file://"):
        return LocalStore(s[len("file://") :], create)
    if "://" in s:
        return FsspecStore(s, create)
    return LocalStore(s, create)
