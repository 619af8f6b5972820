"""`[verify] replay_extent = "state"`: a drawn segment is replayed from its start state, which the
audited worker sends its auditor (verify/replay.py, round.StateMoves)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.inner import InnerLoop
from veriloco.model import build_model, lm_loss
from veriloco.run import resume, train
from veriloco.store import LocalStore
from veriloco.verify.kept import InMemory, OnDisk
from veriloco.verify.replay import (
    Audit,
    attributable,
    check_replay,
    from_state,
    plain_replayer,
    replay_failed,
    replay_run,
    score_replayed,
    state_from_bytes,
    state_layout,
    state_matches,
    state_nbytes,
    state_ref,
    state_to_bytes,
)

STATE = ("--train.inner_state=reset", "--verify.replay_probability=1", "--verify.replay_extent=state",
         "--verify.trace_every=1", "--verify.screen=false")


def _round(cfg, steps: int):
    """One honest round of `steps` inner steps from a fresh model, keeping every trace entry's state."""
    model = build_model(cfg.model, cfg.run.seed)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, cfg.model.ctx), generator=gen),) * 2 for _ in range(steps)]
    loop = InnerLoop(model, cfg.train, 100, lambda m, x, y: lm_loss(m(x), y))
    loop.keep = InMemory(state_layout(model), [])
    trace = loop.run(lambda s: batches[s], steps, trace_every=1).trace
    delta = {k: start[k] - p.detach() for k, p in model.named_parameters()}
    return model, start, batches, loop, trace, delta


def test_state_layout_round_trips_and_refuses_other_shapes():
    cfg = tiny()
    model, _, _, loop, trace, _ = _round(cfg, 3)
    layout = state_layout(model)
    buf = state_to_bytes(loop.keep.tensors(2), layout)
    assert buf.dtype == torch.uint8 and buf.numel() == state_nbytes(layout)
    back = state_from_bytes(buf.numpy().tobytes(), layout)
    assert state_matches(back, trace, 2) and not state_matches(back, trace, 1)
    assert state_from_bytes(buf[:-1], layout) is None  # not the layout's size
    with pytest.raises(ValueError):
        state_to_bytes(loop.keep.tensors(0), layout)  # before the first step: no AdamW moments yet
    bad = dict(loop.keep.tensors(2)) | {"inner/step_count": torch.tensor(2, dtype=torch.int32)}
    with pytest.raises(ValueError, match="step_count"):
        state_to_bytes(bad, layout)


def test_a_segment_replayed_from_its_start_state_matches_bit_for_bit():
    cfg = tiny("--train.inner_state=reset", "--verify.trace_every=1")
    model, start, batches, loop, trace, delta = _round(cfg, cfg.train.inner_steps)
    replayer = plain_replayer(lambda: build_model(cfg.model, cfg.run.seed), loop.loss_fn, cfg.train, 100)
    H = cfg.train.inner_steps
    for segment in (1, H - 2, H - 1):  # a middle one, and the last (which also checks the packet)
        a = Audit(worker=1, segment=segment, auditor=0)
        got = replay_run(cfg.verify, replayer, cfg.train, start, 0, lambda s: batches[s], a, steps_before=0,
                         total_steps=100, state=loop.keep.tensors(segment))
        assert got.offset == segment and len(got.trace) == 2
        assert check_replay(trace, got.trace, got.offset) is None
        assert (got.delta is not None) == (segment == H - 1)
        assert score_replayed(cfg.verify, got, trace, delta, {k: "fp32" for k in delta}) == -1.0
    # a faked entry after the segment's start is found where it is
    forged = list(trace)
    forged[H - 1] = "0" * 64
    a = Audit(worker=1, segment=H - 2, auditor=0)
    got = replay_run(cfg.verify, replayer, cfg.train, start, 0, lambda s: batches[s], a, steps_before=0,
                     total_steps=100, state=loop.keep.tensors(H - 2))
    assert check_replay(forged, got.trace, got.offset) == H - 1


def test_which_audits_fetch_a_state_and_which_reports_blame_the_auditor():
    v = tiny(*STATE).verify
    assert from_state(v, Audit(1, 2, 0)) and not from_state(v, Audit(1, 0, 0))  # the round's start is public
    assert not from_state(v, Audit(1, 2, 0, whole=True))  # suspects are replayed whole
    assert not from_state(tiny(*STATE, "--verify.replay_extent=segment").verify, Audit(1, 2, 0))
    # "the state you sent me does not hash to your trace" cannot be pinned on the auditor; a
    # mismatch after a state that did hash can
    assert not attributable(v, Audit(1, 2, 0), 2.0) and attributable(v, Audit(1, 2, 0), 3.0)
    assert attributable(v, Audit(1, 0, 0), 0.0)
    assert replay_failed(v, 2.0) and not replay_failed(v, -1.0)


