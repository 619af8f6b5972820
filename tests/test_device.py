"""`[run] device` and `[train] precision`: where the model trains and in which precision.

This machine has no GPU, so the CUDA path is checked here only as far as a CPU can: the settings'
checks, the backend a CUDA run would ask for, the one-line refusal where torch sees no GPU, and
bf16 autocast end to end on the CPU (training, replays and the offline audit all in bf16).
`python bench/gpu.py --engine` runs the engine on a GPU."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import TINY, rounds_of, tiny

from veriloco import audit as audit_mod
from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.round import process_backend
from veriloco.run import train
from veriloco.task import CorpusTask, Task, on_device

REPLAYED = ("--train.rounds=2", "--train.inner_state=reset", "--verify.replay_probability=1.0",
            "--verify.trace_every=5", "--verify.loss_gain_batches=1")


@pytest.mark.parametrize("override, message", [
    ("--run.device=gpu", "run.device must be 'cpu' or 'cuda', got 'gpu'"),
    ("--run.backend=nccl", "run.backend = 'nccl' needs run.device = 'cuda'"),
    ("--train.precision=fp16", "train.precision must be 'fp32' or 'bf16', got 'fp16'"),
])
def test_device_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny(override)


def test_the_cpu_collectives_always_have_gloo(monkeypatch):
    """`backend = 'auto'` used to mean nccl alone whenever CUDA was present, while every tensor the
    round moves is on the CPU: every collective would have failed on a GPU machine. NCCL also
    refuses two ranks on one GPU, so 'auto' takes it only with a GPU per local process."""
    assert process_backend(tiny()) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert process_backend(tiny("--run.device=cuda"), 4) == "cpu:gloo,cuda:nccl"
    assert process_backend(tiny("--run.device=cuda"), 8) == "gloo"  # 8 workers share 4 GPUs
    assert process_backend(tiny("--run.device=cuda", "--run.backend=nccl"), 8) == "cpu:gloo,cuda:nccl"  # as asked
    assert process_backend(tiny("--run.device=cuda", "--run.backend=gloo"), 1) == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys):
    from veriloco.cli import main

    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["veriloco", "train", str(TINY), "--run.device=cuda", "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.device = 'cuda' but torch.cuda.is_available() is False" in err
    assert not out.exists()


def test_on_device_keeps_a_cpu_fp32_task_and_casts_the_forward_in_bf16(tmp_path):
    from veriloco.run import prepare_run

    run, corpus_task = prepare_run(tiny(), str(tmp_path / "run"))
    run.release()
    task = corpus_task.as_task()
    assert on_device(task, "cpu", "fp32") is task  # the CPU fp32 path is untouched (bit for bit)
    bf16 = on_device(task, "cpu", "bf16")
    model = bf16.make_model()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast, not a bf16 model
    x, y = task.batch(0, 0, 0)
    with torch.no_grad():
        full, half = float(task.loss(model, x, y)), float(bf16.loss(model, x, y))
    assert full != half and abs(full - half) < 0.05 * full
    assert isinstance(bf16, Task) and isinstance(corpus_task, CorpusTask)


@pytest.mark.parametrize("staged", [(), ("--topology.stages=2", "--topology.microbatches=2")],
                         ids=["one stage", "two stages"])
def test_a_bf16_run_trains_replays_and_audits_in_bf16(tmp_path, monkeypatch, staged):
    """Every replay (in the run, and the audit's) passes bit for bit only if it too ran in bf16:
    one stage's loss under autocast (task.on_device), or each pipeline stage's forward
    (topology.stage_model: the workers, their replays and the audit's emulated pipeline alike).
    The audit that forgets the precision fails (checked below by taking it away)."""
    from veriloco.topology import build_stage_model

    run, summary = train(tiny(*REPLAYED, *staged, "--train.precision=bf16"), str(tmp_path / "bf16"), quiet=True)
    fp32, _ = train(tiny(*REPLAYED, *staged), str(tmp_path / "fp32"), quiet=True)
    recs = rounds_of(run.root)
    assert all(v == "accept" for rec in recs for v in rec["verdicts"])
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    assert recs[-1]["params_hash"] != rounds_of(fp32.root)[-1]["params_hash"]
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] == 4  # both workers, both rounds
    if staged:
        monkeypatch.setattr(audit_mod, "stage_model",
                            lambda cfg, s, stages, device="cpu": build_stage_model(cfg.model, cfg.run.seed, s, stages))
    else:
        monkeypatch.setattr(audit_mod, "on_device", lambda task, device, precision="fp32": task)
    assert not audit_run(run.root, replay=100).ok


def test_a_bf16_ddp_baseline_trains(tmp_path):
    from veriloco.baseline import train_ddp

    _, summary = train_ddp(tiny("--train.mode=ddp", "--train.rounds=2", "--train.precision=bf16"),
                           str(tmp_path / "ddp"), quiet=True)
    assert summary["eval_loss_end"] < summary["eval_loss_start"]


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device must be cpu or cuda, got 'gpu'"),
    pytest.param("cuda", "--device cuda but torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_audit_device_is_checked_in_one_line(tmp_path, monkeypatch, capsys, device, message):
    from veriloco.cli import main

    monkeypatch.setattr(sys, "argv", ["veriloco", "audit", str(tmp_path), "--device", device])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err
