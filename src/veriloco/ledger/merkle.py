"""Merkle tree hashing, inclusion and consistency proofs, as in RFC 9162 §2.1 (Certificate
Transparency v2), with sha256.

- leaf hash  ``MTH({d}) = H(0x00 || d)``; interior node ``H(0x01 || left || right)``;
- a tree of ``n > 1`` leaves splits at ``k``, the largest power of two ``< n`` (§2.1.1), so
  sizes that are not powers of two are well defined and a tree only ever grows on the right;
- the empty tree's root is ``H()`` (sha256 of no bytes).

Proofs are lists of 32-byte node hashes. The two verifiers are the algorithms of §2.1.3.2 and
§2.1.4.2: they need only the proof, the sizes and the roots, never the leaves, so an auditor
holding two signed roots can check them without the ledger. Verifiers also accept hex strings
for hashes, since the ledger hands them out as hex.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HashLike = bytes | str

EMPTY_ROOT: bytes = hashlib.sha256(b"").digest()


def leaf_hash(entry: bytes) -> bytes:
    """RFC 9162 leaf hash: sha256(0x00 || entry)."""
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 interior node hash: sha256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """k: the largest power of two strictly smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def _as_bytes(h: HashLike) -> bytes:
    if isinstance(h, str):
        try:
            h = bytes.fromhex(h)
        except ValueError:
            return b""  # a malformed hex hash simply fails verification
    return bytes(h)


def _mth(hashes: Sequence[bytes], lo: int, hi: int) -> bytes:
    n = hi - lo
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return hashes[lo]
    k = _split(n)
    return node_hash(_mth(hashes, lo, lo + k), _mth(hashes, lo + k, hi))


def root_of_hashes(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH over already-computed leaf hashes."""
    return _mth(leaf_hashes, 0, len(leaf_hashes))


def root(leaves: Sequence[bytes]) -> bytes:
    """MTH(D[n]) of the entries `leaves` (raw entry bytes, not leaf hashes)."""
    return root_of_hashes([leaf_hash(d) for d in leaves])


def _path(m: int, hashes: Sequence[bytes], lo: int, hi: int) -> list[bytes]:
    # PATH(m, D[lo:hi]) of §2.1.3.1, audit path from the leaf upwards
    n = hi - lo
    if n <= 1:
        return []
    k = _split(n)
    if m < k:
        return _path(m, hashes, lo, lo + k) + [_mth(hashes, lo + k, hi)]
    return _path(m - k, hashes, lo + k, hi) + [_mth(hashes, lo, lo + k)]


def inclusion_proof_of_hashes(index: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """Audit path for leaf `index` in the tree of `leaf_hashes`."""
    if not 0 <= index < len(leaf_hashes):
        raise ValueError(f"leaf index {index} is outside a tree of size {len(leaf_hashes)}")
    return _path(index, leaf_hashes, 0, len(leaf_hashes))


def inclusion_proof(index: int, leaves: Sequence[bytes]) -> list[bytes]:
    """RFC 9162 §2.1.3.1 inclusion proof (audit path) for entry `index` of `leaves`."""
    return inclusion_proof_of_hashes(index, [leaf_hash(d) for d in leaves])


def verify_inclusion(
    leaf: HashLike, index: int, size: int, proof: Sequence[HashLike], root_hash: HashLike
) -> bool:
    """RFC 9162 §2.1.3.2: True iff `proof` shows leaf hash `leaf` at `index` in the tree of
    `size` leaves whose root is `root_hash`."""
    if not 0 <= index < size:
        return False
    fn, sn = index, size - 1
    r = _as_bytes(leaf)
    for p in proof:
        p = _as_bytes(p)
        if sn == 0 or len(p) != 32:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == _as_bytes(root_hash)


def _subproof(m: int, hashes: Sequence[bytes], lo: int, hi: int, whole: bool) -> list[bytes]:
    # SUBPROOF(m, D[lo:hi], b) of §2.1.4.1
    n = hi - lo
    if m == n:
        return [] if whole else [_mth(hashes, lo, hi)]
    k = _split(n)
    if m <= k:
        return _subproof(m, hashes, lo, lo + k, whole) + [_mth(hashes, lo + k, hi)]
    return _subproof(m - k, hashes, lo + k, hi, False) + [_mth(hashes, lo, lo + k)]


def consistency_proof_of_hashes(m: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """Consistency proof between the first `m` leaves and all of `leaf_hashes`."""
    n = len(leaf_hashes)
    if not 0 <= m <= n:
        raise ValueError(f"old size {m} is outside 0..{n}")
    if m == 0 or m == n:
        return []  # the empty tree and the tree itself are trivially consistent
    return _subproof(m, leaf_hashes, 0, n, True)


def consistency_proof(m: int, leaves: Sequence[bytes]) -> list[bytes]:
    """RFC 9162 §2.1.4.1 proof that the tree of the first `m` entries is a prefix of `leaves`."""
    return consistency_proof_of_hashes(m, [leaf_hash(d) for d in leaves])


def verify_consistency(
    m: int, n: int, root_m: HashLike, root_n: HashLike, proof: Sequence[HashLike]
) -> bool:
    """RFC 9162 §2.1.4.2: True iff `proof` shows the tree of size `m` with root `root_m` is a
    prefix of the tree of size `n` with root `root_n`."""
    first, second = _as_bytes(root_m), _as_bytes(root_n)
    path = [_as_bytes(p) for p in proof]
    if not 0 <= m <= n or any(len(p) != 32 for p in path):
        return False
    if m == n:
        return not path and first == second and len(first) == 32
    if m == 0:
        return not path and first == EMPTY_ROOT
    if not path:
        return False
    if m & (m - 1) == 0:  # m is a power of two: its root is a node of the new tree
        path = [first] + path
    fn, sn = m - 1, n - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == first and sr == second and sn == 0


class Frontier:
    """The right edge of a growing tree: roots of its perfect subtrees, largest first.

    Appending is O(log n) and `root()` folds them from the right, which equals MTH because the
    tree splits at the largest power of two (RFC 9162 §2.1.1). Backends use it to record the
    root after every append without rehashing the whole log.
    """

    def __init__(self) -> None:
        self._nodes: list[tuple[int, bytes]] = []  # (subtree size, subtree root)
        self.size = 0

    def append(self, leaf: bytes) -> None:
        """Add the leaf hash `leaf` on the right."""
        size, h = 1, leaf
        while self._nodes and self._nodes[-1][0] == size:
            left_size, left = self._nodes.pop()
            size, h = size + left_size, node_hash(left, h)
        self._nodes.append((size, h))
        self.size += 1

    def copy(self) -> Frontier:
        """An independent copy (to compute a root before committing to an append)."""
        other = Frontier()
        other._nodes, other.size = list(self._nodes), self.size
        return other

    def root(self) -> bytes:
        """MTH of the leaves appended so far."""
        if not self._nodes:
            return EMPTY_ROOT
        r = self._nodes[-1][1]
        for _, h in reversed(self._nodes[:-1]):
            r = node_hash(h, r)
        return r
