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


def twin_run(tmp_path, monkeypatch, noise: str, *overrides: str) -> Path:
    """Worker 1 trains honestly and leaks its round to worker 2 (red_team.Leaks), which sends it as
    its own from round 1 on (red_team.Twin)."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    leak = tmp_path / "leak"
    leak.mkdir()
    cfg = tiny(*COMMON, *overrides, f"--adversary.1=red_team:Leaks:dir={leak}",
               f"--adversary.2=red_team:Twin:dir={leak},at=1,noise={noise}")
    run, _ = train(cfg, str(tmp_path / "run"), quiet=True)
    return run.root


@pytest.mark.parametrize("noise", ["0", "0.001"], ids=["exact", "near"])
def test_the_copier_not_the_original_is_refused_where_the_run_replays(tmp_path, monkeypatch, noise):
    root = twin_run(tmp_path, monkeypatch, noise, "--verify.replay_probability=0.01")
    recs = rounds_of(root)
    assert [r["verdicts"] for r in recs] == [["accept"] * 3, ["accept", "accept", "replay_mismatch"],
                                             ["accept", "accept", "banned"]], [r["verdicts"] for r in recs]
    one = recs[1]["evidence"]
    # the original: kept in and replayed by every member, whatever the draw (p = 0.01 drew nobody)
    assert one["1"]["copy_replay"]["copy_of"] == [2] and "first_mismatch" not in one["1"]["copy_replay"]
    assert one["2"]["copy_of"] == [1] and one["2"]["first_mismatch"] >= 0, one["2"]  # its replay does not reproduce it
    report = audit_run(root, replay=100)
    assert report.ok, report.first_failure


def test_without_replays_both_ends_of_a_copy_are_refused(tmp_path, monkeypatch):
    """Nothing can tell the original where the run replays nothing: both ends go, as before."""
    recs = rounds_of(twin_run(tmp_path, monkeypatch, "0"))
    assert [r["verdicts"] for r in recs[1:]] == [["accept", "duplicate", "duplicate"]] * 2, [r["verdicts"] for r in recs]
