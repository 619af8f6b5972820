"""What `veriloco train --resume` refuses, and what it finishes, found by a review that killed and
edited stopped runs (thirty-eighth session): each case here went wrong before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli, rounds_of, tiny

from veriloco.run import train

ROUNDS = 4


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A delay-1 run of 4 rounds stopped after 2 (never modified)."""
    d = tmp_path_factory.mktemp("resume") / "run"
    train(tiny(f"--train.rounds={ROUNDS}", "--outer.delay=1"), str(d), quiet=True, stop_after=2)
    return d


@pytest.fixture
def run(stopped, tmp_path) -> Path:
    return Path(shutil.copytree(stopped, tmp_path / "run"))


def test_a_resume_with_no_round_left_to_run_does_nothing(run, monkeypatch, capsys):
    """`--stop-after 2` of a run with 2 rounds recorded: with delay 1 its workers ran one round
    anyway and failed (UnboundLocalError, exit 1)."""
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet", "--stop-after", "2")
    assert code == 0, lines
    assert len(rounds_of(run)) == 2


def test_a_foreign_private_state_is_refused_before_anything_starts(run, monkeypatch, capsys):
    """Worker 0's state put where worker 1's goes (an operator's copy): the resume ran on it and
    its run differed from the uninterrupted one from then on, and the audit passed."""
    shutil.copy(run / "workers" / "0" / "state-1.safetensors", run / "workers" / "1" / "state-1.safetensors")
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 2 and len(lines) == 1, lines
    assert "is the private state of run" in lines[0] and "process 0, round 1, not of run" in lines[0]
    assert "process 1, round 1" in lines[0] and len(rounds_of(run)) == 2


def test_records_that_are_not_the_ledgers_are_refused(run, monkeypatch, capsys):
    """The last record given the round before's checkpoint and params hash: the resume started
    from them (and the audit then failed); the ledger holds what each round made."""
    records = rounds_of(run)
    records[-1]["checkpoint"], records[-1]["params_hash"] = records[-2]["checkpoint"], records[-2]["params_hash"]
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 2 and lines == [f"veriloco: error: {run}/rounds.jsonl: round 1's checkpoint or params hash is not "
                                   "its ledger entry's"], lines


def test_every_process_keeps_the_states_a_resume_needs(run, monkeypatch, capsys):
    """With delay 1 a process other than the recorder can finish round r while the records end at
    r - 2 (a recorder slow to write them), and it deleted state r - 2, which a resume after a kill
    then needs ("process 1 has no saved state for round ..."): it keeps three, the recorder two."""
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, lines
    kept = {p: sorted(f.name for f in (run / "workers" / p).glob("state-*")) for p in ("0", "1")}
    assert kept == {"0": ["state-2.safetensors", "state-3.safetensors"],
                    "1": ["state-1.safetensors", "state-2.safetensors", "state-3.safetensors"]}, kept


def test_a_run_stopped_after_its_signature_is_finished_by_resume(run, monkeypatch, capsys):
    """Killed between the signed manifest and the summary (its last act's last steps): the resume
    said the run was complete, and the run stayed unpublished (an audit from its store failed)."""
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, lines
    (run / "summary.json").unlink()
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, lines
    assert json.loads((run / "summary.json").read_text())["complete"] is True
    code, lines, out = cli(monkeypatch, capsys, "audit", "--ledger", str(run / "ledger.sqlite"), "--store", str(run / "store"))
    assert code == 0 and out.startswith(f"audit ok: {ROUNDS} rounds"), (lines, out)
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 2 and lines == [f"veriloco: error: {run} is already complete ({ROUNDS}/{ROUNDS} rounds)"]


def test_a_metrics_line_lost_to_a_kill_is_rebuilt_by_resume(run, monkeypatch, capsys):
    """The recorder appends a round's record, then its metrics line: a kill between the two left
    metrics.jsonl a round short for good (plots and the report skip it). The resume rebuilds it
    from the record, marked, with the seconds a resumed run counts from (the rounds' summed)."""
    recs = rounds_of(run)
    metrics = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(recs) == len(metrics) == 2
    (run / "metrics.jsonl").write_text(metrics[0])  # killed after round 1's record
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, lines
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in after] == list(range(ROUNDS))
    assert after[0] == json.loads(metrics[0]) and all("rebuilt" not in m for m in after[2:])
    lost, rebuilt = json.loads(metrics[1]), after[1]
    assert rebuilt.pop("rebuilt") is True
    assert rebuilt.keys() == lost.keys()
    assert {k: rebuilt[k] for k in ("round", "eval_loss", "train_loss", "tokens", "utilisation")} == \
        {k: lost[k] for k in ("round", "eval_loss", "train_loss", "tokens", "utilisation")}
    assert rebuilt["elapsed_s"] == round(recs[0]["round_s"] + recs[1]["round_s"], 3)


def test_a_metrics_line_of_the_last_round_is_rebuilt_too(run, monkeypatch, capsys):
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, lines
    (run / "summary.json").unlink()  # killed after the last record, before its metrics line and the summary
    metrics = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(metrics[:-1]))
    code, lines, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, lines
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in after] == list(range(ROUNDS)) and after[-1]["rebuilt"] is True


def test_the_rebuild_is_best_effort_and_keeps_every_line(tmp_path):
    """A record it cannot read stops the rebuild, not the resume; lines without a round, and two lines
    of one round, stay as they were (the review's cases)."""
    from veriloco.records import RunDir

    run = RunDir(tmp_path)
    good = {"round": 0, "tokens": 10, "round_s": 1.0, "inner_s": [0.5], "train_loss": [2.0], "eval_loss": None}
    for rec in (good, {"round": 1, "tokens": None}, {"round": 2, "tokens": 5, "round_s": 0.0, "inner_s": [0.1],
                                                      "train_loss": [1.0], "eval_loss": None}):
        run.append_round(rec)
    for line in ({"note": "no round"}, {"round": 1, "a": 1}, {"round": 1, "a": 2}):
        run.append_metrics(line)
    run.truncate_to(3)
    assert run.metrics() == [{"note": "no round"},
                             {"round": 0, "eval_loss": None, "train_loss": [2.0], "tokens": 10, "elapsed_s": 1.0,
                              "tokens_per_s": 10.0, "utilisation": 0.5, "rebuilt": True},
                             {"round": 1, "a": 1}, {"round": 1, "a": 2}]
