"""EVM ledger backend: entry hashes and Merkle roots on a chain, entry bodies off-chain.

The `LineageLedger` Vyper contract (`contracts/LineageLedger.vy`) keeps, per run id (the
bytes32 form of the entries' 64-hex `run_id`), the sha256 of every entry body in order and the
latest RFC 9162 Merkle root, and logs `EntryAppended(run_id, index, entry_hash, merkle_root)` per
append. Only the run's registered recorder may append, and only at the next index, so the chain
is the append-only authority. The bodies (canonical JSON bytes) live off-chain in a
content-addressed store (`veriloco.store.LocalStore` for a directory, or any store with
`put`/`get`) under that same sha256, so the on-chain hash is also the body's address. Every read
checks a body against its on-chain hash; `root()` checks the root recomputed from the bodies
against the root on chain; `verify()`/`check()` (run on open) add each event's prefix root. A
tampered mirror or a chain that disagrees gives a `LedgerError` naming the entry index.

    ledger = EvmLedger.connect(rpc_url, contract_address, run_id, key_file, mirror_dir)
    ledger = EvmLedger.in_process(mirror_dir)        # tests and benchmarks: eth-tester + py-evm

`web3` (and `eth-tester[py-evm]` for the in-process chain) are the `chain` extra; this module
imports them only when a chain is used, so the rest of veriloco runs without them, and it keeps
the interpreter's recursion limit as it was (see `_import_chain_libs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..store import LocalStore, StoreError
from .base import Ledger
from .entry import MAX_ENTRY_BYTES, LedgerError, make_entry, parse_entry

if TYPE_CHECKING:
    from eth_account.signers.local import LocalAccount
    from web3 import Web3

CONTRACTS = Path(__file__).resolve().parent / "contracts"
ABI_FILE = CONTRACTS / "LineageLedger.abi.json"
BIN_FILE = CONTRACTS / "LineageLedger.bin"
EVM_VERSION = "cancun"  # what LineageLedger.bin was compiled for; see contracts/compile.py

_HEX32 = re.compile(r"^(0x)?[0-9a-fA-F]{64}$")  # a run id or a private key
_SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


class BlobStore(Protocol):
    """What the off-chain mirror must do: content-addressed put/get by sha256 hex."""

    def put(self, data: bytes) -> str: ...

    def get(self, digest: str, max_bytes: int | None = None) -> bytes: ...


@dataclass(frozen=True)
class AppendedEvent:
    """One `EntryAppended` log of a run, as read back from the chain."""

    index: int
    entry_hash: bytes
    merkle_root: bytes
    block_number: int
    tx_hash: str


def _import_chain_libs(tester: bool = False) -> None:
    """Import web3 and eth-account (and eth-tester with py-evm if `tester`), keeping the
    interpreter's recursion limit: py_ecc and py-evm raise it to 100000 on import, and with that
    limit a deeply nested hostile JSON document overflows the C stack inside `json.loads`
    (a segfault) instead of raising the RecursionError that `parse_entry` turns into a
    LedgerError. LineageLedger makes no nested calls, so py-evm does not need the deep limit.
    """
    limit = sys.getrecursionlimit()
    try:
        import eth_account  # noqa: F401
        import web3  # noqa: F401

        if tester:
            import eth  # noqa: F401  (py-evm)
            import eth_tester  # noqa: F401
    except ImportError as e:
        raise LedgerError(f"the EVM ledger needs the 'chain' extra (pip install "
                          f"'veriloco[chain]'): {e}") from None
    finally:
        sys.setrecursionlimit(limit)


def open_contract(rpc_url: str, contract_address: str, key_file: str | os.PathLike[str] | None,
                  gas_limit: int | None = None, timeout_s: float = 30.0) -> LineageContract:
    """The LineageLedger contract at `contract_address` over HTTP(S) RPC, as the recorder of
    `key_file` (None: read-only). LedgerError, naming the problem, for a key file that is missing
    or malformed, an RPC that does not answer, or an address that is not a LineageLedger's; a run
    calls this before it makes anything (`run.check_chain`), so a typo is not found by the
    workers."""
    _import_chain_libs()
    from web3 import HTTPProvider, Web3

    account = load_key(key_file) if key_file is not None else None
    w3 = Web3(HTTPProvider(rpc_url, request_kwargs={"timeout": timeout_s}))
    try:
        reached = w3.is_connected()
    except Exception:  # noqa: BLE001 - a URL web3 cannot use at all (no scheme, bad port) is not reached either
        reached = False
    if not reached:
        raise LedgerError(f"cannot reach an EVM RPC at {rpc_url}")
    return LineageContract(w3, contract_address, account, gas_limit=gas_limit)


def load_abi() -> list[dict[str, Any]]:
    """The committed ABI of LineageLedger."""
    return json.loads(ABI_FILE.read_text())


def load_bytecode() -> str:
    """The committed deploy bytecode of LineageLedger, 0x-hex."""
    return BIN_FILE.read_text().strip()


def runtime_code() -> bytes:
    """The code a deployed LineageLedger holds: the part of the committed deploy bytecode that
    its preamble copies out, `PUSH2 len PUSH2 offset PUSH2 0 CODECOPY ...` (vyper 0.4's layout
    for a contract without immutables)."""
    init = bytes.fromhex(load_bytecode().removeprefix("0x"))
    if len(init) < 11 or init[0] != 0x61 or init[3] != 0x61 or init[6:10] != b"\x61\x00\x00\x39":
        raise LedgerError("LineageLedger.bin does not start with vyper's deploy preamble")
    length, offset = int.from_bytes(init[1:3], "big"), int.from_bytes(init[4:6], "big")
    if offset + length > len(init):
        raise LedgerError("LineageLedger.bin preamble points past its end")
    return init[offset : offset + length]


def run_id_bytes(run_id: bytes | str) -> bytes:
    """A run id as 32 bytes: accepts 32 raw bytes or 64 hex digits (optionally 0x-prefixed)."""
    if isinstance(run_id, (bytes, bytearray)):
        if len(run_id) != 32:
            raise LedgerError(f"run id is {len(run_id)} bytes, expected 32")
        return bytes(run_id)
    if isinstance(run_id, str) and _HEX32.match(run_id):
        return bytes.fromhex(run_id.removeprefix("0x"))
    raise LedgerError(f"run id is not 32 bytes of hex: {run_id!r:.80}")


def load_key(path: str | os.PathLike[str]) -> LocalAccount:
    """The recorder account from a file holding one hex private key (64 digits, 0x optional).

    The file must not be readable by group or others, like an ssh key; the key never appears in
    an error message.
    """
    _import_chain_libs()
    from eth_account import Account

    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text().strip()
    except FileNotFoundError:
        raise LedgerError(f"recorder key file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LedgerError(f"cannot read recorder key file {p}: {type(e).__name__}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise LedgerError(f"recorder key file {p} is accessible by others: chmod 600 it")
    if not _HEX32.match(text):
        raise LedgerError(f"recorder key file {p} does not hold one 64-digit hex private key")
    key = int(text.removeprefix("0x"), 16)
    if not 0 < key < _SECP256K1_N:
        raise LedgerError(f"recorder key in {p} is outside the secp256k1 key range")
    return Account.from_key(key.to_bytes(32, "big"))


def _revert_reason(e: BaseException) -> str:
    """The one-line reason a node or eth-tester gave for refusing a transaction or call."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    for prefix in ("execution reverted: ", "execution reverted:"):
        if prefix in msg:
            return msg.split(prefix, 1)[1].strip().strip("'\"")
    return msg


