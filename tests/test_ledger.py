"""Ledger: RFC 9162 Merkle proofs against a literal reference and the published CT vectors,
in-toto entries parsed strictly, and the SQLite backend under misuse, tampering and kill -9."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import veriloco
from veriloco.hashing import canonical_json
from veriloco.ledger import (
    EMPTY_ROOT,
    ZERO_HASH,
    LedgerError,
    SqliteLedger,
    entry_bytes,
    entry_hash,
    leaf_hash,
    make_entry,
    merkle,
    parse_entry,
    verdict_reason,
    verify_chain,
    verify_consistency,
    verify_inclusion,
)

# ---- a literal transcription of RFC 9162 §2.1, on slices, as the reference -------------------


def _h(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:  # counting, not bit tricks, so it cannot share a bug with merkle._split
        k *= 2
    return k


def ref_mth(d: list[bytes]) -> bytes:
    if not d:
        return _h(b"")
    if len(d) == 1:
        return _h(b"\x00" + d[0])
    k = _k(len(d))
    return _h(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:]))


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) <= 1:
        return []
    k = _k(len(d))
    if m < k:
        return ref_path(m, d[:k]) + [ref_mth(d[k:])]
    return ref_path(m - k, d[k:]) + [ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    if m == len(d):
        return [] if b else [ref_mth(d)]
    k = _k(len(d))
    if m <= k:
        return ref_subproof(m, d[:k], b) + [ref_mth(d[k:])]
    return ref_subproof(m - k, d[k:], False) + [ref_mth(d[:k])]


def _flip(h: bytes) -> bytes:
    return bytes([h[0] ^ 1]) + h[1:]


# RFC 6962 / certificate-transparency test data and published roots for sizes 0..8
CT_LEAVES = [bytes.fromhex(x) for x in
             ["", "00", "10", "2021", "3031", "40414243", "5051525354555657",
              "606162636465666768696a6b6c6d6e6f"]]
CT_ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]


def test_published_ct_vectors() -> None:
    for n, want in enumerate(CT_ROOTS):
        assert merkle.root(CT_LEAVES[:n]).hex() == want
        assert ref_mth(CT_LEAVES[:n]).hex() == want
    assert EMPTY_ROOT.hex() == CT_ROOTS[0]
    assert [h.hex() for h in merkle.inclusion_proof(5, CT_LEAVES)] == [
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ]
    assert [h.hex() for h in merkle.consistency_proof(6, CT_LEAVES)] == [
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ]


LEAVES = [f"entry-{i}".encode() for i in range(40)]


def test_roots_and_frontier_match_reference_for_sizes_0_to_40() -> None:
    frontier = merkle.Frontier()
    assert frontier.root() == ref_mth([])
    for n in range(1, 41):
        frontier.append(leaf_hash(LEAVES[n - 1]))
        assert merkle.root(LEAVES[:n]) == ref_mth(LEAVES[:n]) == frontier.root(), n


def test_inclusion_all_sizes_and_indices() -> None:
    for n in range(1, 41):
        d = LEAVES[:n]
        r = ref_mth(d)
        for i in range(n):
            proof = merkle.inclusion_proof(i, d)
            assert proof == ref_path(i, d), (n, i)
            leaf = leaf_hash(d[i])
            assert verify_inclusion(leaf, i, n, proof, r)
            assert verify_inclusion(leaf.hex(), i, n, [p.hex() for p in proof], r.hex())
            # every tampering fails: each proof node, the leaf, the root, the index, the length
            for j in range(len(proof)):
                bad = list(proof)
                bad[j] = _flip(bad[j])
                assert not verify_inclusion(leaf, i, n, bad, r), (n, i, j)
            assert not verify_inclusion(_flip(leaf), i, n, proof, r)
            assert not verify_inclusion(leaf, i, n, proof, _flip(r))
            for other in range(n):
                if other != i:
                    assert not verify_inclusion(leaf, other, n, proof, r), (n, i, other)
            assert not verify_inclusion(leaf, i, n, proof + [r], r)
            if proof:
                assert not verify_inclusion(leaf, i, n, proof[:-1], r)
        assert not verify_inclusion(leaf_hash(d[0]), n, n, [], r)  # index outside the tree
        assert not verify_inclusion(leaf_hash(d[0]), 0, n, ["zz"], r)  # malformed hex


def test_consistency_all_prefixes() -> None:
    for n in range(1, 41):
        d = LEAVES[:n]
        rn = ref_mth(d)
        for m in range(0, n + 1):
            rm = ref_mth(d[:m])
            proof = merkle.consistency_proof(m, d)
            assert proof == (ref_subproof(m, d, True) if 0 < m < n else []), (m, n)
            assert verify_consistency(m, n, rm, rn, proof), (m, n)
            assert verify_consistency(m, n, rm.hex(), rn.hex(), [p.hex() for p in proof])
            for j in range(len(proof)):
                bad = list(proof)
                bad[j] = _flip(bad[j])
                assert not verify_consistency(m, n, rm, rn, bad), (m, n, j)
            assert not verify_consistency(m, n, _flip(rm), rn, proof), (m, n)
            if m:  # (the empty tree is a prefix of every tree, whatever its root)
                assert not verify_consistency(m, n, rm, _flip(rn), proof), (m, n)
            if proof:
                assert not verify_consistency(m, n, rm, rn, proof[:-1]), (m, n)
            assert not verify_consistency(m, n, rm, rn, proof + [rn]), (m, n)
            if 0 < m < n:  # the root of a different prefix does not pass as this one's
                assert not verify_consistency(m, n, ref_mth(d[: m - 1]), rn, proof)
        assert not verify_consistency(n, n - 1, rn, ref_mth(d[:-1]), [])  # a shrinking log


def test_proof_generation_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="outside a tree of size 3"):
        merkle.inclusion_proof(3, LEAVES[:3])
    with pytest.raises(ValueError, match="outside 0..3"):
        merkle.consistency_proof(4, LEAVES[:3])


# ---- entries --------------------------------------------------------------------------------

RUN = hashlib.sha256(b"run").hexdigest()


def _digest(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def commitments(r: int, workers: int = 4) -> list[dict[str, Any]]:
    """Commitments shaped like the real ones: what a worker signs, plus the verdict on it."""
    out = []
    for w in range(workers - 1):
        out.append({
            "worker": w, "round": r, "base_hash": _digest(f"G{r}"),
            "batches_root": _digest(f"b{r}.{w}"), "trace_root": _digest(f"t{r}.{w}"),
            "losses": [3.25 - 0.01 * r, 3.125 - 0.01 * r], "packet_hash": _digest(f"p{r}.{w}"),
            "codec": "topk-int8", "signature": "ab" * 64,
            "verdict": "accept" if w != 2 else "bad_signature",
        })
    # the last one as verify.screen.Verdict.to_dict() records it
    out.append({"worker": workers - 1, "packet_hash": _digest(f"p{r}.x"), "verdict": {
        "worker": workers - 1, "reason": "cosine_outlier", "evidence": {"cosine": -0.93}}})
    return out


def round_entry(r: int, prev: str, **extra: Any) -> dict[str, Any]:
    return make_entry(
        run_id=RUN, round=r, prev_entry_hash=prev, checkpoint=_digest(f"ckpt{r}"),
        commitments=commitments(r), aggregate_hash=_digest(f"agg{r}"),
        codecs={"0": "topk-int8", "1": "topk-int8"}, eval_loss=2.5 - r / 100, **extra,
    )


def test_entry_is_an_in_toto_statement() -> None:
    e = round_entry(0, ZERO_HASH, bytes_sent=12345)
    assert e["_type"] == "https://in-toto.io/Statement/v1"
    assert e["predicateType"] == "https://veriloco.dev/round/v1"
    assert e["subject"] == [{"name": "checkpoint", "digest": {"sha256": _digest("ckpt0")}}]
    assert e["predicate"]["bytes_sent"] == 12345 and e["predicate"]["round"] == 0
    data = entry_bytes(e)
    assert data == canonical_json(e)
    assert parse_entry(data) == e
    reasons = [verdict_reason(c) for c in e["predicate"]["commitments"]]
    assert reasons == ["accept", "accept", "bad_signature", "cosine_outlier"]
    assert entry_hash(data) == hashlib.sha256(data).hexdigest() == entry_hash(e)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("run_id", "not-a-hash", "run_id is not sha256 hex"),
        ("round", -1, "round must be an integer >= 0"),
        ("round", True, "round must be an integer"),
        ("prev_entry_hash", "A" * 64, "prev_entry_hash is not sha256 hex"),
        ("checkpoint", "0" * 63, "checkpoint digest is not sha256 hex"),
        ("aggregate_hash", 5, "aggregate_hash is not sha256 hex"),
        ("codecs", "topk", "codecs must be an object or a list"),
        ("eval_loss", float("nan"), "eval_loss must be a finite number"),
        ("commitments", [{"worker": 0}], "commitment 0 verdict must be a reason code"),
        ("commitments", [{"verdict": ""}], "commitment 0 verdict must be"),
        ("commitments", [{"verdict": {"reason": 3}}], "commitment 0 verdict must be"),
        ("commitments", {"0": {}}, "commitments must be a list"),
        ("commitments", [{"verdict": "accept"}], "commitment 0 must name its worker"),
        ("commitments", [{"verdict": "accept", "worker": "0"}], "commitment 0 must name its worker"),
        ("commitments", [{"verdict": "accept", "worker": 0, "stage": -1}], "commitment 0 must name its worker"),
        ("commitments", [{"verdict": "accept", "worker": 0}, {"verdict": "accept", "worker": 0}],
         "commitment 1 is a second one of worker 0"),
    ],
)
def test_make_entry_rejects_bad_fields(field: str, value: Any, reason: str) -> None:
    kw: dict[str, Any] = dict(
        run_id=RUN, round=0, prev_entry_hash=ZERO_HASH, checkpoint=_digest("c"),
        commitments=[], aggregate_hash=None, codecs=[], eval_loss=None,
    )
    kw[field] = value
    with pytest.raises(LedgerError, match=reason):
        make_entry(**kw)


def _reencoded(e: dict[str, Any], **dump_kw: Any) -> bytes:
    return json.dumps(e, **dump_kw).encode()


def test_parse_entry_rejects_hostile_rows() -> None:
    e = round_entry(3, _digest("prev"))
    good = entry_bytes(e)
    text = good.decode()
    cases: list[tuple[bytes, str]] = [
        (good + b" " * 10, "over the limit"),  # with max_bytes=len(good) below
        (b"\xff" + good[1:], "not valid UTF-8 at byte 0"),
        (b"{" + good, "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply|not in canonical form|must be"),
        (_reencoded(e), "not in canonical form"),  # spaces
        (_reencoded(e, separators=(",", ":")), "not in canonical form"),  # unsorted keys
        (good[:-1] + b',"subject":[]}', "not in canonical form"),  # duplicate key
        (text.replace("cosine_outlier", "cosine\\u005foutlier").encode(), "not in canonical form"),
        (text.replace('"eval_loss":2.47', '"eval_loss":NaN').encode(), "NaN is not allowed"),
        (text.replace('"eval_loss":2.47', '"eval_loss":1e999').encode(), "re-encoded"),
        (canonical_json({**e, "extra": 1}), "entry has keys"),
        (canonical_json({**e, "_type": "https://in-toto.io/Statement/v0.1"}), "_type is"),
        (canonical_json({**e, "subject": []}), "entry subject must be"),
        (canonical_json([e]), "must be a JSON object"),
        (canonical_json({**e, "predicate": {**e["predicate"], "round": "3"}}), "round must be"),
        (canonical_json({**e, "predicate": {k: v for k, v in e["predicate"].items()
                                            if k != "codecs"}}), "missing 'codecs'"),
    ]
    assert "eval_loss\":2.47" in text
    for data, reason in cases:
        limit = len(good) if data.startswith(good) else 1 << 20
        with pytest.raises(LedgerError, match=reason) as info:
            parse_entry(data, max_bytes=limit)
        assert "\n" not in str(info.value), str(info.value)
    with pytest.raises(LedgerError, match="must be bytes"):
        parse_entry(text)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(min_value=0), byte=st.integers(min_value=0, max_value=255))
def test_parse_entry_on_a_mutated_row_fails_cleanly(pos: int, byte: int) -> None:
    data = bytearray(entry_bytes(round_entry(1, _digest("prev"))))
    pos %= len(data)
    if data[pos] == byte:
        return
    data[pos] = byte
    try:
        parsed = parse_entry(bytes(data))
    except LedgerError:
        return
    # a mutation that still parses (a hex digit, a loss digit) must change the hash
    assert entry_hash(bytes(data)) != entry_hash(round_entry(1, _digest("prev")))
    assert parsed != round_entry(1, _digest("prev"))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_parse_entry_on_random_bytes_raises_only_ledger_error(data: bytes) -> None:
    with pytest.raises(LedgerError):
        parse_entry(data)


# ---- the SQLite ledger ------------------------------------------------------------------------


def fill(ledger: SqliteLedger, n: int, **extra: Any) -> list[bytes]:
    for r in range(ledger.size(), n):
        assert ledger.append(round_entry(r, ledger.head_hash(), **extra)) == r
    return [ledger.entry_bytes(i) for i in range(n)]


def test_append_chain_roots_and_proofs(tmp_path: Path) -> None:
    with SqliteLedger(tmp_path / "l.db", synchronous="NORMAL") as ledger:
        assert ledger.size() == 0 and ledger.head_hash() == ZERO_HASH
        assert ledger.root() == EMPTY_ROOT.hex()
        bodies = fill(ledger, 13)
        assert ledger.size() == len(ledger) == 13
        assert ledger.head_hash() == entry_hash(bodies[-1])
        assert [e["predicate"]["round"] for e in ledger.entries()] == list(range(13))
        assert ledger.entries()[5] == ledger.entry(5) == parse_entry(bodies[5])
        for i in range(1, 13):
            assert ledger.entry(i)["predicate"]["prev_entry_hash"] == entry_hash(bodies[i - 1])
        for n in range(14):
            assert ledger.root(n) == ref_mth(bodies[:n]).hex()
            if n:
                assert ledger._stored_root(n) == ledger.root(n)  # roots table, per append
        for n in range(1, 14):
            for i in range(n):
                proof = ledger.inclusion_proof(i, n)
                assert verify_inclusion(leaf_hash(bodies[i]), i, n, proof, ledger.root(n))
            for m in range(n + 1):
                proof = ledger.consistency_proof(m, n)
                assert verify_consistency(m, n, ledger.root(m), ledger.root(n), proof)
        assert verify_chain(ledger) == [] and ledger.verify() == []
        assert verify_chain(ledger, trusted=(7, ledger.root(7))) == []
        with pytest.raises(LedgerError, match="entry 13 is outside a ledger of 13"):
            ledger.entry_bytes(13)
        with pytest.raises(LedgerError, match="tree size 14 is outside 0..13"):
            ledger.root(14)
        with pytest.raises(LedgerError, match="entry 5 is outside a ledger of 5"):
            ledger.inclusion_proof(5, 5)
        with pytest.raises(LedgerError, match="old tree size 9 is outside 0..8"):
            ledger.consistency_proof(9, 8)


def test_append_enforces_the_chain(tmp_path: Path) -> None:
    with SqliteLedger(tmp_path / "l.db", synchronous="OFF") as ledger:
        with pytest.raises(LedgerError, match="entry is for round 1 but the ledger holds 0"):
            ledger.append(round_entry(1, ZERO_HASH))
        with pytest.raises(LedgerError, match="entry 0 has prev_entry_hash"):
            ledger.append(round_entry(0, _digest("x")))
        fill(ledger, 2)
        with pytest.raises(LedgerError, match="but the last entry's hash is"):
            ledger.append(round_entry(2, ZERO_HASH))
        with pytest.raises(LedgerError, match="the next entry must be round 2"):
            ledger.append(round_entry(1, ledger.head_hash()))
        other = round_entry(2, ledger.head_hash())
        other["predicate"]["run_id"] = _digest("another run")
        with pytest.raises(LedgerError, match="is for run .* but this ledger records run"):
            ledger.append(other)
        with pytest.raises(LedgerError, match="commitment 0 verdict"):
            bad = round_entry(2, ledger.head_hash())
            bad["predicate"]["commitments"][0]["verdict"] = None
            ledger.append(bad)
        assert ledger.size() == 2 and verify_chain(ledger) == []
        # the backend refuses an index that is not the next one, even past the base's checks
        with pytest.raises(LedgerError, match="grew to 2 entries while appending entry 1"):
            ledger._append_raw(1, ledger.entry_bytes(1), "0" * 64, "0" * 64)


def test_two_handles_on_one_file_stay_in_step(tmp_path: Path) -> None:
    a = SqliteLedger(tmp_path / "l.db", synchronous="OFF")
    b = SqliteLedger(tmp_path / "l.db", synchronous="OFF")
    fill(a, 3)
    assert b.size() == 3 and b.root() == a.root()  # b's cache catches up
    stale_head = b.head_hash()
    fill(a, 4)
    with pytest.raises(LedgerError, match="the next entry must be round 4"):
        b.append(round_entry(3, stale_head))
    b.append(round_entry(4, b.head_hash()))
    assert a.size() == 5 and a.head_hash() == b.head_hash() and verify_chain(a) == []
    a.close()
    b.close()


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    with SqliteLedger(tmp_path / "l.db") as ledger:
        fill(ledger, 5)
        root5, head = ledger.root(), ledger.head_hash()
    with SqliteLedger(tmp_path / "l.db") as ledger:
        assert ledger.size() == 5 and ledger.root() == root5 and ledger.head_hash() == head
        fill(ledger, 7)
        assert verify_consistency(5, 7, root5, ledger.root(), ledger.consistency_proof(5))


def test_update_and_delete_are_refused_by_triggers(tmp_path: Path) -> None:
    with SqliteLedger(tmp_path / "l.db", synchronous="OFF") as ledger:
        fill(ledger, 3)
    db = sqlite3.connect(tmp_path / "l.db")
    for sql in [
        "UPDATE entries SET body = x'00' WHERE idx = 1",
        "UPDATE entries SET hash = 'x'",
        "DELETE FROM entries WHERE idx = 2",
        "UPDATE roots SET root = 'x' WHERE size = 1",
        "DELETE FROM roots",
    ]:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute(sql)
    with pytest.raises(sqlite3.IntegrityError, match="not the next one"):
        db.execute("INSERT INTO entries VALUES (7, 'h', x'00')")
    db.close()
    with SqliteLedger(tmp_path / "l.db") as ledger:
        assert ledger.size() == 3 and verify_chain(ledger) == []


def tamper(path: Path, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Run `sql` on the ledger file with its triggers dropped, as an attacker would (opening a
    SqliteLedger recreates the triggers, so they are dropped again each time)."""
    db = sqlite3.connect(path, isolation_level=None)
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    db.execute(sql, params)
    db.close()


