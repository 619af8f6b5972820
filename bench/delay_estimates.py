"""How well can a worker guess the average it is missing under delay 1? Measured on a delay-0 run.

    python bench/delay_estimates.py [--config quick|default] [--rounds 10] [--inner-steps 20]
                                    [--momentum 0.5] [--seed 0] [--out bench/results/delay_estimates.json]

With `[outer] delay = 1` a worker starts round r+1 before round r's average delta `avg_r` has
arrived; its start point is G plus a correction built from an estimate of `avg_r` made from what
it holds then: its own delta of round r, and every worker's delta of round r-1 (round.py,
start_point). The closer the estimate, the closer the start point to delay 0's (bench/delay.py
measures what the delay costs in eval loss; this says why no correction gets within 0.5% there).

One delay-0 run with fp32 packets (bench/comm.py's quick GPT, or configs/default.toml's with
`--config default`), 4 workers; every round's packets are decoded from the run's store, and for
each round r >= 1 and worker m the relative error norm(avg_r - estimate) / norm(avg_r) of:

    eager       own_r / W (Kale et al.'s eager update: its own share)
    local       own_r (its delta for the whole average)
    best_own    a * own_r with the best a for that round and worker (known only afterwards: the
                floor of every estimate that scales the worker's own delta)
    previous    own_r / W + the others' round r-1 deltas / W (the others as they were a round ago)

and the cosines cos(own_r, avg_r) and cos(avg_r, avg_{r-1}), and best a. Means over rounds and
workers. Writes `{"config": ..., "means": {...}, "rounds": [...]}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

ESTIMATES = ("eager", "local", "best_own", "previous")


def flat_deltas(run: Path) -> list[list]:
    """Every round's decoded packets from the run's store, one flat float64 vector per worker."""
    import torch

    from veriloco.packet import decode_bundle, decode_packet, packet_codecs
    from veriloco.store import LocalStore

    store = LocalStore(run / "store")
    out = []
    for line in (run / "rounds.jsonl").read_text().splitlines():
        row = []
        for digest in json.loads(line)["bundles"]:
            _, packet, _ = decode_bundle(store.get(digest))
            delta = decode_packet(packet, _shapes(packet), len(packet))  # our own run's packets
            row.append(torch.cat([delta[k].flatten() for k in sorted(delta)]).double())
            assert set(packet_codecs(packet).values()) == {"fp32"}, "the run must send fp32 packets"
        out.append(row)
    return out


def _shapes(packet: bytes) -> dict[str, tuple[int, ...]]:
    from veriloco.packet import _meta

    return {k: tuple(v) for k, v in _meta(packet)["shapes"].items()}


def measure(deltas: list[list]) -> tuple[dict, list[dict]]:
    W, per_round = len(deltas[0]), []
    for r in range(1, len(deltas)):
        avg, prev = sum(deltas[r]) / W, deltas[r - 1]
        prev_avg = sum(prev) / W
        row = {k: 0.0 for k in (*ESTIMATES, "cos_own_avg", "best_a")}
        for m, own in enumerate(deltas[r]):
            a = float(avg @ own / (own @ own))
            guesses = {"eager": own / W, "local": own, "best_own": a * own,
                       "previous": own / W + sum(prev[j] for j in range(W) if j != m) / W}
            for k, g in guesses.items():
                row[k] += float((avg - g).norm() / avg.norm()) / W
            row["cos_own_avg"] += float(avg @ own / (avg.norm() * own.norm())) / W
            row["best_a"] += a / W
        row["cos_avg_prev_avg"] = float(avg @ prev_avg / (avg.norm() * prev_avg.norm()))
        per_round.append({"round": r, **{k: round(v, 4) for k, v in row.items()}})
    means = {k: round(sum(p[k] for p in per_round) / len(per_round), 4) for k in per_round[0] if k != "round"}
    return means, per_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("quick", "default"), default="quick")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "delay_estimates.json"))
    args = ap.parse_args()
    if args.rounds < 2 or args.inner_steps < 1:
        ap.error("--rounds must be >= 2 (round 0 has no previous round) and --inner-steps >= 1")
    from comm import shared_overrides

    from veriloco.config import load_config
    from veriloco.run import train

    overrides = [o for o in shared_overrides(args.config == "quick", args.rounds, args.inner_steps, 4)
                 if not o.startswith(("--link", "--outer.momentum"))]
    overrides += ["--compress.codec=fp32", "--outer.delay=0", "--ledger.backend=none", "--outer.lr=0.7",
                  f"--outer.momentum={args.momentum}", f"--run.seed={args.seed}"]
    cfg = load_config(ROOT / "configs" / "default.toml" if args.config == "default" else None, overrides)
    with tempfile.TemporaryDirectory(prefix="veriloco-delay-est-") as tmp:
        _, summary = train(cfg, str(Path(tmp) / "run"), quiet=True)
        means, per_round = measure(flat_deltas(Path(tmp) / "run"))
    result = {"config": {"model": args.config, "rounds": args.rounds, "inner_steps": args.inner_steps,
                         "momentum": args.momentum, "seed": args.seed, "workers": 4, "overrides": overrides},
              "eval_loss": summary["eval_loss_end"], "means": means, "rounds": per_round}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"delay-0 run: eval loss {summary['eval_loss_end']:.4f}; means over rounds 1..{args.rounds - 1} and 4 workers:")
    print("| relative error of the estimate: eager | local | best multiple of own | previous | cos(own, avg) | best a "
          "| cos(avg, last avg) |")
    m = means
    print(f"| {m['eager']:.3f} | {m['local']:.3f} | {m['best_own']:.3f} | {m['previous']:.3f} | {m['cos_own_avg']:.3f} "
          f"| {m['best_a']:.3f} | {m['cos_avg_prev_avg']:.3f} |")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
