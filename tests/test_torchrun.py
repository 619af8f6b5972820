"""`torchrun ... -m veriloco.run CONFIG --out DIR`: the static engine under torchrun, on two
"machines" (two torchrun nodes on this one, each with its own run directory, as the README's
several-machines recipe has it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import TINY, rounds_of, tiny

from veriloco.run import free_port, train


def _two_nodes(tmp_path: Path, extra: list[list[str]]) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=t",
                               "-m", "veriloco.run", str(TINY), "--out", str(tmp_path / f"node{n}"), *extra[n]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return out


def test_two_torchrun_nodes_train_what_veriloco_train_does(tmp_path):
    nodes = _two_nodes(tmp_path, [[], []])
    assert [p.returncode for p in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]
    _, whole = train(tiny(), str(tmp_path / "one"), quiet=True)
    assert [r["params_hash"] for r in rounds_of(tmp_path / "node0")] == [r["params_hash"] for r in rounds_of(tmp_path / "one")]
    assert json.loads((tmp_path / "node0" / "summary.json").read_text())["final_params_hash"] == whole["final_params_hash"]


def test_a_torchrun_node_with_another_config_stops_the_run_at_once(tmp_path):
    """Each node prepares its own run directory; one with another config (or corpus, veriloco or
    torch) has another run id. Its workers' commitments were refused as another run's, every
    round; the workers now compare run ids when they start, and both nodes stop with the reason."""
    nodes = _two_nodes(tmp_path, [[], ["--train.lr=0.002"]])
    assert [p.returncode for p in nodes] == [1, 1]
    for p in nodes:
        assert "RuntimeError: the workers' run manifests differ (member 1 of the stage's group has another run id " \
               "than member 0)" in p.stderr
    assert not (tmp_path / "node0" / "rounds.jsonl").exists() or not rounds_of(tmp_path / "node0")
