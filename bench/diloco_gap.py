"""How far is DiLoCo itself from DDP at this machine's scale, and does it close with length?

    python bench/diloco_gap.py [--lengths 10,40] [--inner-steps 20] [--workers 4] [--full] [--sweep]
                               [--out bench/results/diloco_gap.json]

The communication target (>= 1000x less traffic than DDP within 2% of its eval loss) needs
DiLoCo with fp32 packets and no delay to come within 2% first; this measures that gap. Same
rows as bench/comm.py's `ddp` and `fp32-d0` (its code: comm.run_row, comm.shared_overrides),
4 workers, the emulated 1 Gbit/s 50 ms link, delay 0, at three outer optimizers: DiLoCo's
(lr 0.7, Nesterov momentum 0.9), momentum 0.5, and plain averaging (lr 1, no momentum).
`--lengths`: runs of that many rounds of the quick GPT (2 layers, d 64, H = 20), each its own
DDP row with as many tokens; `--inner-steps` and `--workers` change its H and worker count
(tests/test_bench_smoke.py's shorter run). `--full`: also comm.py's full setting (the default 4-layer GPT,
6 rounds x H = 30; ~6 more minutes). `--sweep`: also tune both sides on the quick GPT at 10
rounds: DDP at three inner learning rates, DiLoCo at two inner learning rates x five outer
optimizers (~3 more minutes), so the gap is best against best. Eval losses are deterministic on CPU: the same every run.
Writes `{"runs": [{"setting", "rounds", "inner_steps", "rows": [{"name", "outer", "eval_loss",
"loss_vs_ddp_pct"}]}]}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm import RowSpec, run_row, shared_overrides  # noqa: E402

from veriloco.config import load_config  # noqa: E402

OUTERS = ((0.7, 0.9), (0.7, 0.5), (1.0, 0.0))  # (outer lr, Nesterov momentum)
SWEEP_DDP_LRS = (1.5e-3, 3e-3, 6e-3)  # train.lr (the configs' is 3e-3)
SWEEP_DILOCO_LRS = (1.5e-3, 3e-3)
SWEEP_OUTERS = ((0.7, 0.5), (0.7, 0.3), (0.5, 0.5), (0.7, 0.0), (1.0, 0.5))


def _run(specs: list[RowSpec], base: list[str], workdir: str, label: str) -> list[tuple]:
    """(spec, config, comm.run_row's row) for each spec, one after another, each printed."""
    out = []
    for spec in specs:
        cfg = load_config(str(ROOT / "configs" / "default.toml"), base + list(spec.overrides))
        row = run_row(spec, cfg, str(Path(workdir) / f"{label.replace(' ', '')}-{spec.name}"))
        if "skipped" in row:
            raise SystemExit(f"{label}, {spec.name}: {row['skipped']}")
        print(f"  {label} | {spec.name:28s} eval {row['eval_loss']:.4f} ({row['elapsed_s']:.0f}s)", flush=True)
        out.append((spec, cfg, row))
    return out


def run_sweep(workdir: str, rounds: int = 10) -> dict:
    """Best against best on the quick GPT: DDP and DiLoCo (fp32, delay 0) over a small grid of
    inner learning rates and outer optimizers; the gap is the best DiLoCo's vs the best DDP's."""
    base = shared_overrides(True, rounds, 20, 4)
    specs = [RowSpec(f"ddp-lr{lr:g}", "ddp", (f"--train.lr={lr}",), "ddp") for lr in SWEEP_DDP_LRS]
    specs += [RowSpec(f"diloco-lr{lr:g}-o{olr}-m{m}", "veriloco", ("--outer.delay=0", "--compress.codec=fp32",
                      f"--train.lr={lr}", f"--outer.lr={olr}", f"--outer.momentum={m}"), "d0")
              for lr in SWEEP_DILOCO_LRS for olr, m in SWEEP_OUTERS]
    rows = [{"name": spec.name, "kind": spec.kind, "lr": cfg.train.lr,
             "outer": None if spec.kind == "ddp" else {"lr": cfg.outer.lr, "momentum": cfg.outer.momentum},
             "eval_loss": row["eval_loss"]}
            for spec, cfg, row in _run(specs, base, workdir, f"sweep {rounds} rounds")]
    best_ddp = min((r for r in rows if r["kind"] == "ddp"), key=lambda r: r["eval_loss"])
    best_diloco = min((r for r in rows if r["kind"] != "ddp"), key=lambda r: r["eval_loss"])
    gap = round(100 * (best_diloco["eval_loss"] - best_ddp["eval_loss"]) / best_ddp["eval_loss"], 2)
    print(f"  sweep: best DDP {best_ddp['name']} {best_ddp['eval_loss']:.4f}, best DiLoCo {best_diloco['name']} "
          f"{best_diloco['eval_loss']:.4f} ({gap:+.2f}%)", flush=True)
    return {"rounds": rounds, "inner_steps": 20, "rows": rows, "best_ddp": best_ddp["name"],
            "best_diloco": best_diloco["name"], "best_gap_pct": gap}


def run_setting(name: str, quick: bool, rounds: int, inner_steps: int, workdir: str, workers: int = 4) -> dict:
    """DDP and DiLoCo (fp32, delay 0) at each of OUTERS, `rounds` x `inner_steps`, side by side."""
    base = shared_overrides(quick, rounds, inner_steps, workers)
    specs = [RowSpec("ddp", "ddp", (), "ddp")] + [
        RowSpec(f"diloco-lr{lr}-m{m}", "veriloco",
                ("--outer.delay=0", "--compress.codec=fp32", f"--outer.lr={lr}", f"--outer.momentum={m}"), "d0")
        for lr, m in OUTERS
    ]
    rows = [{"name": spec.name, "outer": None if spec.kind == "ddp" else {"lr": cfg.outer.lr, "momentum": cfg.outer.momentum},
             "eval_loss": row["eval_loss"], "tokens": row["tokens"]}
            for spec, cfg, row in _run(specs, base, workdir, f"{name} {rounds:3d} rounds")]
    ddp = rows[0]["eval_loss"]
    for r in rows:
        r["loss_vs_ddp_pct"] = round(100 * (r["eval_loss"] - ddp) / ddp, 2)
    return {"setting": name, "rounds": rounds, "inner_steps": inner_steps, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="10,40", help="comma-separated round counts of the quick GPT")
    ap.add_argument("--inner-steps", type=int, default=20, help="H of the quick GPT's runs")
    ap.add_argument("--workers", type=int, default=4, help="workers of the quick GPT's runs (DDP's too)")
    ap.add_argument("--full", action="store_true", help="also comm.py's full setting (6 rounds x H=30, 0.88M params)")
    ap.add_argument("--sweep", action="store_true", help="also tune inner lr and outer optimizer on the quick GPT (~3 min)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "diloco_gap.json"))
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--lengths: comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 1:
        raise SystemExit("--lengths: at least one round count, each >= 1")
    if args.inner_steps < 1 or args.workers < 2:
        raise SystemExit("--inner-steps must be >= 1 and --workers >= 2")
    t0, runs, sweep = time.perf_counter(), [], None
    with tempfile.TemporaryDirectory(prefix="veriloco-bench-gap-") as workdir:
        runs += [run_setting("quick", True, n, args.inner_steps, workdir, args.workers) for n in lengths]
        if args.full:
            runs.append(run_setting("full", False, 6, 30, workdir))
        if args.sweep:
            sweep = run_sweep(workdir)
    print("\n| setting | rounds x H | " + " | ".join(r["name"] for r in runs[0]["rows"]) + " |")
    print("|---|---|" + "---|" * len(runs[0]["rows"]))
    for run in runs:
        cells = [f"{r['eval_loss']:.4f}" + ("" if r["outer"] is None else f" ({r['loss_vs_ddp_pct']:+.2f}%)")
                 for r in run["rows"]]
        print(f"| {run['setting']} | {run['rounds']} x {run['inner_steps']} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, **({"sweep": sweep} if sweep else {}), "total_s": round(time.perf_counter() - t0, 1)}, indent=2) + "\n")
    print(f"-> {out} ({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
