"""bench/memory.py: the rows run and relate as the README says."""

from __future__ import annotations

import json

from conftest import bench_arguments, run_bench


def test_memory_rows(tmp_path):
    out = tmp_path / "memory.json"
    p = run_bench("memory.py", "--layers", "2", "--d-model", "32", "--ctx", "32", "--batches", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "grad_accum=2", "grad_accum=4", "checkpoint"]
    assert rows["checkpoint"]["max_param_diff"] == 0 and rows["checkpoint"]["saved_vs_plain"] < 0.5
    assert rows["grad_accum=4"]["saved_bytes"] < rows["grad_accum=2"]["saved_bytes"] < rows["plain"]["saved_bytes"]
    assert 0 < rows["grad_accum=2"]["max_param_diff"] < 1e-5
    assert "| checkpoint |" in p.stdout


def test_bad_arguments_exit_2():
    p = bench_arguments("memory.py", "--batch", "3", timeout=60)
    assert p.returncode == 2 and "--batch a multiple of 4" in p.stderr
