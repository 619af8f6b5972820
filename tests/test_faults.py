"""Faults: a worker that dies mid-run ends the run with a clear error, never a hang or a half-applied round."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.run import resume, train


def test_dead_worker_is_an_error_not_a_hang(tmp_path, monkeypatch):
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    cfg = tiny("--topology.workers=3", "--train.rounds=4", "--run.timeout_s=20", "--adversary.2=red_team:Dies:at=2")
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="exit code 9|exited|terminated"):
        train(cfg, str(tmp_path / "run"), quiet=True)
    assert time.perf_counter() - t0 < 120
    recs = rounds_of(tmp_path / "run")
    # round 2 never recorded: nothing half-applied. Round 1 is recorded once every worker's figures
    # of it are gathered, under round 2's first steps: worker 2 may die before its own have left
    # (then a resume does round 1 again)
    assert [r["round"] for r in recs] in ([0], [0, 1])
    assert audit_run(tmp_path / "run").ok  # what was recorded is whole and verifies


HASHED = ("params_hash", "aggregate_hash", "checkpoint", "packets", "train_loss", "eval_loss")


@pytest.mark.parametrize("delay", [0, 1])
def test_kill_9_of_every_process_then_resume_reproduces_the_uninterrupted_run(tmp_path, delay):
    """Crash of everything: SIGKILL to the launcher and all its workers in the middle of a round,
    then `--resume` continues from the last committed round, with the same losses and hashes.
    With delay 1 the killed run was also part-way into the round after it (whose exchange
    overlaps): the resume redoes that round from the G before the last committed one."""
    import os
    import signal
    import subprocess

    from conftest import ROOT, TINY

    from veriloco.run import resume

    overrides = ["--train.rounds=6", "--train.inner_steps=10", f"--outer.delay={delay}", "--outer.momentum=0.5"]
    train(tiny(*overrides), str(tmp_path / "a"), quiet=True)
    b = tmp_path / "b"
    cli = [sys.executable, "-m", "veriloco.cli", "train"]
    p = subprocess.Popen([*cli, str(TINY), *overrides, "--out", str(b), "--quiet"], cwd=ROOT,
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not ((b / "rounds.jsonl").exists() and len(rounds_of(b)) >= 2):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended or stalled before round 2"
        time.sleep(0.02)
    time.sleep(0.1)  # into the next round's inner steps
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    killed_at = len(rounds_of(b))
    assert 2 <= killed_at < 6 and not (b / "summary.json").exists()
    resume(str(b), quiet=True)  # in this process (the command's --resume: tests/test_engine.py)
    ra, rb = rounds_of(tmp_path / "a"), rounds_of(b)
    assert len(rb) == 6
    for x, y in zip(ra, rb, strict=True):
        assert {k: x[k] for k in HASHED} == {k: y[k] for k in HASHED}
    assert audit_run(b).ok


def test_crash_between_ledger_append_and_record_resumes_cleanly(tmp_path):
    """The ledger entry of round r is written before its line in rounds.jsonl: a crash in between
    leaves the ledger one ahead. The redone round must reproduce that entry byte for byte."""
    from veriloco.run import resume

    run, _ = train(tiny("--train.rounds=4"), str(tmp_path / "r"), quiet=True, stop_after=3)
    lines = (run.root / "rounds.jsonl").read_text().splitlines(keepends=True)
    (run.root / "rounds.jsonl").write_text("".join(lines[:2]))  # round 2's record lost, its entry kept
    resume(str(run.root), quiet=True)
    assert [r["round"] for r in rounds_of(run.root)] == [0, 1, 2, 3]
    report = audit_run(run.root)
    assert report.ok, report.first_failure


# Workers that ran on after the signal fail the test whatever ROUNDS is: still running, they record
# a round during the watch (2.5 s after the launcher's exit; 1 s after Ctrl-C's); quicker, they end
# the run before the watch starts (`done < ROUNDS`) or during it. ROUNDS only has to leave the
# signal time to land before the run ends: it is sent once 2 rounds are recorded, and a round takes
# ~0.1 s here under the suite (~0.07 s alone), so the ~21 rounds left last over 1 s even at 0.05 s
# a round (a machine twice as fast), against the milliseconds a signal takes. (80 rounds made the
# uninterrupted run and each resume ~8 s.)
ROUNDS = 24
ARGS = [f"--train.rounds={ROUNDS}", "--train.inner_steps=3", "--train.eval_every=50"]


def _signalled_run(run: Path, send, **popen) -> tuple[int, list[str]]:
    """`veriloco train` of ARGS into `run` in its own session; once 2 rounds are recorded,
    `send(pid)`; its exit code and stderr's non-blank lines."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-m", "veriloco.cli", "train", str(Path(__file__).parents[1] / "configs" / "tiny.toml"),
                          *ARGS, "--quiet", "--out", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **popen)
    deadline = time.monotonic() + 120
    while not ((run / "rounds.jsonl").exists() and len(rounds_of(run)) >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    send(p.pid)
    _, err = p.communicate(timeout=60)
    return p.returncode, [ln for ln in err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> str:
    """The final params hash of the uninterrupted run of ARGS (trained once for the tests below)."""
    _, whole = train(tiny(*ARGS), str(tmp_path_factory.mktemp("whole") / "run"), quiet=True)
    return whole["final_params_hash"]


def _nothing_runs_on_and_it_resumes_to_the_whole_run(run: Path, whole_hash: str, before_s: float, watch_s: float) -> None:
    """After `before_s`, no round is recorded during `watch_s`; the resume ends at the whole run's params."""
    time.sleep(before_s)
    done = len(rounds_of(run))
    assert 2 <= done < ROUNDS
    time.sleep(watch_s)
    assert len(rounds_of(run)) == done  # no worker runs on
    _, resumed = resume(str(run), quiet=True)
    assert resumed["complete"] and resumed["final_params_hash"] == whole_hash


def test_ctrl_c_ends_every_process_in_one_line_and_the_run_resumes_to_the_uninterrupted_one(tmp_path, whole_run):
    """SIGINT to the terminal's whole process group, as Ctrl-C sends it, once a round is recorded:
    the launcher ends its workers and exits 130 with one line naming the resume. Before, each worker
    printed a KeyboardInterrupt from wherever it landed and the launcher nothing. Nothing writes to
    the run afterwards, and the resume reaches the uninterrupted run's params."""
    import os
    import signal

    run = tmp_path / "run"
    code, err = _signalled_run(run, lambda pid: os.killpg(pid, signal.SIGINT),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert code == 130, err
    assert err == [f"veriloco: interrupted; continue with `veriloco train --resume {run}`"], err
    _nothing_runs_on_and_it_resumes_to_the_whole_run(run, whole_run, 0.0, 1.0)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_launcher_killed_alone_takes_its_workers_with_it(tmp_path, sig, whole_run):
    """A signal to the launcher alone, as a scheduler preempting a job sends SIGTERM (and later
    SIGKILL): the workers trained on without it, into the run directory (by hand: 94 rounds
    recorded between 3 s and 6 s after SIGTERM), and a resume started then raced them (its audit failed: a ledger entry with no
    round record). Now SIGTERM is handled as Ctrl-C is, exit 143 and one line naming the resume,
    and after SIGKILL each worker sees its launcher gone and exits. Either way nothing writes to
    the run afterwards, and the resume reaches the uninterrupted run's params."""
    import os
    import signal

    run = tmp_path / "run"
    code, err = _signalled_run(run, lambda pid: os.kill(pid, getattr(signal, sig)))
    if sig == "SIGTERM":
        assert code == 143, err
        assert err == [f"veriloco: terminated (SIGTERM); continue with `veriloco train --resume {run}`"], err
    else:
        assert code == -signal.SIGKILL
    # the workers' watch threads see the launcher's end within a scheduling tick
    _nothing_runs_on_and_it_resumes_to_the_whole_run(run, whole_run, 1.0, 1.5)
