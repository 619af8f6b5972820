"""Signed checkpoint manifests, in the spirit of OpenSSF model signing.

At the end of a run the recorder (worker 0) writes `RUN/checkpoint.sig.json`: a canonical JSON
manifest listing the sha256 of every file that makes up the result — the final checkpoint blob
and the run manifest — signed with its Ed25519 key. `veriloco audit` checks the signature
against the recorder's admitted key and every listed digest against the files.
"""

from __future__ import annotations

import json
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
    if not path.is_file():
        return f"{FILE} is missing"
    try:
        signed = json.loads(path.read_bytes())
        body, sig, pub = signed["manifest"], signed["signature"], signed["public_key"]
        files = body["files"]
    except (ValueError, KeyError, TypeError):
        return f"{FILE} is not a signed manifest"
    if pub != recorder_key or not verify_signature(pub, DOMAIN + canonical_json(body), sig):
        return f"{FILE}: the signature is not the recorder's"
    if checkpoint not in files.values():
        return f"{FILE} does not name the final checkpoint {checkpoint[:16]}"
    for name, digest in files.items():
        p = run.root / name
        if ".." in Path(name).parts or not p.is_file() or sha256_hex(p.read_bytes()) != digest:
            return f"{FILE}: {name} is missing or does not hash to its listed digest"
    return None
