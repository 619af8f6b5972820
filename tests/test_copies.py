"""A copy of another member's packet of the same round: the screen flags both ends and cannot tell
the original, so where the run replays, every member replays each end whole and the replay decides
(check.screen_checked's replay_copies, replay.judge_copy). Before the forty-third session both ends
were rejected, so whoever saw an honest member's packet before it committed (an elastic retry's
newcomer: the second review of the forty-second session) could censor that member every round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import train

COMMON = ("--topology.workers=3", "--train.rounds=3", "--train.inner_steps=4", "--verify.trace_every=2",
          "--train.inner_state=reset")


def on_path(monkeypatch) -> None:
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)


def twin_run(tmp_path, monkeypatch, twin: str, *overrides: str) -> Path:
    """Worker 1 trains honestly and leaks its round to worker 2 (red_team.Leaks), which sends it as
    its own from round 1 on (red_team.Twin with the params `twin`)."""
    on_path(monkeypatch)
    leak = tmp_path / "leak"
    leak.mkdir()
    cfg = tiny(*COMMON, *overrides, f"--adversary.1=red_team:Leaks:dir={leak}",
               f"--adversary.2=red_team:Twin:dir={leak},at=1,{twin}")
    run, _ = train(cfg, str(tmp_path / "run"), quiet=True)
    return run.root


@pytest.mark.parametrize("twin, extra", [("noise=0", ()), ("noise=0.001", ()), ("noise=0,one_codec=1", ()),
                                         ("scale=4", ("--topology.workers=5",)),
                                         ("noise=0", ("--compress.codec=lowrank:rank=4",)),
                                         ("noise=0", ("--topology.stages=2",))],
                         ids=["exact", "near", "one_codec", "scaled", "lowrank", "stages"])
def test_the_copier_not_the_original_is_refused_where_the_run_replays(tmp_path, monkeypatch, twin, extra):
    """Also where the copier names its codec as one spec, or sends the copy scaled up, so that the
    screen refuses its end on a second flag (norm_outlier, with 5 workers to make a centre): the
    forty-third session's review found that either spared its end the replay, and with it the
    conviction, while every member replayed the original every round. And in a PowerSGD run, whose
    warm start a replay cannot know: until the forty-fourth session both ends were refused there
    (replay.lowrank_distance now checks such a packet). And between pipelined workers, each stage
    copying its slice (check.pooled_copies: a copy of one slice is the worker's)."""
    root = twin_run(tmp_path, monkeypatch, twin, "--verify.replay_probability=0.01", *extra)
    recs = rounds_of(root)
    rest = ["accept"] * (len(recs[0]["verdicts"]) - 3)
    assert [r["verdicts"] for r in recs] == [["accept"] * 3 + rest, ["accept", "accept", "replay_mismatch"] + rest,
                                             ["accept", "accept", "banned"] + rest], [r["verdicts"] for r in recs]
    one = recs[1]["stages"][0]["evidence"] if "stages" in recs[1] else recs[1]["evidence"]  # (each stage's is the same)
    # the original: kept in and replayed by every member, whatever the draw (p = 0.01 drew nobody)
    assert one["1"]["copy_replay"]["copy_of"] == [2] and "first_mismatch" not in one["1"]["copy_replay"]
    assert one["2"]["copy_of"] == [1] and one["2"]["first_mismatch"] >= 0, one["2"]  # its replay does not reproduce it
    report = audit_run(root, replay=100)
    assert report.ok, report.first_failure


def test_without_replays_both_ends_of_a_copy_are_refused(tmp_path, monkeypatch):
    """Nothing can tell the original where the run replays nothing: both ends go, as before."""
    recs = rounds_of(twin_run(tmp_path, monkeypatch, "noise=0"))
    assert [r["verdicts"] for r in recs[1:]] == [["accept", "duplicate", "duplicate"]] * 2, [r["verdicts"] for r in recs]


def test_a_commitment_that_names_one_codec_for_every_tensor_is_replayed_against_its_packet(tmp_path, monkeypatch):
    """red_team.OneCodec trains honestly and sends its delta scaled by 2.5 under a commitment whose
    codec is one spec: until the forty-third session's review an exact replay then checked its
    trace alone (replay_codecs read no codecs), and it went in every round, the audit passing."""
    on_path(monkeypatch)
    run, _ = train(tiny("--topology.workers=3", "--train.rounds=2", "--train.inner_steps=4", "--verify.trace_every=2",
                        "--train.inner_state=reset", "--verify.replay_probability=1",
                        "--adversary.2=red_team:OneCodec:scale=2.5"), str(tmp_path / "run"), quiet=True)
    recs = rounds_of(run.root)
    assert [r["verdicts"][2] for r in recs] == ["replay_mismatch", "banned"], [r["verdicts"] for r in recs]
    # one past its trace (3 entries: 4 steps, one every 2): the trace replays, but the packet is not its end
    assert recs[0]["evidence"]["2"]["first_mismatch"] == 3, recs[0]["evidence"]
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_a_packet_under_a_codec_the_run_does_not_use_is_malformed(tmp_path, monkeypatch):
    """No honest worker of the run makes one (round.run_codecs: `[compress] codec`, or the adaptive
    ladder's rungs); as an end of a copy, one a replay cannot re-encode spared the copier its replay
    while every member replayed the original every round (the forty-third session's review)."""
    on_path(monkeypatch)
    run, _ = train(tiny("--topology.workers=3", "--train.rounds=2", "--train.inner_steps=4", "--verify.trace_every=2",
                        "--adversary.2=red_team:ForeignCodec"), str(tmp_path / "run"), quiet=True)
    recs = rounds_of(run.root)
    assert [r["verdicts"] for r in recs] == [["accept", "accept", "malformed"]] * 2, [r["verdicts"] for r in recs]
    assert recs[0]["evidence"]["2"] == {"codec_not_the_runs": "lowrank:rank=4"}
    report = audit_run(run.root)
    assert report.ok, report.first_failure
