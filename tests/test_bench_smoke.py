"""Bench scripts that no other test runs, each at its smallest setting, so a change elsewhere that
breaks one shows here instead of at the next bench run (as the torchft row did:
tests/test_bench_torchft.py). `bench/chaos.py` and `bench/elastic_faults.py` take minutes at
their smallest; only chaos's refusal of too few rounds is checked."""

from __future__ import annotations

import json
import math

from conftest import bench_arguments, run_bench


def test_init_memory_measures_each_way_of_writing_g0(tmp_path):
    out = tmp_path / "im.json"
    p = run_bench("init_memory.py", "--layers", "2", "--d-model", "64", "--vocab", "256", "--repeats", "1",
                  "--out", str(out), timeout=120)
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["params"] > 0 and data["repeats"] == 1
    assert {(r["source"], r["way"]) for r in data["rows"]} == {(s, w) for s in ("init", "seed") for w in ("whole", "streamed")}
    assert all(r["peak_mb"] > 0 and r["seconds"] >= 0 for r in data["rows"])


def test_ledger_race_opens_one_new_ledger_from_several_processes_at_once():
    p = bench_arguments("ledger_race.py", "--trials", "2", "--procs", "3")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "0 of 6 opens failed", p.stdout


def test_diloco_gap_compares_each_outer_optimizer_with_ddp(tmp_path):
    out = tmp_path / "dg.json"
    # H = 5 on 2 workers, not the bench's 20 on 4: the DDP row starts a fresh interpreter per worker,
    # and each of its steps waits out the link's 50 ms
    p = bench_arguments("diloco_gap.py", "--lengths", "1", "--inner-steps", "5", "--workers", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["rounds"] == 1 and run["inner_steps"] == 5 and [r["name"] for r in run["rows"]] == [
        "ddp", "diloco-lr0.7-m0.9", "diloco-lr0.7-m0.5", "diloco-lr1.0-m0.0"]
    ddp = run["rows"][0]["eval_loss"]
    for r in run["rows"]:
        assert math.isfinite(r["eval_loss"]) and r["tokens"] == run["rows"][0]["tokens"]
        assert r["loss_vs_ddp_pct"] == round(100 * (r["eval_loss"] - ddp) / ddp, 2)


def test_chaos_refuses_a_run_too_short_for_its_faults():
    p = bench_arguments("chaos.py", "--rounds", "8")
    assert p.returncode == 2 and "--rounds must be >= 17" in p.stderr, p.stderr
