"""Signed checkpoint manifests, in the spirit of OpenSSF model signing.

At the end of a run the recorder (worker 0) writes `RUN/checkpoint.sig.json`: a canonical JSON
manifest listing the sha256 of every file that makes up the result — the final checkpoint blob,
the run manifest and the round records (rounds.jsonl) — signed with its Ed25519 key.
`veriloco audit` checks the signature against the recorder's admitted key and every listed
digest against the files: in the run directory, or, for a run published into a store
(run.py `publish_run`), against the store's blobs of those digests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .hashing import canonical_json, sha256_hex
from .records import RunDir, atomic_write
from .verify.identity import public_key_hex, sign, verify_signature

DOMAIN = b"veriloco/checkpoint-manifest/v1\n"
FILE = "checkpoint.sig.json"


def write_signed_manifest(run: RunDir, run_id: str, checkpoint: str, round: int, key: Ed25519PrivateKey) -> Path:
    """Sign {run_id, round, files: {name: sha256}} and write it next to the run's records."""
    body = {
        "run_id": run_id,
        "round": round,
        "files": {
            f"store/{checkpoint[:2]}/{checkpoint[2:]}": checkpoint,
            "manifest.json": sha256_hex(run.manifest_path.read_bytes()),
            "rounds.jsonl": sha256_hex(run.rounds_path.read_bytes()),
        },
    }
    signed = {"manifest": body, "public_key": public_key_hex(key),
              "signature": sign(key, DOMAIN + canonical_json(body))}
    path = run.root / FILE
    atomic_write(path, canonical_json(signed) + b"\n")
    return path


def check_signed_manifest(run: RunDir, recorder_key: str, checkpoint: str) -> str | None:
    """None when RUN/checkpoint.sig.json is signed by `recorder_key`, names `checkpoint`, and
    every file it lists hashes to its digest; otherwise what is wrong, in one line."""
    path = run.root / FILE
    return check_signed(path.read_bytes() if path.is_file() else None, recorder_key, checkpoint,
                        lambda name, digest: read_listed(run.root, name))


def read_listed(root: Path, name: str) -> bytes | None:
    """The bytes of file `name` that a signed manifest lists, read under the run directory `root`
    only (None for a name that leaves it, absolute or through `..`, or that is not a file; the run
    directory's own links, a store on another disk, are followed). The recorder writes the list,
    and an absolute name made the audit read, and hash, any file of the auditor's machine."""
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    p = root / name
    try:
        return p.read_bytes() if p.is_file() else None
    except OSError:
        return None


def signed_files(data: bytes) -> dict[str, str]:
    """{name: sha256} listed in a signed manifest (unchecked: call `check_signed` to trust it);
    ValueError if `data` is not a signed manifest."""
    try:
        files = json.loads(data)["manifest"]["files"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(f"{FILE} is not a signed manifest") from None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{FILE} is not a signed manifest")
    return files


def check_signed(
    data: bytes | None, recorder_key: str, checkpoint: str, read: Callable[[str, str], bytes | None],
    run_id: str | None = None, round: int | None = None,
) -> str | None:
    """None when the signed manifest `data` is signed by `recorder_key`, names `checkpoint` (and
    `run_id` and the last `round`, where given), lists manifest.json and rounds.jsonl, and every
    file it lists, as `read(name, digest)` returns it, hashes to its digest; otherwise what is
    wrong, in one line. `read` returns None for a file it cannot find."""
    if data is None:
        return f"{FILE} is missing"
    try:
        signed = json.loads(data)
        body, sig, pub = signed["manifest"], signed["signature"], signed["public_key"]
        files = dict(body["files"])
        message = DOMAIN + canonical_json(body)
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"{FILE} is not a signed manifest"
    if pub != recorder_key or not verify_signature(pub, message, sig):
        return f"{FILE}: the signature is not the recorder's"
    if checkpoint not in files.values():
        return f"{FILE} does not name the final checkpoint {checkpoint[:16]}"
    if run_id is not None and body.get("run_id") != run_id:
        return f"{FILE} is signed for run {str(body.get('run_id'))[:16]}, not {run_id[:16]}"
    if round is not None and body.get("round") != round:
        return f"{FILE} is signed for round {str(body.get('round'))[:12]}, the records end at round {round}"
    missing = [name for name in ("manifest.json", "rounds.jsonl") if name not in files]
    if missing:
        return f"{FILE} does not list {missing[0]}"
    for name, digest in files.items():
        got = read(name, digest) if isinstance(name, str) and isinstance(digest, str) else None
        if got is None or sha256_hex(got) != digest:
            return f"{FILE}: {name} is missing or does not hash to its listed digest"
    return None
