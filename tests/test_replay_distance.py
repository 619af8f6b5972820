"""`[verify] replay_match = "distance"`: replay the whole round, compare deltas within a tolerance.

On CPU an honest replay reproduces the committed delta exactly (distance 0; with PowerSGD tensors
their fp16 rounding: tests/test_lowrank_replay.py); a lazy worker
lands far above the tolerance and is rejected as replay_mismatch with its distance as evidence;
the offline audit recomputes the same verdicts, and a forged verdict fails it. No GPU here:
nondeterministic kernels are simulated (and measured) in bench/verify.py, not in these tests.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, rounds_of, tiny
from typer.testing import CliRunner

from veriloco.audit import audit_run
from veriloco.cli import app
from veriloco.config import ConfigError
from veriloco.ledger import SqliteLedger
from veriloco.ledger.entry import ZERO_HASH, entry_hash
from veriloco.run import train
from veriloco.verify.replay import as_committed, relative_distance

DISTANCE = ("--train.rounds=2", "--train.inner_steps=6", "--verify.trace_every=6", "--train.inner_state=reset",
            "--verify.replay_probability=1.0", "--verify.replay_match=distance")


# ---- the distance itself --------------------------------------------------------------------------

def test_relative_distance_is_relative_l2_over_all_tensors():
    c = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # ||c|| = 5
    assert relative_distance(c, c) == 0.0
    r = {"a": torch.tensor([3.0, 1.0]), "b": torch.tensor([[4.0]])}
    assert relative_distance(r, c) == pytest.approx(1 / 5, rel=1e-12)
    # a worker cannot make any delta pass by sending an ever larger one: the distance tends to 1
    assert relative_distance(r, {k: 1e6 * v for k, v in c.items()}) == pytest.approx(1.0, rel=1e-5)
    assert relative_distance(r, {k: torch.zeros_like(v) for k, v in c.items()}) == math.inf
    assert relative_distance(r, {"a": torch.tensor([float("nan"), 0.0]), "b": c["b"]}) == math.inf


def test_replayed_delta_is_encoded_as_the_packet_was():
    g = torch.Generator().manual_seed(0)
    d = {"w": torch.randn(8, 64, generator=g), "b": torch.randn(64, generator=g)}
    assert all(torch.equal(as_committed(d, {"w": "fp32", "b": "fp32"})[k], d[k]) for k in d)
    q = as_committed(d, {"w": "int8:block=64", "b": "int8:block=64"})
    assert 0 < relative_distance(q, d) < 0.01  # int8's rounding, reproduced exactly by the auditor
    assert relative_distance(as_committed(d, {"w": "int8:block=64", "b": "int8:block=64"}), q) == 0.0


# ---- config: what distance mode cannot do is refused up front ---------------------------------------

@pytest.mark.parametrize("extra, words", [
    (("--verify.replay_match=fuzzy",), "verify.replay_match must be 'exact' or 'distance'"),
    (("--verify.replay_tolerance=0",), "verify.replay_tolerance must be in (0, 1)"),
    (("--verify.replay_tolerance=1.0",), "verify.replay_tolerance must be in (0, 1)"),
    (("--compress.error_feedback=true",), "needs compress.error_feedback = false"),
])
def test_unsupported_distance_configs_are_config_errors(extra, words):
    with pytest.raises(ConfigError) as e:
        tiny(*DISTANCE, *extra)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_lossy_codecs_and_ladders_are_allowed():
    """PowerSGD too since the forty-fourth session (replay.lowrank_parts); before, it and the
    default adaptive ladder, which holds it, were refused."""
    tiny(*DISTANCE, "--compress.codec=int8:block=64")
    tiny(*DISTANCE, "--compress.codec=adaptive", "--compress.ladder=fp32;int8:block=64;topk:bits=8,density=0.01")
    tiny(*DISTANCE, "--compress.codec=lowrank:rank=4")
    tiny(*DISTANCE, "--compress.codec=adaptive")
    tiny("--compress.error_feedback=true", "--verify.replay_match=distance")  # no replay: nothing to refuse


def test_cli_bad_replay_match_exits_2_with_one_line(tmp_path):
    res = CliRunner().invoke(app, ["train", str(TINY), "--verify.replay_match=fuzzy", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert "verify.replay_match must be 'exact' or 'distance'" in res.output
    assert not (tmp_path / "x").exists()


# ---- a real run: 4 workers, worker 1 lazy, every round replayed ------------------------------------

@pytest.fixture(scope="module")
def lazy_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("distance") / "run"
    # ban = false: the lazy worker is judged (and replayed) again in round 1, not just refused
    train(tiny(*DISTANCE, "--topology.workers=4", "--adversary.1=lazy:skip=0.5", "--compress.codec=int8:block=64",
               "--verify.aggregator=trimmed_mean", "--verify.ban=false"), str(d), quiet=True)
    return d


def test_honest_workers_replay_at_distance_zero_and_are_accepted(lazy_run):
    recs = rounds_of(lazy_run)
    assert len(recs) == 2
    for rec in recs:
        assert [rec["verdicts"][j] for j in (0, 2, 3)] == ["accept"] * 3
        for j in (0, 2, 3):  # CPU kernels are deterministic: the replay is the packet, bit for bit
            ev = rec["evidence"][str(j)]["replayed"]
            assert ev["distance"] == 0.0 and ev["auditor"] != j


def test_lazy_worker_rejected_with_its_distance_as_evidence(lazy_run):
    for rec in rounds_of(lazy_run):
        assert rec["verdicts"][1] == "replay_mismatch"
        ev = rec["evidence"]["1"]
        assert ev["tolerance"] == tiny().verify.replay_tolerance
        assert ev["distance"] > 10 * ev["tolerance"], ev  # half its steps skipped: far out


def test_audit_recomputes_the_distance_verdicts(lazy_run):
    report = audit_run(lazy_run, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 2 * 4  # every worker, every round


def _forge_verdict(run: Path, r: int, j: int, verdict: str) -> None:
    """Rewrite round r's verdict of worker j in the ledger and rebuild the whole chain (hashes,
    Merkle roots) and rounds.jsonl around it, as a forger with write access would."""
    import json

    path = run / "ledger.sqlite"
    with SqliteLedger(path) as old:
        entries = old.entries()
    path.unlink()
    recs, prev = rounds_of(run), ZERO_HASH
    with SqliteLedger(path) as new:
        for i, e in enumerate(entries):
            if i == r:
                e["predicate"]["commitments"][j]["verdict"] = verdict
                recs[i]["verdicts"][j] = verdict
            e["predicate"]["prev_entry_hash"] = prev
            new.append(e)
            prev = recs[i]["entry"] = entry_hash(e)
    (run / "rounds.jsonl").write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in recs))


@pytest.mark.parametrize("worker, forged, failure", [
    # the lazy worker's rejection erased: the audit's replay fails, and it names the auditor
    (1, "accept", "round 1: worker 1's replay fails, but the round accepted it: its auditor, worker"),
    (2, "replay_mismatch", "round 1: worker 2's verdict recomputes to 'accept'"),  # an honest worker framed
])
def test_forged_distance_verdict_fails_the_audit(lazy_run, tmp_path, worker, forged, failure):
    run = Path(shutil.copytree(lazy_run, tmp_path / "run"))
    _forge_verdict(run, 1, worker, forged)
    report = audit_run(run, replay=100)
    assert not report.ok
    assert report.first_failure.startswith(failure), report.first_failure
