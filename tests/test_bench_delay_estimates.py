"""bench/delay_estimates.py: how well a worker can guess the average it misses under delay 1."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import ROOT, bench_arguments

sys.path.insert(0, str(ROOT / "bench"))


def test_the_estimates_on_deltas_whose_answer_is_known():
    from delay_estimates import measure

    g = torch.Generator().manual_seed(0)
    same = torch.randn(50, generator=g, dtype=torch.float64)
    # every worker sends the same delta: its own is the average (local exact, eager a quarter of it)
    means, _ = measure([[same] * 4, [same] * 4])
    assert means["local"] == pytest.approx(0.0, abs=1e-9) and means["eager"] == pytest.approx(0.75)
    assert means["best_a"] == pytest.approx(1.0) and means["cos_own_avg"] == pytest.approx(1.0)
    # the others repeat last round while the worker's own delta is orthogonal to theirs: "previous" is exact
    u, v = torch.zeros(50, dtype=torch.float64), torch.zeros(50, dtype=torch.float64)
    u[0], v[1] = 1.0, 1.0
    means, rounds = measure([[v, v, v, v], [u, v, v, v]])
    # avg = (u + 3v) / 4. Worker 0: u/4 + 3v/4, exact; each other: v/4 + 3v/4 = v, off by
    # norm(u - v) / norm(u + 3v) = sqrt(2 / 10); the mean over the 4 workers is 3/4 of that
    assert rounds[0]["previous"] == pytest.approx(0.75 * (2 / 10) ** 0.5, abs=1e-4)
    assert means["best_own"] <= min(means["eager"], means["local"]) + 1e-12


def test_a_short_run_prints_the_table(tmp_path):
    out = tmp_path / "est.json"
    p = bench_arguments("delay_estimates.py", "--rounds", "2", "--inner-steps", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert [r["round"] for r in result["rounds"]] == [1] and 0 < result["means"]["cos_own_avg"] <= 1
    assert result["means"]["best_own"] <= result["means"]["local"] + 1e-9 and "| relative error" in p.stdout


def test_bad_arguments_exit_2():
    p = bench_arguments("delay_estimates.py", "--rounds", "1")
    assert p.returncode == 2 and "--rounds must be >= 2" in p.stderr
