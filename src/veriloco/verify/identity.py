"""Worker identity: one Ed25519 key per worker, key files, and signatures as hex strings.

A worker's public key is written as 64 lowercase hex characters (the 32 raw bytes); a signature
as 128 (the 64 raw bytes). Ed25519 (RFC 8032) signatures are deterministic, so one key signing one
message always gives the same signature, which keeps ledgers and tests reproducible.

Key files hold either a PKCS#8 PEM (what `openssl genpkey -algorithm ed25519` writes) or the 32
raw private bytes as 64 hex characters on one line. They are written atomically with mode 0600.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..store import atomic_write

MAX_KEY_FILE_BYTES = 4096  # a PEM Ed25519 key is ~120 bytes; anything near this is not a key
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_PUBLIC_HEX = re.compile(r"[0-9a-f]{64}")
_SIGNATURE_HEX = re.compile(r"[0-9a-f]{128}")
_DEMO_KEY_DOMAIN = b"veriloco/demo-worker-key/v1"


class IdentityError(ValueError):
    """A key file or key text is missing, unreadable, or not an Ed25519 key (one-line message)."""


def generate_key() -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """A fresh random Ed25519 key pair from the OS's CSPRNG."""
    private = Ed25519PrivateKey.generate()
    return private, private.public_key()


def derive_worker_key(run_seed: int, worker: int) -> Ed25519PrivateKey:
    """A deterministic key for worker `worker`, derived from `run_seed`: LOCAL/DEMO RUNS ONLY.

    Anyone who knows the run seed (it is in the config) can derive every worker's private key
    and sign in its name, so these keys prove nothing about who did the work. They exist so that
    local multi-process runs and tests have stable identities without key files. Real deployments
    create one key per worker with `generate_key` + `save_private_key` and
    admit only the public keys listed in the run manifest.
    """
    for name, value in (("run_seed", run_seed), ("worker", worker)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if worker < 0:
        raise ValueError(f"worker must be >= 0, got {worker}")
    seed = hashlib.sha256(b"%s|%d|%d" % (_DEMO_KEY_DOMAIN, run_seed, worker)).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_key_hex(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The 64-hex-character raw public key of `key` (a private key gives its public half)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise TypeError(f"expected an Ed25519 key, got {type(key).__name__}")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def save_private_key(
    path: str | os.PathLike[str],
    key: Ed25519PrivateKey,
    *,
    fmt: str = "pem",
    overwrite: bool = False,
) -> Path:
    """Write `key` to `path` as `fmt` ("pem": PKCS#8, or "hex": 64 hex chars), mode 0600.

    Atomic: the bytes go to a temporary 0600 file in the same directory, are fsynced, and the
    file is renamed into place, so a crash never leaves a half-written or world-readable key.
    An existing file is an IdentityError unless `overwrite` (losing a key loses an identity).
    """
    if not isinstance(key, Ed25519PrivateKey):
        raise TypeError(f"expected an Ed25519PrivateKey, got {type(key).__name__}")
    if fmt == "pem":
        data = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    elif fmt == "hex":
        raw = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        data = raw.hex().encode() + b"\n"
    else:
        raise ValueError(f"key file format must be 'pem' or 'hex', got {fmt!r}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise IdentityError(f"key file {path} already exists; refusing to overwrite it")
    if not path.parent.is_dir():
        raise IdentityError(f"cannot write key file {path}: directory {path.parent} does not exist")
    atomic_write(path, data, mode=0o600)  # private key: owner only
    return path


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read an Ed25519 private key file (PKCS#8 PEM without password, or 64 hex chars)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_KEY_FILE_BYTES:
            raise IdentityError(
                f"key file {path} is {size} bytes, over {MAX_KEY_FILE_BYTES}; not a key file"
            )
        data = path.read_bytes()
    except FileNotFoundError:
        raise IdentityError(f"key file {path} does not exist") from None
    except IsADirectoryError:
        raise IdentityError(f"key file {path} is a directory") from None
    except OSError as e:
        raise IdentityError(f"cannot read key file {path}: {e.strerror or e}") from None
    text = data.strip()
    if _HEX64.fullmatch(text.decode("ascii", errors="replace")):
        return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text.decode("ascii")))
    if not text.startswith(b"-----BEGIN"):
        raise IdentityError(f"key file {path} is neither a PEM key nor 64 hex characters")
    try:
        key = serialization.load_pem_private_key(text, password=None)
    except TypeError:  # cryptography raises TypeError when the PEM is encrypted
        raise IdentityError(
            f"key file {path} is password-protected; veriloco needs an unencrypted key"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as e:
        raise IdentityError(f"key file {path} is not a valid PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(
            f"key file {path} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 key"
        )
    return key


def load_public_key(text: str | bytes, source: str = "public key") -> Ed25519PublicKey:
    """Parse a public key given as 64 hex characters or a PEM SubjectPublicKeyInfo.

    `source` names where the text came from (a manifest field, a file) in the error message.
    """
    if isinstance(text, str):
        try:
            data = text.strip().encode("ascii")
        except UnicodeEncodeError:
            raise IdentityError(f"{source} contains non-ASCII characters") from None
    elif isinstance(text, (bytes, bytearray)):
        data = bytes(text).strip()
    else:
        raise IdentityError(f"{source} must be text, got {type(text).__name__}")
    if len(data) > MAX_KEY_FILE_BYTES:
        raise IdentityError(f"{source} is {len(data)} bytes, over {MAX_KEY_FILE_BYTES}")
    if _HEX64.fullmatch(data.decode("ascii", errors="replace")):
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(data.decode("ascii")))
    if not data.startswith(b"-----BEGIN"):
        raise IdentityError(f"{source} is neither 64 hex characters nor a PEM public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise IdentityError(f"{source} is not a valid PEM public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise IdentityError(f"{source} is a {type(key).__name__.lstrip('_')}, not an Ed25519 key")
    return key


def sign(private: Ed25519PrivateKey, message: bytes) -> str:
    """The Ed25519 signature of `message` by `private`, as 128 lowercase hex characters."""
    if not isinstance(private, Ed25519PrivateKey):
        raise TypeError(f"expected an Ed25519PrivateKey, got {type(private).__name__}")
    if not isinstance(message, (bytes, bytearray)):
        raise TypeError(f"message must be bytes, got {type(message).__name__}")
    return private.sign(bytes(message)).hex()


def verify_signature(public_hex: object, message: object, signature_hex: object) -> bool:
    """True iff `signature_hex` is a valid signature of `message` under `public_hex`.

    Built for hostile input: any type, length, case or encoding problem gives False, never an
    exception. Hex must be lowercase (the form `public_key_hex` and `sign` write), so a given
    signature has one spelling and its canonical JSON one hash.
    """
    try:
        if not isinstance(public_hex, str) or not _PUBLIC_HEX.fullmatch(public_hex):
            return False
        if not isinstance(signature_hex, str) or not _SIGNATURE_HEX.fullmatch(signature_hex):
            return False
        if not isinstance(message, (bytes, bytearray)):
            return False
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes.fromhex(signature_hex), bytes(message))
        return True
    except (InvalidSignature, ValueError, TypeError, UnsupportedAlgorithm):
        return False
    except Exception:  # noqa: BLE001 - a verifier of hostile input must answer, not crash
        return False
