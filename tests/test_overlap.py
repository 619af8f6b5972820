"""`[outer] overlap_steps` (Streaming DiLoCo's tau): with delay 1, round r's update lands after tau
of round r+1's inner steps instead of a whole round late."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import rounds_of, tiny
from test_engine import HASHED, uninterrupted_and_resumed

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.inner import Landing, run_steps
from veriloco.run import train


def test_landing_moves_before_its_step_after_the_trace_and_is_not_timed():
    events: list[str] = []

    def step(x, y) -> float:
        events.append(f"step{int(x)}")
        return 0.0

    def trace_hash() -> str:
        events.append("hash")
        return "h"

    def move() -> None:
        events.append("land")
        time.sleep(0.2)

    batch = lambda s: (torch.tensor(s), torch.zeros(1))  # noqa: E731
    res = run_steps(step, trace_hash, batch, 4, trace_every=2, land=Landing(2, move))
    assert events == ["hash", "step0", "step1", "hash", "land", "step2", "step3", "hash"]
    assert res.seconds < 0.1  # the landing's seconds are not inner-step time
    events.clear()
    run_steps(step, trace_hash, batch, 2, land=Landing(2, move))  # a round of no more than tau steps
    assert events == ["step0", "step1", "land"]


@pytest.mark.parametrize(("overrides", "message"), [
    (("--outer.delay=1", "--outer.overlap_steps=5"), "outer.overlap_steps must be in [0, train.inner_steps = 5), got 5"),
    (("--outer.overlap_steps=1",), "outer.overlap_steps = 1 needs outer.delay = 1"),
    (("--outer.delay=1", "--outer.overlap_steps=-1"), "outer.overlap_steps must be in [0, train.inner_steps = 5), got -1"),
])
def test_bad_overlap_steps_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        tiny(*overrides)


def test_landing_inside_the_round_is_closer_to_delay_0_than_a_round_late(tmp_path):
    """tiny, 2 workers, H = 5, 6 rounds, outer momentum 0.5 (deterministic on CPU): measured eval
    losses 3.5928 (delay 0), 3.6017 (tau = 1, +0.25%), 3.6195 (a round late, +0.74%)."""
    base = ("--train.rounds=6", "--outer.momentum=0.5")
    loss = {}
    for name, extra in {"d0": (), "late": ("--outer.delay=1",),
                        "tau1": ("--outer.delay=1", "--outer.overlap_steps=1")}.items():
        _, summary = train(tiny(*base, *extra), str(tmp_path / name), quiet=True)
        loss[name] = summary["eval_loss_end"]
    gap = {k: (v - loss["d0"]) / loss["d0"] for k, v in loss.items()}
    assert 0 < gap["tau1"] < 0.005 and gap["tau1"] < 0.5 * gap["late"], gap


@pytest.mark.parametrize("stages", [1, 2])
def test_every_round_replayed_through_the_landing_and_audited(tmp_path, stages):
    """Honest workers' replays reproduce their traces (which cross the landing) bit for bit; a lazy
    worker, not banned, is refused in every round (by replay, or by the screen first); the
    offline audit, replaying every sampled segment, agrees."""
    pipe = ("--topology.stages=2", "--topology.microbatches=2") if stages == 2 else ()
    cfg = tiny("--train.rounds=3", "--topology.workers=3", "--outer.delay=1", "--outer.momentum=0.5",
               "--outer.overlap_steps=2", "--train.inner_state=reset", "--verify.replay_probability=1.0",
               "--verify.trace_every=5", "--verify.loss_gain_batches=1", "--verify.ban=false",
               "--adversary.2=lazy:skip=0.4", *pipe)
    run, _ = train(cfg, str(tmp_path / "run"), quiet=True)
    recs = rounds_of(run.root)
    verdicts = [r["verdicts"] for r in recs]
    assert all(v[:2] == ["accept", "accept"] and v[2] != "accept" for v in verdicts), verdicts
    assert verdicts[1][2] == "replay_mismatch", verdicts  # round 1: the first whose update landed on a moved G
    parts = [r["stages"][0] if stages == 2 else r for r in recs]
    assert all("replayed" in p["evidence"]["0"] and "replayed" in p["evidence"]["1"] for p in parts)
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] >= 6


def test_overlap_stop_and_resume_equals_uninterrupted(tmp_path):
    """Stopped after round 1 and resumed, the resumed round's update lands as the uninterrupted
    run's did: the same records, verdicts and replays included."""
    cfg = tiny("--train.rounds=4", "--topology.workers=3", "--outer.delay=1", "--outer.momentum=0.5",
               "--outer.overlap_steps=2", "--outer.correction=local", "--train.inner_state=reset",
               "--verify.replay_probability=1.0", "--verify.trace_every=1")
    _, b = uninterrupted_and_resumed(cfg, tmp_path, (*HASHED, "verdicts", "evidence"))
    assert all(rec["verdicts"] == ["accept"] * 3 and "replayed" in rec["evidence"]["0"] for rec in b)


def test_spent_sums_wall_and_cpu_seconds_over_its_blocks():
    from veriloco.inner import Spent

    spent = Spent()
    with spent.timing():
        time.sleep(0.1)  # wall, no CPU
    with spent.timing():
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # CPU
            pass
    assert spent.wall >= 0.15 and 0.05 <= spent.cpu < 0.1 + 0.05
