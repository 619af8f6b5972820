"""`torchrun ... -m veriloco.run CONFIG --out DIR`: the static engine under torchrun, on two
"machines" (two torchrun nodes on this one, each with its own run directory, as the README's
several-machines recipe has it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, TINY, cli, rounds_of, tiny

from veriloco.run import free_port, train


def _two_nodes(tmp_path: Path, extra: list[list[str]], cwd: list[Path] | None = None) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=t",
                               "-m", "veriloco.run", str(TINY), "--out", str(tmp_path / f"node{n}"), *extra[n]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd[n] if cwd else None)
             for n in range(2)]
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


def test_parties_that_hold_only_their_own_private_key_train_together(tmp_path, monkeypatch, capsys):
    """Among parties each makes its own key (`veriloco keygen --worker W`) and hands out the .pub:
    a machine's key_dir holds every worker's .pub and only its own workers' .key (the same
    relative path on each machine). Two torchrun nodes train with that, and the run audits with
    the two parties' keys admitted. A machine without the private key of a worker it would run
    is refused in one line, exit 2, before it writes anything (it failed in the worker, exit 1,
    after the run directory was made)."""
    from veriloco.audit import audit_run
    from veriloco.verify.identity import load_private_key, public_key_hex

    made = []
    for n in range(2):
        code, _, out = cli(monkeypatch, capsys, "keygen", "--out", str(tmp_path / f"made{n}"), "--worker", str(n))
        assert code == 0 and "hand out" in out and sorted(p.name for p in (tmp_path / f"made{n}").iterdir()) == \
            [f"worker-{n}.key", f"worker-{n}.pub"]
        made.append(tmp_path / f"made{n}")
    homes = [tmp_path / "A", tmp_path / "B"]
    for n, home in enumerate(homes):
        (home / "keys").mkdir(parents=True)
        for m in range(2):
            (home / "keys" / f"worker-{m}.pub").write_bytes((made[m] / f"worker-{m}.pub").read_bytes())
        (home / "keys" / f"worker-{n}.key").write_bytes((made[n] / f"worker-{n}.key").read_bytes())
    nodes = _two_nodes(tmp_path, [["--verify.key_dir=keys"]] * 2, homes)
    assert [p.returncode for p in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]
    manifest = json.loads((tmp_path / "node0" / "manifest.json").read_text())
    assert manifest["worker_keys"] == {str(n): public_key_hex(load_private_key(made[n] / f"worker-{n}.key")) for n in range(2)}
    report = audit_run(tmp_path / "node0")
    assert report.ok, report.first_failure
    # party B's machine without its own .key: both machines' processes stop at once in one line, exit 2, with nothing
    # written (B's refusal left A waiting in init_process_group for run.timeout_s, 120 s by default)
    (homes[1] / "keys" / "worker-1.key").unlink()
    nodes = _two_nodes(tmp_path / "again", [["--verify.key_dir=keys"]] * 2, homes)
    assert all(p.returncode != 0 and "failed (exitcode: 2)" in p.stderr for p in nodes), nodes[0].stderr[-2000:]  # (torchrun's own: 1)
    assert "worker 1 runs here and verify.key_dir keys has no worker-1.key" in nodes[1].stderr
    assert "rank 1 (on its machine) refused to start" in nodes[0].stderr
    assert not (tmp_path / "again").exists()
    # party A's machine starting both workers itself: it holds worker 1's .pub, not its .key
    monkeypatch.chdir(homes[0])
    code, lines, _ = cli(monkeypatch, capsys, "train", str(TINY), "--verify.key_dir=keys", "--out", str(tmp_path / "both"))
    assert code == 2 and len(lines) == 1, lines
    assert "worker 1 runs here and verify.key_dir keys has no worker-1.key" in lines[0]
    assert not (tmp_path / "both").exists()


def test_a_torchrun_node_with_another_config_stops_the_run_at_once(tmp_path):
    """Each node prepares its own run directory; one with another config (or corpus, veriloco or
    torch) has another run id. The run stopped after round 0's steps with "workers disagree on the
    global params", naming neither the cause nor the machine; the workers now compare run ids when
    they start, and both nodes stop with the reason."""
    nodes = _two_nodes(tmp_path, [[], ["--train.lr=0.002"]])
    assert [p.returncode for p in nodes] == [1, 1]
    for p in nodes:
        assert "RuntimeError: the workers' run manifests differ (member 1 of the stage's group has another run id " \
               "than member 0)" in p.stderr
    assert not (tmp_path / "node0" / "rounds.jsonl").exists() or not rounds_of(tmp_path / "node0")


_TASK_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[2])
import custom_model as cm
from veriloco import Task, load_config, torchrun_task

if __name__ == "__main__":
    cfg = load_config(overrides=sys.argv[3:])
    summary = torchrun_task(Task(cm.make_model, cm.loss, cm.batch, cm.eval_batches), cfg, sys.argv[1], quiet=True)
    if summary is not None:
        print("final", summary["final_params_hash"])
"""


