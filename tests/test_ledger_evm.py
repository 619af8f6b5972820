"""EVM ledger backend on an in-process chain (eth-tester + py-evm): the LineageLedger contract's
rules (recorder only, no gaps, no rewrites), events, roots, and detection of a tampered mirror or
a chain whose root disagrees with the bodies."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# find_spec, not importorskip: importing py-evm or py_ecc raises the process's recursion limit,
# which evm.py undoes for its own imports (see test_chain_libraries_keep_the_recursion_limit)
_MISSING = [m for m in ("web3", "eth_tester", "eth") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(
        f"EVM ledger tests need web3 and eth-tester[py-evm] (the 'chain' extra); missing {_MISSING}",
        allow_module_level=True,
    )

from veriloco.ledger import LedgerError, entry_bytes, make_entry, merkle  # noqa: E402
from veriloco.ledger.evm import (  # noqa: E402
    ABI_FILE,
    BIN_FILE,
    EVM_VERSION,
    EvmLedger,
    InProcessChain,
    LineageContract,
    deploy,
    load_key,
)
from veriloco.store import LocalStore  # noqa: E402


@pytest.fixture(scope="module")
def chain() -> InProcessChain:
    return InProcessChain.start()  # one chain per module; each test deploys its own contract


def _entry(ledger: EvmLedger, r: int, run_id: str | None = None) -> dict:
    return make_entry(
        run_id=run_id or ledger.run_id_hex,
        round=r,
        prev_entry_hash=ledger.head_hash(),
        checkpoint=hashlib.sha256(b"ckpt %d" % r).hexdigest(),
        commitments=[{"worker": 0, "verdict": "accept"}, {"worker": 1, "verdict": "reject: norm"}],
        aggregate_hash=hashlib.sha256(b"agg %d" % r).hexdigest(),
        codecs={"default": "topk"},
        eval_loss=3.0 - 0.1 * r,
    )


def _fill(ledger: EvmLedger, n: int) -> list[bytes]:
    for r in range(n):
        assert ledger.append(_entry(ledger, r)) == r
    return [ledger.entry_bytes(i) for i in range(n)]


class DictMirror:
    """A mirror that trusts its contents (does not check blobs against their names)."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def get(self, digest: str, max_bytes: int | None = None) -> bytes:
        return self.blobs[digest]


def test_committed_bytecode_is_what_vyper_compiles() -> None:
    pytest.importorskip("vyper", reason="recompiling the contract needs vyper")
    from veriloco.ledger.contracts import compile as contract_compile

    abi_text, bin_text = contract_compile.render(*contract_compile.compile_contract())
    assert BIN_FILE.read_text() == bin_text
    assert ABI_FILE.read_text() == abi_text
    assert contract_compile.EVM_VERSION == EVM_VERSION == "cancun"


def test_appends_counts_roots_and_one_event_each(chain: InProcessChain, tmp_path: Path) -> None:
    ledger = EvmLedger.in_process(tmp_path / "mirror", chain=chain)
    bodies = _fill(ledger, 5)
    c, rid = ledger.contract, ledger.run_id

    assert ledger.size() == c.count(rid) == 5
    for i, body in enumerate(bodies):
        assert c.entry_hash(rid, i) == hashlib.sha256(body).digest()
    want_root = merkle.root(bodies)
    assert ledger.root() == want_root.hex()
    assert c.latest_root(rid) == want_root

    events = ledger.events()
    assert [ev.index for ev in events] == list(range(5))
    assert len({ev.tx_hash for ev in events}) == 5  # one transaction, one event per append
    for ev, body in zip(events, bodies, strict=True):
        assert ev.entry_hash == hashlib.sha256(body).digest()
        assert ev.merkle_root == merkle.root(bodies[: ev.index + 1])
    assert ledger.verify() == []

    # reopened read-only (an auditor: no key) from the chain and the mirror alone
    auditor = EvmLedger(LineageContract(chain.w3, c.address), rid, tmp_path / "mirror")
    assert auditor.size() == 5 and auditor.root() == want_root.hex()
    assert auditor.entries() == ledger.entries()
    proof = auditor.inclusion_proof(3)
    assert merkle.verify_inclusion(merkle.leaf_hash(bodies[3]), 3, 5, proof, want_root)
    with pytest.raises(LedgerError, match="read-only"):
        auditor.append(_entry(auditor, 5))

    # the recorder resumes from another process (same key, fresh objects); all views follow
    writer = LineageContract(chain.w3, c.address, chain.account(0))
    resumed = EvmLedger(writer, rid, tmp_path / "mirror")
    assert resumed.append(_entry(resumed, 5)) == 5
    assert ledger.append(_entry(ledger, 6)) == 6  # the first writer's view caught up
    assert auditor.size() == resumed.size() == 7 and auditor.root() == ledger.root()
    assert len(auditor.events()) == 7 and auditor.verify() == []


