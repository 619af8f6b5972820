"""An elastic round on a long kernel-shaped link: what the membership protocol's round trips cost,
the working tree against an older revision, the same runs alternately.

    python bench/elastic_latency.py [--old REV] [--latency 50ms] [--bandwidth 1gbit] [--workers 3]
                                    [--rounds 6] [--trials 2] [--set KEY=VALUE ...] [--fault SPEC ...]
                                    [--out bench/results/elastic_latency.json]

Every run is `veriloco train configs/tiny.toml --run.membership=elastic --link.shaping=kernel`
(fp32 packets, delay 0) in a fresh interpreter: each worker in its own network namespace, the
coordinator (torchft's Lighthouse and the TCPStore) in another, every path `--latency` long one way
(netns.py's delay line) and shaped to `--bandwidth` (tc tbf). So every request a worker makes of the
coordinator, and every collective among the workers, pays the latency as it would across sites.
Side "new" runs the working tree's `src`; with `--old`, side "old" runs `git archive REV src`.
`--fault` (as `veriloco train --fault` takes it) puts the same fault in every run, e.g. a worker
that dies and stays away, so that every later quorum is formed without it.

Per run: the wall time; the steady round, the median `round_s` over rounds 1.. (round 0 forms the
first group and opens its connections); the median of the workers' inner-step seconds
(`inner_s`: the compute a round is for) and of the exchange (`exchange_s`); the share of the round
that is not inner steps (`protocol_share`); the eval loss and the packets, which must be
the same on both sides (the protocol changes when bytes move, never what they are).
Needs root (network namespaces); says so and exits 0 without it. Prints a table and writes
`{"old": REV or null, "latency", "bandwidth", "rows": [...], "summary": [...]}`.
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


def run_once(src: Path, args: argparse.Namespace, out: Path) -> dict:
    """One elastic run over the kernel link with the package at `src`."""
    from audit_memory import veriloco

    done, wall, _ = veriloco(src, "train", str(ROOT / "configs" / "tiny.toml"), "--out", str(out), "--quiet",
                             "--run.membership=elastic", "--link.shaping=kernel", f"--link.latency={args.latency}",
                             f"--link.bandwidth={args.bandwidth}", f"--topology.workers={args.workers}",
                             f"--train.rounds={args.rounds}", "--compress.codec=fp32", "--run.timeout_s=60",
                             *[f"--{o}" for o in args.set], *[f"--fault={f}" for f in args.fault])
    if done.returncode != 0:
        raise SystemExit(f"elastic_latency.py: the run with {src} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    recs = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out)
    steady = recs[1:] or recs
    round_s = statistics.median(r["round_s"] for r in steady)
    inner_s = statistics.median(statistics.median(r["inner_s"]) for r in steady)
    return {"wall_s": round(wall, 2), "round_s": round(round_s, 4), "inner_s": round(inner_s, 4),
            "exchange_s": round(statistics.median(statistics.median(r["exchange_s"]) for r in steady), 4),
            "protocol_share": round(1 - inner_s / round_s, 4), "rounds": len(recs),
            "eval_loss": summary["eval_loss_end"], "packets": [r["packets"] for r in recs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None, help="git revision to compare against (side 'old')")
    ap.add_argument("--latency", default="50ms", help="one-way latency of every path (default 50ms)")
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--fault", action="append", default=[], metavar="SPEC",
                    help="a fault for every run, as `veriloco train --fault` takes it (e.g. die:2@1.2: worker 2 dies in "
                         "round 1 and the others go on without it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "elastic_latency.json"))
    args = ap.parse_args()
    from veriloco import netns
    from veriloco.link import Link

    try:
        link = Link.from_strings(args.bandwidth, args.latency)
    except ValueError as e:
        ap.error(str(e))
    if link.bandwidth_bps == float("inf"):
        ap.error("--bandwidth must be finite")
    if args.rounds < 2 or args.workers < 2 or args.trials < 1:
        ap.error("needs --rounds >= 2, --workers >= 2 and --trials >= 1")
    if any("=" not in o for o in args.set):
        ap.error("--set takes KEY=VALUE")
    ok, why = netns.available()
    if not ok:
        print(f"elastic_latency.py: skipped: {why}")
        return 0

    from round_cost import alternating, conclude, side_medians

    with tempfile.TemporaryDirectory(prefix="elastic-latency-") as tmp:
        sides, rows = alternating(args.old, args.trials, Path(tmp), lambda src, out: run_once(src, args, out),
                                  lambda row: f"trial {row['trial']} | {row['side']:>3} | round {row['round_s']:.3f} s "
                                              f"(inner steps {row['inner_s']:.3f} s, exchange {row['exchange_s']:.3f} s) | "
                                              f"wall {row['wall_s']:.1f} s | eval {row['eval_loss']:.4f}")
    summary = side_medians(sides, rows, ("round_s", "inner_s", "exchange_s", "protocol_share", "wall_s"))
    print(f"\n{args.workers} workers, {args.rounds} rounds, {args.bandwidth}, {args.latency} one way; medians over {args.trials} trials")
    print("| side | round | inner steps | exchange | not inner steps | wall |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['side']} | {s['round_s']:.3f} s | {s['inner_s']:.3f} s | {s['exchange_s']:.3f} s | "
              f"{s['protocol_share']:.1%} | {s['wall_s']:.1f} s |")
    if len(summary) == 2:
        print(f"old / new round time: {summary[1]['round_s'] / summary[0]['round_s']:.2f}x")
    return conclude(args.out, {"old": args.old, "latency": args.latency, "bandwidth": args.bandwidth,
                               "workers": args.workers, "rounds": args.rounds, "rows": rows, "summary": summary}, rows)


if __name__ == "__main__":
    raise SystemExit(main())