@pytest.mark.parametrize("overrides, match", [
    (("--verify.replay_match=distance",), "replay_match = 'exact'"),
    (("--verify.replay_extent=half",), "'round', 'segment' or 'state'"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny(*STATE, *overrides)


def test_lazy_withholding_and_framing_workers_against_state_replays(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)  # spawned workers import the user's attacker module
    sys.path.insert(0, tests_dir)
    cfg = tiny(*STATE, "--topology.workers=4", "--train.rounds=4", "--verify.ban=false",
               "--adversary.1=lazy:skip=0.4,scale=none", "--adversary.2=red_team:Withholds",
               "--adversary.3=red_team:Framer")
    run, _ = train(cfg, str(tmp_path / "s"), quiet=True)
    recs = rounds_of(run.root)
    # lazy does 3 of 5 steps: trace entries 0-3 are real, 4 and 5 made up
    drawn, disputed = {w: [] for w in range(4)}, set()
    for rec in recs:
        for w in range(4):
            ev = rec["evidence"].get(str(w), {})
            seg = ev.get("replayed", ev).get("segment")
            assert seg is not None, (rec["round"], w, ev)  # p = 1: every worker every round
            drawn[w].append(seg)
            v = rec["verdicts"][w]
            if w == 0:
                assert v == "accept"
            elif w == 1:  # caught exactly when its segment reaches a made-up entry
                assert (v == "replay_mismatch") == (seg >= 3), (rec["round"], seg, v)
            elif w == 2:  # a withheld state convicts, except for the first segment (public start)
                assert (v == "replay_mismatch") == (seg > 0), (rec["round"], seg, v)
            elif (ev.get("replayed", ev)["auditor"], 3) in disputed and seg > 0:
                # framed this auditor before: now its state goes to every member at once, and a wrong one convicts
                assert v == "replay_mismatch" and "state_resent" not in ev, (rec["round"], ev)
            else:  # the framer's auditor is not convicted, and the framer keeps its verdict
                assert v == "accept"
                assert rec["verdicts"][ev["replayed"]["auditor"]] != "false_report"
                if seg > 0:
                    assert ev["replayed"].get("state_resent") is True and ev["replayed"]["disputed"] is True
                    disputed.add((ev["replayed"]["auditor"], 3))
        assert sorted(map(list, disputed)) == rec.get("disputes", [])
    assert any(s > 0 for s in drawn[2]) and any(s > 0 for s in drawn[3])  # (12 draws of 5 segments each)
    # every byte is counted at both ends: private sends, and the resends to every member
    sent = sum(sum(rec["state_bytes_sent"]) for rec in recs)
    assert sent == sum(sum(rec["state_bytes_received"]) for rec in recs) > 0
    size = state_nbytes(state_layout(build_model(cfg.model, cfg.run.seed)))
    assert sent % size == 0
    report = audit_run(run.root, replay=100)  # the offline audit re-runs every replay from the stored states
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 16

    # a stored state that is not the one the round replayed from fails the audit
    store = LocalStore(run.root / "store")
    run_id = json.loads((run.root / "manifest.json").read_text())["run_id"]
    r, seg = next((rec["round"], rec["evidence"]["0"]["replayed"]["segment"]) for rec in recs
                  if rec["evidence"]["0"]["replayed"]["segment"] > 0)
    other = next(ref for ref in sorted((run.root / "store" / "refs" / "replay-states" / run_id).iterdir())
                 if ref.name != f"{r}-0-{seg}")
    store.put_ref(state_ref(run_id, r, 0, seg), other.read_bytes())
    report = audit_run(run.root, replay=100)
    assert not report.ok and "worker 0's replay fails" in report.first_failure


def test_an_auditor_that_reports_no_number_for_a_state_replay_covers_for_no_one(tmp_path, monkeypatch):
    """An auditor that reports no number (NaN) for a segment replayed from a state it was sent in
    private read as a pass until the forty-second session (the others had no state to replay
    from). Now the worker sends that state to every member, as for a reported failure, and each
    replays the segment itself: the lazy worker is caught whenever its segment reaches a made-up
    entry, as under an honest auditor, and no one is blamed."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    cfg = tiny(*STATE, "--topology.workers=4", "--train.rounds=4", "--verify.ban=false",
               "--adversary.1=lazy:skip=0.4,scale=none", *(f"--adversary.{j}=red_team:Silent" for j in (0, 2, 3)))
    run, _ = train(cfg, str(tmp_path / "q"), quiet=True)
    recs, unreported = rounds_of(run.root), []
    for rec in recs:
        for w in range(4):
            ev = rec["evidence"].get(str(w), {})
            rep = ev.get("replayed", ev)
            if rep["auditor"] != 1:  # a silent auditor: each member replayed from the state sent to all
                unreported.append((w, rep["segment"]))
            if w == 1:  # caught exactly when its segment reaches a made-up entry (lazy does 3 of 5 steps)
                assert (rec["verdicts"][1] == "replay_mismatch") == (rep["segment"] >= 3), (rec["round"], ev)
            else:
                assert rec["verdicts"][w] == "accept", (rec["round"], w, ev)
                assert ("unreported" in rep) == (rep["auditor"] != 1), (rec["round"], w, ev)
    assert any(w == 1 and seg >= 3 for w, seg in unreported), unreported  # the lazy one, from a state
    assert any(w != 1 and seg > 0 for w, seg in unreported), unreported  # an honest one, from a state
    sent = sum(sum(rec["state_bytes_sent"]) for rec in recs)
    assert sent == sum(sum(rec["state_bytes_received"]) for rec in recs) > 0
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_the_state_sent_to_every_member_is_the_one_the_audit_replays_from(tmp_path, monkeypatch):
    """red_team.SelfFramer sends its auditor the right start state in private and none (zeros)
    once asked to send it to every member (its silent auditors ask it: red_team.Silent). Every
    member rightly convicts it; until the review of the forty-second session the store still held
    the private copy, the offline audit replayed from that and failed the run. A state sent to
    every member is stored whether it hashes or not."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    cfg = tiny(*STATE, "--topology.workers=3", "--train.rounds=2", "--verify.ban=false",
               "--adversary.1=red_team:SelfFramer", *(f"--adversary.{j}=red_team:Silent" for j in (0, 2)))
    run, _ = train(cfg, str(tmp_path / "q"), quiet=True)
    recs = rounds_of(run.root)
    segs = [rec["evidence"]["1"]["segment"] for rec in recs]
    assert all(s > 0 for s in segs), segs  # (drawn from a state in both rounds: the run id decides)
    assert [rec["verdicts"][1] for rec in recs] == ["replay_mismatch"] * 2, recs
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_an_auditor_disputes_a_private_state_once_per_worker_then_the_state_is_public(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    cfg = tiny(*STATE, "--topology.workers=3", "--train.rounds=8", "--verify.ban=false",
               "--adversary.2=red_team:StateLiar")
    run, _ = train(cfg, str(tmp_path / "s"), quiet=True)
    recs = rounds_of(run.root)
    size = state_nbytes(state_layout(build_model(cfg.model, cfg.run.seed)))
    disputed, convicted = set(), 0
    for rec in recs:
        assert rec["verdicts"][0] == rec["verdicts"][1] == "accept"  # never framed by the liar
        sends = 0  # states sent this round, in state sizes: 1 in private, 2 to both other members
        for j in (0, 1, 2):
            ev = rec["evidence"][str(j)]["replayed"]
            if ev["auditor"] != 2 or j == 2:
                sends += ev["segment"] > 0
            elif ev["segment"] == 0 or (2, j) in disputed:  # a public state: the lie is pinned on the liar
                assert rec["verdicts"][2] == "false_report" and "state_resent" not in ev, (rec["round"], ev)
                convicted += 1
                sends += 2 * (ev["segment"] > 0)
            else:  # the pair's first dispute: no one can tell who lies; the state goes to everyone, now and later
                assert ev["state_resent"] is True
                disputed.add((2, j))
                sends += 1 + 2
        assert rec.get("disputes", []) == sorted(map(list, disputed))
        assert sum(rec["state_bytes_sent"]) == sum(rec["state_bytes_received"]) == sends * size, rec["round"]
    # the liar audits worker j in a round with chance 1/2: in 8 rounds it meets one of them twice, or
    # audits a segment 0 (a public start), all but surely; each audit's outcome is checked exactly above
    assert convicted >= 1 and len(disputed) <= 2
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_states_kept_on_disk_are_the_states_kept_in_memory(tmp_path):
    cfg = tiny("--train.inner_state=reset", "--verify.trace_every=1")
    model, _, batches, loop, _, _ = _round(cfg, 4)
    layout = state_layout(model)
    again = InnerLoop(build_model(cfg.model, cfg.run.seed), cfg.train, 100, lambda m, x, y: lm_loss(m(x), y))
    path = tmp_path / "kept-0.bin"
    again.keep = OnDisk(layout, path)
    again.run(lambda s: batches[s], 4, trace_every=1)
    mem, disk = loop.keep, again.keep
    assert len(mem) == len(disk) == 5 and path.stat().st_size == 4 * state_nbytes(layout)
    assert mem.buffer(0) is None and disk.buffer(0) is None  # before the first step: not a sendable state
    for j in range(1, 5):
        assert torch.equal(mem.buffer(j), disk.buffer(j))
        assert all(torch.equal(mem.tensors(j)[k], v) for k, v in disk.tensors(j).items())
    disk.release()
    assert not path.exists()
    full = OnDisk(layout, tmp_path / "kept-1.bin")

    class NoSpace:  # the file a full disk gives
        def __getattr__(self, name):
            return getattr(full_file, name)

        def write(self, data):
            raise OSError(28, "No space left on device")

    full_file, full.file = full.file, NoSpace()
    with pytest.raises(OSError, match=r"kept-1.bin: cannot keep trace entry 0's state \(\d+ bytes each\): No space"):
        full.append(mem.tensors(1))
    assert len(full) == 0
    full.file = full_file
    full.release()
    # a released round's memory holds the next round's states (no fresh pages every entry)
    name = next(n for n, _, _ in layout if n.startswith("param/"))
    before = {mem.tensors(j)[name].data_ptr() for j in range(5)}
    mem.release()
    loop.keep = InMemory(layout, mem.pool)
    loop.run(lambda s: batches[s], 4, trace_every=1)  # no reset: every entry has the layout's tensors
    after = [loop.keep.tensors(j)[name].data_ptr() for j in range(5)]
    assert sum(p in before for p in after) == 4 and len(mem.pool) == 1  # the old entry 0 had no moments


def test_a_resumed_run_with_the_update_a_round_late_replays_from_states_as_the_uninterrupted_one(tmp_path):
    # states kept on disk here (the other runs keep them in memory)
    cfg = tiny(*STATE, "--topology.workers=3", "--train.rounds=4", "--outer.delay=1", "--verify.keep_states=disk")
    whole, _ = train(cfg, str(tmp_path / "whole"), quiet=True)
    part, _ = train(cfg, str(tmp_path / "part"), quiet=True, stop_after=2)
    stale = part.root / "workers" / "1" / "kept-2.bin"  # as a run killed mid-round leaves it
    stale.write_bytes(b"x" * 100)
    resume(str(part.root), quiet=True)
    a, b = rounds_of(whole.root), rounds_of(part.root)
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["evidence"] for r in a] == [r["evidence"] for r in b]  # the same draws, all passed
    assert all(v == "accept" for r in b for v in r["verdicts"])
    assert any(sum(r["state_bytes_sent"]) for r in b[2:])  # states were sent after the resume
    assert not list(whole.root.rglob("kept-*.bin")) and not list(part.root.rglob("kept-*.bin"))


def test_elastic_membership_sends_states_over_the_quorum_group(tmp_path):
    cfg = tiny(*STATE, "--topology.workers=3", "--run.membership=elastic", "--run.timeout_s=30",
               "--run.heartbeat_timeout_s=1.5", "--adversary.1=lazy:skip=0.4,scale=none", "--verify.ban=false")
    run, _ = train(cfg, str(tmp_path / "e"), quiet=True)
    recs = rounds_of(run.root)
    for rec in recs:
        ev = rec["evidence"]["1"]
        seg = ev.get("replayed", ev)["segment"]
        assert (rec["verdicts"][1] == "replay_mismatch") == (seg >= 3)
        assert rec["verdicts"][0] == rec["verdicts"][2] == "accept"
    assert sum(sum(r["state_bytes_sent"]) for r in recs) == sum(sum(r["state_bytes_received"]) for r in recs) > 0
    assert audit_run(run.root, replay=100).ok
