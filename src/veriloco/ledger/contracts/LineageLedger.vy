# pragma version ~=0.4.3
# pragma evm-version cancun
"""
@title LineageLedger
@notice Append-only, per-run record of veriloco ledger entries.
    The chain holds, per run (bytes32 run id = hash of the run manifest), the sha256 of every
    entry body and the latest RFC 9162 Merkle root over the bodies; the bodies themselves stay
    off-chain in a content-addressed store. The first `register` of a run fixes its recorder;
    only that address may append, and only at index == count (no gaps, no rewrites).
"""

event RunRegistered:
    run_id: indexed(bytes32)
    recorder: indexed(address)

event EntryAppended:
    run_id: indexed(bytes32)
    index: uint256
    entry_hash: bytes32
    merkle_root: bytes32

recorder: public(HashMap[bytes32, address])
count: public(HashMap[bytes32, uint256])
latest_root: public(HashMap[bytes32, bytes32])
_hashes: HashMap[bytes32, HashMap[uint256, bytes32]]


@external
def register(run_id: bytes32, recorder: address):
    """
    @notice Fix the recorder of `run_id`; the first registration wins, later ones revert.
    """
    assert recorder != empty(address), "recorder is the zero address"
    assert self.recorder[run_id] == empty(address), "run already registered"
    self.recorder[run_id] = recorder
    log RunRegistered(run_id=run_id, recorder=recorder)


@external
def append(run_id: bytes32, index: uint256, entry_hash: bytes32, merkle_root: bytes32):
    """
    @notice Record entry `index` of `run_id` and the Merkle root over entries 0..index.
    """
    assert self.recorder[run_id] != empty(address), "run not registered"
    assert msg.sender == self.recorder[run_id], "sender is not the run's recorder"
    assert index == self.count[run_id], "index is not the next entry"
    assert entry_hash != empty(bytes32), "entry hash is zero"
    self._hashes[run_id][index] = entry_hash
    self.count[run_id] = index + 1
    self.latest_root[run_id] = merkle_root
    log EntryAppended(run_id=run_id, index=index, entry_hash=entry_hash, merkle_root=merkle_root)


@view
@external
def entry_hash(run_id: bytes32, i: uint256) -> bytes32:
    """
    @notice sha256 of the body of entry `i` of `run_id`; reverts past the end.
    """
    assert i < self.count[run_id], "index out of range"
    return self._hashes[run_id][i]
