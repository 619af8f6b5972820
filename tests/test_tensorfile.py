"""safetensors a tensor at a time (tensorfile.py): the canonical G_0 blob written tensor by tensor
is safetensors' own bytes, a file is read by header and tensor, and the prepare step writes G_0
without holding it twice."""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import tiny
from safetensors.torch import save as st_save

from veriloco.hashing import TensorsHasher, tensors_hash
from veriloco.model import build_model
from veriloco.store import LocalStore, StagedBlob
from veriloco.tensorfile import TensorFile, write_tensors
from veriloco.weights import init_blob, write_initial


def _layout(tensors):
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_written_tensor_by_tensor_is_safetensors_own_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"b.w": torch.randn(3, 5, generator=g), "a": torch.randn(7, generator=g), "empty": torch.zeros(0, 4),
               "z.scalar": torch.tensor(2.5), "m": torch.randn(2, 3, 4, generator=g)}
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out, asked = io.BytesIO(), []
    n = write_tensors(out, _layout(tensors), lambda k: asked.append(k) or tensors[k])
    assert out.getvalue() == st_save(tensors) and n == len(out.getvalue())
    assert asked == sorted(tensors)  # one at a time, in name order
    out = io.BytesIO()
    write_tensors(out, _layout(tensors), tensors.__getitem__, metadata={"format": "pt"})  # as export writes
    assert out.getvalue() == st_save(tensors, metadata={"format": "pt"})


def test_a_models_g0_blob_and_hash_are_what_they_were():
    cfg = tiny()
    params = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}
    assert init_blob(params) == st_save({k: params[k].contiguous() for k in sorted(params)})
    f = io.BytesIO()
    assert write_initial(f, params) == tensors_hash(params)
    h = TensorsHasher()
    h.add("b", torch.ones(1))
    with pytest.raises(ValueError, match="sorted order"):
        h.add("a", torch.ones(1))


def test_write_tensors_refuses_what_it_cannot_write_exactly():
    with pytest.raises(ValueError, match="one dtype"):
        write_tensors(io.BytesIO(), {"a": (torch.float32, (1,)), "b": (torch.float16, (1,))}, lambda k: None)
    with pytest.raises(ValueError, match=r"tensor a is torch.float32 \(2,\), the layout says"):
        write_tensors(io.BytesIO(), {"a": (torch.float32, (3,))}, lambda k: torch.ones(2))


def test_a_file_is_read_by_header_then_tensor_by_tensor(tmp_path):
    tensors = {"x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "i": torch.arange(3), "e": torch.zeros(0)}
    path = tmp_path / "t.safetensors"
    path.write_bytes(st_save(tensors, metadata={"format": "pt"}))
    f = TensorFile(path, "t")
    assert sorted(f) == ["e", "i", "x"] and f.layout()["x"] == (torch.bfloat16, (2, 3))
    assert all(torch.equal(f[k], v) for k, v in tensors.items())

    def bad(header, data=b"\0" * 16):
        raw = json.dumps(header).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
        return TensorFile(path, "t")

    with pytest.raises(ValueError, match="t is not a safetensors file: its header length is"):
        path.write_bytes(b"short")
        TensorFile(path, "t")
    with pytest.raises(ValueError, match="its header is not an object"):
        bad([1, 2])
    for entry in ({"dtype": "F32", "shape": [5], "data_offsets": [0, 20]},  # past the end of the data
                  {"dtype": "U16", "shape": [8], "data_offsets": [0, 16]},  # a dtype it does not read
                  {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]},
                  {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]},
                  {"dtype": "F32", "shape": [4], "data_offsets": [0]},
                  {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]},  # zero bytes, yet no torch.empty
                  {"dtype": "F32", "shape": [0] + [1] * 65, "data_offsets": [0, 0]}):
        with pytest.raises(ValueError, match="tensor 'w' is malformed"):
            bad({"w": entry})
    with pytest.raises(ValueError, match="its header is not JSON"):  # a RecursionError in json
        raw = b'{"w":' + b"[" * 100000 + b"]" * 100000 + b"}"
        path.write_bytes(len(raw).to_bytes(8, "little") + raw)
        TensorFile(path, "t")


