"""Adversaries against the real engine: 5 workers, some attacking, the survivors' verdicts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import TINY, cli, rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import train

BASE = ("--topology.workers=5", "--train.rounds=3", "--train.inner_steps=6", "--verify.trace_every=3",
        "--train.inner_state=reset", "--verify.replay_probability=1.0", "--verify.aggregator=trimmed_mean")


def verdicts_of(run_dir: Path, worker: int) -> list[str]:
    return [r["verdicts"][worker] for r in rounds_of(run_dir)]


def test_lazy_forged_malformed_rejected_every_round(tmp_path):
    # 2 segments per round; lazy trains the first, and every drawn replay runs the whole round
    # ([verify] replay_extent = "round", the default), so it reaches the skipped steps
    run, summary = train(tiny(*BASE, "--adversary.1=lazy:skip=0.25",
                              "--adversary.2=forged_signature", "--adversary.3=malformed"),
                         str(tmp_path / "a"), quiet=True)
    # caught by replay in round 0, then banned: a replay mismatch proves it cheated
    assert verdicts_of(run.root, 1) == ["replay_mismatch", "banned", "banned"]
    assert rounds_of(run.root)[0].get("banned") == [1]
    assert verdicts_of(run.root, 2) == ["bad_signature"] * 3
    assert verdicts_of(run.root, 3) == ["malformed"] * 3
    assert verdicts_of(run.root, 0) == verdicts_of(run.root, 4) == ["accept"] * 3  # no honest rejection
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    report = audit_run(run.root, replay=100)  # the offline audit agrees, replays included
    assert report.ok, report.first_failure
    assert report.checked["replays"] > 0


def test_equivocate_replay_noise_and_user_class(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)  # spawned workers import the user's attacker module
    sys.path.insert(0, tests_dir)
    run, _ = train(tiny(*BASE, "--adversary.1=equivocate", "--adversary.2=replay", "--adversary.3=noise",
                        "--adversary.4=red_team:Halve:factor=0.01"), str(tmp_path / "b"), quiet=True)
    recs = rounds_of(run.root)
    assert verdicts_of(run.root, 1) == ["equivocation", "banned", "banned"]
    assert recs[0]["evidence"]["1"]["commitments"][0]["signature"] != recs[0]["evidence"]["1"]["commitments"][1]["signature"]
    replayed = verdicts_of(run.root, 2)  # resends its round-0 packet from round 1 on
    assert replayed[1] == "duplicate" and replayed[2] != "accept"  # (round 2: replay catches it)
    assert all(v != "accept" for v in verdicts_of(run.root, 3))  # noise: no training, caught every round
    # the user's class ran and was caught: a 0.01-scaled delta is a norm outlier while the screen has
    # 3+ candidates (round 0 always; later, with 4 attackers of 5 and two of them banned, it may not)
    assert verdicts_of(run.root, 4)[0] == "norm_outlier"
    assert verdicts_of(run.root, 0) == ["accept"] * 3
    assert audit_run(run.root).ok


def test_bad_adversary_spec_is_a_config_error():
    from veriloco.config import ConfigError

    with pytest.raises(ConfigError, match="unknown adversary"):
        tiny("--adversary.1=nonsense")
    with pytest.raises(ConfigError, match="cannot load"):
        tiny("--adversary.1=no.such.module:Class")
    assert json.dumps(tiny("--adversary.1=lazy:skip=0.3").adversary) == '{"1": "lazy:skip=0.3"}'


def test_a_resent_packet_is_refused_every_round_without_replays(tmp_path):
    """The replay attacker resends the same bytes every round; with no replays drawn, the screen
    alone must refuse it each time, though its previous copy was itself refused (before, only the
    previous round's accepted packets counted, and it got through every other round)."""
    run, _ = train(tiny("--topology.workers=4", "--train.rounds=4", "--adversary.1=replay"), str(tmp_path / "r"),
                   quiet=True)
    assert verdicts_of(run.root, 1) == ["accept", "duplicate", "duplicate", "duplicate"]
    assert all(r["verdicts"][j] == "accept" for r in rounds_of(run.root) for j in (0, 2, 3))
    report = audit_run(run.root)
    assert report.ok, report.first_failure


def test_with_the_update_a_round_late_stale_and_copy_are_screened_against_the_round_before(tmp_path):
    """Delay 1, no overlap, no replays: a worker sends round r before round r-1 is applied, so stale
    and copy resubmit round r-2's deltas; the screen compares with them too (`earlier`), every
    round. A resumed run screens, and its attackers attack, as the uninterrupted one did: the
    copier's and the noise sender's draws are per round (Adversary.rng) and in name order."""
    from test_engine import HASHED, uninterrupted_and_resumed

    cfg = tiny("--topology.workers=5", "--train.rounds=4", "--outer.delay=1", "--outer.momentum=0.5",
               "--adversary.1=stale", "--adversary.3=copy", "--adversary.4=noise")
    a, _ = uninterrupted_and_resumed(cfg, tmp_path, (*HASHED, "verdicts", "evidence"))
    assert [r["verdicts"][1] for r in a][2:] == [r["verdicts"][3] for r in a][2:] == ["near_duplicate"] * 2
    assert "near_duplicate_of_earlier_mean" in a[2]["evidence"]["1"]
    assert "near_duplicate_of_earlier" in a[2]["evidence"]["3"]
    assert all(r["verdicts"][j] == "accept" for r in a for j in (0, 2))
    for run in ("a", "b"):
        report = audit_run(tmp_path / run)
        assert report.ok, report.first_failure


def test_lazy_disguises_its_short_delta_as_asked():
    """scale=previous: last round's median accepted norm; steps: its own norm / (1 - skip);
    none: as trained. A scale it does not know is a config error."""
    import torch

    from veriloco.config import ConfigError
    from veriloco.verify.adversary import View, load_adversary

    delta = {"w": torch.full((4,), 0.5)}  # norm 1
    view = View(world=4, previous_deltas={j: {"w": torch.full((4,), 0.5 * n)} for j, n in enumerate((2.0, 3.0, 4.0))})

    def norm(spec: str, v: View) -> float:
        out = load_adversary(spec, 1, 0).delta(3, delta, v)
        assert torch.allclose(out["w"] / out["w"].norm(), delta["w"])  # the direction it trained
        return float(out["w"].norm())

    assert norm("lazy:skip=0.25", view) == pytest.approx(3.0)
    assert norm("lazy:skip=0.25,scale=previous", View(world=4)) == pytest.approx(1 / 0.75)  # round 0: nothing older
    assert norm("lazy:skip=0.25,scale=steps", view) == pytest.approx(1 / 0.75)
    assert norm("lazy:skip=0.5,scale=none", view) == pytest.approx(1.0)
    assert load_adversary("lazy:skip=0.25", 1, 0).inner_steps(0, 20) == 15
    with pytest.raises(ConfigError, match="lazy: scale must be one of previous, steps, none"):
        tiny("--adversary.1=lazy:scale=big")
    with pytest.raises(ConfigError, match=r"skim: skip must be in \[0, 1\), got 1.0"):
        tiny("--adversary.1=skim:skip=1")


@pytest.mark.parametrize("spec, needle", [
    # each of these ran, silently, as the attack with its defaults (thirty-fourth session)
    ("lazy:skp=0.25", "lazy: unknown parameter 'skp'; it takes scale, skip"),
    ("lazy:skip=2", "lazy: skip must be in [0, 1), got 2.0"),
    ("lazy:skip=-0.25", "lazy: skip must be in [0, 1), got -0.25"),
    ("noise:scale=3", "noise: unknown parameter 'scale'; it takes none"),
    ("scaled:factor=abc", "scaled: factor must be a number, got 'abc'"),
    ("scaled:factor=nan", "scaled: factor must be a number, got nan"),  # failed the run with exit 1
    ("copy:noise=-1", "copy: noise must be a number >= 0, got -1.0"),
    ("alie:z=inf", "alie: z must be a number, got inf"),
    ("ipm:eps=0.5", "ipm: unknown parameter 'eps'; it takes epsilon"),
    ("sign_flip:factor=2", "sign_flip: unknown parameter 'factor'; it takes none"),
])
def test_a_built_in_attacker_s_parameters_are_checked_when_the_config_is_read(spec, needle, monkeypatch, capsys,
                                                                              tmp_path):
    from veriloco.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny(f"--adversary.1={spec}")
    assert str(e.value) == f"adversary.1: {needle}"
    code, lines, _ = cli(monkeypatch, capsys, "train", str(TINY), f"--adversary.1={spec}", "--out", str(tmp_path / "r"))
    assert code == 2 and lines == [f"veriloco: error: adversary.1: {needle}"] and not (tmp_path / "r").exists()


def test_an_attacker_of_one_s_own_takes_any_parameters_unless_it_declares_them():
    from veriloco.verify.adversary import Adversary, load_adversary, real

    assert load_adversary("red_team:SlowRounds:seconds=0.5,parity=1", 1, 0).params == {"seconds": "0.5", "parity": "1"}

    class Declared(Adversary):
        kind = "declared"
        PARAMS = {"rate": real(lambda x: x > 0, "a number > 0")}

    assert Declared(1, 0, rate="2").params == {"rate": "2"}
    with pytest.raises(ValueError, match="declared: rate must be a number > 0, got 0.0"):
        Declared(1, 0, rate="0")
    with pytest.raises(ValueError, match="declared: unknown parameter 'rat'; it takes rate"):
        Declared(1, 0, rat="2")
    # a subclass of a built-in inherits its PARAMS, and the refusal says how to take more
    from veriloco.verify.adversary import Lazy

    class Lazier(Lazy):
        pass

    assert Lazier(1, 0, skip="0.5").params == {"skip": "0.5"}
    with pytest.raises(ValueError) as e:
        Lazier(1, 0, mode="tail")
    assert str(e.value) == ("lazy: unknown parameter 'mode'; it takes scale, skip (Lazier inherits Lazy's PARAMS: a "
                            "subclass that takes more declares its own, e.g. PARAMS = {**Lazy.PARAMS, 'mode': real()}, "
                            "or None for any)")


def test_skim_passes_the_screens_and_only_a_replay_catches_it(tmp_path):
    """A worker that trains on half of every batch sends a delta trained on its own data: the
    screens (loss gain included) accept it; a replay on the whole batches convicts it."""
    base = ("--topology.workers=4", "--train.rounds=3", "--train.inner_steps=6", "--verify.trace_every=3",
            "--train.inner_state=reset", "--verify.loss_gain_batches=1", "--adversary.1=skim")
    run, _ = train(tiny(*base), str(tmp_path / "screens"), quiet=True)
    assert all(v == "accept" for r in rounds_of(run.root) for v in r["verdicts"])  # no replay: it passes
    run, _ = train(tiny(*base, "--verify.replay_probability=1.0"), str(tmp_path / "replayed"), quiet=True)
    assert verdicts_of(run.root, 1) == ["replay_mismatch", "banned", "banned"]
    assert all(verdicts_of(run.root, j) == ["accept"] * 3 for j in (0, 2, 3))
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