def test_only_the_recorder_may_append_or_register(chain: InProcessChain, tmp_path: Path) -> None:
    ledger = EvmLedger.in_process(tmp_path / "mirror", chain=chain, recorder=1)
    _fill(ledger, 2)
    rid, address = ledger.run_id, ledger.contract.address
    root = ledger.contract.latest_root(rid)
    intruder = LineageContract(chain.w3, address, chain.account(2))
    with pytest.raises(LedgerError, match="entry 2: refused by the chain: sender is not the run's"):
        intruder.append(rid, 2, b"\x01" * 32, b"\x02" * 32)
    # without gas estimation the refusal comes from the mined transaction itself
    blind = LineageContract(chain.w3, address, chain.account(2), gas_limit=200_000)
    with pytest.raises(LedgerError, match="sender is not the run's recorder"):
        blind.append(rid, 2, b"\x01" * 32, b"\x02" * 32)
    with pytest.raises(LedgerError, match="run already registered"):
        intruder.register(rid, chain.account(2).address)
    with pytest.raises(LedgerError, match=f"is recorded by {chain.account(1).address}"):
        EvmLedger(intruder, rid, tmp_path / "mirror")
    other_run = hashlib.sha256(b"another run").hexdigest()
    with pytest.raises(LedgerError, match=f"run {other_run} is not registered"):
        EvmLedger(intruder, other_run, tmp_path / "mirror", register=False)
    assert ledger.contract.count(rid) == 2 and ledger.contract.latest_root(rid) == root
    assert ledger.contract.recorder(rid) == chain.account(1).address


def test_no_gaps_and_no_rewrites(chain: InProcessChain, tmp_path: Path) -> None:
    ledger = EvmLedger.in_process(tmp_path / "mirror", chain=chain)
    _fill(ledger, 3)
    c, rid = ledger.contract, ledger.run_id
    for index in (4, 2, 0):  # a gap, a rewrite of the last entry, a rewrite of the first
        with pytest.raises(LedgerError, match=f"entry {index}: .*index is not the next entry"):
            c.append(rid, index, b"\x01" * 32, b"\x02" * 32)
    with pytest.raises(LedgerError, match="entry hash is zero"):
        c.append(rid, 3, b"\x00" * 32, b"\x02" * 32)
    assert c.count(rid) == 3 and ledger.check() == 3
    assert ledger.append(_entry(ledger, 3)) == 3  # the recorder's nonce survived the refusals


def test_tampered_local_mirror_names_the_index(chain: InProcessChain, tmp_path: Path) -> None:
    ledger = EvmLedger.in_process(tmp_path / "mirror", chain=chain)
    bodies = _fill(ledger, 4)
    store = LocalStore(tmp_path / "mirror")
    path = store.path_of(hashlib.sha256(bodies[2]).hexdigest())
    path.write_bytes(bodies[2].replace(b"topk", b"tOpk"))
    with pytest.raises(LedgerError, match="entry 2: off-chain body is unusable: .*corrupt"):
        ledger.entry_bytes(2)
    with pytest.raises(LedgerError, match="entry 2"):
        EvmLedger(LineageContract(chain.w3, ledger.contract.address), ledger.run_id, store)
    os.unlink(path)
    with pytest.raises(LedgerError, match="entry 2: off-chain body is unusable: .*missing"):
        ledger.entry_bytes(2)


def test_swapped_body_in_trusting_mirror_names_the_index(
    chain: InProcessChain, tmp_path: Path
) -> None:
    mirror = DictMirror()
    ledger = EvmLedger.in_process(mirror, chain=chain)
    bodies = _fill(ledger, 3)
    mirror.blobs[hashlib.sha256(bodies[1]).hexdigest()] = bodies[0]  # valid entry, wrong place
    reader = LineageContract(chain.w3, ledger.contract.address)
    with pytest.raises(LedgerError, match="entry 1: off-chain body hashes to"):
        EvmLedger(reader, ledger.run_id, mirror)


