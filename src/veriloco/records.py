"""The run directory: manifest, per-round records, metrics and summary.

```
RUN/
  manifest.json   config, model-init hash, corpus root, code version; its hash is the run id
  store/          content-addressed blobs: corpus chunks, packets, checkpoints
  workers/W/      each worker's private state (inner optimizer), for resume (elastic: workers/W.lock
                  is held by the process running worker W, elastic.hold_worker)
  rounds.jsonl    one JSON line per completed round: the verifiable record
  metrics.jsonl   one JSON line per round: numbers for plots
  summary.json    written at the end of the run
  .lock           while a launcher trains into RUN: its pid, flock'ed (RunDir.claim); removed at its end
```
A line of rounds.jsonl is written only after everything it names is in the store, so the last
complete line is always a consistent point to resume from; a torn last line (a crash mid-write)
is ignored and truncated on resume.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .hashing import canonical_json, json_hash, scheme_problem
from .store import atomic_write

if TYPE_CHECKING:
    from .store import FsspecStore, LocalStore


class RunDirError(ValueError):
    """A run directory is missing, incomplete, or holds malformed records."""


class RunInUse(RunDirError):
    """Another process holds the run directory (`RunDir.claim`)."""


_CLAIMS: dict[Path, int] = {}  # run directory (resolved) -> the open, flock'ed RUN/.lock this process holds


class Held(Exception):
    """`lock_with_pid`'s file is locked by another process: `holder` is what it wrote there."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder

    def pid(self) -> str:
        """' (pid N)' for the message (' (pid N on HOST)' for another machine's), or '' when the
        file names no pid."""
        pid, host = _pid_host(self.holder)
        if pid is None:
            return ""
        return f" (pid {pid} on {host})" if host is not None and host != socket.gethostname() else f" (pid {pid})"


def _pid_host(text: str) -> tuple[int | None, str | None]:
    """A lock file's "PID HOST" (or a bare PID, as written before the host was): the pid, if it is
    one, and the host, if named."""
    pid, _, host = text.strip().partition(" ")
    if not (pid.isascii() and pid.isdigit() and 0 < int(pid) < 1 << 31):  # a pid, not what a copy's garbage says
        return None, None
    return int(pid), host.strip() or None


def lock_with_pid(path: Path) -> int:
    """Open `path` (made if missing), take its exclusive flock without waiting and write this
    process's pid into it; the fd, which holds the lock while open. `Held` when another process
    holds it. On a file system without locks (an NFS mount without its lock manager: ENOLCK) the
    fd comes back unlocked: nothing is guarded there, as before there were locks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise Held(holder) from None
    except OSError:
        pass
    os.ftruncate(fd, 0)
    # the host too: a run directory shared between machines (elastic) is read from machines where
    # this pid means nothing (RunDir.holder)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


def _locked_elsewhere(path: Path) -> bool:
    """Whether a process holds `path`'s flock: a shared lock tried without waiting is refused.
    Where locks cannot be asked (ENOLCK), or the file went, False, as an unlocked file is."""
    return _lock_state(path) is True


def _lock_state(path: Path) -> bool | None:
    """`_locked_elsewhere`, but None where locks cannot be asked (ENOLCK: an NFS mount without its
    lock manager), where no lock tells whether a process holds the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # (closing lets go of a lock it got)
    return False


def make_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """`mkdir -p path`; returns the directories it made, deepest first (what to remove if what
    follows fails). A file where a directory must go, or a directory the OS refuses to make, is a
    RunDirError in one line, with nothing made."""
    path = Path(path)
    made = [d for d in (path, *path.parents) if not d.exists()]
    nearest = next((d for d in (path, *path.parents) if d.exists()), None)
    if nearest is not None and not nearest.is_dir():
        raise RunDirError(f"{nearest} is a file, not a directory (making {path})")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # no permission, a read-only file system, ...
        remove_dirs(made)
        raise RunDirError(f"cannot make the directory {path}: {e.strerror or e}") from None
    return made


