"""The `Ledger` interface: an append-only, hash-chained log of round entries with RFC 9162
Merkle roots and proofs.

Everything that is the same for every backend lives here: the chain checks on `append`, the
Merkle root, inclusion and consistency proofs over the entries' bytes (RFC 9162 §2.1, see
`merkle.py`), and `verify_chain`, which re-reads a ledger from storage and names the first bad
index. A backend (SQLite, an EVM contract, ...) implements storage only:

    _size() -> int                      how many entries are stored
    _raw(i) -> bytes                    the stored bytes of entry i (LedgerError if unreadable)
    _append_raw(index, data, entry_hash, root) -> None
                                        store `data` as entry `index`, atomically, and raise
                                        LedgerError if the stored size is no longer `index`
                                        (another writer appended first); `entry_hash` is
                                        sha256(data) and `root` the Merkle root (hex) over
                                        entries 0..index, for backends that record them
    _stored_hash(i) -> str | None       optional: the hash the backend recorded for entry i
    _stored_root(n) -> str | None       optional: the root the backend recorded at size n
    close() -> None

Entries are in-toto Statements (see `entry.py`); entry i is round i.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ..hashing import sha256_hex
from . import merkle
from .entry import ZERO_HASH, LedgerError, entry_bytes, parse_entry

__all__ = ["Ledger", "LedgerError", "verify_chain"]


class Ledger(ABC):
    """Append-only log of round entries. Subclasses provide storage; see the module docstring.

    Leaf hashes of entries already read are cached in memory (entries never change), and the
    cache catches up with the storage on every call, so several processes may share one ledger.
    `verify_chain` bypasses the cache and re-reads everything.
    """

    def __init__(self) -> None:
        self._reset_cache()

    def _reset_cache(self) -> None:
        self._leaves: list[bytes] = []  # RFC 9162 leaf hash of each entry read so far
        self._hashes: list[str] = []  # sha256 of each entry's bytes (the chain)
        self._frontier = merkle.Frontier()
        self._run_id: str | None = None

    # ---- storage: implemented by each backend

    @abstractmethod
    def _size(self) -> int:
        """Number of stored entries."""

    @abstractmethod
    def _raw(self, i: int) -> bytes:
        """Stored bytes of entry `i`; LedgerError if missing or unreadable."""

    @abstractmethod
    def _append_raw(self, index: int, data: bytes, entry_hash: str, root: str) -> None:
        """Store `data` as entry `index` atomically; LedgerError if the size is not `index`."""

    def _stored_hash(self, i: int) -> str | None:
        """The entry hash the backend recorded for entry `i`, if it records one."""
        return None

    def _stored_root(self, n: int) -> str | None:
        """The Merkle root the backend recorded when it held `n` entries, if it records one."""
        return None

    def close(self) -> None:  # noqa: B027 - a backend with nothing to release need not override
        """Release the storage (connections, files)."""

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- cache of leaf hashes

    def _remember(self, data: bytes) -> None:
        leaf = merkle.leaf_hash(data)
        self._leaves.append(leaf)
        self._hashes.append(sha256_hex(data))
        self._frontier.append(leaf)
        if self._run_id is None:
            self._run_id = parse_entry(data)["predicate"]["run_id"]

    def _sync(self) -> int:
        """Read entries appended since the last call (by us or another process); return size."""
        n = self._size()
        if n < len(self._leaves):  # storage shrank: it was tampered with; start again
            self._reset_cache()
        for i in range(len(self._leaves), n):
            self._remember(self._raw(i))
        return n

    # ---- the public interface

    def append(self, entry: dict[str, Any]) -> int:
        """Append `entry` (see `entry.make_entry`) and return its index.

        LedgerError unless the entry is well formed, its round is the ledger's size, its
        prev_entry_hash is the hash of the last entry (64 zeros for round 0), and its run_id is
        the run_id of entry 0.
        """
        return self.append_bytes(entry_bytes(entry))

    def append_bytes(self, data: bytes) -> int:
        """Append an entry given as its canonical bytes (e.g. copied from another ledger)."""
        p = parse_entry(data)["predicate"]
        n = self._sync()
        if p["round"] != n:
            raise LedgerError(
                f"entry is for round {p['round']} but the ledger holds {n} entries; "
                f"the next entry must be round {n}"
            )
        prev = self._hashes[-1] if n else ZERO_HASH
        if p["prev_entry_hash"] != prev:
            raise LedgerError(
                f"entry {n} has prev_entry_hash {p['prev_entry_hash']}, "
                f"but the last entry's hash is {prev}"
            )
        if self._run_id is not None and p["run_id"] != self._run_id:
            raise LedgerError(
                f"entry {n} is for run {p['run_id']}, but this ledger records run {self._run_id}"
            )
        leaf = merkle.leaf_hash(data)
        frontier = self._frontier.copy()
        frontier.append(leaf)
        self._append_raw(n, bytes(data), sha256_hex(data), frontier.root().hex())
        self._remember(bytes(data))
        return n

    def size(self) -> int:
        """Number of entries."""
        return self._sync()

    def __len__(self) -> int:
        return self.size()

    def _check_index(self, i: int, n: int, what: str = "entry") -> None:
        if not isinstance(i, int) or not 0 <= i < n:
            raise LedgerError(f"{what} {i} is outside a ledger of {n} entries")

    def entry_bytes(self, i: int) -> bytes:
        """Stored bytes of entry `i`."""
        self._check_index(i, self._size())
        return self._raw(i)

    def entry(self, i: int) -> dict[str, Any]:
        """Entry `i`, parsed and validated."""
        return parse_entry(self.entry_bytes(i))

    def entries(self) -> list[dict[str, Any]]:
        """All entries, parsed and validated, in order."""
        return [parse_entry(self._raw(i)) for i in range(self._size())]

    def entry_hash(self, i: int) -> str:
        """sha256 hex of entry `i`'s bytes (what entry i+1 names as prev_entry_hash)."""
        self._check_index(i, self._sync())
        return self._hashes[i]

    def head_hash(self) -> str:
        """Hash of the last entry: the prev_entry_hash the next entry must carry."""
        n = self._sync()
        return self._hashes[-1] if n else ZERO_HASH

    def _tree_size(self, n: int | None) -> int:
        size = self._sync()
        if n is None:
            return size
        if not isinstance(n, int) or not 0 <= n <= size:
            raise LedgerError(f"tree size {n} is outside 0..{size}")
        return n

    def root(self, n: int | None = None) -> str:
        """RFC 9162 Merkle root (hex) over the first `n` entries' bytes (all by default)."""
        n = self._tree_size(n)
        if n == len(self._leaves):
            return self._frontier.root().hex()
        return merkle.root_of_hashes(self._leaves[:n]).hex()

    def inclusion_proof(self, i: int, n: int | None = None) -> list[str]:
        """RFC 9162 audit path (hex) of entry `i` in the tree of the first `n` entries.

        Check it with `merkle.verify_inclusion(merkle.leaf_hash(entry_bytes), i, n, proof, root)`.
        """
        n = self._tree_size(n)
        self._check_index(i, n)
        return [h.hex() for h in merkle.inclusion_proof_of_hashes(i, self._leaves[:n])]

    def consistency_proof(self, m: int, n: int | None = None) -> list[str]:
        """RFC 9162 proof (hex) that the tree of the first `m` entries is a prefix of the tree of
        the first `n`; check it with `merkle.verify_consistency(m, n, root_m, root_n, proof)`."""
        n = self._tree_size(n)
        if not isinstance(m, int) or not 0 <= m <= n:
            raise LedgerError(f"old tree size {m} is outside 0..{n}")
        return [h.hex() for h in merkle.consistency_proof_of_hashes(m, self._leaves[:n])]

    def verify(self) -> list[str]:
        """Problems found by `verify_chain(self)`; empty when the ledger is sound."""
        return verify_chain(self)


