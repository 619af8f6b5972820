"""SQLite ledger backend (stdlib `sqlite3`): one file, WAL journal, one transaction per append.

Schema:

    entries(idx INTEGER PRIMARY KEY, hash TEXT, body BLOB)   one row per round entry
    roots(size INTEGER PRIMARY KEY, root TEXT)                RFC 9162 Merkle root after each append

Triggers make both tables append-only (UPDATE and DELETE abort) and refuse an insert whose index
is not the next one, so even another program writing to the file cannot rewrite history through
SQL without first dropping the triggers — which `verify_chain` then catches from the hashes.
Each append runs in `BEGIN IMMEDIATE` (the write lock is taken before the size is read), so two
processes appending to one file cannot interleave, and a crash mid-append leaves the previous
state: SQLite's journal rolls back the unfinished transaction when the file is next opened.
"""

from __future__ import annotations

import os
import sqlite3
import time

from .base import Ledger
from .entry import LedgerError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (idx INTEGER PRIMARY KEY, hash TEXT NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS roots (size INTEGER PRIMARY KEY, root TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS entries_no_update BEFORE UPDATE ON entries
  BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END;
CREATE TRIGGER IF NOT EXISTS entries_no_delete BEFORE DELETE ON entries
  BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END;
CREATE TRIGGER IF NOT EXISTS entries_next_only BEFORE INSERT ON entries
  WHEN NEW.idx IS NOT (SELECT COALESCE(MAX(idx) + 1, 0) FROM entries)
  BEGIN SELECT RAISE(ABORT, 'ledger entry index is not the next one'); END;
CREATE TRIGGER IF NOT EXISTS roots_no_update BEFORE UPDATE ON roots
  BEGIN SELECT RAISE(ABORT, 'ledger roots are append-only'); END;
CREATE TRIGGER IF NOT EXISTS roots_no_delete BEFORE DELETE ON roots
  BEGIN SELECT RAISE(ABORT, 'ledger roots are append-only'); END;
"""


class SqliteLedger(Ledger):
    """Ledger in the SQLite file `path` (created if missing).

    `synchronous` is SQLite's PRAGMA: "FULL" (default) fsyncs every commit, so an append that
    returned survives a power cut; "NORMAL" survives a process crash only, and is faster.
    """

    def __init__(
        self, path: str | os.PathLike[str], synchronous: str = "FULL", timeout: float = 30.0
    ) -> None:
        if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        super().__init__()
        self.path = os.fspath(path)
        deadline = time.monotonic() + timeout
        while True:
            db = None
            try:
                # autocommit mode: we issue BEGIN/COMMIT ourselves
                db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA synchronous={synchronous}")
                db.executescript(_SCHEMA)
                self._db = db
                return
            except sqlite3.OperationalError as e:
                # Several processes opening a new ledger at once (an elastic run's workers): switching
                # it to WAL can fail with "database is locked" at once, without SQLite's busy wait.
                if db is not None:
                    db.close()
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise LedgerError(f"cannot open ledger {self.path}: {e}") from None
                time.sleep(0.05)
            except sqlite3.DatabaseError as e:
                raise LedgerError(f"cannot open ledger {self.path}: {e}") from None

    def _size(self) -> int:
        try:
            (n,) = self._db.execute("SELECT COALESCE(MAX(idx) + 1, 0) FROM entries").fetchone()
        except sqlite3.DatabaseError as e:
            raise LedgerError(f"cannot read ledger {self.path}: {e}") from None
        return int(n)

    def _row(self, i: int) -> tuple[str, bytes]:
        try:
            row = self._db.execute("SELECT hash, body FROM entries WHERE idx = ?", (i,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise LedgerError(f"cannot read entry {i} of {self.path}: {e}") from None
        if row is None:
            raise LedgerError(f"entry {i} is missing from {self.path}")
        h, body = row
        if not isinstance(body, bytes) or not isinstance(h, str):
            raise LedgerError(f"entry {i} of {self.path} has a non-blob body or non-text hash")
        return h, body

    def _raw(self, i: int) -> bytes:
        return self._row(i)[1]

    def _stored_hash(self, i: int) -> str | None:
        return self._row(i)[0]

    def _stored_root(self, n: int) -> str | None:
        try:
            row = self._db.execute("SELECT root FROM roots WHERE size = ?", (n,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise LedgerError(f"cannot read the root at size {n} of {self.path}: {e}") from None
        return None if row is None else str(row[0])

    def _append_raw(self, index: int, data: bytes, entry_hash: str, root: str) -> None:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")  # take the write lock before reading the size
        except sqlite3.DatabaseError as e:
            raise LedgerError(f"cannot lock ledger {self.path} for append: {e}") from None
        try:
            n = self._size()
            if n != index:
                raise LedgerError(
                    f"ledger {self.path} grew to {n} entries while appending entry {index} "
                    "(another writer)"
                )
            db.execute(
                "INSERT INTO entries (idx, hash, body) VALUES (?, ?, ?)", (index, entry_hash, data)
            )
            db.execute("INSERT INTO roots (size, root) VALUES (?, ?)", (index + 1, root))
            db.execute("COMMIT")
        except BaseException as e:
            db.execute("ROLLBACK")
            if isinstance(e, sqlite3.DatabaseError):
                raise LedgerError(f"append of entry {index} to {self.path} failed: {e}") from None
            raise

    def close(self) -> None:
        """Close the connection (the last one to close also checkpoints the WAL into the file)."""
        self._db.close()