def test_a_torchrun_node_whose_corpus_is_missing_stops_every_node_with_nothing_written(tmp_path):
    """Each machine prepares its own run directory; one whose `--data.source` is not there failed
    with a traceback (exit 1), and the others, their run directories written, failed in their
    barrier with gloo's "Connection closed by peer", naming nothing (by hand, before). Now every
    process stops at once: the refused one in one line, exit 2, the others naming its rank; what
    they had prepared is gone."""
    nodes = _two_nodes(tmp_path, [[], [f"--data.source={tmp_path / 'nowhere.txt'}"]])
    assert all(p.returncode != 0 and "failed (exitcode: 2)" in p.stderr for p in nodes), nodes[1].stderr[-2000:]
    assert "veriloco: error: data.source not found" in nodes[1].stderr, nodes[1].stderr[-2000:]
    assert "veriloco: error: rank 1 (on its machine) refused to start" in nodes[0].stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_users_task_under_torchrun_trains_what_train_task_does(tmp_path, monkeypatch):
    """`torchrun_task(task, cfg, out)` from the script torchrun starts: a user's own model under
    torchrun (it ran the built-in task only), recording what `train_task` records."""
    from veriloco import Task, load_config, train_task
    from veriloco.audit import audit_task

    examples = str(ROOT / "examples")
    overrides = ["--train.rounds=3", "--train.inner_steps=5", "--train.warmup_steps=5", "--train.lr=0.01",
                 "--train.eval_batches=2"]
    script = tmp_path / "script.py"
    script.write_text(_TASK_SCRIPT)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(script),
                        str(tmp_path / "tr"), examples, *overrides], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    monkeypatch.syspath_prepend(examples)
    import custom_model as cm

    task = Task(cm.make_model, cm.loss, cm.batch, cm.eval_batches)
    whole = train_task(task, load_config(overrides=[*overrides, "--topology.workers=2"]), str(tmp_path / "one"), quiet=True)
    assert f"final {whole['final_params_hash']}" in p.stdout
    assert [r["params_hash"] for r in rounds_of(tmp_path / "tr")] == [r["params_hash"] for r in rounds_of(tmp_path / "one")]
    report = audit_task(task, tmp_path / "tr")
    assert report.ok, report.first_failure


def test_torchrun_without_out_says_so_in_one_line(tmp_path):
    """`python -m veriloco.run CONFIG` under torchrun without --out: a machine's other processes
    failed on `. is not a run directory` (the first had made runs/<run id>, a path only it knew)."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "veriloco.run",
                        str(TINY)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode != 0
    needle = "veriloco: error: under torchrun, give --out DIR: the run directory every process of this machine shares"
    assert needle in p.stderr
    assert not (tmp_path / "runs").exists()
