"""`[run] keep_checkpoints`: the store keeps the newest N rounds' checkpoints, and nothing else changes.

A round's checkpoint is G and its outer momentum (twice the model), so a long run's store grows
by that every round; with keep_checkpoints = N the older ones are deleted as rounds are recorded.
Training, resume, the audit (which recomputes every round's checkpoint from the packets) and
export of a kept round work as before; a pruned round is named as such."""

from __future__ import annotations

import pytest
from conftest import cli, rounds_of, tiny

from veriloco.config import ConfigError
from veriloco.records import checkpoint_blobs, prune_checkpoints, pruned
from veriloco.run import resume, train
from veriloco.store import LocalStore

DELAY1 = ("--train.rounds=5", "--outer.delay=1", "--outer.momentum=0.5", "--outer.lookahead=true",
          "--train.inner_state=reset", "--verify.replay_probability=1.0", "--verify.trace_every=5")


def held(store: LocalStore, recs: list[dict]) -> list[bool]:
    """Per round: whether the store holds its checkpoint(s)."""
    return [all(store.has(d) for d in checkpoint_blobs(r)) for r in recs]


def test_prune_keeps_the_newest_and_what_they_name(tmp_path):
    store = LocalStore(tmp_path / "s")
    blobs = [store.put(f"ckpt {i}".encode()) for i in range(5)]
    recs = [{"round": i, "checkpoint": blobs[i]} for i in range(4)] + [{"round": 4, "checkpoint": blobs[1]}]
    assert prune_checkpoints(store, recs, 0) == [] and all(map(store.has, blobs))  # 0: keep all
    assert prune_checkpoints(store, recs, 2) == [blobs[0], blobs[2]]  # round 1's bytes are round 4's too
    assert [store.has(b) for b in blobs] == [False, True, False, True, True]  # blob 4 no record names
    assert prune_checkpoints(store, recs, 2) == []  # idempotent
    # a pipelined run's record names its stage checkpoints; its small stage manifest stays
    st = [store.put(f"stage {i}".encode()) for i in range(4)]
    man = store.put(b"manifest")
    staged = [{"round": 0, "checkpoint": man, "stages": [{"checkpoint": st[0]}, {"checkpoint": st[1]}]},
              {"round": 1, "checkpoint": man, "stages": [{"checkpoint": st[2]}, {"checkpoint": st[3]}]}]
    assert checkpoint_blobs(staged[0]) == {st[0], st[1]}
    assert sorted(prune_checkpoints(store, staged, 1)) == sorted(st[:2]) and store.has(man)
    assert [pruned(2, 5, r) for r in range(5)] == [True, True, True, False, False] and not pruned(0, 5, 0)


def test_keep_checkpoints_must_leave_a_resume_its_two(monkeypatch, capsys):
    with pytest.raises(ConfigError, match="run.keep_checkpoints must be 0"):
        tiny("--run.keep_checkpoints=1")
    code, lines, _ = cli(monkeypatch, capsys, "plan", "--run.keep_checkpoints=-1")
    assert code == 2 and len(lines) == 1 and "run.keep_checkpoints" in lines[0]