class LineageContract:
    """A deployed LineageLedger reached through web3: views, `register`, `append`, events.

    `account` signs transactions locally (the same path for a public node and eth-tester);
    it may be None for read-only use. `gas_limit=None` estimates gas per transaction, which also
    surfaces a refusal (with its reason) before anything is sent; a fixed limit saves one EVM
    execution per append. With `verify_code`, the code at `address` must be the runtime of the
    committed bytecode, so a look-alike contract that lies in its views is refused.
    """

    def __init__(
        self,
        w3: Web3,
        address: str,
        account: LocalAccount | None = None,
        *,
        gas_limit: int | None = None,
        receipt_timeout_s: float = 120.0,
        verify_code: bool = True,
    ) -> None:
        _import_chain_libs()
        from web3 import Web3

        if not Web3.is_address(address):
            raise LedgerError(f"not an EVM address: {address!r:.80}")
        if gas_limit is not None and gas_limit < 21_000:
            raise LedgerError(f"gas limit {gas_limit} is below the 21000 of any transaction")
        self.w3 = w3
        self.address = Web3.to_checksum_address(address)
        self.account = account
        self.gas_limit = gas_limit
        self.receipt_timeout_s = receipt_timeout_s
        code = bytes(w3.eth.get_code(self.address))
        if not code:
            raise LedgerError(f"no contract at {self.address}")
        if verify_code and code != runtime_code():
            raise LedgerError(f"contract at {self.address} is not this LineageLedger")
        self._c = w3.eth.contract(address=self.address, abi=load_abi())
        self._chain_id = w3.eth.chain_id

    # -- views ---------------------------------------------------------------------------------
    def count(self, run_id: bytes, block: int | str = "latest") -> int:
        """Number of entries recorded for `run_id` (as of `block`)."""
        return int(self._c.functions.count(run_id).call(block_identifier=block))

    def entry_hash(self, run_id: bytes, i: int) -> bytes:
        """On-chain sha256 of entry `i`'s body."""
        try:
            return bytes(self._c.functions.entry_hash(run_id, i).call())
        except Exception as e:  # web3 and eth-tester raise different types for a revert
            why = _revert_reason(e)
            raise LedgerError(f"entry {i}: cannot read its hash from the chain: {why}") from None

    def latest_root(self, run_id: bytes, block: int | str = "latest") -> bytes:
        """Merkle root posted with the latest entry as of `block` (zeros before the first)."""
        return bytes(self._c.functions.latest_root(run_id).call(block_identifier=block))

    def recorder(self, run_id: bytes) -> str | None:
        """The registered recorder of `run_id`, or None if the run is not registered."""
        addr = self._c.functions.recorder(run_id).call()
        return None if int(addr, 16) == 0 else addr

    def events(self, run_id: bytes, from_block: int = 0) -> list[AppendedEvent]:
        """Every `EntryAppended` log of `run_id`, in chain order."""
        logs = self._c.events.EntryAppended().get_logs(
            from_block=from_block, argument_filters={"run_id": run_id}
        )
        out = [
            AppendedEvent(
                index=int(log.args.index),
                entry_hash=bytes(log.args.entry_hash),
                merkle_root=bytes(log.args.merkle_root),
                block_number=int(log.blockNumber),
                tx_hash=log.transactionHash.hex(),
            )
            for log in logs
        ]
        return sorted(out, key=lambda ev: (ev.block_number, ev.index))

    # -- transactions --------------------------------------------------------------------------
    def register(self, run_id: bytes, recorder: str) -> dict[str, Any]:
        """Fix the recorder of `run_id` (the first registration wins); returns the receipt."""
        return self._transact(self._c.functions.register(run_id, recorder), f"register {recorder}")

    def append(self, run_id: bytes, index: int, entry_hash: bytes, merkle_root: bytes) -> Any:
        """Record entry `index`; returns the receipt after checking its `EntryAppended` log."""
        receipt = self._transact(
            self._c.functions.append(run_id, index, entry_hash, merkle_root), f"entry {index}"
        )
        logs = self._c.events.EntryAppended().process_receipt(receipt)
        if not any(
            int(log.args.index) == index and bytes(log.args.entry_hash) == entry_hash
            and bytes(log.args.merkle_root) == merkle_root for log in logs
        ):
            raise LedgerError(f"entry {index}: transaction mined without its EntryAppended event")
        return receipt

    def _transact(self, fn: Any, what: str) -> Any:
        if self.account is None:
            raise LedgerError(f"{what}: no recorder key given, the ledger is read-only")
        # the nonce is asked for every time, so several processes may share one recorder key
        nonce = self.w3.eth.get_transaction_count(self.account.address, "pending")
        params: dict[str, Any] = {
            "from": self.account.address, "nonce": nonce, "chainId": self._chain_id,
        }
        if self.gas_limit is not None:
            params["gas"] = self.gas_limit
        try:
            tx = fn.build_transaction(params)  # estimates gas (a refusal shows here) and fees
            signed = self.account.sign_transaction(tx)
            tx_hash = self.w3.eth.send_raw_transaction(signed.raw_transaction)
        except Exception as e:  # web3, the node and eth-tester each raise their own types
            raise LedgerError(f"{what}: refused by the chain: {_revert_reason(e)}") from None
        try:
            receipt = self.w3.eth.wait_for_transaction_receipt(
                tx_hash, timeout=self.receipt_timeout_s
            )
        except Exception as e:
            # the transaction may still be mined; EvmLedger re-reads the chain before each append
            raise LedgerError(
                f"{what}: sent as {tx_hash.hex()}, no receipt: {_revert_reason(e)}"
            ) from None
        if receipt["status"] != 1:
            raise LedgerError(
                f"{what}: transaction {tx_hash.hex()} reverted on chain: {self._why(tx, receipt)}"
            )
        return receipt

    def _why(self, tx: dict[str, Any], receipt: Any) -> str:
        """The revert reason of a mined, failed transaction, by replaying it as a call on the
        state before its block (diagnostic only: earlier transactions in the block are not
        replayed)."""
        call = {"from": tx["from"], "to": tx["to"], "data": tx["data"], "gas": tx["gas"]}
        try:
            self.w3.eth.call(call, block_identifier=max(int(receipt["blockNumber"]) - 1, 0))
        except Exception as e:
            return _revert_reason(e)
        return "out of gas or no reason given"