def remove_dirs(made: Sequence[Path]) -> None:
    """Remove what `make_dirs` made, deepest first, each only if it is empty."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            pass


def users_task(manifest: dict[str, Any]) -> str | None:
    """The name of the user's Task a `train_task` run trained (its model factory's), or None for
    the built-in tasks, whose model `[model]` describes and whose batches come from the corpus in
    the store. A user's Task is code the run directory does not hold: what rebuilds the model or
    the batches (audit, resume, sample) needs it from the user (audit_task, resume_task)."""
    if "task" in manifest and "corpus_manifest" not in manifest:
        return str(manifest["task"])[:80]
    return None


class RunDir:
    """Paths and readers/writers of one run directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"
        self.rounds_path = self.root / "rounds.jsonl"
        self.metrics_path = self.root / "metrics.jsonl"
        self.summary_path = self.root / "summary.json"
        self.store_dir = self.root / "store"

    def worker_dir(self, worker: int) -> Path:
        return self.root / "workers" / str(worker)

    # -- one launcher at a time -----------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.root / ".lock"

    def claim(self) -> bool:
        """Hold this run directory for this process until `release` (or until it ends), so that a
        second `veriloco train --resume` of it, or a second run into it, is refused in one line
        instead of racing the first for its rounds. An exclusive flock on RUN/.lock, which holds the
        holder's pid for the message; the directory is made if missing. RunInUse when another
        process holds it. Workers and joiners of an elastic run do not claim: only launchers.
        True when this made the directory."""
        key = self.root.resolve()
        if key in _CLAIMS:
            return False
        made = not self.root.exists()
        while True:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = lock_with_pid(self.lock_path)
            except Held as e:
                raise RunInUse(f"{self.root} is in use by another veriloco process{e.pid()}: wait for it to end, "
                               "or stop it, before running into it again") from None
            except OSError as e:
                raise RunDirError(f"cannot lock the run directory {self.root}: {e.strerror or e}") from None
            try:  # the file locked must still be the one at the path: a releasing holder unlinks it
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        _CLAIMS[key] = fd
        return made

    def holder(self) -> int | None:
        """The pid of a live process that holds this run directory (`claim`: a launcher training
        into it now), else None. On its own machine, read from RUN/.lock without locking it, so
        asking never gets in a launcher's way; a lock file a killed launcher left names a pid that
        is gone. A pid of another machine (a shared run directory) cannot be asked after here: the
        file's lock is tried instead (shared, without waiting, and let go at once), which a live
        holder's refuses. Before, that pid was looked up among this machine's processes: a run
        training on machine A was no run in progress to `veriloco audit` on machine B. On its own
        machine too the file must be locked (a live pid alone can be any process's)."""
        try:
            text = self.lock_path.read_text(encoding="ascii", errors="replace").strip()
        except OSError:
            return None
        pid, host = _pid_host(text)
        if pid is None:
            return None
        if host is not None and host != socket.gethostname():
            return pid if _locked_elsewhere(self.lock_path) else None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
        # a live pid alone is not a holder: a lock file a killed launcher left may name a pid reused since, and
        # one written by hand may name any (pid 1 is always alive), which made `veriloco audit` skip the signature;
        # where locks cannot be asked (ENOLCK), the pid is all there is
        return pid if _lock_state(self.lock_path) is not False else None

    def holder_host(self) -> str | None:
        """The machine named in RUN/.lock when it is not this one (a run directory shared between
        machines), else None: for messages beside `holder`'s pid."""
        try:
            _, host = _pid_host(self.lock_path.read_text(encoding="ascii", errors="replace"))
        except OSError:
            return None
        return host if host is not None and host != socket.gethostname() else None

    def release(self) -> None:
        """Give up `claim` (nothing when not held): RUN/.lock goes, so a run leaves no trace of it."""
        fd = _CLAIMS.pop(self.root.resolve(), None)
        if fd is None:
            return
        try:
            self.lock_path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    # -- manifest ---------------------------------------------------------------------------
    def write_manifest(self, manifest: dict[str, Any]) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.manifest_path, canonical_json(manifest) + b"\n")
        return json_hash(manifest)

    def read_manifest(self, hashes: bool = True) -> dict[str, Any]:
        """The manifest, checked to be a run's; with `hashes`, also to be one whose tensor hashes
        this code computes (`hashing.scheme_problem`): everything but the report, which only shows."""
        if not self.manifest_path.is_file():
            raise RunDirError(f"{self.root} is not a run directory: no manifest.json")
        try:
            manifest = json.loads(self.manifest_path.read_bytes())
        except (ValueError, RecursionError) as e:  # not JSON or UTF-8, a 5000-digit int; nested past the stack
            raise RunDirError(f"{self.manifest_path} is not valid JSON: {str(e)[:100]}") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
            raise RunDirError(f"{self.manifest_path} has no config")
        if hashes and (problem := scheme_problem(manifest)) is not None:
            raise RunDirError(f"{self.manifest_path}: {problem}")
        return manifest

    def read_own_manifest(self) -> dict[str, Any]:
        """`read_manifest`, refused unless it hashes to its run id: a run goes on (resume, join) only
        under the config it was started with, not one edited since (which the audit would refuse)."""
        manifest = self.read_manifest()
        if json_hash({k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")}) != manifest.get("run_id"):
            raise RunDirError(f"{self.manifest_path} was changed since the run started (it does not hash to its "
                              "run id): a run goes on only under the config it started with")
        return manifest

    # -- records ------------------------------------------------------------------------------
    def append_jsonl(self, path: Path, obj: dict[str, Any]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(_jsonl_line(obj))
            f.flush()
            os.fsync(f.fileno())

    def append_round(self, record: dict[str, Any]) -> None:
        self.append_jsonl(self.rounds_path, record)

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        self.append_jsonl(self.metrics_path, metrics)

    def read_jsonl(self, path: Path) -> list[dict[str, Any]]:
        """Complete lines of a JSONL file; a torn last line is skipped, a bad middle line is an error."""
        if not path.exists():
            return []
        if not path.is_file():
            raise RunDirError(f"{path} is not a file")
        lines = path.read_bytes().split(b"\n")
        out = []
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON or UTF-8, a 5000-digit int; nested past the stack
                if i == len(lines) - 1:  # no trailing newline: a torn write
                    break
                raise RunDirError(f"{path.name} line {i + 1} is not valid JSON") from None
            if not isinstance(obj, dict):
                raise RunDirError(f"{path.name} line {i + 1} is not a JSON object")
            out.append(obj)
        return out

    def has_records(self) -> bool:
        """Whether rounds.jsonl holds anything (read or not: a malformed one counts)."""
        return self.rounds_path.is_file() and self.rounds_path.stat().st_size > 0

    def rounds(self) -> list[dict[str, Any]]:
        return self.read_jsonl(self.rounds_path)

    def metrics(self) -> list[dict[str, Any]]:
        return self.read_jsonl(self.metrics_path)

    def truncate_to(self, n_rounds: int, elastic: bool = False) -> None:
        """Keep the first n_rounds records of rounds.jsonl and metrics.jsonl (resume), and rebuild
        the metrics lines a kill lost (`rebuild_metrics`)."""
        rounds = [o for o in self.rounds() if o.get("round", -1) < n_rounds]
        atomic_write(self.rounds_path, "".join(map(_jsonl_line, rounds)).encode())
        self.rebuild_metrics(rounds, n_rounds, elastic)

    def rebuild_metrics(self, rounds: list[dict[str, Any]], n_rounds: int, elastic: bool = False) -> None:
        """metrics.jsonl's lines of the first n_rounds rounds, and for each of `rounds` (the records)
        without one a line rebuilt from its record, marked `"rebuilt": true`: the recorder appends a
        round's record, then its metrics line, and a kill between the two lost the line for good.
        Its elapsed_s is the rounds' seconds summed (what a resumed run counts from), not the first
        run's wall clock; `elastic`: with the round's members, as an elastic run's lines have. Best
        effort: from a record it cannot read (a field missing or of another type), it rebuilds no
        more; every line it keeps stays as it was, in round order."""
        kept = [o for o in self.metrics() if o.get("round", -1) < n_rounds]
        have = {o.get("round") for o in kept}
        tokens, elapsed = 0, 0.0
        for rec in rounds:
            try:
                tokens, elapsed = tokens + rec["tokens"], elapsed + rec["round_s"]
                if rec["round"] not in have:
                    extra = {"members": rec.get("members")} if elastic else {}
                    kept.append(metrics_of(rec, tokens, elapsed) | extra | {"rebuilt": True})
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                break
        kept.sort(key=lambda o: o.get("round") if type(o.get("round")) is int else -1)
        atomic_write(self.metrics_path, "".join(map(_jsonl_line, kept)).encode())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.summary_path, (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())


def _jsonl_line(obj: dict[str, Any]) -> str:
    """One line of rounds.jsonl or metrics.jsonl."""
    return json.dumps(obj, sort_keys=True, allow_nan=False) + "\n"


def metrics_of(rec: dict[str, Any], tokens: int, elapsed_s: float) -> dict[str, Any]:
    """Round `rec`'s metrics.jsonl line: the run's tokens and seconds so far (this round's in
    them), and the utilisation of the workers present (their mean inner-step seconds over the
    round's seconds)."""
    inner = [x for x, v in zip(rec["inner_s"], rec["train_loss"], strict=True) if v is not None]
    return {"round": rec["round"], "eval_loss": rec["eval_loss"], "train_loss": rec["train_loss"], "tokens": tokens,
            "elapsed_s": round(elapsed_s, 3), "tokens_per_s": round(tokens / elapsed_s, 1),
            "utilisation": round(sum(inner) / len(inner) / rec["round_s"], 4)}


class RoundsFollower:
    """A run's rounds.jsonl read as it grows, for a process that polls it many times a second
    (the elastic launcher, a worker awaiting a record): each call parses only the lines appended
    since the last. `RunDir.rounds` reads the whole file: 31 ms at 1,000 rounds of 4 workers (2.3
    KB a record) and 0.7 s at 10,000 (bench/records_poll.py), which a 20 Hz poll made 62% of a core
    and then more than a core; a poll of this takes 2.4 us at any length. A line counts once its newline
    is written (a torn last line waits); a file that shrank or was replaced (a resume truncates
    it) is read again whole; a complete line that is not a JSON object is a RunDirError."""

    def __init__(self, run: RunDir) -> None:
        self.path = run.rounds_path
        self._records: list[dict[str, Any]] = []
        self._offset, self._file = 0, None
        self._lock = threading.Lock()  # an elastic worker's exchange thread awaits records beside its main thread

    def rounds(self) -> list[dict[str, Any]]:
        """Every complete record so far (a list of its own; the records in it are shared)."""
        with self._lock:
            return list(self._read())

    def _read(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        file = (st.st_dev, st.st_ino) if st else None
        if file != self._file or (st is not None and st.st_size < self._offset):
            self._records, self._offset, self._file = [], 0, file
        if st is None or st.st_size == self._offset:
            return self._records
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        end = data.rfind(b"\n") + 1
        new = []
        for i, raw in enumerate(data[:end].split(b"\n")[:-1]):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                obj = None
            if not isinstance(obj, dict):
                raise RunDirError(f"{self.path.name} line {len(self._records) + i + 1} is not a JSON object")
            new.append(obj)
        self._records += new  # all of it or (an error above) none, so the next call reads the same lines again
        self._offset += end
        return self._records


def checkpoint_blobs(record: dict[str, Any]) -> set[str]:
    """The model-sized blobs a round record names: its checkpoint, or a pipelined run's stage
    checkpoints (the stage-checkpoint manifest it names instead is a few hundred bytes: kept)."""
    parts = record.get("stages") or [record]
    return {p["checkpoint"] for p in parts if isinstance(p, dict) and isinstance(p.get("checkpoint"), str)}


def prune_checkpoints(store: LocalStore | FsspecStore, records: Sequence[dict[str, Any]], keep: int) -> list[str]:
    """`[run] keep_checkpoints`: delete the checkpoints of all but the newest `keep` of `records`
    (a run's records in round order: all of them at a resume, the newest keep + 1 after each
    round), except a blob a kept round names too. keep = 0 keeps all. Idempotent; returns the
    digests it deleted."""
    if keep <= 0 or len(records) <= keep:
        return []
    kept = set().union(*(checkpoint_blobs(r) for r in records[-keep:]))
    return [d for rec in records[:-keep] for d in sorted(checkpoint_blobs(rec) - kept) if store.delete(d)]


def pruned(keep: int, n_records: int, r: int) -> bool:
    """Whether round r's checkpoint is one `[run] keep_checkpoints = keep` deletes once n_records
    rounds are recorded."""
    return keep > 0 and r < n_records - keep