def verify_chain(ledger: Ledger, trusted: tuple[int, str] | None = None) -> list[str]:
    """Re-read every entry from storage and check the hash chain; return the problems found,
    each "entry <index>: <reason>", in index order (empty list: the ledger is sound).

    Checks, per entry: it parses (strictly), round == index, prev_entry_hash == hash of the
    previous stored entry, same run_id as entry 0, and — where the backend records them — the
    stored entry hash and the stored Merkle root after it. `trusted` = (size, root) is a root
    obtained earlier (e.g. signed by a peer); the ledger must still have that root at that size.
    """
    problems: list[str] = []
    n = ledger._size()
    prev: str | None = ZERO_HASH
    run_id: str | None = None
    frontier = merkle.Frontier()
    roots_at: dict[int, str] = {}
    for i in range(n):
        try:
            data = ledger._raw(i)
        except LedgerError as e:
            problems.append(f"entry {i}: {e}")
            prev = None  # the next link cannot be checked
            continue
        h = sha256_hex(data)
        stored = ledger._stored_hash(i)
        if stored is not None and stored != h:
            problems.append(f"entry {i}: stored hash {stored} does not match its bytes ({h})")
        frontier.append(merkle.leaf_hash(data))
        roots_at[i + 1] = frontier.root().hex()
        stored_root = ledger._stored_root(i + 1)
        if stored_root is not None and stored_root != roots_at[i + 1]:
            problems.append(
                f"entry {i}: stored Merkle root at size {i + 1} is {stored_root}, "
                f"recomputed {roots_at[i + 1]}"
            )
        try:
            p = parse_entry(data)["predicate"]
        except LedgerError as e:
            problems.append(f"entry {i}: {e}")
            prev = h
            continue
        if p["round"] != i:
            problems.append(f"entry {i}: records round {p['round']}")
        if prev is not None and p["prev_entry_hash"] != prev:
            problems.append(
                f"entry {i}: prev_entry_hash {p['prev_entry_hash']} is not the hash of entry "
                f"{i - 1} ({prev})" if i else f"entry 0: prev_entry_hash is not {ZERO_HASH}"
            )
        if run_id is None:
            run_id = p["run_id"]
        elif p["run_id"] != run_id:
            problems.append(f"entry {i}: run_id {p['run_id']} differs from entry 0's {run_id}")
        prev = h
    if trusted is not None:
        size, want = trusted
        if size > n:
            problems.append(f"entry {n}: the ledger has {n} entries, fewer than trusted size {size}")
        else:
            got = roots_at.get(size, merkle.EMPTY_ROOT.hex())
            if got != want:
                problems.append(
                    f"entry {max(size - 1, 0)}: root at trusted size {size} is {got}, "
                    f"trusted {want}"
                )
    return problems