def deploy(w3: Web3, account: LocalAccount, *, gas_limit: int | None = None) -> str:
    """Deploy LineageLedger from `account`; returns the contract address."""
    c = w3.eth.contract(abi=load_abi(), bytecode=load_bytecode())
    params: dict[str, Any] = {
        "from": account.address,
        "nonce": w3.eth.get_transaction_count(account.address, "pending"),
        "chainId": w3.eth.chain_id,
    }
    if gas_limit is not None:
        params["gas"] = gas_limit
    try:
        tx = c.constructor().build_transaction(params)
        tx_hash = w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)
        receipt = w3.eth.wait_for_transaction_receipt(tx_hash)
    except Exception as e:
        raise LedgerError(f"deploying LineageLedger failed: {_revert_reason(e)}") from None
    if receipt["status"] != 1 or not receipt["contractAddress"]:
        raise LedgerError(f"deploying LineageLedger failed: transaction {tx_hash.hex()} reverted")
    return receipt["contractAddress"]


@dataclass
class InProcessChain:
    """An eth-tester chain on py-evm inside this process, with its funded test accounts.

    Blocks are mined on every transaction. For tests and benchmarks only: the keys are public.
    """

    w3: Web3
    keys: list[bytes]

    @classmethod
    def start(cls) -> InProcessChain:
        """A fresh chain (py-evm runs its newest fork; LineageLedger targets cancun, a subset)."""
        _import_chain_libs(tester=True)
        from eth_tester import EthereumTester, PyEVMBackend
        from web3 import EthereumTesterProvider, Web3

        backend = PyEVMBackend()
        w3 = Web3(EthereumTesterProvider(EthereumTester(backend)))
        return cls(w3=w3, keys=[k.to_bytes() for k in backend.account_keys])

    def account(self, i: int = 0) -> LocalAccount:
        """Test account `i` (funded), with its private key."""
        _import_chain_libs()
        from eth_account import Account

        return Account.from_key(self.keys[i])

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> ChainServer:
        """Serve this chain over HTTP JSON-RPC on `host:port` (0: a free port) from a daemon
        thread, so other processes (a run's spawned workers, `veriloco audit`) reach it by URL."""
        return ChainServer(self, host, port)


