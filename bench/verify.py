"""Verification benchmark: every attack, several seeds, detection and damage.

    python bench/verify.py [--quick] [--seeds N] [--rounds R] [--out bench/results/verify.json]

Each run: 4 workers train the tiny GPT (configs/tiny.toml, widened to 4 workers) with worker 1
attacking (`--adversary.1=KIND`), inner state reset per round so replay needs no private state,
replay probability `--replay`. For each attack and seed: the rounds in which worker 1's update
was rejected (detection rate = rejected rounds / rounds where it attacked; rounds-to-detection =
first rejected round + 1), the honest workers' false rejections, and the final eval loss next
to the clean run's with the same seed. One trace segment per round (trace_every = inner_steps): a
sampled replay redoes the whole round, which catches a lazy worker wherever it skipped (a
finer trace lets a replay stop early, but a lazy worker skips the last steps, so only a
full replay is sure to see them). Verification compute is the time every worker spent in
the per-round checks and replays, as a share of inner-step time. Writes
`{"attacks": [...], "honest": {...}, "overhead": x}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from veriloco.config import load_config
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = ["noop", "noise", "scaled", "sign_flip", "stale", "replay", "copy", "lazy:skip=0.25", "lazy:skip=0.5",
           "wrong_data", "alie", "ipm", "malformed", "forged_signature", "equivocate"]
ROBUST = {"sign_flip", "alie", "ipm"}  # judged by damage (final loss), not only by detection


def run_one(base: list[str], extra: list[str], out: Path) -> list[dict]:
    cfg = load_config(ROOT / "configs" / "tiny.toml", base + extra)
    run, _ = train(cfg, str(out), quiet=True)
    return [json.loads(line) for line in run.rounds_path.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 seed, 8 rounds, fewer attacks")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--replay", type=float, default=0.1, help="replay probability per worker per round")
    ap.add_argument("--aggregator", default="trimmed_mean")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "verify.json"))
    args = ap.parse_args()
    attacks = ATTACKS
    if args.quick:
        args.seeds, args.rounds = 1, 8
    base = ["--topology.workers=4", f"--train.rounds={args.rounds}", "--train.inner_steps=20",
            "--verify.trace_every=20", "--verify.loss_gain_batches=1", "--train.inner_state=reset", f"--verify.replay_probability={args.replay}",
            f"--verify.aggregator={args.aggregator}", "--train.eval_every=1000"]
    rows, honest_subs, honest_rej, verify_s, inner_s = [], 0, 0, 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        clean = {}
        for seed in range(args.seeds):
            recs = run_one(base, [f"--run.seed={seed}"], Path(tmp) / f"clean-{seed}")
            clean[seed] = recs[-1]["eval_loss"]
            for rec in recs:
                honest_subs += len(rec["verdicts"])
                honest_rej += sum(v != "accept" for v in rec["verdicts"])
                verify_s += sum(rec.get("verify_s", [0.0]))
                inner_s += sum(rec["inner_s"])
        for attack in attacks:
            kind = attack.split(":")[0]
            rates, firsts, losses, reasons = [], [], [], set()
            for seed in range(args.seeds):
                name = attack.replace(":", "-").replace("=", "")
                recs = run_one(base, [f"--run.seed={seed}", f"--adversary.1={attack}"], Path(tmp) / f"{name}-{seed}")
                rejected = [r["round"] for r in recs if r["verdicts"][1] != "accept"]
                reasons |= {r["verdicts"][1] for r in recs if r["verdicts"][1] != "accept"}
                attacked = [r["round"] for r in recs if kind not in ("replay", "copy", "stale") or r["round"] > 0]
                rates.append(len([x for x in rejected if x in attacked]) / max(len(attacked), 1))
                firsts.append(min(rejected) + 1 if rejected else None)
                losses.append(recs[-1]["eval_loss"])
                for rec in recs:
                    honest_subs += len(rec["verdicts"]) - 1
                    honest_rej += sum(v != "accept" for j, v in enumerate(rec["verdicts"]) if j != 1)
            found = [f for f in firsts if f is not None]
            row = {
                "attack": attack, "detected_rate": round(statistics.mean(rates), 4),
                "rounds_to_detect": statistics.median(found) if found else None,
                "seeds_detected": len(found), "seeds": args.seeds, "reasons": sorted(reasons),
                "final_eval_loss": round(statistics.mean(losses), 4),
                "clean_eval_loss": round(statistics.mean(clean.values()), 4),
            }
            row["loss_vs_clean_pct"] = round(100 * (row["final_eval_loss"] / row["clean_eval_loss"] - 1), 2)
            rows.append(row)
            print(f"{attack:18s} detected {row['detected_rate']:6.1%}  first round {row['rounds_to_detect']}  "
                  f"loss {row['final_eval_loss']:.4f} vs clean {row['clean_eval_loss']:.4f} ({row['loss_vs_clean_pct']:+.2f}%)  {row['reasons']}", flush=True)
    result = {"attacks": rows, "honest": {"submissions": honest_subs, "rejections": honest_rej},
              "overhead": round(verify_s / inner_s, 4) if inner_s else None,
              "config": {"rounds": args.rounds, "seeds": args.seeds, "replay_probability": args.replay,
                         "aggregator": args.aggregator, "workers": 4}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("\n| attack | detected | rounds to detect | final eval loss | clean | vs clean |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['attack']} | {r['detected_rate']:.0%} | {r['rounds_to_detect']} | {r['final_eval_loss']:.4f} | {r['clean_eval_loss']:.4f} | {r['loss_vs_clean_pct']:+.2f}% |")
    print(f"\nhonest: {honest_rej} rejections in {honest_subs} submissions; verification overhead "
          f"{result['overhead']} of inner-step time  -> {args.out}")


if __name__ == "__main__":
    main()