def test_chain_root_that_disagrees_with_bodies(chain: InProcessChain, tmp_path: Path) -> None:
    ledger = EvmLedger.in_process(tmp_path / "mirror", chain=chain)
    _fill(ledger, 2)
    # a faulty recorder posts entry 2 with a root that is not the Merkle root of the bodies
    digest = LocalStore(tmp_path / "mirror").put(entry_bytes(_entry(ledger, 2)))
    ledger.contract.append(ledger.run_id, 2, bytes.fromhex(digest), b"\x33" * 32)
    with pytest.raises(LedgerError, match="entry 2: chain root 3333"):
        ledger.root()
    problems = ledger.verify()
    assert problems and problems[0].startswith("entry 2: stored Merkle root at size 3")
    reader = LineageContract(chain.w3, ledger.contract.address)
    with pytest.raises(LedgerError, match="entry 2: stored Merkle root"):
        EvmLedger(reader, ledger.run_id, tmp_path / "mirror")


def test_entry_for_another_run_is_refused(chain: InProcessChain, tmp_path: Path) -> None:
    ledger = EvmLedger.in_process(tmp_path / "mirror", chain=chain)
    with pytest.raises(LedgerError, match="entry 0 is for run 00*, this EVM ledger records"):
        ledger.append(_entry(ledger, 0, run_id="0" * 64))
    assert ledger.size() == 0


def test_contract_address_must_hold_lineage_ledger(chain: InProcessChain) -> None:
    with pytest.raises(LedgerError, match="no contract at"):
        LineageContract(chain.w3, chain.account(3).address)
    other = deploy(chain.w3, chain.account(0))
    LineageContract(chain.w3, other)  # the real one is accepted
    # a contract whose runtime is one STOP byte: initcode returns memory[0:1] == 0x00
    tx = {"from": chain.account(0).address, "data": "0x60016000f3", "gas": 100_000}
    receipt = chain.w3.eth.wait_for_transaction_receipt(chain.w3.eth.send_transaction(tx))
    with pytest.raises(LedgerError, match="is not this LineageLedger"):
        LineageContract(chain.w3, receipt["contractAddress"])


def test_recorder_key_file_is_validated(chain: InProcessChain, tmp_path: Path) -> None:
    key = tmp_path / "recorder.key"
    key.write_text("0x" + chain.keys[4].hex() + "\n")
    key.chmod(0o600)
    assert load_key(key).address == chain.account(4).address
    key.chmod(0o644)
    with pytest.raises(LedgerError, match="accessible by others: chmod 600"):
        load_key(key)
    for text, why in (("zz" * 32, "64-digit hex"), ("0" * 64, "outside the secp256k1"),
                      ("ab" * 31, "64-digit hex")):
        key.write_text(text)
        key.chmod(0o600)
        with pytest.raises(LedgerError, match=why) as e:
            load_key(key)
        assert text not in str(e.value)  # a key never lands in an error message
    with pytest.raises(LedgerError, match="does not exist"):
        load_key(tmp_path / "nope.key")


def test_connect_names_an_unreachable_rpc(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(LedgerError, match=f"cannot reach an EVM RPC at {url}"):
        EvmLedger.connect(url, "0x" + "11" * 20, "ab" * 32, None, tmp_path / "m", timeout_s=2)


def test_chain_libraries_keep_the_recursion_limit() -> None:
    # py_ecc and py-evm set the limit to 100000 on import; left there, json.loads of a deeply
    # nested hostile entry overflows the C stack (a segfault) instead of a clean LedgerError.
    # A fresh interpreter, because this one may already hold the libraries.
    code = (
        "import sys\n"
        "from veriloco.ledger import LedgerError, parse_entry\n"
        "from veriloco.ledger.evm import EvmLedger\n"
        "import tempfile\n"
        "limit = sys.getrecursionlimit()\n"
        "ledger = EvmLedger.in_process(tempfile.mkdtemp())\n"
        "assert sys.getrecursionlimit() == limit, sys.getrecursionlimit()\n"
        "try:\n"
        "    parse_entry(b'[' * 200_000 + b']' * 200_000, max_bytes=1 << 20)\n"
        "except LedgerError:\n"
        "    print('refused')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr[-2000:]
