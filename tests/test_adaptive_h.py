"""Adaptive H (`[train] inner_steps_max`): H grows so a delayed exchange hides under compute, and
every H is derived from the records, so replays, resume and the audit follow it."""

from __future__ import annotations

import json

import pytest
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.round import StepSchedule, grow_steps
from veriloco.run import resume, train

SLOW = ("--outer.delay=1", "--outer.momentum=0.5", "--link.bandwidth=10mbit", "--link.latency=20ms",
        "--train.inner_steps_max=200", "--verify.trace_every=5", "--train.eval_every=1000")


def test_h_grows_in_whole_segments_never_shrinks_and_stops_at_the_cap():
    cfg = tiny(*SLOW)
    assert grow_steps(cfg, 5, 4) == 5 and grow_steps(cfg, 5, None) == 5
    assert grow_steps(cfg, 5, 38) == 40 and grow_steps(cfg, 40, 12) == 40 and grow_steps(cfg, 40, 999) == 200
    assert grow_steps(tiny(*SLOW[:-3]), 5, 38) == 5  # adaptive H off: H stays
    records = [{"hide_steps": n} for n in (38, 61, 12, 500)]
    sched = StepSchedule.of(cfg, records)
    assert sched.steps == [5, 5, 40, 65, 65, 200] and sched.at(3) == 65 and sched.before(3) == 50
    # the LR schedule is re-aimed at the rounds left at the current H
    assert sched.total(2) == 10 + (cfg.train.rounds - 2) * 40
    fixed = StepSchedule.of(tiny(), records)  # without adaptive H: H everywhere, whatever the records say
    assert fixed.at(7) == 5 and fixed.before(7) == 35 and fixed.total(7) == 5 * cfg.train.rounds


@pytest.mark.parametrize("overrides, message", [
    (("--outer.delay=1", "--link.latency=20ms", "--train.inner_steps_max=3"), "must be 0 or >= train.inner_steps"),
    (("--link.latency=20ms", "--train.inner_steps_max=20"), "needs train.mode = 'diloco', outer.delay = 1"),
    (("--outer.delay=1", "--train.inner_steps_max=20"), "needs a [link]"),
    (("--outer.delay=1", "--link.latency=20ms", "--train.inner_steps_max=20", "--outer.overlap_steps=2"),
     "outer.overlap_steps = 0"),
    (("--outer.delay=1", "--link.latency=20ms", "--train.inner_steps_max=20", "--topology.workers=1"),
     "topology.workers >= 2"),
    (("--outer.delay=1", "--link.latency=20ms", "--train.inner_steps_max=22", "--verify.trace_every=5"), "must divide"),
])
def test_bad_adaptive_h_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        tiny(*overrides)


