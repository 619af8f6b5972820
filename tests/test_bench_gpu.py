"""bench/gpu.py: its --smoke run (the GPU code path on the CPU) writes every row, and without
CUDA a full run refuses with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import bench_arguments

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.py"
SPECS = {
    "fp32",
    "fp16",
    "bf16",
    "int8:block=64",
    "int4:block=64",
    "topk:density=0.01,bits=8",
    "lowrank:rank=4",
}


def run(args: list[str], pythonpath: str = str(ROOT / "src")) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_smoke_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    p = run(["--smoke", "--out", str(out)])
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["skipped"] == []
    env = res["env"]
    for key in ("torch", "cuda", "device_name", "date_utc"):
        assert key in env
    m = res["model"]
    assert (m["n_layer"], m["d_model"], m["ctx"]) == (2, 64, 64)
    assert m["flops_per_token"] == 6 * m["params_matmul"] + 12 * 2 * 64 * 64
    assert m["params_matmul"] == m["params_total"] - (256 + 64) * 64  # minus the embedding tables
    assert res["peak_tflops"] == 989.0

    train = {r["variant"]: r for r in res["train"]}
    assert set(train) == {"inner", "bare"}
    for r in train.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["steps"] == 3
        assert r["loss_first"] == pytest.approx(5.5, abs=0.5)  # ~ln(256) at init
    # the InnerLoop's trace hash (params + AdamW moments), timed, and in steps: what trace_every costs
    assert train["inner"]["trace_hash_s"] > 0 and train["inner"]["trace_hash_steps"] > 0
    assert "trace_hash_s" not in train["bare"]

    rows = res["codecs"]
    assert {(r["spec"], r["path"]) for r in rows} == {(s, p) for s in SPECS for p in ("device", "host")}
    assert len(rows) == 2 * 2 * len(SPECS)  # two targets: the matrix and the model delta
    for r in rows:
        assert "error" not in r, r
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0
        assert 0 < r["ratio"] <= 1
    exact = [r for r in rows if r["spec"] == "fp32"]
    assert all(r["rel_err"] == 0 and r["ratio"] == 1 for r in exact)
    int8 = [r for r in rows if r["spec"] == "int8:block=64"]
    assert all(0 < r["rel_err"] < 0.02 for r in int8)
    assert "| inner |" in p.stdout and "| lowrank:rank=4 |" in p.stdout


def test_smoke_without_the_runtime_dependencies(tmp_path: Path) -> None:
    """The GPU machine may lack the package's runtime deps: model/inner/compress need torch only."""
    block = tmp_path / "block" / "safetensors"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('safetensors blocked by the test')\n")
    out = tmp_path / "gpu.json"
    p = run(
        ["--smoke", "--variants", "inner", "--sdpa", "math", "--codecs", "int4:block=64",
         "--no-model-delta", "--out", str(out)],
        pythonpath=os.pathsep.join([str(tmp_path / "block"), str(ROOT / "src")]),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [r["variant"] for r in res["train"]] == ["inner"] and "error" not in res["train"][0]
    assert len(res["codecs"]) == 2 and all("error" not in r for r in res["codecs"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_full_run_needs_cuda(tmp_path: Path) -> None:
    p = run(["--out", str(tmp_path / "gpu.json")])
    assert p.returncode == 2
    assert p.stderr.strip() == "no CUDA device: run with --smoke on CPU"
    assert not (tmp_path / "gpu.json").exists()


def test_smoke_engine_trains_both_precisions_and_audits(tmp_path: Path) -> None:
    """Part 3 (`--engine`) on the CPU: the round engine at fp32 and bf16, and 2 stages x 2 replicas,
    replays on, then the audit."""
    out = tmp_path / "gpu.json"
    # in-process main() (the tests above run the script as typed): the engine's workers start from this
    # process's forkserver, and its audits and parts 1 and 2 are small
    p = bench_arguments("gpu.py", "--smoke", "--engine", "--variants", "inner", "--codecs", "fp32", "--paths", "host",
                        "--no-model-delta", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    engine = json.loads(out.read_text())["engine"]
    rows = {r["precision"]: r for r in engine if r["layout"] == "default"}
    assert set(rows) == {"fp32", "bf16"} and len(engine) == 3
    assert "--topology.replicas=2" in engine[2]["overrides"]
    for r in engine:
        assert "error" not in r, r
        assert r["verdicts"] == ["accept"] and r["audit_ok"], r
        assert r["eval_loss_end"] < r["eval_loss_start"]
        assert "--run.device=cpu" in r["overrides"]
    assert rows["fp32"]["eval_loss_end"] != rows["bf16"]["eval_loss_end"]  # the precision took effect
