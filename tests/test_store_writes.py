"""One copy per store: a bundle is stored by its sender before it is sent, a round checkpoint by
one process of its stage per store (round.checkpoint_writer: the highest worker, so not the
recorder), and each record says how many bytes each worker wrote into its store
(`store_bytes_written`)."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import tiny

from veriloco.run import train
from veriloco.store import PEERS_DIR, LocalStore, StagedBlob, StoreError, mark_peer, seen_peers


def _blob_size(store: LocalStore, digest: str) -> int:
    return (store.root / digest[:2] / digest[2:]).stat().st_size


def test_a_store_counts_the_bytes_it_writes(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put(b"x" * 100)
    assert store.bytes_written == 100
    store.put(b"x" * 100)  # held already: nothing written
    assert store.bytes_written == 100
    with StagedBlob(store.root) as blob:
        blob.write(b"y" * 40)
        store.adopt(blob)
    assert store.bytes_written == 140
    with StagedBlob(store.root) as blob:  # written, then dropped: the store held it
        blob.write(b"y" * 40)
        store.adopt(blob)
    assert store.bytes_written == 180
    store.put_ref("runs/a", b"ref")
    assert store.bytes_written == 183


def test_peers_are_the_processes_whose_markers_a_store_holds(tmp_path):
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    tokens = ["0a" * 16, "1b" * 16, "2c" * 16]
    marks = [mark_peer(a, tokens[0]), mark_peer(a, tokens[1]), mark_peer(b, tokens[2])]
    assert seen_peers(a, tokens) == [0, 1]
    assert seen_peers(b, tokens) == [2]
    # a peer's token is input from outside: one that names another path, or is not a string, is not seen
    (a.root / "refs").mkdir()
    assert seen_peers(a, ["../refs", 7, None, tokens[1].upper(), tokens[0]]) == [4]
    with pytest.raises(StoreError, match="not a peer token"):
        mark_peer(a, "../x")
    for m in marks:
        m.unlink()
    assert seen_peers(a, tokens) == [] and not any((a.root / PEERS_DIR).iterdir())


def _writer(rank: int, port: int, root: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from veriloco.round import checkpoint_writer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    store = LocalStore(f"{root}/{'ab'[rank == 2]}")  # ranks 0, 1, 3 share store a; 2 has b
    writes = checkpoint_writer(store, dist.group.WORLD, rank)
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump({"writes": writes, "left": sorted(p.name for p in (store.root / PEERS_DIR).iterdir())}, f)
    dist.destroy_process_group()


def test_the_highest_worker_of_each_store_writes_its_checkpoints(tmp_path):
    """Four processes of one stage, over gloo: 0, 1 and 3 share a store, 2 has its own (a machine
    with a run directory of its own): 3 and 2 write, and no marker is left behind."""
    from veriloco.procs import start_workers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_workers(_writer, (port, str(tmp_path)), 4)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [g["writes"] for g in got] == [False, False, True, True]
    assert (tmp_path / "a" / PEERS_DIR).is_dir() and not any((tmp_path / "a" / PEERS_DIR).iterdir())


def test_each_bundle_and_checkpoint_is_written_once_per_store(tmp_path):
    """3 workers on one machine share the run's store: per round, worker 2 writes its bundle and
    the checkpoint, the others their bundles only (each used to write every bundle and the
    checkpoint); the run audits as before."""
    from veriloco.audit import audit_run

    out = tmp_path / "run"
    train(tiny("--topology.workers=3", "--train.rounds=3"), str(out), quiet=True)
    store = LocalStore(out / "store")
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    for rec in records:
        ckpt = _blob_size(store, rec["checkpoint"])
        assert rec["store_bytes_written"] == [*rec["bundle_bytes"][:2], rec["bundle_bytes"][2] + ckpt], rec["round"]
    assert audit_run(str(out)).ok


def test_stages_write_one_checkpoint_each_and_delay_one_stores_the_next_bundle_early(tmp_path):
    """2 workers x 2 stages, delay 1: worker 0's processes write their bundles (each round's
    before the record of the round before, the last round's record none) and the recorder the
    stage-checkpoint manifest (counted in the next record), worker 1's their bundles and both
    stage checkpoints."""
    out = tmp_path / "run"
    train(tiny("--topology.stages=2", "--outer.delay=1", "--train.rounds=3"), str(out), quiet=True)
    store = LocalStore(out / "store")
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    zero = [r["store_bytes_written"][0] for r in records]
    manifests = [_blob_size(store, r["checkpoint"]) for r in records]
    assert zero[0] == records[0]["bundle_bytes"][0] + records[1]["bundle_bytes"][0]
    assert zero[-1] == manifests[-2]  # its bundles were stored by the round before's record
    assert sum(zero) == sum(r["bundle_bytes"][0] for r in records) + sum(manifests[:-1])
    ckpts = sum(_blob_size(store, s["checkpoint"]) for r in records for s in r["stages"])
    assert sum(r["store_bytes_written"][1] for r in records) == sum(r["bundle_bytes"][1] for r in records) + ckpts


def test_a_sole_writer_stores_the_same_blob_in_one_pass(tmp_path):
    import torch

    from veriloco.tensorfile import put_tensors, tensors_digest

    tensors = {"param/a": torch.arange(10.0), "param/b": torch.ones(3, 4), "outer/m": torch.zeros(5)}
    one, two = LocalStore(tmp_path / "one"), LocalStore(tmp_path / "two")
    digest = put_tensors(one, tensors, {"round": "3"})
    assert put_tensors(two, tensors, {"round": "3"}, fresh=True) == digest == tensors_digest(tensors, {"round": "3"})
    assert two.get(digest) == one.get(digest)
    written = two.bytes_written
    assert put_tensors(two, tensors, {"round": "3"}, fresh=True) == digest  # held already: the staged copy is dropped
    assert two.get(digest) == one.get(digest) and two.bytes_written == 2 * written
