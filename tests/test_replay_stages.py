"""Replay spot checks of pipelined workers ([topology] stages = 2): in the run, the auditor's own
pipeline replays the audited worker's round, slice by slice, bit for bit; offline, `veriloco
audit --replay` replays it in one process (pipeline.EmulatedPipeline) and must reach the same
numbers. Both runs: 3 workers x 2 stages (6 processes), 2 micro-batches, every round of every
worker replayed (p = 1), 2 segments per round, each replay to a drawn segment
(`replay_extent = "segment"`, so that a replay that stops early is exercised too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import train

BASE = ("--topology.workers=3", "--topology.stages=2", "--topology.microbatches=2", "--train.rounds=3",
        "--train.inner_steps=6", "--verify.trace_every=3", "--train.inner_state=reset",
        "--verify.replay_probability=1.0", "--verify.replay_extent=segment")


LAZY_ROUNDS = 5


def verdicts_of(run_dir: Path, worker: int) -> list[str]:
    return [r["verdicts"][worker] for r in rounds_of(run_dir)]


@pytest.fixture(scope="module")
def lazy_run(tmp_path_factory) -> Path:
    """Worker 1 skips half its inner steps; delay 1 with the eager correction (the start point of
    a replay then holds the worker's own previous delta, slice by slice). It is caught when a replay
    of it reaches segment 1, which the draw decides, and the draw is seeded by the run id, so by
    every config field: with 3 rounds a new field once drew segment 0 in every round, and with 5
    the nineteenth session's fields drew segment 0 four times and then a norm outlier (1 in 32).
    So the run is repeated with the next run.seed (another run id, another draw) until a replay
    reaches segment 1 while worker 1 is still accepted: 4 tries miss with probability 2^-20. A
    replay that never convicts fails every try."""
    draws = []
    for seed in range(4):
        run, _ = train(tiny(*BASE, f"--train.rounds={LAZY_ROUNDS}", "--adversary.1=lazy:skip=0.5", "--outer.delay=1",
                            "--outer.momentum=0.5", f"--run.seed={seed}"),
                       str(tmp_path_factory.mktemp("replay_stages") / f"lazy-{seed}"), quiet=True)
        if "replay_mismatch" in verdicts_of(run.root, 1):
            return run.root
        draws.append([(r["verdicts"][1], r["stages"][0]["evidence"].get("1", {}).get("replayed", {}).get("segment"))
                      for r in rounds_of(run.root)])
    pytest.fail(f"no run convicted the lazy worker by replay; (verdict, segment replayed) per round, per seed: {draws}")


def test_the_pipeline_replays_honest_workers_clean_and_convicts_a_lazy_one(lazy_run):
    recs = rounds_of(lazy_run)
    for j in (0, 2):
        assert verdicts_of(lazy_run, j) == ["accept"] * LAZY_ROUNDS
    for rec in recs:  # both stages drew the same plan and reached the same verdicts
        first, second = (part["evidence"] for part in rec["stages"])
        assert first == second
        for j in ("0", "2"):
            assert first[j]["replayed"]["auditor"] != int(j)
    # lazy does its first 3 steps (segment 0) honestly: it passes until segment 1 is drawn, and the
    # replay finds the first wrong state hash at the end of segment 1 (trace entry 2)
    caught = verdicts_of(lazy_run, 1).index("replay_mismatch")
    for rec in recs[:caught]:
        assert rec["stages"][0]["evidence"]["1"]["replayed"]["segment"] == 0
    evidence = recs[caught]["stages"][0]["evidence"]["1"]
    assert evidence["segment"] == 1 and evidence["first_mismatch"] == 2
    assert verdicts_of(lazy_run, 1)[caught + 1:] == ["banned"] * (LAZY_ROUNDS - 1 - caught)


def test_the_offline_audit_replays_a_pipelined_run_in_one_process(lazy_run):
    report = audit_run(lazy_run, replay=100)
    assert report.ok, report.first_failure
    caught = verdicts_of(lazy_run, 1).index("replay_mismatch")
    # every worker in each round up to the conviction, then the two honest ones
    assert report.checked["replays"] == 3 * (caught + 1) + 2 * (LAZY_ROUNDS - 1 - caught)


def test_the_offline_audit_names_auditors_that_covered_for_a_lazy_pipelined_worker(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)  # spawned workers import the user's class
    sys.path.insert(0, tests_dir)
    # one segment per round (trace_every = inner_steps): every replay covers the skipped steps
    run, _ = train(tiny(*BASE, "--train.rounds=2", "--verify.trace_every=6", "--adversary.1=lazy:skip=0.5",
                        "--adversary.0=red_team:Whitewash", "--adversary.2=red_team:Whitewash"),
                   str(tmp_path / "c"), quiet=True)
    assert verdicts_of(run.root, 1) == ["accept", "accept"]  # its auditors cover for it
    report = audit_run(run.root, replay=100)
    assert not report.ok
    assert "stage 0: worker 1's replay fails, but the round accepted it: its auditor, worker" in report.first_failure


def test_a_worker_whose_one_slice_is_rejected_gets_no_slice_in(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    run, _ = train(tiny(*BASE, "--train.rounds=2", "--adversary.1=red_team:SpoilStage0"), str(tmp_path / "s"),
                   quiet=True)
    for rec in rounds_of(run.root):
        first, second = rec["stages"]
        assert first["verdicts"][1] not in ("accept", "other_stage")  # its spoiled slice
        assert second["verdicts"][1] == "other_stage"  # its good slice, refused with it
        assert second["evidence"]["1"] == {"rejected_by_stages": [0]}
        assert rec["verdicts"] == ["accept", first["verdicts"][1], "accept"]  # the real reason, not other_stage
        assert "1" not in second["evidence"] or "replayed" not in second["evidence"]["1"]
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_loss_gains_of_pipelined_workers_are_the_whole_models(tmp_path):
    """With stages every worker computes every gain through its pipeline: the loss of G_r and of
    G_r - delta over the whole model. The recorded gains are recomputed here in one process from
    the stored checkpoint and packets alone, and the offline audit screens with its own."""
    from safetensors.torch import load as st_load

    from veriloco.packet import decode_bundle, decode_packet
    from veriloco.pipeline import EmulatedPipeline
    from veriloco.store import LocalStore
    from veriloco.task import CorpusTask
    from veriloco.topology import build_stage_model
    from veriloco.verify.commitment import parse_signed_commitment
    from veriloco.verify.lossgain import gain_steps, stage_seed

    cfg = tiny(*BASE, "--train.rounds=3", "--verify.loss_gain_batches=2", "--verify.replay_probability=0.25",
               "--adversary.1=scaled")
    run, _ = train(cfg, str(tmp_path / "g"), quiet=True)
    recs = rounds_of(run.root)
    assert all(x > 0 for rec in recs for x in rec["loss_gain_s"])
    store = LocalStore(run.root / "store")
    task = CorpusTask(cfg, run.store_dir, run.read_manifest()["corpus_manifest"]).as_task()
    models = [build_stage_model(cfg.model, cfg.run.seed, s, 2) for s in range(2)]
    G0 = {k: v.detach().clone() for m in models for k, v in m.named_parameters()}
    emu = EmulatedPipeline(models, cfg.train, 1, microbatches=2)

    def loss(params, r, at):
        with torch.no_grad():
            for k, p in emu.named_parameters():
                p.copy_(params[k])
        return emu.eval_loss([task.batch(1, r, s) for s in at])

    def tested_steps(rec):  # the batches the round drew: from each stage's screen seed, pooled
        seeds = []
        for part in rec["stages"]:
            signed = [parse_signed_commitment(decode_bundle(store.get(h))[0]) for h in part["bundles"] if h]
            salts = "".join(x[:64] for x in part["reveals"] if x)  # the salts, revealed after every bundle was in
            seeds.append(signed[0].commitment.base_hash + "".join(sorted(c.digest for c in signed)) + salts)
        return gain_steps(stage_seed(seeds), cfg.train.inner_steps, 2)

    checked, drawn = 0, []
    for r, rec in enumerate(recs):
        gains = [part["evidence"].get("1", {}).get("loss_gain") for part in rec["stages"]]
        if gains[0] is None:
            continue
        assert gains[0] == gains[1]  # one number per worker, on every stage
        G = G0 if r == 0 else {k[len("param/"):]: v for part in recs[r - 1]["stages"]
                               for k, v in st_load(store.get(part["checkpoint"])).items() if k.startswith("param/")}
        delta = {}
        for s, part in enumerate(rec["stages"]):
            shapes = {k: tuple(v.shape) for k, v in models[s].named_parameters()}
            delta |= decode_packet(decode_bundle(store.get(part["bundles"][1]))[1], shapes, 1 << 30)
        at = tested_steps(rec)
        drawn.append(at)
        assert gains[0]["own_before"] == loss(G, r, at)
        assert gains[0]["own_after"] == loss({k: G[k] - delta[k] for k in G}, r, at)
        checked += 1
    assert checked >= 2  # the scaled worker is rejected, with its gain in the evidence, every round
    assert any(at != [0, 1] for at in drawn)  # drawn, not the first two
    assert any("no_loss_gain" in rec["stages"][0]["evidence"]["1"]["flags"] for rec in recs)
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


LG_CHECKERS = ("--verify.loss_gain_batches=1", "--verify.loss_gain_checkers=1", "--verify.replay_probability=0.25")


def test_pipelined_loss_gains_are_shared_among_checkers_and_a_false_one_is_convicted(tmp_path, monkeypatch):
    """With checkers, each packet's gain is computed by one drawn worker's pipeline; a false
    checker (red_team:FalseChecker, honest as an auditor) reports every gain it checks as failing,
    every member recomputes it and convicts it (false_report, evidence: the loss gain) in the first
    round the draw makes it a checker; the audit settles the recorded reports again.

    Whether the draw makes worker 2 a checker before the last round is 1 - 1/64 for a run (each
    round leaves it out with probability 1/4); the draw is seeded by the round's commitments, so by
    the run id and by the bits of every loss and state hash (on the thirty-second session's
    machine, with the code CI had passed at 74f7360, the first seed drew only workers 0 and 1 in
    all 4 rounds). So the run is repeated with the next run.seed until it does: 3 tries miss with
    probability 2^-18."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    rounds, draws = 4, []
    for seed in range(3):
        run, _ = train(tiny(*BASE, *LG_CHECKERS, f"--train.rounds={rounds}", "--adversary.2=red_team:FalseChecker",
                            f"--run.seed={seed}"), str(tmp_path / f"c{seed}"), quiet=True)
        recs = rounds_of(run.root)
        checkers = [{row[0] for rows in rec["stages"][0]["loss_gain_reports"].values() for row in rows} for rec in recs]
        if any(2 in c for c in checkers[:-1]):
            break
        draws.append(checkers)
    else:
        pytest.fail(f"worker 2 was never drawn as a checker before the last round; checkers per round, per seed: {draws}")
    for rec in recs:
        reports = [part["loss_gain_reports"] for part in rec["stages"]]
        assert reports[0] == reports[1]  # one table for the worker's stages
    assert sorted(recs[0]["stages"][0]["loss_gain_reports"]) == ["0", "1", "2"]
    assert all(len(rows) == 1 for rows in recs[0]["stages"][0]["loss_gain_reports"].values())  # one checker each
    k = next(i for i, c in enumerate(checkers) if 2 in c)  # before the last round
    assert verdicts_of(run.root, 2) == ["accept"] * k + ["false_report"] + ["banned"] * (rounds - 1 - k)
    assert "loss_gain" in recs[k]["stages"][0]["evidence"]["2"]
    for j in (0, 1):
        assert verdicts_of(run.root, j) == ["accept"] * rounds
    # checkers compute a packet's gain, the others only what they must: less than every gain
    # (CPU seconds, the computing itself: the wall seconds of 6 processes on 2 cores also hold their waits for
    # the CPU, and came out 0.263 s after against 0.222 s in one full-suite run; alone, CPU 0.018 against 0.047 s)
    assert sum(recs[k + 1]["loss_gain_cpu_s"]) < sum(recs[k]["loss_gain_cpu_s"])
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_a_checker_that_tells_stages_apart_cannot_split_a_pipelined_worker(tmp_path, monkeypatch):
    """red_team:SplitReports reports the truth to stage 0's processes and a failing gain to stage 1's:
    every stage settles from its stage 0's table, so the run goes on (a split would hang it) and
    nobody is convicted on the lie stage 0 never heard."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    # the checkers are drawn from the run id, which every config key changes: with 3 workers, worker 1
    # checks neither other packet in a round with chance 1/4, so in none of 4 rounds with 1/256
    run, _ = train(tiny(*BASE, *LG_CHECKERS, "--train.rounds=4", "--adversary.1=red_team:SplitReports"),
                   str(tmp_path / "s"), quiet=True)
    checked_by_1 = 0
    for rec in rounds_of(run.root):
        assert rec["verdicts"] == ["accept"] * 3
        assert rec["stages"][0]["loss_gain_reports"] == rec["stages"][1]["loss_gain_reports"]
        checked_by_1 += sum(row[0] == 1 for rows in rec["stages"][0]["loss_gain_reports"].values() for row in rows)
    assert checked_by_1 > 0  # the splitter was drawn as a checker
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_an_auditor_silent_on_one_stage_neither_splits_nor_covers_for_a_pipelined_worker(tmp_path, monkeypatch):
    """red_team:SilentStage1 reports its replays' numbers to stage 0's processes and none (NaN) to
    stage 1's. Until the forty-second session a judge's stage 1 read that as a pass (as stage 0
    did the number) and no member replayed; had stage 1 replayed alone, its pipeline would have
    hung. The stages pool what they heard (round.pooled_reports): NaN on any stage, and every
    stage of every member replays the worker itself."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    # one segment per round (trace_every = inner_steps): every replay covers the skipped steps
    run, _ = train(tiny(*BASE, "--verify.trace_every=6", "--verify.ban=false", "--adversary.1=lazy:skip=0.5",
                        "--adversary.0=red_team:SilentStage1", "--adversary.2=red_team:SilentStage1"),
                   str(tmp_path / "q"), quiet=True)
    recs, unreported = rounds_of(run.root), []
    for rec in recs:
        first, second = (part["evidence"] for part in rec["stages"])
        assert first == second  # the stages acted on one number
        assert rec["verdicts"] == ["accept", "replay_mismatch", "accept"], (rec["round"], first)
        for j in (0, 2):  # audited by the other silent one, or by the lazy one, which reports
            rep = first[str(j)]["replayed"]
            assert rep.get("unreported", False) is (rep["auditor"] != 1), (rec["round"], first)
        unreported += [first[str(j)]["replayed"]["auditor"] for j in (0, 2) if "unreported" in first[str(j)]["replayed"]]
    assert unreported, recs  # (a silent one audited an honest one)
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_a_pipelined_delay_1_run_resumes_as_it_would_have_run(tmp_path):
    """Stopped after 2 of 4 rounds and resumed: the same records, slice by slice, as uninterrupted
    (each stage restores its slice of the G before the last committed round and its own delta)."""
    from veriloco.run import resume

    cfg = tiny(*BASE, "--train.rounds=4", "--outer.delay=1", "--outer.momentum=0.5")
    a, _ = train(cfg, str(tmp_path / "a"), quiet=True)
    b, _ = train(cfg, str(tmp_path / "b"), quiet=True, stop_after=2)
    resume(str(b.root), quiet=True)
    keys = ("params_hash", "checkpoint", "verdicts", "stages", "train_loss", "eval_loss")
    ra, rb = rounds_of(a.root), rounds_of(b.root)
    assert len(ra) == len(rb) == 4
    for x, y in zip(ra, rb, strict=True):
        assert {k: x[k] for k in keys if k != "stages"} == {k: y[k] for k in keys if k != "stages"}
        assert [p["evidence"] for p in x["stages"]] == [p["evidence"] for p in y["stages"]]


def test_a_false_accuser_among_pipelined_workers_is_convicted(tmp_path):
    run, _ = train(tiny(*BASE, "--adversary.2=false_accuser"), str(tmp_path / "f"), quiet=True)
    verdicts = verdicts_of(run.root, 2)
    first = verdicts.index("false_report")  # every member replayed what it accused, and it passed
    assert verdicts[first + 1:] == ["banned"] * (2 - first)
    for j in (0, 1):
        assert verdicts_of(run.root, j) == ["accept"] * 3
    assert audit_run(run.root, replay=100).ok


def test_distance_mode_replays_pipelined_workers(tmp_path):
    """replay_match = "distance" (for kernels that are not bit-reproducible, e.g. GPUs): the whole
    round is replayed through the auditor's pipeline and each stage's slice of the distance is
    summed in stage order; on CPU an honest worker's distance is exactly 0."""
    run, _ = train(tiny(*BASE, "--train.rounds=2", "--verify.replay_match=distance", "--adversary.1=lazy:skip=0.5"),
                   str(tmp_path / "d"), quiet=True)
    assert verdicts_of(run.root, 1) == ["replay_mismatch", "banned"]
    for rec in rounds_of(run.root):
        first, second = (part["evidence"] for part in rec["stages"])
        assert first == second
        for j in ("0", "2"):
            assert first[j]["replayed"]["distance"] == 0.0
    lazy = rounds_of(run.root)[0]["stages"][0]["evidence"]["1"]
    assert lazy["distance"] > 10 * lazy["tolerance"]
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_pipelined_workers_send_each_stage_slice_of_a_drawn_state_and_a_lazy_one_is_caught(tmp_path, monkeypatch):
    """`replay_extent = "state"` with S = 2: each stage of the audited worker sends its slice of the
    segment's start state to the auditor's same stage; the auditor's stages check the slices
    together against the worker-wide trace entry, and replay the segment through their pipeline.
    The offline audit replays from the stored slices, emulating the pipeline in one process."""
    from veriloco.store import LocalStore
    from veriloco.verify.replay import state_ref

    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)  # spawned workers import the red-team module
    sys.path.insert(0, tests_dir)
    cfg = tiny(*BASE[:-1], "--verify.replay_extent=state", "--verify.trace_every=1", "--verify.ban=false",
               "--adversary.1=lazy:skip=0.5,scale=none", "--adversary.2=red_team:Withholds", "--run.seed=1")
    # (seed 1 draws both outcomes for both attackers: lazy at segments 2 and 5, the withholder at 5, 1, 0)
    run, _ = train(cfg, str(tmp_path / "s"), quiet=True)
    recs = rounds_of(run.root)
    for rec in recs:
        first, second = (part["evidence"] for part in rec["stages"])
        assert first == second  # both stages took the same states and reached the same verdicts
        assert rec["verdicts"][0] == "accept"
        seg = {j: first[str(j)].get("replayed", first[str(j)])["segment"] for j in (1, 2)}
        # lazy does 3 of 6 steps honestly: entries 0-3 are real, so segments 0-2 replay clean
        assert (rec["verdicts"][1] == "replay_mismatch") == (seg[1] >= 3), (rec["round"], seg, rec["verdicts"])
        # a withheld state (both slices zeros) convicts, except for the first segment (public start)
        assert (rec["verdicts"][2] == "replay_mismatch") == (seg[2] > 0), (rec["round"], seg, rec["verdicts"])
    assert sum(sum(rec["state_bytes_sent"]) for rec in recs) > 0
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 9
    # a slice per stage in the store; one that is not the one the round replayed from fails the audit
    run_id = json.loads((run.root / "manifest.json").read_text())["run_id"]
    drawn = [(rec["round"], rec["stages"][0]["evidence"]["0"]["replayed"]["segment"]) for rec in recs]
    r, seg = max(drawn, key=lambda x: x[1])
    assert seg > 0, drawn  # (segment 0 starts from public params: no state is sent)
    store = LocalStore(run.root / "store")
    assert all(store.get_ref(state_ref(run_id, r, 0, seg, s)) for s in (0, 1))
    refs = run.root / "store" / "refs" / "replay-states" / run_id
    other = next(x for x in sorted(refs.iterdir()) if x.name.endswith("-s1") and x.name != f"{r}-0-{seg}-s1")
    store.put_ref(state_ref(run_id, r, 0, seg, 1), other.read_bytes())
    report = audit_run(run.root, replay=100)
    assert not report.ok and "worker 0's replay fails" in report.first_failure