def test_a_pruned_run_trains_resumes_audits_and_exports_as_a_full_one(tmp_path, monkeypatch, capsys):
    """Delay 1 with every round replayed, stopped after 3 rounds and resumed, keep 2: the same
    params every round as the run that keeps everything; its store holds the newest two
    checkpoints; the audit recomputes all five, re-runs the replays and says three were pruned;
    export takes a kept round, and rebuilds a pruned one from G_0 and the packets."""
    full, _ = train(tiny(*DELAY1), str(tmp_path / "full"), quiet=True)
    run, _ = train(tiny(*DELAY1, "--run.keep_checkpoints=2"), str(tmp_path / "kept"), quiet=True, stop_after=3)
    store = LocalStore(run.store_dir)
    assert held(store, rounds_of(run.root)) == [False, True, True]  # what the resume reads: rounds 1 and 2
    # a crash between a record and its pruning leaves an old checkpoint: the resume deletes it (the
    # full run's round 0 checkpoint is the same bytes: the same params and momentum)
    store.put(LocalStore(full.store_dir).get(rounds_of(run.root)[0]["checkpoint"]))
    assert held(store, rounds_of(run.root)) == [True, True, True]
    resume(str(run.root), quiet=True)
    a, b = rounds_of(full.root), rounds_of(run.root)
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["eval_loss"] for r in a] == [r["eval_loss"] for r in b]
    assert held(store, b) == [False, False, False, True, True]
    assert all(held(LocalStore(full.store_dir), a))

    import veriloco.audit as audit

    held_bases, finish = [], audit._finish_slice

    def counting(cfg, sl, *args):  # the audit holds the newest two rounds' params, not every round's
        out = finish(cfg, sl, *args)
        held_bases.append(sorted(sl.bases))
        return out

    monkeypatch.setattr(audit, "_finish_slice", counting)
    code, _, out = cli(monkeypatch, capsys, "audit", str(run.root), "--replay", "10")
    assert code == 0 and "5 checkpoints recomputed (3 pruned from the store: run.keep_checkpoints)" in out, out
    assert "10 replays" in out and held_bases == [[0], [0, 1], [1, 2], [2, 3], [3, 4]], (out, held_bases)
    # export of a pruned round rebuilds it from G_0 and the packets: the full run's checkpoint's params, bit for bit
    for name, root, r in (("full-1", full.root, "1"), ("kept-1", run.root, "1"), ("kept-4", run.root, "4")):
        code, lines, _ = cli(monkeypatch, capsys, "export", str(root), "--out", str(tmp_path / name), "--round", r)
        assert code == 0, lines
    weights = lambda name: (tmp_path / name / "model.safetensors").read_bytes()  # noqa: E731
    assert weights("kept-1") == weights("full-1") != weights("kept-4")
    # a rebuild checks every round it redoes: a bundle that is not what the run accepted stops it in one line
    accepted_bundle = store.path_of(b[0]["bundles"][1])
    good = accepted_bundle.read_bytes()
    accepted_bundle.write_bytes(good[:-4] + bytes(4))
    code, lines, _ = cli(monkeypatch, capsys, "export", str(run.root), "--out", str(tmp_path / "bad"), "--round", "1")
    assert code == 2 and len(lines) == 1 and "round 0: worker 1's accepted packet does not load" in lines[0], lines
    assert not (tmp_path / "bad").exists()
    accepted_bundle.write_bytes(good)

    # a kept round's checkpoint is still required: gone, the audit fails on it, and so does a resume
    store.delete(b[-1]["checkpoint"])
    code, lines, _ = cli(monkeypatch, capsys, "audit", str(run.root))
    assert code == 1 and "round 4: checkpoint: blob" in lines[0], lines


def test_resume_names_a_missing_checkpoint_before_starting_workers(tmp_path):
    from veriloco.records import RunDirError

    run, _ = train(tiny("--train.rounds=3"), str(tmp_path / "r"), quiet=True, stop_after=2)
    LocalStore(run.store_dir).delete(rounds_of(run.root)[-1]["checkpoint"])
    with pytest.raises(RunDirError, match="round 1's checkpoint .* is missing from"):
        resume(str(run.root), quiet=True)


def test_pipelined_and_elastic_runs_prune_too(tmp_path, monkeypatch, capsys):
    """Two stages (the recorder prunes at once, the other stage process a round later) and elastic
    membership (the member that commits a round prunes): the newest two rounds' checkpoints stay
    and the audit passes."""
    for name, extra, gone in (("stages", ("--topology.stages=2", "--model.n_layer=2"), 4),  # 2 rounds x 2 stages
                              ("elastic", ("--run.membership=elastic", "--run.timeout_s=30", "--run.heartbeat_timeout_s=1.5"), 2)):
        run, _ = train(tiny("--train.rounds=4", "--run.keep_checkpoints=2", *extra), str(tmp_path / name), quiet=True)
        recs = rounds_of(run.root)
        assert held(LocalStore(run.store_dir), recs) == [False, False, True, True], name
        code, _, out = cli(monkeypatch, capsys, "audit", str(run.root))
        assert code == 0 and f"({gone} pruned from the store" in out, (name, out)
        code, lines, _ = cli(monkeypatch, capsys, "export", str(run.root), "--out", str(tmp_path / f"{name}-0"), "--round", "0")
        assert (code, name) == (0, "elastic") or (code == 2 and "a pipelined run's pruned rounds are not rebuilt" in lines[0]), lines


def test_a_rebuild_takes_the_accepted_packets_only(tmp_path, monkeypatch, capsys):
    """Worker 2 sends noise, rejected in round 0: rebuilding round 0 aggregates the other two
    packets, as the round did (its aggregate hash would not match otherwise)."""
    run, _ = train(tiny("--train.rounds=3", "--topology.workers=3", "--run.keep_checkpoints=2", "--adversary.2=noise"),
                   str(tmp_path / "r"), quiet=True)
    recs = rounds_of(run.root)
    assert recs[0]["verdicts"] == ["accept", "accept", "norm_outlier"], recs[0]["verdicts"]
    assert held(LocalStore(run.store_dir), recs) == [False, True, True]
    code, lines, _ = cli(monkeypatch, capsys, "export", str(run.root), "--out", str(tmp_path / "e"), "--round", "0")
    assert code == 0 and (tmp_path / "e" / "model.safetensors").is_file(), lines