def test_a_staged_blob_is_adopted_whole_or_left_nowhere(tmp_path):
    store = LocalStore(tmp_path / "store")
    with StagedBlob(tmp_path) as blob:
        blob.write(b"abc")
        blob.write(memoryview(b"def"))
        digest = store.adopt(blob)
    assert store.get(digest) == b"abcdef" and digest == store.put(b"abcdef")
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # the staged file moved in
    with StagedBlob(tmp_path) as again:  # already there: the staged copy is dropped
        again.write(b"abcdef")
        assert store.adopt(again) == digest
    with pytest.raises(RuntimeError), StagedBlob(tmp_path) as lost:
        lost.write(b"half")
        raise RuntimeError("the writer failed")
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # not adopted: gone


def _staging(directory, then) -> tuple[int, str]:
    """A forked process that stages a blob in `directory`, says where, then runs `then`: (pid, path)."""
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            blob = StagedBlob(directory)
            blob.write(b"x")
            os.write(write, str(blob.path).encode())
            then()
        finally:
            os._exit(1)
    os.close(write)
    path = os.read(read, 4096).decode()
    os.close(read)
    return pid, path


def test_a_staged_file_a_killed_process_left_is_removed_by_the_next(tmp_path):
    """kill -9 during the prepare step leaves its staged G_0 (no cleanup runs); the next staged
    blob in that directory removes it, and spares one whose process is still writing it."""
    import os
    import signal
    import time

    dead, left = _staging(tmp_path, lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert os.waitpid(dead, 0)[1] == signal.SIGKILL and os.path.exists(left)
    live, live_path = _staging(tmp_path, lambda: time.sleep(60))
    try:
        fresh = tmp_path / ".tmp-blob-fresh"  # made a moment ago, not locked yet: spared
        fresh.write_bytes(b"")
        with StagedBlob(tmp_path):
            assert os.path.exists(left)  # written less than a minute ago: its process may not have locked it yet
        old = time.time() - 120
        for path in (left, live_path):
            os.utime(path, (old, old))
        with StagedBlob(tmp_path) as blob:
            assert {p.name for p in tmp_path.iterdir()} == {os.path.basename(live_path), fresh.name, blob.path.name}
    finally:
        os.kill(live, signal.SIGKILL)
        os.waitpid(live, 0)


def test_the_prepare_step_reads_an_init_checkpoint_a_tensor_at_a_time(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from veriloco.model import build_meta
    from veriloco.run import prepare_run
    from veriloco.task import StoredParams
    from veriloco.weights import read_init

    cfg = tiny()
    theirs = {k: p.detach().to(torch.bfloat16) for k, p in build_model(cfg.model, 1).named_parameters()}
    save_file(theirs, str(tmp_path / "model.safetensors"))
    cfg = tiny(f"--model.init={tmp_path / 'model.safetensors'}")
    reads = []
    read = TensorFile.__getitem__
    monkeypatch.setattr(TensorFile, "__getitem__", lambda self, k: reads.append(k) or read(self, k))
    assert len(read_init(cfg.model, build_meta(cfg.model))) == len(theirs) and reads == []  # checked from the header
    run, _ = prepare_run(cfg, str(tmp_path / "run"))
    assert sorted(reads) == sorted(theirs)  # each tensor read once, as G_0 was written
    manifest = json.loads((run.root / "manifest.json").read_text())
    g0 = StoredParams(LocalStore(run.store_dir), manifest["initial_params"])
    assert all(torch.equal(g0[k], v.float()) for k, v in theirs.items())
    assert manifest["model_init_hash"] == tensors_hash({k: v.float() for k, v in theirs.items()})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]  # the staged blob moved into the store

    # a prepare that fails after G_0 is staged leaves nothing: not the blob, not the directories made for it
    monkeypatch.setattr(LocalStore, "adopt", lambda self, blob: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        prepare_run(cfg, str(tmp_path / "new" / "deeper" / "run"))
    assert not (tmp_path / "new").exists()


def test_export_reads_the_checkpoint_a_tensor_at_a_time(tmp_path, monkeypatch, tie=True):
    from veriloco.export import export_run, run_params
    from veriloco.run import train

    run, _ = train(tiny("--train.rounds=1", f"--model.tie={str(tie).lower()}"), str(tmp_path / "run"), quiet=True)
    _, params, _ = run_params(run.root)
    whole = {k: params[k] for k in params}
    reads = []
    read = TensorFile.__getitem__
    monkeypatch.setattr(TensorFile, "__getitem__", lambda self, k: reads.append(k) or read(self, k))
    export_run(run.root, tmp_path / "out")
    # each param read twice, one at a time: to check its stage's params hash, then to write it
    assert sorted(reads) == sorted([f"param/{k}" for k in whole] * 2 + (["param/tok_emb.weight"] if tie else []))
    if tie:  # the GPT's export repeats the tied head under its own name
        whole["lm_head.weight"] = whole["tok_emb.weight"].clone()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == st_save(whole, metadata={"format": "pt"})


def test_put_tensors_stores_safetensors_own_bytes_without_building_them(tmp_path, monkeypatch):
    """What a round's checkpoint is stored with (round.finish_round): the blob and digest of
    store.put(save(...)); a blob already there is not written again; mixed dtypes go through save;
    tensors that change between the hash and the write leave an error and no blob."""
    import veriloco.tensorfile as tf
    from veriloco.store import StoreError

    g = torch.Generator().manual_seed(0)
    ckpt = {"param/w": torch.randn(6, 5, generator=g), "param/b": torch.randn(5, generator=g),
            "outer/w/momentum": torch.randn(6, 5, generator=g)}
    store = LocalStore(tmp_path / "store")
    want = st_save(ckpt, metadata={"round": "3"})
    monkeypatch.setattr(tf, "st_save", None)  # one dtype: never built
    digest = tf.put_tensors(store, ckpt, {"round": "3"})
    assert store.get(digest) == want and digest == LocalStore(tmp_path / "other").put(want)
    assert tf.tensors_digest(ckpt, {"round": "3"}) == digest  # what the audit recomputes, as a stream
    assert tf.tensors_digest(ckpt, {"round": "4"}) != digest
    written = []
    monkeypatch.setattr(tf, "StagedBlob", lambda root: written.append(root))
    assert tf.put_tensors(store, dict(ckpt), {"round": "3"}) == digest and written == []  # held: hashed only
    monkeypatch.undo()

    mixed = {**ckpt, "step": torch.tensor(7, dtype=torch.int64)}
    assert store.get(tf.put_tensors(store, mixed, {"round": "4"})) == st_save(mixed, metadata={"round": "4"})
    assert tf.tensors_digest(mixed, {"round": "4"}) == LocalStore(tmp_path / "other").put(st_save(mixed, metadata={"round": "4"}))

    class Moving(dict):  # each read gives another tensor: what is written is not what was hashed
        reads = 0

        def __getitem__(self, k):
            Moving.reads += 1
            return super().__getitem__(k) + Moving.reads

    before = set(store.digests())
    with pytest.raises(StoreError, match="tensors changed while they were stored"):
        tf.put_tensors(store, Moving({"w": torch.zeros(3)}), None)
    assert Moving.reads == 2 and set(store.digests()) == before and not list((tmp_path / "store").glob(".tmp-*"))


def test_a_state_file_of_several_dtypes_is_written_a_tensor_at_a_time_and_atomically(tmp_path):
    """What a worker's private state is written with each round (round.finish_round): safetensors
    reads it back, tensors and metadata; a write that fails half-way leaves the old file whole."""
    from safetensors import safe_open
    from safetensors.torch import load as st_load

    from veriloco.tensorfile import write_tensors_file

    g = torch.Generator().manual_seed(1)
    state = {"inner/w/exp_avg": torch.randn(4, 3, generator=g), "inner/step": torch.tensor(12.0),
             "codec/int8/w": torch.randn(5, generator=g).to(torch.bfloat16), "count": torch.tensor([3, 4], dtype=torch.int64)}
    path = tmp_path / "state-3.safetensors"
    write_tensors_file(path, state, {"history": '{"0": 3}'})
    back = st_load(path.read_bytes())
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"history": '{"0": 3}'}
    before = path.read_bytes()

    class Failing(dict):
        def __getitem__(self, k):
            if k == "inner/step":
                raise OSError("disk gone")
            return super().__getitem__(k)

    with pytest.raises(OSError, match="disk gone"):
        write_tensors_file(path, Failing(state))
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
