"""Ledger: an append-only, hash-chained log of round entries (in-toto Statement v1) with
RFC 9162 Merkle roots, inclusion and consistency proofs; SQLite backend here, EVM in `evm.py`.
"""

from .base import Ledger, LedgerError, verify_chain
from .entry import (
    MAX_ENTRY_BYTES,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    ZERO_HASH,
    check_entry,
    entry_bytes,
    entry_hash,
    make_entry,
    parse_entry,
    verdict_reason,
)
from .merkle import (
    EMPTY_ROOT,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root,
    verify_consistency,
    verify_inclusion,
)
from .sqlite import SqliteLedger

__all__ = [
    "EMPTY_ROOT",
    "MAX_ENTRY_BYTES",
    "PREDICATE_TYPE",
    "STATEMENT_TYPE",
    "ZERO_HASH",
    "Ledger",
    "LedgerError",
    "SqliteLedger",
    "check_entry",
    "consistency_proof",
    "entry_bytes",
    "entry_hash",
    "inclusion_proof",
    "leaf_hash",
    "make_entry",
    "parse_entry",
    "root",
    "verify_chain",
    "verify_consistency",
    "verify_inclusion",
    "verdict_reason",
]
