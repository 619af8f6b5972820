"""G_0 is kept in the run's store, and a pipeline stage is built from its slice alone.

`model.model_from` builds the structure on the meta device, cuts it to the stage, and only then
makes memory for what is left, copied from the (lazily read) stored G_0: the stage must equal the
stage cut from the full model built from the seed, and must neither build the full model nor read
another stage's tensors."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import torch
from conftest import rounds_of, tiny

from veriloco import model as model_mod
from veriloco import topology
from veriloco.audit import audit_run
from veriloco.hashing import canonical_json, json_hash, tensors_hash
from veriloco.hf import HF_ARCHS
from veriloco.model import build_model, model_from
from veriloco.run import train
from veriloco.store import LocalStore, StoreError
from veriloco.task import StoredParams
from veriloco.topology import build_stage_model, layers_of_stage
from veriloco.weights import init_blob

try:
    import transformers  # noqa: F401
    ARCHS = ("gpt", *HF_ARCHS)
except ImportError:
    ARCHS = ("gpt",)

SMALL = ("--model.n_layer=3", "--model.d_model=32", "--model.n_head=4")


class Reads(Mapping):
    """A params mapping that records which names were read."""

    def __init__(self, params):
        self.params, self.read = params, []

    def __getitem__(self, name):
        self.read.append(name)
        return self.params[name]

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_stage_from_params_is_the_stage_cut_from_the_seeds_model(arch):
    cfg = tiny(f"--model.arch={arch}", *SMALL)
    full = build_model(cfg.model, cfg.run.seed)
    params = {k: p.detach() for k, p in full.named_parameters()}
    x = torch.randint(0, 256, (2, cfg.model.ctx), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = full(x)
        assert torch.equal(model_from(cfg.model, params)(x), logits)
        h = x
        for s in range(3):
            cut, built = build_stage_model(cfg.model, cfg.run.seed, s, 3), build_stage_model(cfg.model, 0, s, 3, params)
            assert [n for n, _ in built.named_parameters()] == [n for n, _ in cut.named_parameters()]
            assert all(torch.equal(a, b) for a, b in zip(cut.parameters(), built.parameters(), strict=True))
            cut_buffers, built_buffers = dict(cut.named_buffers()), dict(built.named_buffers())  # rotary tables
            assert cut_buffers.keys() == built_buffers.keys()
            assert all(torch.equal(cut_buffers[k], built_buffers[k]) for k in cut_buffers)
            assert torch.equal(built(h), cut(h))
            h = built(h)
    assert torch.equal(h, logits)


def test_a_stage_reads_only_its_slice_and_never_builds_the_whole_model(monkeypatch):
    cfg = tiny(*SMALL)
    params = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}

    def refuse(*args):
        raise AssertionError("the full model was built")

    monkeypatch.setattr(topology, "build_model", refuse)
    monkeypatch.setattr(model_mod, "build_model", refuse)
    made = []  # how many elements each materialised module holds when memory is made for it
    to_empty = torch.nn.Module.to_empty

    def counting(self, *, device, recurse=True):
        made.append(sum(p.numel() for p in self.parameters()))
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", counting)
    reads = Reads(params)
    stage = build_stage_model(cfg.model, cfg.run.seed, 1, 3, reads)
    mine = [n for n, _ in stage.named_parameters()]
    assert sorted(reads.read) == sorted(mine) and all(n.startswith(f"blocks.{layers_of_stage(1, 3, 3)[0]}.") for n in mine)
    assert made == [sum(p.numel() for p in stage.parameters())] and made[0] < sum(p.numel() for p in params.values()) // 3


def test_stored_params_are_checked_and_read_one_by_one(tmp_path):
    cfg = tiny(*SMALL)
    params = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}
    store = LocalStore(tmp_path / "store")
    digest = store.put(init_blob(params))
    stored = StoredParams(store, digest)
    assert len(stored) == len(params) and sorted(stored) == sorted(params)
    assert all(torch.equal(stored[k], params[k]) for k in params)
    with pytest.raises(KeyError):
        stored["nope"]
    path = store.path_of(digest)
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(StoreError, match="corrupt"):
        StoredParams(LocalStore(tmp_path / "store"), digest)  # the hash is checked before anything is read
    with pytest.raises(StoreError, match="missing"):
        StoredParams(store, "0" * 64)
    with pytest.raises(StoreError, match="not a safetensors file: its header length"):
        StoredParams(store, store.put(b"not tensors"))

    def blob(header: dict, data: bytes) -> str:
        raw = json.dumps(header).encode()
        return store.put(len(raw).to_bytes(8, "little") + raw + data)

    for entry in ({"dtype": "F32", "shape": [4], "data_offsets": [0, 32]},  # past the end of the data
                  {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]},  # 16 bytes for 3 floats
                  {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},  # not a float dtype
                  {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}):
        with pytest.raises(StoreError, match="tensor 'w' is malformed"):
            StoredParams(store, blob({"w": entry}, bytes(16)))
    ok = StoredParams(store, blob({"__metadata__": {}, "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
                                  torch.arange(4, dtype=torch.float32).numpy().tobytes()))
    assert list(ok) == ["w"] and torch.equal(ok["w"], torch.arange(4.0).reshape(2, 2))


def test_the_run_keeps_g0_and_the_audit_holds_it_to_the_seed(tmp_path):
    cfg = tiny("--train.rounds=1", "--topology.stages=2", "--topology.workers=2")
    run, _ = train(cfg, out=str(tmp_path / "run"), quiet=True)  # each stage process reads its slice of the stored G_0
    manifest = run.read_manifest()
    g0 = StoredParams(LocalStore(run.store_dir), manifest["initial_params"])
    seeds = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}
    assert tensors_hash(dict(g0.items())) == tensors_hash(seeds) == manifest["model_init_hash"]
    assert "init" not in manifest  # from the seed, not from weights on disk
    assert len(rounds_of(run.root)) == 1 and audit_run(run.root).ok

    # a launcher that kept other weights than the seed's, under the seed's init hash and a run id
    # recomputed to match, is caught before any round
    other = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed + 1).named_parameters()}
    manifest["initial_params"] = LocalStore(run.store_dir).put(init_blob(other))
    core = {k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")}
    manifest["run_id"] = json_hash(core)
    run.manifest_path.write_bytes(canonical_json(manifest) + b"\n")
    report = audit_run(run.root)
    assert not report.ok
    assert report.first_failure == ("manifest: the starting weights it names (initial_params) are not the model "
                                    "built from the config's seed")
    assert json.loads(run.manifest_path.read_text())["initial_params"] == manifest["initial_params"]


def test_a_replay_builds_its_model_at_the_start_not_from_g0(tmp_path, monkeypatch):
    """verify.replay.plain_replayer with `build`: the built-in task's replays make the model at the
    segment's start (model_from), without reading G_0 and building a second model first."""
    from veriloco.task import CorpusTask, corpus_task_of, on_device

    cfg = tiny("--train.rounds=1", "--train.inner_state=reset", "--verify.replay_probability=1.0", "--verify.trace_every=5")
    run, _ = train(cfg, out=str(tmp_path / "run"), quiet=True)
    task = CorpusTask(cfg, run.store_dir, "0" * 64).as_task()
    assert corpus_task_of(task) is not None and corpus_task_of(on_device(task, "cpu", "bf16")) is not None
    monkeypatch.setattr(CorpusTask, "make_model", lambda self: (_ for _ in ()).throw(AssertionError("G_0 read")))
    report = audit_run(run.root, replay=100)
    assert report.ok and report.checked["replays"] == cfg.topology.workers, report.first_failure
