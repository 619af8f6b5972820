"""Worker processes start from the forkserver (procs.py) or, where there is none, with spawn;
the run is the same either way."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, rounds_of, tiny

from veriloco import procs
from veriloco.run import train


def test_forkserver_and_spawn_runs_are_bit_identical(tmp_path, monkeypatch):
    cfg = tiny("--train.rounds=2", "--train.inner_steps=2")
    assert procs.START_METHOD == "forkserver"  # Linux: the fast path is the one CI takes
    train(cfg, str(tmp_path / "fork"), quiet=True)
    monkeypatch.setattr(procs, "START_METHOD", "spawn")  # the fallback where there is no forkserver
    train(cfg, str(tmp_path / "spawn"), quiet=True)
    a, b = rounds_of(tmp_path / "fork"), rounds_of(tmp_path / "spawn")
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


def test_the_launcher_imports_neither_pipelining_nor_dynamo_and_the_server_preloads_them(tmp_path):
    """A run's launching process stays light (~2.5 s less to start it): it imports torch's pipelining
    (and torch._dynamo, which that brings) only in the forkserver, which `warm` starts as the run
    is prepared, and building a model's structure on the meta device draws nothing that would
    import dynamo. The server holds both, so a worker constructing its optimizer (whose first
    construction imports dynamo) pays nothing."""
    code = f"""
import sys
from multiprocessing import forkserver
from veriloco import procs
from veriloco.config import load_config
from veriloco.model import build_meta, build_model
from veriloco.run import train

cfg = load_config({str(ROOT / "configs" / "tiny.toml")!r}, [])  # (every arch's meta build: tests/test_materialize.py)
meta, real = build_meta(cfg.model), build_model(cfg.model, 0)
assert [(k, p.shape) for k, p in meta.named_parameters()] == [(k, p.shape) for k, p in real.named_parameters()]
assert all(p.is_meta for p in meta.parameters())
assert "torch._dynamo" not in sys.modules and "torch.distributed.pipelining" not in sys.modules
cfg = load_config({str(ROOT / "configs" / "tiny.toml")!r}, ["--train.rounds=1", "--train.inner_steps=2"])
assert not procs._running()
procs.warm()
assert procs._running() and forkserver._forkserver._preload_modules == procs.PRELOAD
pid = forkserver._forkserver._forkserver_pid
train(cfg, {str(tmp_path / "run")!r}, quiet=True)
assert forkserver._forkserver._forkserver_pid == pid  # the run's workers came from the warmed server
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    assert len(rounds_of(tmp_path / "run")) == 1


def test_preloaded_modules_make_an_optimizer_without_importing():
    """What PRELOAD holds is what a worker's first optimizer needs: after those imports, building
    AdamW imports nothing more (were dynamo missing, it would cost every worker ~1 s)."""
    code = f"""
import sys
for name in {procs.PRELOAD!r}:
    __import__(name)
import torch
before = set(sys.modules)
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
print(sorted(set(sys.modules) - before))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout[-500:], done.stderr[-1000:])


def test_a_train_command_that_fails_stops_the_server_it_started(tmp_path):
    """`veriloco train` starts the workers' forkserver before it reads its config; a bad config must
    not leave it running (busy with its imports, it would hold the command's output open ~3 s), and
    is reported without importing torch."""
    code = f"""
import os, signal, sys, time
from multiprocessing import forkserver
from veriloco.cli import main

sys.argv = ["veriloco", "train", {str(tmp_path / "missing.toml")!r}]
try:
    main()
except SystemExit as e:
    assert e.code == 2, e.code
# a bad config is told before torch is imported (~1.5 s, and as long again to exit with it loaded)
assert "torch" not in sys.modules, "the one-line error waited for torch's import"
pid = forkserver._forkserver._forkserver_pid
assert pid is not None  # it was started
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        print("stopped")
        break
    time.sleep(0.05)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "stopped", (done.stdout[-500:], done.stderr[-1500:])
    assert "config file not found" in done.stderr


def test_a_failure_that_only_lost_its_peer_gives_way_to_the_one_that_caused_it(tmp_path):
    """The launcher reports the first worker it sees fail; when that one's error is only a
    collective that lost its peer, another worker's own error is the cause (below: a full disk)."""
    import pickle

    from torch.multiprocessing import ProcessRaisedException

    peer = "Traceback ...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5521. GLHF!"
    cause = "Traceback ...\nOSError: [Errno 28] No space left on device"
    files = [str(tmp_path / f"e{i}") for i in range(3)]
    (tmp_path / "e0").write_bytes(pickle.dumps(peer))
    (tmp_path / "e2").write_bytes(pickle.dumps(cause))  # process 1 wrote none (terminated)
    first = ProcessRaisedException(peer, 0, 123)
    assert procs.root_cause(first, files) == (2, cause)
    own = ProcessRaisedException(cause, 2, 125)
    assert procs.root_cause(own, files) is own  # a failure of its own is reported as it is
    (tmp_path / "e2").write_bytes(pickle.dumps(peer))
    assert procs.root_cause(first, files) is first  # nobody else said more
    # an error file is read as plain data only: a pickled object (a global) is no cause
    (tmp_path / "e2").write_bytes(pickle.dumps(ValueError("x")))
    assert procs.root_cause(first, files) is first


def test_a_worker_out_of_disk_space_is_the_error_reported_and_the_run_resumes(tmp_path):
    """On a 3 MB tmpfs, the run fails on the recorder's full disk: its line said `Connection closed
    by peer` (the other worker's failure, seen first); after the disk grows, the resume ends where
    the uninterrupted run does. Needs root to mount a tmpfs (skipped elsewhere)."""
    import json
    import os

    import pytest

    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        # ~0.7 MB a round: the 3 MB tmpfs fills in round 2 or 3, and 12 rounds would need ~8.5 MB, over 3x
        # what it holds (the remounted 64 MB holds them all)
        args = ["--train.rounds=12"]
        p = subprocess.run([sys.executable, "-m", "veriloco.cli", "train", str(ROOT / "configs" / "tiny.toml"), *args,
                            "--quiet", "--out", str(small / "r")], capture_output=True, text=True, timeout=300)
        assert p.returncode == 1
        last = p.stderr.splitlines()[-1]  # by hand, every time: "OSError: [Errno 28] No space left on device"
        assert last.startswith("veriloco: error: training failed: ") and "Connection closed" not in last, last
        assert "No space left on device" in last or "disk is full" in last, last  # (SQLite says the latter)
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        from veriloco.run import resume

        _, resumed = resume(str(small / "r"), quiet=True)
        _, whole = train(tiny(*args), str(tmp_path / "whole"), quiet=True)
        assert resumed["final_params_hash"] == whole["final_params_hash"]
        assert json.loads((small / "r" / "summary.json").read_text())["complete"]
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
