"""Commitments: what a worker signs about its round before its packet is accepted.

A commitment binds a worker to everything a verifier may later check: the run and round, the
global params it started from (`base_hash`), the batches it used (`batch_root`), its trace (state
hashes every k inner steps, and their root), its per-segment losses, the packet it sent (hash,
size, codec), and the hash of its round's salt (`salt_hash`). It travels as canonical JSON
(hashing.canonical_json):

    {"commitment": {...fields...}, "signature": <128 hex>, "public_key": <64 hex>}

The signature covers `SIGNING_DOMAIN + commitment_bytes(c)`; the domain prefix keeps a signature
on a commitment from being valid for any other message type (a ledger entry, a future format).

`parse_signed_commitment` treats its input as hostile: size first, strict UTF-8, no NaN/Infinity,
no duplicate keys, exactly the expected keys, exact types (a bool is not an int, an int is not a
float), ranges, lowercase 64-hex digests, bounded lists, and the bytes must be exactly the
canonical encoding (so one commitment has one byte string, one hash, and no malleability).
Anything else is a one-line `CommitmentError`.

The salt is the commit-reveal behind the round's random draws (replay sample, loss-gain batches
and checkers): every worker commits `sha256(salt)` and reveals the salt only after it has received
every bundle (exchange.py), and the draws' seed mixes the revealed salts (check.round_seed). A
worker that sends last sees the others' commitments but not their salts, so no choice of its own
commitment tells it the draw. `round_salt` makes the salt from the worker's key (an Ed25519
signature is deterministic): nobody without the key can compute it, and a rerun draws the same.

Equivocation (signing two different commitments for one run and round, e.g. showing different
packets to different peers) is caught by `EquivocationDetector`, whose evidence (both signed
commitments) anyone can re-check offline with `verify_equivocation_evidence`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..hashing import canonical_json, sha256_hex
from ..packet import MAX_HEADER, PacketError, packet_codecs
from . import (
    BAD_SIGNATURE,
    EQUIVOCATION,
    KEY_MISMATCH,
    LATE,
    MALFORMED,
    STALE_BASE,
    UNKNOWN_WORKER,
)
from .identity import public_key_hex, sign, verify_signature

SIGNING_DOMAIN = b"veriloco/commitment/v1\n"
SALT_DOMAIN = b"veriloco/salt/v1\n"  # what round_salt signs: no commitment or ledger entry starts so
SALT_BYTES = 32
REVEAL_DOMAIN = b"veriloco/reveal/v1\n"  # what a reveal's signature covers (reveal_message)
REVEAL_BYTES = SALT_BYTES + 64  # a reveal on the wire: the salt and the Ed25519 signature
DEFAULT_MAX_BYTES = 1 << 20  # a commitment at every limit below is ~1 MiB; honest ones are ~1 KiB
MAX_TRACE = 4096  # trace hashes per commitment (H / k); 4096 covers H=4096 with k=1
MAX_LOSSES = 4096  # per-segment losses, same bound as the trace
MAX_CODEC_PARAMS = 4096  # entries of a per-parameter codec map (a model's named tensors)
MAX_NAME_CHARS = 256  # length of a codec spec or a parameter name
MAX_ROUND = 2**53 - 1  # largest int every JSON reader represents exactly
MAX_WORKER = 2**31 - 1
MAX_PACKET_BYTES = 2**40  # 1 TiB: far above any packet, below anything that overflows

FIELDS: tuple[str, ...] = (
    "run_id",
    "round",
    "worker",
    "base_hash",
    "batch_root",
    "trace_root",
    "trace",
    "losses",
    "packet_hash",
    "packet_bytes",
    "codec",
    "salt_hash",
)
_SIGNED_KEYS = frozenset({"commitment", "signature", "public_key"})
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_NAME = re.compile(rf"[\x21-\x7e]{{1,{MAX_NAME_CHARS}}}")  # printable ASCII, no spaces


class CommitmentError(ValueError):
    """A commitment or signed commitment is malformed, oversized, or not canonical."""


def _check_int(name: str, value: Any, hi: int) -> int:
    if type(value) is not int:  # bool is a subclass of int: reject it too
        raise CommitmentError(
            f"commitment field {name!r} must be an int, got {type(value).__name__}"
        )
    if not 0 <= value <= hi:
        raise CommitmentError(f"commitment field {name!r} = {value} is outside [0, {hi}]")
    return value


def _check_hex64(name: str, value: Any) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise CommitmentError(f"{name} must be 64 lowercase hex characters, got {value!r:.80}")
    return value


def _check_codec(value: Any) -> str | dict[str, str]:
    if isinstance(value, str):
        if not _NAME.fullmatch(value):
            raise CommitmentError(
                f"codec spec {value!r:.80} is not 1-{MAX_NAME_CHARS} printable chars"
            )
        return value
    if not isinstance(value, dict):
        raise CommitmentError(f"codec must be a spec string or a map, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_CODEC_PARAMS:
        raise CommitmentError(f"codec map has {len(value)} entries, allowed 1-{MAX_CODEC_PARAMS}")
    for k, v in value.items():
        if not isinstance(k, str) or not _NAME.fullmatch(k):
            raise CommitmentError(f"codec map key {k!r:.80} is not a parameter name")
        if not isinstance(v, str) or not _NAME.fullmatch(v):
            raise CommitmentError(f"codec spec for {k!r:.80} is not a spec string")
    return dict(value)


@dataclass(frozen=True)
class Commitment:
    """One worker's claim about one round; every field is validated on construction."""

    run_id: str  # sha256 of the run manifest
    round: int  # outer round r
    worker: int  # worker id w
    base_hash: str  # tensors_hash of the global params G_r the inner steps started from
    batch_root: str  # root over the hashes of the batches used in the H inner steps
    trace_root: str  # root over `trace`
    trace: tuple[str, ...]  # state hashes (params + inner optimizer) every k inner steps
    losses: tuple[float, ...]  # mean training loss of each trace segment
    packet_hash: str  # sha256 of the packet bytes
    packet_bytes: int  # length of the packet in bytes
    codec: str | dict[str, str]  # one codec spec for all params, or {param: spec}
    salt_hash: str  # sha256 of the round's salt, revealed once every bundle is in (round_salt)

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _HEX64.fullmatch(self.run_id):
            raise CommitmentError(
                f"run_id must be 64 lowercase hex characters, got {self.run_id!r:.80}"
            )
        _check_int("round", self.round, MAX_ROUND)
        _check_int("worker", self.worker, MAX_WORKER)
        for name in ("base_hash", "batch_root", "trace_root", "packet_hash", "salt_hash"):
            _check_hex64(name, getattr(self, name))
        _check_int("packet_bytes", self.packet_bytes, MAX_PACKET_BYTES)
        if not isinstance(self.trace, (list, tuple)) or len(self.trace) > MAX_TRACE:
            raise CommitmentError(f"trace must be a list of at most {MAX_TRACE} hashes")
        for i, h in enumerate(self.trace):
            _check_hex64(f"trace[{i}]", h)
        if not isinstance(self.losses, (list, tuple)) or len(self.losses) > MAX_LOSSES:
            raise CommitmentError(f"losses must be a list of at most {MAX_LOSSES} floats")
        losses = []
        for i, x in enumerate(self.losses):
            # honest code may hand ints; canonical bytes always hold floats, so parse of a
            # wire "2" (int) fails the canonical check rather than silently becoming 2.0
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise CommitmentError(f"losses[{i}] must be a float, got {type(x).__name__}")
            try:
                value = float(x)
            except OverflowError:
                raise CommitmentError(f"losses[{i}] is too large for a float") from None
            if not math.isfinite(value):
                raise CommitmentError(f"losses[{i}] = {value} is not finite")
            losses.append(value)
        object.__setattr__(self, "trace", tuple(self.trace))
        object.__setattr__(self, "losses", tuple(losses))
        object.__setattr__(self, "codec", _check_codec(self.codec))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object form (lists, not tuples)."""
        d = {name: getattr(self, name) for name in FIELDS}
        d["trace"] = list(self.trace)
        d["losses"] = list(self.losses)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Commitment:
        """Build from a JSON object with exactly the fields of a commitment."""
        if not isinstance(d, dict):
            raise CommitmentError(f"commitment must be a JSON object, got {type(d).__name__}")
        if set(d) != set(FIELDS):
            missing = sorted(set(FIELDS) - set(d))
            extra = sorted(str(k)[:40] for k in set(d) - set(FIELDS))
            raise CommitmentError(
                f"commitment fields: missing {missing[:4]}, unexpected {extra[:4]}"
            )
        if not isinstance(d["trace"], list) or not isinstance(d["losses"], list):
            raise CommitmentError("commitment fields 'trace' and 'losses' must be JSON arrays")
        return cls(**d)

    def codec_for(self, param: str) -> str | None:
        """The codec spec this commitment declares for `param` (None if the map omits it)."""
        return self.codec if isinstance(self.codec, str) else self.codec.get(param)


def round_salt(private: Ed25519PrivateKey, run_id: str, round: int, stage: int = 0) -> bytes:
    """The salt a worker commits to for `round` (of pipeline stage `stage`): the sha256 of its
    Ed25519 signature of the run, round and stage under SALT_DOMAIN. Deterministic (a rerun
    draws the same replays), and unknown to anyone without the key until revealed."""
    message = SALT_DOMAIN + canonical_json({"run_id": run_id, "round": round, "stage": stage})
    return bytes.fromhex(sha256_hex(bytes.fromhex(sign(private, message))))


def reveal_message(digest: str, salt: bytes) -> bytes:
    """What a reveal signs: its salt, for the commitment named `digest` (SignedCommitment.digest),
    so a reveal speaks for one commitment (of one run, round, worker and stage) only."""
    return REVEAL_DOMAIN + digest.encode() + b"\n" + salt


def sign_reveal(private: Ed25519PrivateKey, digest: str, salt: bytes) -> bytes:
    """The REVEAL_BYTES a worker sends once every bundle is in: `salt` and its signature."""
    return salt + bytes.fromhex(sign(private, reveal_message(digest, salt)))


def open_reveal(signed: SignedCommitment, raw: bytes, public_key: str | None) -> str | None:
    """The salt (hex) in reveal `raw` when it is signed by `public_key` for `signed` and opens its
    `salt_hash`; "" when it is signed but does not open it (the worker's own signed word that it
    broke its commitment: an offence anyone can re-check); None when it is not a signed reveal
    (missing, cut, or signed by no one: no one's word)."""
    salt, sig = raw[:SALT_BYTES], raw[SALT_BYTES:]
    if len(raw) != REVEAL_BYTES or not verify_signature(public_key, reveal_message(signed.digest, salt), sig.hex()):
        return None
    return salt.hex() if sha256_hex(salt) == signed.commitment.salt_hash else ""


def commitment_bytes(c: Commitment) -> bytes:
    """The canonical JSON of `c`: the bytes whose hash names it and that get signed."""
    return canonical_json(c.to_dict())


def signing_message(c: Commitment) -> bytes:
    """Exactly what the worker's key signs: a domain prefix and the canonical commitment."""
    return SIGNING_DOMAIN + commitment_bytes(c)


@dataclass(frozen=True)
class SignedCommitment:
    """A commitment with its signature and the signer's public key (both lowercase hex)."""

    commitment: Commitment
    signature: str  # 128 hex: Ed25519 signature of signing_message(commitment)
    public_key: str  # 64 hex: the key that signed; must equal the worker's admitted key

    @property
    def worker(self) -> int:
        return self.commitment.worker

    @property
    def digest(self) -> str:
        """sha256 of the canonical commitment (not of the signature): the commitment's name."""
        return sha256_hex(commitment_bytes(self.commitment))

    def to_dict(self) -> dict[str, Any]:
        return {
            "commitment": self.commitment.to_dict(),
            "signature": self.signature,
            "public_key": self.public_key,
        }

    def to_bytes(self) -> bytes:
        """The canonical wire form that `parse_signed_commitment` accepts."""
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> SignedCommitment:
        """Validate a signed-commitment JSON object (structure only; signature not checked)."""
        if not isinstance(d, dict):
            raise CommitmentError(
                f"signed commitment must be a JSON object, got {type(d).__name__}"
            )
        if set(d) != _SIGNED_KEYS:
            raise CommitmentError(
                f"signed commitment keys must be {sorted(_SIGNED_KEYS)}, "
                f"got {sorted(str(k)[:40] for k in d)[:6]}"
            )
        sig, pub = d["signature"], d["public_key"]
        if not isinstance(sig, str) or not _HEX128.fullmatch(sig):
            raise CommitmentError(
                f"signature must be 128 lowercase hex characters, got {sig!r:.80}"
            )
        _check_hex64("public_key", pub)
        return cls(Commitment.from_dict(d["commitment"]), sig, pub)


def sign_commitment(c: Commitment, private: Ed25519PrivateKey) -> dict[str, Any]:
    """Sign `c`: the JSON object {"commitment", "signature", "public_key"} to send."""
    if not isinstance(c, Commitment):
        raise TypeError(f"expected a Commitment, got {type(c).__name__}")
    return {
        "commitment": c.to_dict(),
        "signature": sign(private, signing_message(c)),
        "public_key": public_key_hex(private),
    }


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise CommitmentError("JSON object has a duplicate key")
    return d


def _reject_constant(name: str) -> Any:
    raise CommitmentError(f"JSON constant {name} is not allowed")


def parse_signed_commitment(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> SignedCommitment:
    """Parse and strictly validate a peer's signed commitment (signature is NOT checked here:
    call `check_signature` with the run's admitted keys)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CommitmentError(f"signed commitment must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise CommitmentError(f"signed commitment is {len(data)} bytes, over the limit {max_bytes}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CommitmentError(f"signed commitment is not UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant
        )
    except CommitmentError:
        raise
    except RecursionError:
        raise CommitmentError("signed commitment JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and ints over the interpreter's digit limit
        raise CommitmentError(f"signed commitment is not JSON: {str(e)[:100]}") from None
    signed = SignedCommitment.from_dict(obj)
    try:
        canonical = signed.to_bytes()
    except (UnicodeEncodeError, ValueError):
        raise CommitmentError("signed commitment has text that cannot be encoded") from None
    if canonical != data:
        raise CommitmentError("signed commitment is not in canonical JSON form")
    return signed


def _as_signed(signed: SignedCommitment | Mapping[str, Any]) -> SignedCommitment:
    if isinstance(signed, SignedCommitment):
        return signed
    return SignedCommitment.from_dict(dict(signed) if isinstance(signed, Mapping) else signed)


def check_signature(
    signed: SignedCommitment | Mapping[str, Any], admitted_keys: Mapping[int, str]
) -> str | None:
    """None if `signed` is signed by its worker's admitted key, else the reason code:
    UNKNOWN_WORKER (worker not admitted), KEY_MISMATCH (embedded key is not the admitted one),
    BAD_SIGNATURE (the signature does not verify). A dict is validated first (CommitmentError)."""
    s = _as_signed(signed)
    admitted = admitted_keys.get(s.worker)
    if admitted is None:
        return UNKNOWN_WORKER
    if not isinstance(admitted, str) or admitted.lower() != s.public_key:
        return KEY_MISMATCH
    if not verify_signature(s.public_key, signing_message(s.commitment), s.signature):
        return BAD_SIGNATURE
    return None


def check_commitment(
    signed: SignedCommitment | Mapping[str, Any],
    admitted_keys: Mapping[int, str],
    *,
    run_id: str,
    round: int,
    base_hash: str,
) -> str | None:
    """`check_signature`, then that the commitment is for this run and round and started from
    this round's global params. Reason codes: those of check_signature; LATE for an earlier
    round; MALFORMED for another run or a later round; STALE_BASE for another base hash."""
    s = _as_signed(signed)
    reason = check_signature(s, admitted_keys)
    if reason is not None:
        return reason
    c = s.commitment
    if c.run_id != run_id:
        return MALFORMED
    if c.round < round:
        return LATE
    if c.round != round:
        return MALFORMED
    if c.base_hash != base_hash:
        return STALE_BASE
    return None


def check_packet(signed: SignedCommitment | Mapping[str, Any], packet: bytes | memoryview,
                 packet_hash: str | None = None, max_header: int = MAX_HEADER) -> str | None:
    """None if `packet` is the one the commitment names (size, sha256, codec per parameter),
    else MALFORMED. Tensors are not decoded here (packet.decode_packet does that).
    `packet_hash`: sha256_hex(packet), where the caller has just computed it. `max_header`: the
    most header bytes read (packet.header_limit of the model)."""
    c = _as_signed(signed).commitment
    if not isinstance(packet, (bytes, bytearray, memoryview)):
        return MALFORMED
    if len(packet) != c.packet_bytes or (packet_hash or sha256_hex(packet)) != c.packet_hash:
        return MALFORMED
    try:
        codecs = packet_codecs(packet, max_header)
    except PacketError:
        return MALFORMED
    if isinstance(c.codec, str):
        ok = bool(codecs) and all(spec == c.codec for spec in codecs.values())
    else:
        ok = codecs == c.codec
    return None if ok else MALFORMED


class EquivocationDetector:
    """Remembers the first validly signed commitment per (run, round, worker) and reports a
    worker who signs a different one for the same slot.

    Only signatures that verify count (under `admitted_keys` when given, else under the key the
    commitment carries, and then both commitments must carry the same key): an unsigned or
    forged message proves nothing against a worker. Re-sending the same commitment is fine.
    """

    def __init__(self, admitted_keys: Mapping[int, str] | None = None) -> None:
        self.admitted_keys = dict(admitted_keys) if admitted_keys is not None else None
        self._first: dict[tuple[str, int, int], SignedCommitment] = {}
        self._evidence: dict[tuple[str, int, int], dict[str, Any]] = {}

    def _valid(self, s: SignedCommitment) -> bool:
        if self.admitted_keys is not None:
            return check_signature(s, self.admitted_keys) is None
        return verify_signature(s.public_key, signing_message(s.commitment), s.signature)

    def observe(self, signed: SignedCommitment | Mapping[str, Any]) -> dict[str, Any] | None:
        """Feed one signed commitment. Returns the evidence (a JSON-serialisable dict) if its
        worker has equivocated in this run and round, else None. Invalid ones are ignored."""
        try:
            s = _as_signed(signed)
        except CommitmentError:
            return None
        c = s.commitment
        key = (c.run_id, c.round, c.worker)
        if key in self._evidence:
            return self._evidence[key]
        if not self._valid(s):
            return None
        first = self._first.setdefault(key, s)
        if first.public_key != s.public_key or first.digest == s.digest:
            return None
        pair = sorted((first, s), key=lambda x: x.digest)  # same evidence whatever the order
        evidence = {
            "reason": EQUIVOCATION,
            "run_id": c.run_id,
            "round": c.round,
            "worker": c.worker,
            "public_key": s.public_key,
            "commitments": [x.to_dict() for x in pair],
        }
        self._evidence[key] = evidence
        return evidence

    def proof(self, run_id: str, round: int, worker: int) -> dict[str, Any] | None:
        """The evidence that `worker` equivocated in (run_id, round), or None: a lookup, with no
        signature checked again (`observe` checked them as they came)."""
        return self._evidence.get((run_id, round, worker))

    def equivocators(self, run_id: str, round: int) -> list[int]:
        """Workers caught equivocating in (run_id, round), ascending."""
        return sorted(w for (r_id, r, w) in self._evidence if r_id == run_id and r == round)

    @property
    def evidence(self) -> list[dict[str, Any]]:
        """All evidence so far, ordered by (run, round, worker)."""
        return [self._evidence[k] for k in sorted(self._evidence)]

    def forget_before(self, round: int) -> None:
        """Drop what is remembered about rounds before `round` (evidence is kept)."""
        self._first = {k: v for k, v in self._first.items() if k[1] >= round}


def verify_equivocation_evidence(
    evidence: Any, admitted_keys: Mapping[int, str] | None = None
) -> bool:
    """Re-check equivocation evidence offline: two different commitments for the same run,
    round and worker, both validly signed by the same key (the admitted one, when given).
    Never raises on malformed evidence; returns False."""
    try:
        if not isinstance(evidence, dict) or evidence.get("reason") != EQUIVOCATION:
            return False
        pair = evidence.get("commitments")
        if not isinstance(pair, list) or len(pair) != 2:
            return False
        a, b = (SignedCommitment.from_dict(x) for x in pair)
        ca, cb = a.commitment, b.commitment
        same_slot = (ca.run_id, ca.round, ca.worker) == (cb.run_id, cb.round, cb.worker)
        claimed = (evidence.get("run_id"), evidence.get("round"), evidence.get("worker"))
        if not same_slot or claimed != (ca.run_id, ca.round, ca.worker):
            return False
        if a.public_key != b.public_key or a.digest == b.digest:
            return False
        for s in (a, b):
            if admitted_keys is not None:
                if check_signature(s, admitted_keys) is not None:
                    return False
            elif not verify_signature(s.public_key, signing_message(s.commitment), s.signature):
                return False
        return True
    except Exception:  # noqa: BLE001 - evidence may be hostile; answer, do not crash
        return False