def test_tampering_through_sql_is_named_by_index(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with SqliteLedger(path, synchronous="OFF") as ledger:
        bodies = fill(ledger, 6)
    # 1. a rewritten body (a verdict flipped to accept): the stored hash no longer matches
    forged = parse_entry(bodies[2])
    forged["predicate"]["commitments"][3]["verdict"]["reason"] = "accept"
    tamper(path, "UPDATE entries SET body = ? WHERE idx = 2", (entry_bytes(forged),))
    with SqliteLedger(path) as ledger:
        problems = verify_chain(ledger)
        assert problems and problems[0].startswith("entry 2: stored hash"), problems
    # 2. body and hash rewritten together: the stored root and the next link give it away
    tamper(path, "UPDATE entries SET hash = ? WHERE idx = 2", (entry_hash(entry_bytes(forged)),))
    with SqliteLedger(path) as ledger:
        problems = verify_chain(ledger)
        assert problems[0].startswith("entry 2: stored Merkle root at size 3"), problems
        assert any(p.startswith("entry 3: prev_entry_hash") for p in problems), problems
    # 3. a deleted row
    tamper(path, "UPDATE entries SET body = ?, hash = ? WHERE idx = 2",
           (bodies[2], entry_hash(bodies[2])))
    tamper(path, "DELETE FROM entries WHERE idx = 4")
    with SqliteLedger(path) as ledger:
        assert verify_chain(ledger)[0] == f"entry 4: entry 4 is missing from {path}"


def test_rewriting_the_last_entry_consistently_is_caught_by_a_trusted_root(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with SqliteLedger(path, synchronous="OFF") as ledger:
        bodies = fill(ledger, 4)
        trusted = (4, ledger.root())  # e.g. a root a peer signed earlier
    forged = parse_entry(bodies[3])
    forged["predicate"]["eval_loss"] = 0.5
    data = entry_bytes(forged)
    new_root = ref_mth(bodies[:3] + [data]).hex()
    tamper(path, "UPDATE entries SET body = ?, hash = ? WHERE idx = 3", (data, entry_hash(data)))
    tamper(path, "UPDATE roots SET root = ? WHERE size = 4", (new_root,))
    with SqliteLedger(path) as ledger:
        assert verify_chain(ledger) == []  # internally consistent: only a trusted root knows
        problems = verify_chain(ledger, trusted=trusted)
        assert problems == [f"entry 3: root at trusted size 4 is {new_root}, trusted {trusted[1]}"]


def test_a_flipped_byte_in_the_file_is_named_by_index(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with SqliteLedger(path, synchronous="OFF") as ledger:
        for r in range(6):
            ledger.append(round_entry(r, ledger.head_hash(), note=f"marker-{r}-end"))
    # closing the last connection checkpointed the WAL, so the bodies are in the main file
    raw = bytearray(path.read_bytes())
    at = raw.find(b"marker-4-end")
    assert at > 0 and raw.count(b"marker-4-end") == 1
    raw[at + len("marker-")] = ord("9")  # still valid JSON, different bytes
    path.write_bytes(bytes(raw))
    with SqliteLedger(path) as ledger:
        problems = verify_chain(ledger)
        assert problems and problems[0].startswith("entry 4: stored hash"), problems
        assert ledger.entry(4)["predicate"]["note"] == "marker-9-end"  # it is readable...
    raw[at] = 0xFF  # ...and an invalid byte makes the row unparseable
    path.write_bytes(bytes(raw))
    with SqliteLedger(path) as ledger:
        problems = verify_chain(ledger)
        assert problems[0].startswith("entry 4: stored hash"), problems
        assert "entry 4: entry is not valid UTF-8 at byte" in " ".join(problems), problems
        with pytest.raises(LedgerError, match="not valid UTF-8"):
            ledger.entries()


_WRITER = """
import sys
from veriloco.ledger import SqliteLedger, make_entry
ledger = SqliteLedger(sys.argv[1])  # synchronous=FULL: each commit is fsynced
print("started", ledger.size(), flush=True)
d = "ab" * 32
while True:
    r = ledger.size()
    c = [{"worker": w, "packet_hash": d, "signature": "cd" * 64, "verdict": "accept"}
         for w in range(4)]
    ledger.append(make_entry(run_id="ef" * 32, round=r, prev_entry_hash=ledger.head_hash(),
                             checkpoint=d, commitments=c, aggregate_hash=d, codecs=[],
                             eval_loss=2.0, pad="x" * 3000))
    print("committed", r + 1, flush=True)
"""


def test_kill_9_during_appends_leaves_a_sound_ledger(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    src = str(Path(veriloco.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("started"), line
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # let it commit a few, then kill it mid-loop
            line = proc.stdout.readline()
            if line.startswith("committed") and int(line.split()[1]) >= 25:
                break
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    printed = [int(x.split()[1]) for x in (line + rest).splitlines() if x.startswith("committed")]
    last = max(printed)
    assert last >= 25
    with SqliteLedger(path) as ledger:
        # a commit can land just before the kill and its "committed" line not get printed
        assert ledger.size() in (last, last + 1), (ledger.size(), last)
        assert verify_chain(ledger) == []
        assert ledger._stored_root(ledger.size()) == ledger.root()
        n = ledger.size()
        e = parse_entry(ledger.entry_bytes(n - 1))
        e["predicate"].update(round=n, prev_entry_hash=ledger.head_hash())
        assert ledger.append(e) == n  # and it takes appends again


def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LedgerError, match=f"cannot open ledger {path}: file is not a database"):
        SqliteLedger(path)


def _open_at(path: str, t0: float) -> None:
    while time.time() < t0:
        pass
    SqliteLedger(path).close()


def test_processes_that_open_a_new_ledger_at_once_all_get_it(tmp_path):
    # an elastic run's workers open the run's ledger together; switching a new file to WAL used to
    # fail at once with "database is locked" in some of them (4 of 120 opens, 20 trials of 6)
    from veriloco.procs import context

    ctx = context()
    for trial in range(4):
        t0 = time.time() + 1.0
        procs = [ctx.Process(target=_open_at, args=(str(tmp_path / f"{trial}.sqlite"), t0)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 6
