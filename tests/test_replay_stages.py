"""Replay spot checks of pipelined workers ([topology] stages = 2): in the run, the auditor's own
pipeline replays the audited worker's round, slice by slice, bit for bit; offline, `veriloco
audit --replay` replays it in one process (pipeline.EmulatedPipeline) and must reach the same
numbers. Both runs: 3 workers x 2 stages (6 processes), 2 micro-batches, every round of every
worker replayed (p = 1), 2 segments per round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import train

BASE = ("--topology.workers=3", "--topology.stages=2", "--topology.microbatches=2", "--train.rounds=3",
        "--train.inner_steps=6", "--verify.trace_every=3", "--train.inner_state=reset",
        "--verify.replay_probability=1.0")


def verdicts_of(run_dir: Path, worker: int) -> list[str]:
    return [r["verdicts"][worker] for r in rounds_of(run_dir)]


@pytest.fixture(scope="module")
def lazy_run(tmp_path_factory) -> Path:
    """Worker 1 skips half its inner steps; delay 1 with the eager correction (the start point of
    a replay then holds the worker's own previous delta, slice by slice)."""
    run, _ = train(tiny(*BASE, "--adversary.1=lazy:skip=0.5", "--outer.delay=1", "--outer.momentum=0.5"),
                   str(tmp_path_factory.mktemp("replay_stages") / "lazy"), quiet=True)
    return run.root


def test_the_pipeline_replays_honest_workers_clean_and_convicts_a_lazy_one(lazy_run):
    recs = rounds_of(lazy_run)
    for j in (0, 2):
        assert verdicts_of(lazy_run, j) == ["accept"] * 3
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
    assert verdicts_of(lazy_run, 1)[caught + 1:] == ["banned"] * (2 - caught)


def test_the_offline_audit_replays_a_pipelined_run_in_one_process(lazy_run):
    report = audit_run(lazy_run, replay=100)
    assert report.ok, report.first_failure
    caught = verdicts_of(lazy_run, 1).index("replay_mismatch")
    # every worker in each round up to the conviction, then the two honest ones
    assert report.checked["replays"] == 3 * (caught + 1) + 2 * (2 - caught)


def test_the_offline_audit_names_auditors_that_covered_for_a_lazy_pipelined_worker(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)  # spawned workers import the user's class
    sys.path.insert(0, tests_dir)
    run, _ = train(tiny(*BASE, "--train.rounds=2", "--adversary.1=lazy:skip=0.5", "--adversary.0=red_team:Whitewash",
                        "--adversary.2=red_team:Whitewash"), str(tmp_path / "c"), quiet=True)
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
