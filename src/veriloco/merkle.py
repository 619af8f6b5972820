"""RFC 9162 Merkle tree hash (MTH) over byte strings, sha256.

leaf = H(0x00 || d), node = H(0x01 || left || right), split at the largest power of two smaller
than n. Used for the corpus root and the ledger; proofs live in `ledger/merkle.py`.
"""

from __future__ import annotations

import hashlib


def leaf_hash(data: bytes) -> bytes:
    """RFC 9162 leaf hash of `data`."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 interior node hash."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _mth(hashes: list[bytes]) -> bytes:
    n = len(hashes)
    if n == 1:
        return hashes[0]
    k = 1
    while k * 2 < n:
        k *= 2
    return node_hash(_mth(hashes[:k]), _mth(hashes[k:]))


def merkle_root(leaves: list[bytes]) -> str:
    """Hex root of the tree over `leaves` (the empty tree is sha256 of the empty string)."""
    if not leaves:
        return hashlib.sha256(b"").hexdigest()
    return _mth([leaf_hash(d) for d in leaves]).hex()