def test_h_grows_on_a_slow_link_replays_follow_it_and_a_skimming_worker_is_still_caught(tmp_path):
    # 3 workers, every round replayed, worker 2 skims (trains on half of each batch: no screen sees it) and is never banned: only a replay, at every H, catches it
    run_dir = tmp_path / "run"
    train(tiny(*SLOW, "--topology.workers=3", "--train.rounds=5", "--train.inner_state=reset",
               "--verify.replay_probability=1", "--verify.ban=false", "--adversary.2=skim"),
          str(run_dir), quiet=True)
    recs = rounds_of(run_dir)
    steps = [r["inner_steps"] for r in recs]
    assert steps == StepSchedule.of(tiny(*SLOW), recs).steps[:5] and steps[:2] == [5, 5]
    assert steps[-1] > 5 and steps == sorted(steps) and all(h % 5 == 0 and h <= 200 for h in steps)
    # 177 KB fp32 bundles to 2 others on 10 Mbit/s (0.3 s) against steps of a few ms: H = 5 cannot hide it
    assert recs[0]["hide_steps"] > 5
    for r in recs:
        assert r["verdicts"] == ["accept", "accept", "replay_mismatch"], (r["round"], r["verdicts"])
        assert r["tokens"] == 3 * r["inner_steps"] * 4 * 32  # workers x H x batch x ctx
    report = audit_run(run_dir, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 15


def test_the_progress_line_shows_the_round_s_h_when_it_can_change():
    from veriloco.round import progress_line

    rec = {"round": 3, "eval_loss": None, "verdicts": ["accept"] * 2, "train_loss": [3.0, 3.1], "bytes_sent": [10, 10],
           "round_s": 0.3}
    assert "| H" not in progress_line(rec, 10, 1.0, 100.0)
    assert progress_line(rec | {"inner_steps": 70}, 10, 1.0, 100.0).endswith("| H 70")


def test_the_round_ramp_starts_at_each_round_s_first_step_whatever_its_h():
    from veriloco.inner import lr_at

    t = tiny(*SLOW, "--train.round_warmup_steps=4", "--train.warmup_steps=0").train
    # a round of 40 steps that began at step 10: its third step is at 3/4 of the ramp
    assert lr_at(t, 12, 1000, round_start=10) == pytest.approx(0.75 * lr_at(t, 12, 1000, round_start=0))
    assert lr_at(t, 12, 1000) == lr_at(t, 12, 1000, round_start=10)  # step % H with H = 5: the same step 2
    assert lr_at(t, 16, 1000, round_start=10) == lr_at(t, 16, 1000, round_start=0)  # past the ramp


def test_pipelined_workers_with_the_round_ramp_replay_bit_for_bit_at_every_h(tmp_path):
    run_dir = tmp_path / "run"
    # 2 Mbit/s: at SLOW's 10 the exchange of a stage's half hid under 5 pipelined steps on a loaded machine
    train(tiny(*SLOW, "--link.bandwidth=2mbit", "--train.inner_steps_max=20", "--topology.stages=2",
               "--train.rounds=4", "--train.inner_state=reset", "--train.round_warmup_steps=2",
               "--verify.replay_probability=1"), str(run_dir), quiet=True)
    recs = rounds_of(run_dir)
    assert recs[-1]["inner_steps"] > 5 and all(v == "accept" for r in recs for v in r["verdicts"])
    assert all("replayed" in e for r in recs for e in r["evidence"].values())  # every worker, every round
    report = audit_run(run_dir, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 8


def test_a_resumed_run_takes_its_h_from_the_records_and_an_edited_h_fails_the_audit(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny(*SLOW, "--train.rounds=5")
    train(cfg, str(run_dir), quiet=True, stop_after=3)
    resume(str(run_dir), quiet=True)
    recs = rounds_of(run_dir)
    assert [r["inner_steps"] for r in recs] == StepSchedule.of(cfg, recs).steps[:5] and recs[-1]["inner_steps"] > 5
    assert audit_run(run_dir).ok

    lines = (run_dir / "rounds.jsonl").read_text().splitlines()
    edited = json.loads(lines[1]) | {"hide_steps": recs[1]["hide_steps"] + 50}  # would make round 3's H larger
    (run_dir / "rounds.jsonl").write_text("\n".join([lines[0], json.dumps(edited), *lines[2:]]) + "\n")
    report = audit_run(run_dir)
    assert not report.ok and "round 1: the record's hide_steps" in report.first_failure
    (run_dir / "rounds.jsonl").write_text("\n".join([lines[0], json.dumps(edited | {"hide_steps": "70"}), *lines[2:]]) + "\n")
    report = audit_run(run_dir)
    assert not report.ok and "round 1: the record's hide_steps '70' is not a positive integer" in report.first_failure


def test_elastic_workers_follow_the_recorded_h_through_a_death_and_a_restart(tmp_path):
    run_dir = tmp_path / "run"
    # min_workers = 3: no round commits without worker 2, so the restarted process heals (a fresh
    # process: every H it uses comes from the records) and takes part in every later round
    cfg = tiny(*SLOW, "--topology.workers=3", "--train.rounds=7", "--run.membership=elastic", "--run.timeout_s=10",
               "--run.heartbeat_timeout_s=1.5", "--run.min_workers=3")
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["die:2@2.1", "restart:2+2"])
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(7))
    assert all(r["verdicts"] == ["accept"] * 3 for r in recs)
    steps = [r["inner_steps"] for r in recs]
    assert steps == StepSchedule.of(cfg, recs).steps[:7] and min(steps[3:]) > 5, steps  # grown after the restart
    kinds = [(e["event"], e["worker"]) for e in (json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines())]
    assert kinds.count(("started", 2)) == 2 and ("died", 2) in kinds
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_the_slow_link_config_is_make_run_with_the_slow_link_settings():
    from conftest import ROOT

    from veriloco.config import load_config

    slow, default = (load_config(ROOT / "configs" / name).to_dict() for name in ("slow_link.toml", "default.toml"))
    changed = {(section, key) for section in default for key in default[section]
               if slow[section][key] != default[section][key]}
    assert changed == {("train", "inner_steps_max"), ("outer", "momentum"), ("outer", "delay"), ("compress", "codec"),
                       ("compress", "error_feedback"), ("link", "bandwidth"), ("link", "latency")}
