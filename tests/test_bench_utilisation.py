"""bench/utilisation.py: a comm.py row's utilisation, the working tree against an older revision."""

from __future__ import annotations

import json

from conftest import bench_arguments, set_args


def test_a_short_eager_run_with_a_changing_straggler_reports_its_figures(tmp_path):
    out = tmp_path / "u.json"
    # in-process main(): each run is `veriloco train` in a fresh interpreter of its own. A 1-layer d 64
    # model (the row's own is 4 x 128): the figures are the same sums, over steps that take less time
    p = bench_arguments("utilisation.py", "--rounds", "3", "--inner-steps", "3", "--trials", "1", "--slow", "0.5",
                        *set_args(["model.n_layer=1", "model.d_model=64", "model.n_head=2", "train.eval_batches=2"]),
                        "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["side"] == "new" and result["old"] is None and result["slow"] == 0.5
    assert "--outer.delay=1" in result["overrides"] and "--link.latency=50ms" in result["overrides"]
    assert "--adversary.1=red_team:SlowRounds:seconds=0.5,parity=1" in result["overrides"]
    # every round has a worker 0.5 s slow, counted in its inner steps: the straggler figure (per round,
    # the slowest minus the mean of 2: about 0.25 s, less what the other's steps took longer) shows it
    assert row["straggler_s"] >= 3 * 0.15 and 0 < row["utilisation"] <= 1 and len(row["packets"]) == 3
    assert "| new |" in p.stdout and "packets identical across all runs" in p.stdout


def test_bad_arguments_exit_2():
    p = bench_arguments("utilisation.py", "--row", "ddp")
    assert p.returncode == 2 and "--row must be one of" in p.stderr and "eager-tau" in p.stderr
    p = bench_arguments("utilisation.py", "--slow", "-1")
    assert p.returncode == 2 and "--slow >= 0" in p.stderr
