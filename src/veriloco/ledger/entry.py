"""One ledger entry per round, as an in-toto Statement v1.

An entry is the record of a round: the commitments the workers signed with the verdict on each,
the hash of the aggregate, the resulting checkpoint, and the hash of the previous entry, which
chains the entries. Wrapping it in an in-toto Statement v1
(https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md) lets generic tooling
read it: the *subject* is the checkpoint blob (by sha256), the *predicate* is the round.

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": "checkpoint", "digest": {"sha256": "<hex>"}}],
     "predicateType": "https://veriloco.dev/round/v1",
     "predicate": {"run_id", "round", "prev_entry_hash", "commitments", "aggregate_hash",
                   "codecs", "eval_loss", ...extra fields}}

An entry's bytes are its canonical JSON (`hashing.canonical_json`); its hash is the sha256 of
those bytes; round 0's `prev_entry_hash` is 64 zeros. Leaves of the ledger's Merkle tree
(RFC 9162) are these same bytes.

A row read back from a ledger is hostile input: `parse_entry` checks size, UTF-8, that the bytes
are exactly the canonical encoding (so one entry has one hash), and every field's type.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..hashing import canonical_json, sha256_hex

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://veriloco.dev/round/v1"
ZERO_HASH = "0" * 64  # prev_entry_hash of round 0
MAX_ENTRY_BYTES = 1 << 20  # an entry holds hashes, not tensors; 1 MiB is generous

_HEX64 = re.compile(r"[0-9a-f]{64}")
_REQUIRED = ("run_id", "round", "prev_entry_hash", "commitments", "aggregate_hash", "codecs",
             "eval_loss")


class LedgerError(Exception):
    """A ledger entry or the ledger itself is malformed, out of order, or tampered with."""


def make_entry(
    *,
    run_id: str,
    round: int,
    prev_entry_hash: str,
    checkpoint: str,
    commitments: list[dict[str, Any]],
    aggregate_hash: str | None,
    codecs: dict[str, Any] | list[Any],
    eval_loss: float | None,
    **extra: Any,
) -> dict[str, Any]:
    """The entry for `round` of run `run_id`, as an in-toto Statement.

    `checkpoint` is the sha256 of the new checkpoint blob (the Statement's subject);
    `commitments` are JSON objects, each with a `verdict`: a reason code string ("accept" or a
    `verify` reason such as "cosine_outlier") or an object with one under "reason" (as
    `verify.screen.Verdict.to_dict()` gives);
    `aggregate_hash` is None when no update was accepted; `extra` fields go into the predicate.
    Raises LedgerError if a field has the wrong type, so a bad entry never reaches a ledger.
    """
    predicate: dict[str, Any] = dict(extra)
    predicate.update(
        run_id=run_id,
        round=round,
        prev_entry_hash=prev_entry_hash,
        commitments=commitments,
        aggregate_hash=aggregate_hash,
        codecs=codecs,
        eval_loss=eval_loss,
    )
    entry = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": "checkpoint", "digest": {"sha256": checkpoint}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }
    check_entry(entry)
    try:
        canonical_json(entry)
    except (TypeError, ValueError) as e:
        raise LedgerError(f"entry for round {round} is not JSON-encodable: {e}") from None
    return entry


def entry_bytes(entry: dict[str, Any]) -> bytes:
    """The canonical JSON bytes of `entry`: what is stored, hashed and Merkle-ized."""
    return canonical_json(entry)


def entry_hash(data: bytes | dict[str, Any]) -> str:
    """sha256 hex of an entry's bytes (a dict is encoded canonically first)."""
    return sha256_hex(data if isinstance(data, bytes | bytearray) else canonical_json(data))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def parse_entry(data: bytes, max_bytes: int = MAX_ENTRY_BYTES) -> dict[str, Any]:
    """Decode and validate an entry read from a ledger; LedgerError naming the first problem."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LedgerError(f"entry must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise LedgerError(f"entry is {len(data)} bytes, over the limit {max_bytes}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LedgerError(f"entry is not valid UTF-8 at byte {e.start}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise LedgerError("entry JSON nests too deeply") from None
    except ValueError as e:
        raise LedgerError(f"entry is not valid JSON: {str(e).splitlines()[0]}") from None
    try:
        again = canonical_json(obj)
    except (ValueError, UnicodeEncodeError, RecursionError) as e:
        raise LedgerError(f"entry cannot be re-encoded canonically: {e}") from None
    if again != data:
        raise LedgerError(
            "entry is not in canonical form (sorted keys, no spaces, no duplicate keys, "
            "UTF-8 not escapes)"
        )
    check_entry(obj)
    return obj


def _is_hex64(x: Any) -> bool:
    return isinstance(x, str) and _HEX64.fullmatch(x) is not None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_entry(entry: Any) -> None:
    """Check the structure of an entry object; LedgerError naming the first bad field."""
    if not isinstance(entry, dict):
        raise LedgerError(f"entry must be a JSON object, got {type(entry).__name__}")
    keys = set(entry)
    want = {"_type", "subject", "predicateType", "predicate"}
    if keys != want:
        raise LedgerError(f"entry has keys {sorted(keys)}, expected {sorted(want)}")
    if entry["_type"] != STATEMENT_TYPE:
        raise LedgerError(f"entry _type is {entry['_type']!r:.80}, expected {STATEMENT_TYPE!r}")
    if entry["predicateType"] != PREDICATE_TYPE:
        raise LedgerError(
            f"entry predicateType is {entry['predicateType']!r:.80}, expected {PREDICATE_TYPE!r}"
        )
    subject = entry["subject"]
    if (
        not isinstance(subject, list)
        or len(subject) != 1
        or not isinstance(subject[0], dict)
        or set(subject[0]) != {"name", "digest"}
        or subject[0]["name"] != "checkpoint"
        or not isinstance(subject[0]["digest"], dict)
        or set(subject[0]["digest"]) != {"sha256"}
    ):
        raise LedgerError(
            'entry subject must be [{"name": "checkpoint", "digest": {"sha256": <hex>}}]'
        )
    if not _is_hex64(subject[0]["digest"]["sha256"]):
        raise LedgerError(
            f"entry checkpoint digest is not sha256 hex: {subject[0]['digest']['sha256']!r:.80}"
        )
    p = entry["predicate"]
    if not isinstance(p, dict):
        raise LedgerError(f"entry predicate must be an object, got {type(p).__name__}")
    for key in _REQUIRED:
        if key not in p:
            raise LedgerError(f"entry predicate is missing {key!r}")
    if not _is_hex64(p["run_id"]):
        raise LedgerError(f"entry run_id is not sha256 hex: {p['run_id']!r:.80}")
    if not _is_int(p["round"]) or p["round"] < 0:
        raise LedgerError(f"entry round must be an integer >= 0, got {p['round']!r:.80}")
    if not _is_hex64(p["prev_entry_hash"]):
        raise LedgerError(f"entry prev_entry_hash is not sha256 hex: {p['prev_entry_hash']!r:.80}")
    if p["aggregate_hash"] is not None and not _is_hex64(p["aggregate_hash"]):
        raise LedgerError(f"entry aggregate_hash is not sha256 hex: {p['aggregate_hash']!r:.80}")
    if not isinstance(p["codecs"], dict | list):
        raise LedgerError(f"entry codecs must be an object or a list, got {p['codecs']!r:.80}")
    loss = p["eval_loss"]
    if loss is not None and (
        not isinstance(loss, int | float) or isinstance(loss, bool) or not math.isfinite(loss)
    ):
        raise LedgerError(f"entry eval_loss must be a finite number or null, got {loss!r:.80}")
    commitments = p["commitments"]
    if not isinstance(commitments, list):
        raise LedgerError(f"entry commitments must be a list, got {type(commitments).__name__}")
    seen = set()
    for j, c in enumerate(commitments):
        if not isinstance(c, dict):
            raise LedgerError(f"entry commitment {j} is not an object")
        v = c.get("verdict")
        reason = v.get("reason") if isinstance(v, dict) else v
        if not isinstance(reason, str) or not reason:
            raise LedgerError(
                f"entry commitment {j} verdict must be a reason code string (\"accept\" or why "
                f"not) or an object with one under \"reason\", got {v!r:.80}"
            )
        slot = (c.get("worker"), c.get("stage", 0))
        if not all(_is_int(x) and x >= 0 for x in slot):
            raise LedgerError(f"entry commitment {j} must name its worker (and stage) as integers >= 0, "
                              f"got {slot[0]!r:.40} ({slot[1]!r:.40})")
        if slot in seen:
            raise LedgerError(f"entry commitment {j} is a second one of worker {slot[0]} (stage {slot[1]})")
        seen.add(slot)


def verdict_reason(commitment: dict[str, Any]) -> str:
    """The reason code of a recorded commitment's verdict: "accept" or why it was rejected."""
    v = commitment["verdict"]
    return str(v["reason"] if isinstance(v, dict) else v)
