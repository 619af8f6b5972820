"""What the one-step delay costs: delay 0 vs delay 1 with each correction, fp32 packets, side by side.

    python bench/delay.py [--rounds 10] [--inner-steps 20] [--momentum 0.0,0.5,0.9] [--seeds 0] [--outer-lr 0.7]
                          [--out bench/results/delay.json]

The communication benchmark's eager row mixes two effects (the delay and the adaptive codec);
this one isolates the delay. Every row trains bench/comm.py's quick GPT (2 layers, d64) with W = 4
workers on the same batches, fp32 packets, no link emulation (the loss does not depend on it),
outer lr 0.7, Nesterov momentum from --momentum; per momentum and seed (`run.seed`: the model's
init and the batches), nine rows:

    d0          delay 0: DiLoCo, wait for the exchange, then step
    eager       delay 1, S = G - c/W * own newest delta (Kale et al. 2025's eager updates; round.py)
    local       delay 1, S = G - c * own newest delta (the worker's delta stands in for the average)
    eager+la, local+la   the same with `--outer.lookahead=true`: also - lr mu^2 m, the momentum
                part of the outer step G still lacks
    naive       delay 1, S = G
    eager/t1, local/t1, naive/t1   the same start points with `--outer.overlap_steps=1`: round r's
                update lands after the first inner step of round r+1 (Streaming DiLoCo's tau = 1)
                instead of a whole round late

and reports each delay-1 row's eval loss against d0's of the same momentum and seed (the issue's
target: eager within 0.5%), then the mean over the seeds. Writes `{"rows": [...], "means": [...],
"config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm import shared_overrides  # noqa: E402

from veriloco.config import load_config  # noqa: E402
from veriloco.run import train  # noqa: E402

ROWS = {
    "d0": ["--outer.delay=0"],
    "eager": ["--outer.delay=1", "--outer.correction=eager"],
    "local": ["--outer.delay=1", "--outer.correction=local"],
    "eager+la": ["--outer.delay=1", "--outer.correction=eager", "--outer.lookahead=true"],
    "local+la": ["--outer.delay=1", "--outer.correction=local", "--outer.lookahead=true"],
    "naive": ["--outer.delay=1", "--outer.correction=naive"],
    "eager/t1": ["--outer.delay=1", "--outer.correction=eager", "--outer.overlap_steps=1"],
    "local/t1": ["--outer.delay=1", "--outer.correction=local", "--outer.overlap_steps=1"],
    "naive/t1": ["--outer.delay=1", "--outer.correction=naive", "--outer.overlap_steps=1"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--momentum", default="0.0,0.5,0.9")
    ap.add_argument("--outer-lr", default="0.7",
                    help="comma-separated outer learning rates; each row is compared with d0 at the same lr, and "
                         "with more than one the summary also compares each row's best lr with d0's best")
    ap.add_argument("--seeds", default="0", help="comma-separated run.seed values; means are over them")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows of {', '.join(ROWS)} (d0 always runs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "delay.json"))
    args = ap.parse_args()
    names = ["d0", *[n for n in (x.strip() for x in args.rows.split(",")) if n and n != "d0"]]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    base = [o for o in shared_overrides(True, args.rounds, args.inner_steps, 4) if not o.startswith("--link")]
    base += ["--compress.codec=fp32", "--ledger.backend=none"]
    rows = []
    print(f"{'momentum':>8} | {'seed':>4} | {'row':>10} | {'eval loss':>9} | {'vs d0':>8}", flush=True)
    momenta, seeds = [float(x) for x in args.momentum.split(",")], [int(x) for x in args.seeds.split(",")]
    lrs = [float(x) for x in args.outer_lr.split(",")]
    for lr in lrs:
        for m in momenta:
            for seed in seeds:
                d0 = None
                for name in names:
                    cfg = load_config(None, [*base, *ROWS[name], f"--outer.momentum={m}", f"--outer.lr={lr}",
                                             f"--run.seed={seed}"])
                    with tempfile.TemporaryDirectory(prefix="veriloco-delay-") as tmp:
                        _, summary = train(cfg, str(Path(tmp) / "run"), quiet=True)
                    loss = summary["eval_loss_end"]
                    d0 = loss if name == "d0" else d0
                    vs = 100 * (loss - d0) / d0
                    rows.append({"outer_lr": lr, "momentum": m, "seed": seed, "name": name, "eval_loss": loss,
                                 "vs_d0_pct": round(vs, 3)})
                    print(f"lr {lr:<4} {m:>8} | {seed:>4} | {name:>10} | {loss:>9.4f} | {vs:>+7.2f}%", flush=True)
    means = []
    print(f"\nmean over seeds {seeds}: eval loss vs d0 of the same seed and outer lr")
    print(f"{'lr':>4} {'momentum':>8} | " + " | ".join(f"{n:>9}" for n in names[1:]))
    for lr in lrs:
        for m in momenta:
            line = []
            for name in names[1:]:
                vs = [r["vs_d0_pct"] for r in rows if r["momentum"] == m and r["name"] == name and r["outer_lr"] == lr]
                means.append({"outer_lr": lr, "momentum": m, "name": name, "mean_vs_d0_pct": round(sum(vs) / len(vs), 3),
                              "max_vs_d0_pct": max(vs), "seeds": len(vs)})
                line.append(f"{sum(vs) / len(vs):>+8.2f}%")
            print(f"{lr:>4} {m:>8} | " + " | ".join(line))
    best = best_vs_best(rows, names, momenta, seeds) if len(lrs) > 1 else []
    for b in best:
        print(f"best outer lr, momentum {b['momentum']}: {b['name']} (lr {b['outer_lr']}, mean {b['mean_eval_loss']:.4f}) "
              f"vs d0 (lr {b['d0_outer_lr']}, {b['d0_mean_eval_loss']:.4f}): {b['vs_d0_pct']:+.2f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "means": means, "best_vs_best": best, "config": {
        "overrides": base, "rounds": args.rounds, "inner_steps": args.inner_steps, "seeds": seeds,
        "outer_lr": lrs}}, indent=2) + "\n")
    print(f"wrote {args.out}")


def best_vs_best(rows: list[dict], names: list[str], momenta: list[float], seeds: list[int]) -> list[dict]:
    """Per momentum and row: the outer lr with the lowest eval loss averaged over the seeds,
    against d0's best lr likewise (each method at its own best lr)."""
    def best(m: float, name: str) -> tuple[float, float]:  # (mean eval loss, outer lr) at the best lr
        by_lr: dict[float, list[float]] = {}
        for r in rows:
            if r["momentum"] == m and r["name"] == name:
                by_lr.setdefault(r["outer_lr"], []).append(r["eval_loss"])
        return min((sum(v) / len(v), lr) for lr, v in by_lr.items() if len(v) == len(seeds))

    out = []
    for m in momenta:
        d0_loss, d0_lr = best(m, "d0")
        for name in names[1:]:
            loss, lr = best(m, name)
            out.append({"momentum": m, "name": name, "outer_lr": lr, "mean_eval_loss": round(loss, 4),
                        "d0_outer_lr": d0_lr, "d0_mean_eval_loss": round(d0_loss, 4),
                        "vs_d0_pct": round(100 * (loss - d0_loss) / d0_loss, 3)})
    return out


if __name__ == "__main__":
    main()