def test_the_rounds_follower_reads_what_was_appended_and_starts_over_on_a_new_file(tmp_path):
    """What the elastic launcher and a worker awaiting a record poll (bench/records_poll.py: a
    whole read of 10,000 records takes most of a second, a poll microseconds)."""
    from veriloco.records import RoundsFollower, RunDir, RunDirError

    run = RunDir(tmp_path)
    follower = RoundsFollower(run)
    assert follower.rounds() == []  # no file yet
    for r in range(3):
        run.append_round({"round": r})
        assert follower.rounds() == run.rounds() == [{"round": x} for x in range(r + 1)]
    with run.rounds_path.open("a") as f:  # a torn line counts once its newline is written
        f.write('\n{"round": 3')
        f.flush()
        assert len(follower.rounds()) == 3
        f.write("}\n")
    assert follower.rounds()[-1] == {"round": 3} and len(follower.rounds()) == 4
    run.truncate_to(2)  # a resume replaces the file: read again whole
    assert follower.rounds() == [{"round": 0}, {"round": 1}]
    run.append_round({"round": 2})
    assert follower.rounds() == run.rounds()
    with run.rounds_path.open("a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(RunDirError, match="rounds.jsonl line 4 is not a JSON object"):
        follower.rounds()


def test_a_run_that_will_not_fit_on_its_disk_says_so_and_runs(tmp_path, monkeypatch, capsys):
    """`veriloco train` and a resume warn (one line on stderr) when the plan's store and private
    states for the rounds to come exceed the free space of the run's filesystem; nothing else."""
    import shutil
    from collections import namedtuple

    from veriloco.plan import disk_warning, make_plan

    cfg = tiny("--train.rounds=2")
    plan = make_plan(cfg)
    need = plan.store_held(2) + plan.private_state_bytes * 2
    assert plan.store_held(2) == 2 * (plan.checkpoint_bytes + 2 * plan.payload)
    assert make_plan(tiny("--train.rounds=5", "--run.keep_checkpoints=2")).store_held(5, 1) == 4 * 2 * plan.payload + plan.checkpoint_bytes
    assert disk_warning(cfg, tmp_path) is None  # this disk has room for a tiny run
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(need, need - 1000, 1000))
    line = disk_warning(cfg, tmp_path)
    assert line.startswith("warning: rounds 0..1 will write about ") and "has 1.0 KB free" in line
    assert "--run.keep_checkpoints=2" in line
    capsys.readouterr()
    run, summary = train(cfg, str(tmp_path / "r"), quiet=True)
    assert summary["complete"] and "warning: rounds 0..1 will write about" in capsys.readouterr().err


def test_the_rounds_follower_is_shared_safely_by_threads(tmp_path):
    """An elastic worker's exchange thread awaits records while its main thread commits rounds
    (one follower per process): polled from four threads while records are appended, every
    thread sees a prefix of the file's records, never a record twice or a line cut in the middle."""
    import threading

    from veriloco.records import RoundsFollower, RunDir

    run = RunDir(tmp_path)
    follower, seen, errors = RoundsFollower(run), [[] for _ in range(4)], []
    pad = "x" * 3000  # records of several pages, as a run of many workers writes

    def poll(out: list) -> None:
        try:
            while len(out) < 300:
                got = follower.rounds()
                assert [r["round"] for r in got] == list(range(len(got))), [r["round"] for r in got][:10]
                out[:] = got
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=poll, args=(s,)) for s in seen]
    [t.start() for t in threads]
    for r in range(300):
        run.append_round({"round": r, "pad": pad})
    [t.join(timeout=60) for t in threads]
    assert not errors, errors[0]
    assert all(len(s) == 300 for s in seen) and follower.rounds() == run.rounds()


def test_a_healer_whose_checkpoint_was_pruned_meanwhile_heals_to_a_newer_round(tmp_path):
    """Elastic: the others may record two more rounds while a worker heals, and with keep 2 the
    checkpoint it set out to load is gone. catch_up says so as a MembershipError, which
    heal_toward answers by healing to the newest round (test_elastic); a checkpoint missing
    from a round that was kept is still the store's error."""
    from types import SimpleNamespace

    from veriloco import elastic
    from veriloco.membership import MembershipError
    from veriloco.records import RunDir
    from veriloco.store import StoreError

    run, store = RunDir(tmp_path), LocalStore(tmp_path / "store")
    gone = [store.put(f"checkpoint {r}".encode()) for r in range(4)]
    for r in range(4):
        run.append_round({"round": r, "checkpoint": gone[r]})
        store.delete(gone[r])
    w = SimpleNamespace(run=run, store=store, applied=-1, worker=2,
                        cfg=tiny("--run.membership=elastic", "--run.keep_checkpoints=2", "--run.timeout_s=5"))
    with pytest.raises(MembershipError, match="round 1's checkpoint was pruned .* before this worker read it"):
        elastic.catch_up(w, 1)
    with pytest.raises(StoreError, match="is missing"):
        elastic.catch_up(w, 2)  # rounds 2 and 3 are the two kept: not pruned, missing
