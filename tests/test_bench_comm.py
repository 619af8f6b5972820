"""bench/comm.py's row logic: ratios, loss gaps, targets and the table, on made-up rows.

Plus one real (tiny) veriloco row, so a change in the engine's summary or records that the
bench reads shows up here rather than 25 minutes into a bench run.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, tiny

sys.path.insert(0, str(ROOT / "bench"))
import comm  # noqa: E402


def _rows() -> list[dict]:
    d1 = ["--outer.delay=1"]
    return [
        {"name": "ddp", "kind": "ddp", "role": "ddp", "eval_loss": 2.50, "bytes_per_worker": 3_000_000_000,
         "wall_s": 400.0, "tokens_per_s": 5000.0, "tokens": 2_000_000, "steps": 180},
        {"name": "fp32-d0", "kind": "veriloco", "role": "d0", "overrides": [], "eval_loss": 2.52,
         "bytes_per_worker": 60_000_000, "wall_s": 200.0, "utilisation": 0.9, "inner_s": 180.0,
         "tokens_per_s": 10_000.0, "steps": 180},
        {"name": "eager", "kind": "veriloco", "role": "eager", "overrides": d1, "eval_loss": 2.53,
         "bytes_per_worker": 60_000_000, "wall_s": 190.0, "utilisation": 0.98, "tokens_per_s": 10_500.0,
         "codecs_used": {"fp32": 100}, "exchange_wait_s": 0.1},
        {"name": "naive", "kind": "veriloco", "role": "naive", "overrides": d1, "eval_loss": 2.60,
         "bytes_per_worker": 60_000_000, "wall_s": 190.0, "utilisation": 0.97, "tokens_per_s": 10_400.0},
        {"name": "topk", "kind": "veriloco", "role": "frontier", "overrides": d1, "eval_loss": 2.54,
         "bytes_per_worker": 2_000_000, "wall_s": 190.0, "utilisation": 0.96, "tokens_per_s": 10_300.0},
        {"name": "torchft", "kind": "torchft", "role": "torchft", "eval_loss": 2.52,
         "bytes_per_worker": 30_000_000, "wall_s": 210.0, "utilisation": 0.95, "tokens_per_s": 9_000.0},
        {"name": "broken", "kind": "veriloco", "role": "frontier", "skipped": "RuntimeError: boom"},
    ]


def test_finish_rows_ratios_gaps_and_ddp_estimate():
    rows = comm.finish_rows(_rows())
    by = {r["name"]: r for r in rows}
    assert by["ddp"]["ratio_vs_ddp"] == 1.0 and by["ddp"]["loss_vs_ddp_pct"] == 0.0
    assert by["topk"]["ratio_vs_ddp"] == 1500.0
    assert by["fp32-d0"]["loss_vs_ddp_pct"] == pytest.approx(0.8)
    # DDP's utilisation: fp32-d0's compute per step (1 s) x DDP's 180 steps / DDP's 400 s wall
    assert by["ddp"]["utilisation"] == pytest.approx(0.45) and "estimate" in by["ddp"]["utilisation_note"]
    assert by["broken"]["ratio_vs_ddp"] is None and by["broken"]["loss_vs_ddp_pct"] is None


def test_targets_follow_the_numbers():
    targets = comm.evaluate_targets(comm.finish_rows(_rows()))
    traffic, util, delay, peer = targets
    assert traffic["met"] is True and traffic["best_within_tolerance"] == "topk"  # 1500x at +1.6%
    assert util["met"] is True  # eager row at 98%
    assert delay["met"] is True and delay["eager_cost_pct"] == pytest.approx(100 * 0.01 / 2.52, abs=1e-3)
    assert peer["met"] is True and "eager" in peer["detail"]  # 2.53 within 0.5% of 2.52, faster

    worse = _rows()
    worse[4]["eval_loss"] = 2.60  # topk now +4% vs DDP: no row >= 1000x within 2%
    worse[2]["utilisation"] = 0.80
    worse[2]["eval_loss"] = 2.60  # eager +3.2% vs delay 0, and no longer equal to torchft's loss
    worse[1]["tokens_per_s"] = 8_000.0  # fp32-d0 ties torchft's loss but is slower
    traffic, util, delay, peer = comm.evaluate_targets(comm.finish_rows(worse))
    assert (traffic["met"], util["met"], delay["met"], peer["met"]) == (False, False, False, False)
    assert "fp32-d0" in peer["detail"] and "x0.889" in peer["detail"]

    # an eager row whose update lands inside the next round is reported beside the target, not for it
    landed = {"name": "eager-tau", "kind": "veriloco", "role": "overlap", "overrides": ["--outer.delay=1",
              "--outer.overlap_steps=2"], "eval_loss": 2.521, "bytes_per_worker": 60_000_000, "wall_s": 190.0,
              "utilisation": 0.95, "tokens_per_s": 10_500.0}
    _, util, delay, _ = comm.evaluate_targets(comm.finish_rows([*worse, landed]))
    assert delay["met"] is False and "after 2 inner step(s) instead of a round (eager-tau): +0.04%" in delay["detail"]
    assert util["met"] is False and "eager with overlap_steps 2: 95.0%" in util["detail"]


def test_missing_rows_give_na_not_a_verdict():
    rows = [r for r in _rows() if r["role"] not in ("ddp", "torchft")]
    rows.append({"name": "torchft", "kind": "torchft", "role": "torchft", "skipped": "torchft unavailable: ImportError"})
    traffic, _, _, peer = comm.evaluate_targets(comm.finish_rows(rows))
    assert traffic["met"] is None and peer["met"] is None and "ImportError" in peer["detail"]


def test_table_has_every_row_and_says_why_one_was_skipped():
    rows = comm.finish_rows(_rows())
    table = comm.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert any("broken" in line and "skipped: RuntimeError: boom" in line for line in table)
    assert any(line.startswith("| ddp |") and "(est.)" in line for line in table)
    assert "NOT met" not in comm.targets_text(comm.evaluate_targets(rows))


def test_budget_for_ratio_matches_the_byte_accounting():
    cfg = tiny("--topology.workers=4", "--train.inner_steps=30")
    budget = comm.budget_for_ratio(cfg, 1000.0)
    ddp_bytes_per_round = 30 * 2 * 3 / 4 * comm.model_bytes(cfg)
    assert ddp_bytes_per_round / ((budget + 8) * 3) == pytest.approx(1000.0, rel=1e-3)


def test_overlap_for_hides_an_fp32_exchange_under_the_fewest_steps():
    cfg = tiny("--topology.workers=4", "--train.inner_steps=30")
    exchange_s = 0.05 + 3 * comm.model_bytes(cfg) * 8 / 1e9  # 1 Gbit/s, 50 ms
    per_step = exchange_s / cfg.compress.safety / 2.5  # 2.5 steps' worth: 3 steps needed
    assert comm.overlap_for(cfg, {"inner_s": per_step * 180, "steps": 180}) == 3
    assert comm.overlap_for(cfg, {"inner_s": 1000.0, "steps": 180}) == 1  # slow steps: one is enough
    assert comm.overlap_for(cfg, {"inner_s": 1e-6, "steps": 180}) == 29  # never the whole round
    assert comm.overlap_for(cfg, None) == 1


def test_a_real_tiny_veriloco_row(tmp_path):
    cfg = tiny("--train.rounds=2", "--train.eval_every=2", "--link.bandwidth=1gbit", "--link.latency=5ms",
               "--outer.delay=1", "--compress.codec=adaptive", "--compress.error_feedback=true")
    spec = comm.RowSpec("eager", "veriloco", (), "eager")
    row = comm.run_row(spec, cfg, str(tmp_path))
    assert "skipped" not in row, row.get("skipped")
    for key in ("eval_loss", "bytes_per_worker", "wall_s", "utilisation", "tokens_per_s"):
        assert isinstance(row[key], (int, float)) and row[key] > 0, key
    assert row["tokens"] == 2 * 5 * 4 * 32 * 2  # rounds x H x batch x ctx x workers
    assert sum(row["codecs_used"].values()) > 0
    json.dumps(row)  # the row goes into the JSON as is


def test_the_link_check_line_shows_both_latencies_or_why_it_was_skipped():
    from comm import link_summary

    row = {"bytes": 1 << 20, "ratio": 1.03}
    assert link_summary({"skipped": "network namespaces need root"}) == "network namespaces need root"
    assert link_summary({"rows": [row]}) == "kernel/emulated 1024 KiB 1.03"
    line = link_summary({"rows": [row], "latency": "50ms", "rows_latency": [{"bytes": 1 << 20, "ratio": 5.39}]})
    assert line == "kernel/emulated 1024 KiB 1.03; at 50ms, new connections: 1024 KiB 5.39"