class ChainServer:
    """A minimal HTTP JSON-RPC endpoint in front of an `InProcessChain` (tests, demos).

    Each POST is one JSON-RPC request (or a batch); it goes through the same eth-tester
    middleware an in-process `Web3` uses, one at a time (eth-tester is not thread-safe), and the
    result is encoded as a node would: quantities as 0x-hex, bytes as 0x-hex. `url` is where it
    listens; `close()` stops it.
    """

    def __init__(self, chain: InProcessChain, host: str = "127.0.0.1", port: int = 0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from web3 import Web3

        w3 = Web3(chain.w3.provider, middleware=[])  # the tester's own middleware only
        call = chain.w3.provider.request_func(w3, w3.middleware_onion)
        lock = threading.Lock()

        def answer(req: Any) -> dict[str, Any]:
            rid = req.get("id") if isinstance(req, dict) else None
            if not isinstance(req, dict) or not isinstance(req.get("method"), str):
                return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32600, "message": "invalid request"}}
            try:
                with lock:
                    out = call(req["method"], req.get("params") or [])
            except Exception as e:  # a revert or a validation error: the node's error answer
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                return {"jsonrpc": "2.0", "id": rid, "error": {"code": 3 if "revert" in msg else -32000, "message": msg}}
            if "error" in out:
                return {"jsonrpc": "2.0", "id": rid, "error": dict(out["error"])}
            return {"jsonrpc": "2.0", "id": rid, "result": _rpc_json(out.get("result"))}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    body = [answer(x) for x in req] if isinstance(req, list) else answer(req)
                except ValueError:
                    body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse error"}}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="chain-rpc", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ChainServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rpc_json(x: Any) -> Any:
    """A tester result as JSON-RPC writes it: ints as 0x-hex quantities, bytes as 0x-hex."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return hex(x)
    if isinstance(x, (bytes, bytearray)):
        return "0x" + bytes(x).hex()
    if isinstance(x, dict) or hasattr(x, "items"):
        return {k: _rpc_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rpc_json(v) for v in x]
    return x


class EvmLedger(Ledger):
    """A `Ledger` whose order, entry hashes and Merkle roots live in a LineageLedger contract.

    `contract` is reached with the recorder's key (or with none: read-only, for audit);
    `run_id` (the entries' `run_id`, 64 hex digits) names the run on chain; `mirror` holds the
    bodies by sha256 (a directory path makes a `LocalStore`). With `register`, an unregistered
    run is registered to the contract's account; a run registered to another account is refused
    unless the ledger is read-only. With `verify_on_open`, every body, event and root is checked
    (`check()`) before the ledger is handed out. `from_block` bounds the event scan.
    """

    chain: InProcessChain | None = None  # set by `in_process`

    def __init__(
        self,
        contract: LineageContract,
        run_id: bytes | str,
        mirror: BlobStore | str | os.PathLike[str],
        *,
        register: bool = True,
        verify_on_open: bool = True,
        from_block: int = 0,
    ) -> None:
        super().__init__()
        self.contract = contract
        self.run_id = run_id_bytes(run_id)
        self.mirror: BlobStore = (
            LocalStore(mirror) if isinstance(mirror, (str, os.PathLike)) else mirror
        )
        self.from_block = from_block
        self._onchain: list[bytes] = []  # entry hashes read from the chain (final once mined)
        self._event_roots: list[bytes] = []  # merkle_root of each EntryAppended, by index
        self._read_at_block: int | None = None  # block at which `_onchain` was last read
        account = contract.account
        recorder = contract.recorder(self.run_id)
        if recorder is None and account is not None and register:
            contract.register(self.run_id, account.address)
            recorder = account.address
        if account is not None:
            if recorder is None:
                raise LedgerError(
                    f"run {self.run_id.hex()} is not registered on {contract.address}"
                )
            if recorder.lower() != account.address.lower():
                raise LedgerError(
                    f"run {self.run_id.hex()} is recorded by {recorder}, not by {account.address}"
                )
        if verify_on_open:
            self.check()

    @property
    def run_id_hex(self) -> str:
        """The run id as the 64 hex digits entries carry."""
        return self.run_id.hex()

    # ---- constructors

    @classmethod
    def connect(
        cls,
        rpc_url: str,
        contract_address: str,
        run_id: bytes | str,
        key_file: str | os.PathLike[str] | None,
        mirror: BlobStore | str | os.PathLike[str],
        *,
        gas_limit: int | None = None,
        timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> EvmLedger:
        """Open the ledger of `run_id` on the contract at `contract_address` over HTTP(S) RPC.

        `key_file` holds the recorder's hex private key; None opens read-only (for audit).
        Other keyword arguments go to `EvmLedger(...)`.
        """
        return cls(open_contract(rpc_url, contract_address, key_file, gas_limit, timeout_s), run_id, mirror, **kwargs)

    @classmethod
    def in_process(
        cls,
        mirror: BlobStore | str | os.PathLike[str],
        run_id: bytes | str | None = None,
        *,
        chain: InProcessChain | None = None,
        recorder: int = 0,
        gas_limit: int | None = None,
        **kwargs: Any,
    ) -> EvmLedger:
        """A ledger on a fresh (or the given) in-process chain: deploys LineageLedger from test
        account 0 and records as test account `recorder`. `run_id` defaults to
        sha256(b"veriloco-test-run"). The chain is kept as `ledger.chain`."""
        chain = chain or InProcessChain.start()
        address = deploy(chain.w3, chain.account(0))
        contract = LineageContract(chain.w3, address, chain.account(recorder), gas_limit=gas_limit)
        rid = run_id if run_id is not None else hashlib.sha256(b"veriloco-test-run").digest()
        ledger = cls(contract, rid, mirror, **kwargs)
        ledger.chain = chain
        return ledger

    # ---- storage hooks (see base.py)

    def _read_chain(self) -> int:
        """Read on-chain entry hashes past the ones already known; return the on-chain count.

        The count only changes with a new block, so within one block it is read once: the base
        class asks for the size on every call, and an `eth_call` costs far more than
        `eth_blockNumber` on eth-tester.
        """
        block = self.contract.w3.eth.block_number
        if block == self._read_at_block:
            return len(self._onchain)
        n = self.contract.count(self.run_id, block)
        if n < len(self._onchain):  # only a chain reorganisation can do this
            raise LedgerError(
                f"entry {n}: chain now holds {n} entries of run {self.run_id.hex()}, "
                f"{len(self._onchain)} were read before (reorganised chain?)"
            )
        for i in range(len(self._onchain), n):
            self._onchain.append(self.contract.entry_hash(self.run_id, i))
        self._read_at_block = block
        return n

    def _size(self) -> int:
        return self._read_chain()

    def _raw(self, i: int) -> bytes:
        if i >= len(self._onchain):
            self._read_chain()
        if not 0 <= i < len(self._onchain):
            raise LedgerError(f"entry {i} is not on chain: the run has {len(self._onchain)}")
        want = self._onchain[i]
        try:
            data = self.mirror.get(want.hex(), max_bytes=MAX_ENTRY_BYTES)
        except StoreError as e:
            raise LedgerError(f"entry {i}: off-chain body is unusable: {e}") from None
        got = hashlib.sha256(data).digest()
        if got != want:  # for mirrors that do not check a blob against its name themselves
            raise LedgerError(
                f"entry {i}: off-chain body hashes to {got.hex()}, the chain holds {want.hex()}"
            )
        return data

    def _stored_hash(self, i: int) -> str | None:
        if i >= len(self._onchain):
            self._read_chain()
        return self._onchain[i].hex() if 0 <= i < len(self._onchain) else None

    def _stored_root(self, n: int) -> str | None:
        if n <= 0:
            return None
        # the latest root is state (authoritative); older roots come from the append events
        if n >= len(self._onchain) and n == self._read_chain():
            return self._latest_root().hex()
        if n > len(self._event_roots):
            self._read_events()
        return self._event_roots[n - 1].hex() if n <= len(self._event_roots) else None

    def _latest_root(self) -> bytes:
        """The on-chain root at the block the entry hashes were last read at (same state)."""
        block = "latest" if self._read_at_block is None else self._read_at_block
        return self.contract.latest_root(self.run_id, block)

    def _read_events(self) -> list[AppendedEvent]:
        events = self.contract.events(self.run_id, from_block=self.from_block)
        self._event_roots = [ev.merkle_root for ev in events]
        return events

    def _append_raw(self, index: int, data: bytes, entry_hash: str, root: str) -> None:
        run_id = parse_entry(data)["predicate"]["run_id"]
        if run_id != self.run_id.hex():
            raise LedgerError(
                f"entry {index} is for run {run_id}, "
                f"this EVM ledger records run {self.run_id.hex()}"
            )
        # body first: an unreferenced blob is harmless, a hash on chain without its body is not
        digest = self.mirror.put(data)
        if digest != entry_hash:
            raise LedgerError(f"entry {index}: mirror named the body {digest}, not its sha256")
        receipt = self.contract.append(
            self.run_id, index, bytes.fromhex(entry_hash), bytes.fromhex(root)
        )
        self._onchain.append(bytes.fromhex(entry_hash))
        if self._read_at_block == int(receipt["blockNumber"]) - 1:
            # we had read the chain just before our block, so we know its count after it (were
            # another append in it, our stale next index would be refused by the contract)
            self._read_at_block = int(receipt["blockNumber"])
        if len(self._event_roots) == index:
            self._event_roots.append(bytes.fromhex(root))

    # ---- reads checked against the chain

    def root(self, n: int | None = None) -> str:
        """RFC 9162 root (hex) of the first `n` entries' bodies; for the whole ledger, also
        checked against the root on chain (LedgerError naming the last index if they differ)."""
        r = super().root(n)
        size = len(self._leaves)
        if (n is None or n == size) and size:
            on_chain = self._latest_root().hex()
            if on_chain != r:
                raise LedgerError(
                    f"entry {size - 1}: chain root {on_chain} is not the Merkle root of the "
                    f"bodies {r}"
                )
        return r

    def verify(self) -> list[str]:
        """Re-read the run from the chain (nothing from memory) and return `verify_chain`'s
        problems: each body against its on-chain hash, the latest on-chain root and each
        `EntryAppended` event's root against the roots recomputed from the bodies; plus exactly
        one event per entry, in order, agreeing with the contract's storage."""
        events = self._read_events()
        in_order = [ev.index for ev in events] == list(range(len(events)))
        # the hashes from one log scan instead of one eth_call per entry; storage is checked
        # below, and `_read_chain` reads from storage any entry the scan did not return
        self._onchain = [ev.entry_hash for ev in events] if in_order else []
        self._read_at_block = None
        problems = super().verify()
        n = len(self._onchain)
        if not in_order or len(events) != n:
            first = next((k for k, ev in enumerate(events) if ev.index != k), len(events))
            problems.append(
                f"entry {min(first, n)}: chain has {len(events)} append events for {n} entries"
            )
        elif n and self.contract.entry_hash(self.run_id, n - 1) != events[-1].entry_hash:
            problems.append(f"entry {n - 1}: event hash differs from the contract's storage")
        return problems

    def check(self) -> int:
        """Raise LedgerError with the first problem `verify()` finds; else return the size."""
        problems = self.verify()
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise LedgerError(problems[0] + more)
        return len(self._onchain)

    def events(self) -> list[AppendedEvent]:
        """The run's `EntryAppended` events as read from the chain."""
        return self._read_events()


def bench_evm(n: int = 100, *, gas_limit: int | None = None) -> dict[str, Any]:
    """Append `n` round entries (4 commitments each) to an EvmLedger on a fresh in-process
    chain; return one row with the columns of bench/ledger.py plus EVM figures.

    All times are from the clock: `append_s` is the wall time of the `n` appends (entry
    building, base-class checks, mirror write, signing, gas estimation unless `gas_limit` is
    fixed, mining, receipt and event check); `ms_per_append*` are per `append` call;
    `verify_s` is `verify_chain` (bodies vs on-chain hashes and roots) and `check_s` the full
    `check()` (that plus the event scan); `gas_per_append` is the last append's gas used.
    """
    import statistics
    import tempfile

    from .base import verify_chain

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    with tempfile.TemporaryDirectory(prefix="veriloco-bench-evm-") as tmp:
        ledger = EvmLedger.in_process(Path(tmp) / "mirror", gas_limit=gas_limit)
        try:
            times: list[float] = []
            sizes: list[int] = []
            t_start = time.perf_counter()
            for r in range(n):
                digest = hashlib.sha256(b"%d" % r).hexdigest()
                entry = make_entry(
                    run_id=ledger.run_id_hex, round=r, prev_entry_hash=ledger.head_hash(),
                    checkpoint=digest, aggregate_hash=digest, eval_loss=2.5,
                    commitments=[
                        {"worker": w, "packet_hash": digest, "trace_root": digest,
                         "signature": digest * 2, "verdict": "accept"} for w in range(4)
                    ],
                    codecs={str(w): "topk-int8" for w in range(4)},
                )
                t0 = time.perf_counter()
                ledger.append(entry)
                times.append(time.perf_counter() - t0)
                sizes.append(len(ledger.entry_bytes(r)) if r < 8 else sizes[-1])
            append_s = time.perf_counter() - t_start
            t0 = time.perf_counter()
            problems = verify_chain(ledger)
            verify_s = time.perf_counter() - t0
            if problems:
                raise LedgerError(f"bench ledger failed verification: {problems[0]}")
            t0 = time.perf_counter()
            ledger.check()
            check_s = time.perf_counter() - t0
            w3 = ledger.contract.w3
            last = w3.eth.get_block("latest").transactions[-1]
            gas = int(w3.eth.get_transaction_receipt(last)["gasUsed"])
        finally:
            ledger.close()
    return {
        "backend": "evm-inproc" + ("" if gas_limit is None else "-fixedgas"),
        "entries": n,
        "entry_bytes": round(statistics.fmean(sizes)),
        "append_s": round(append_s, 4),
        "appends_per_s": round(n / append_s, 1),
        "ms_per_append": round(1000 * statistics.fmean(times), 2),
        "ms_per_append_median": round(1000 * statistics.median(times), 2),
        "ms_per_append_max": round(1000 * max(times), 2),
        "verify_s": round(verify_s, 4),
        "check_s": round(check_s, 4),
        "gas_per_append": gas,
        "gas_limit": "estimated" if gas_limit is None else gas_limit,
        "evm_version": EVM_VERSION,
        "chain": "eth-tester + py-evm, in process, one block per transaction",
    }
