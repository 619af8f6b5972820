"""Compute utilisation of one `bench/comm.py` row, the working tree against an older revision, the
same runs alternately.

    python bench/utilisation.py [--old REV] [--row eager] [--workers 2] [--rounds 6] [--inner-steps 30]
                                [--trials 3] [--slow SECONDS] [--set KEY=VALUE ...]
                                [--out bench/results/utilisation.json]

Every run is `veriloco train configs/default.toml` with `bench/comm.py`'s shared overrides (the
emulated 1 Gbit/s, 50 ms link; eval after the last round; outer Nesterov momentum 0.5) and the
row's own (`--row`: eager, eager-tau, fp32-d0, naive, ...; eager-tau's tau is comm.py's for this
machine: 1), in a fresh interpreter. Side "new" runs the working tree's `src`; with `--old`, side
"old" runs `git archive REV src`. The sides alternate, and each trial starts with the other side
than the last, so the machine's drift falls on both.

`--slow SECONDS`: every worker is also that much slower in every other round (worker w in the
rounds r with r % 2 == w % 2: tests/red_team.py's `SlowRounds`, which sleeps in its first inner
step; honest otherwise). A straggler that changes from round to round, as workers on machines of
their own see when one has a slow round, without taking CPU from the others on this shared
machine. The sleep counts as inner-step time.

Per run, from its summary and records: `utilisation` (mean inner-step seconds / wall, the figure
comm.py's target is judged on), the wall, tokens/s, `straggler_s` (per round, the slowest worker's
inner-step seconds minus the mean, summed: the most a worker can wait for the slowest if every
round ends together), `wait_s` (the exchange waits, summed over rounds, mean over workers), the
eval loss and every round's packets, which must be the same in every run (what changes is
when a worker waits, never what it computes). Prints per-run lines and a table of medians with
new/old ratios; writes `{"old", "row", "overrides", "rows": [...], "summary": [...]}`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

FIELDS = ("utilisation", "wall_s", "tokens_per_s", "straggler_s", "wait_s")


def comm_rows() -> dict:
    """comm.py's veriloco rows that need no other row's result, by name."""
    from comm import row_specs

    return {s.name: s for s in row_specs() if s.kind == "veriloco" and not s.budget_ratio}


def row_overrides(row: str, workers: int, rounds: int, inner_steps: int) -> list[str]:
    """comm.py's overrides for `row` (its shared ones first); tau = 1 for an overlap row."""
    from comm import shared_overrides

    spec = comm_rows()[row]
    extra = ["--outer.overlap_steps=1"] if spec.overlap else []
    return shared_overrides(False, rounds, inner_steps, workers) + list(spec.overrides) + extra


def run_once(src: Path, overrides: list[str], out: Path) -> dict:
    """One run with the package at `src`: its figures (see the module docstring)."""
    from audit_memory import veriloco

    done, _, _ = veriloco(src, "train", str(ROOT / "configs" / "default.toml"), "--out", str(out), "--quiet", *overrides,
                          path=(ROOT / "tests",))  # --slow's SlowRounds
    if done.returncode != 0:
        raise SystemExit(f"utilisation.py: the run with {src} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    recs = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    s = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out)
    return {
        "utilisation": s["utilisation"], "wall_s": s["wall_s"], "tokens_per_s": s["tokens_per_s"],
        "straggler_s": round(sum(max(r["inner_s"]) - statistics.fmean(r["inner_s"]) for r in recs), 3),
        "wait_s": round(sum(statistics.fmean(r["wait_s"]) for r in recs), 3),
        "eval_loss": s["eval_loss_end"], "packets": [r["packets"] for r in recs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None, help="git revision to compare against (side 'old')")
    ap.add_argument("--row", default="eager", help="the comm.py row (default eager: delay 1, the eager correction)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--slow", type=float, default=0.0, metavar="SECONDS",
                    help="each worker that much slower in every other round (a straggler that changes every round)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for both sides")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "utilisation.json"))
    args = ap.parse_args()
    if args.rounds < 2 or args.workers < 2 or args.trials < 1 or args.inner_steps < 2 or args.slow < 0:
        ap.error("needs --rounds >= 2, --workers >= 2, --inner-steps >= 2, --trials >= 1 and --slow >= 0")
    if any("=" not in o for o in args.set):
        ap.error("--set takes KEY=VALUE")
    if args.row not in comm_rows():
        ap.error(f"--row must be one of {', '.join(sorted(comm_rows()))}")
    overrides = row_overrides(args.row, args.workers, args.rounds, args.inner_steps) + [f"--{o}" for o in args.set]
    if args.slow:
        overrides += [f"--adversary.{w}=red_team:SlowRounds:seconds={args.slow},parity={w % 2}" for w in range(args.workers)]

    from round_cost import alternating, conclude, side_medians

    with tempfile.TemporaryDirectory(prefix="utilisation-") as tmp:
        sides, rows = alternating(args.old, args.trials, Path(tmp), lambda src, out: run_once(src, overrides, out),
                                  lambda row: f"trial {row['trial']} | {row['side']:>3} | utilisation {row['utilisation']:.2%} | "
                                              f"wall {row['wall_s']:.2f} s | {row['tokens_per_s']:.0f} tok/s | "
                                              f"straggler {row['straggler_s']:.3f} s | eval {row['eval_loss']:.4f}")
    summary = side_medians(sides, rows, FIELDS)
    print(f"\nrow {args.row}, {args.workers} workers, {args.rounds} rounds x H = {args.inner_steps}"
          f"{f', each {args.slow} s slower in every other round' if args.slow else ''}; medians over {args.trials} trials")
    print("| side | utilisation | wall | tokens/s | straggler | exchange wait |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['side']} | {s['utilisation']:.2%} | {s['wall_s']:.2f} s | {s['tokens_per_s']:.0f} | "
              f"{s['straggler_s']:.3f} s | {s['wait_s']:.3f} s |")
    if len(summary) == 2:
        new, old = summary
        print(f"new/old: utilisation x{new['utilisation'] / old['utilisation']:.4f}, "
              f"tokens/s x{new['tokens_per_s'] / old['tokens_per_s']:.4f}, wall x{new['wall_s'] / old['wall_s']:.4f}")
    return conclude(args.out, {"old": args.old, "row": args.row, "workers": args.workers, "rounds": args.rounds,
                               "slow": args.slow, "inner_steps": args.inner_steps, "overrides": overrides, "rows": rows,
                               "summary": summary}, rows)


if __name__ == "__main__":
    raise SystemExit(main())
