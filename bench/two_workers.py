"""Two workers, one of them attacking: what the checks refuse when there is no majority; with
`--old REV`, an older revision of veriloco against the working tree, the same runs, alternately.

    python bench/two_workers.py [--old REV] [--rounds 20] [--seeds 0,1,2] [--config tiny|default]
                                [--attacks noise,scaled,sign_flip,alie,ipm,noop] [--loss-gain-batches 2]
                                [--set KEY=VALUE ...] [--out bench/results/two_workers.json]

Every run trains `--config` (configs/tiny.toml or configs/default.toml) with 2 workers for
`--rounds` rounds, the loss-gain screen on (`--loss-gain-batches` of each worker's batches, a
failing delta rejected: `loss_gain_action = "reject"`, the strictest setting, since with no
replays drawn there is nothing else to decide), and worker 1 attacking (`--adversary.1=KIND`),
or both honest (`honest`). Each run is `veriloco train` in a fresh interpreter with the working
tree's `src` (side "new"), and with `--old`, also with `git archive REV src` (side "old").

With 2 workers the screen's norm and cosine checks are skipped (their robust centre needs 3), so
the loss gain and the checks that do not compare workers are what is left (README: Two
workers). Per attack and side, over the seeds: the share of worker 1's rounds refused
(`refused`), the first refused round (`rounds_to_detect`, 1-based, None when never), worker 0's
refused rounds (honest, `false_refusals`, next to `honest_submissions`), and the final eval
loss. Prints a table and writes `{"old": REV or null, "rows": [{"attack", "side", "seed", "refused",
"rounds", "first_refused", "false_refusals", "eval_loss"}...], "summary": [...]}`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

ATTACKS = ("honest", "noise", "scaled", "sign_flip", "alie", "ipm", "noop")


def run_once(src: Path, config: Path, attack: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One run with the package at `src`: worker 1's and worker 0's refusals and the final eval loss."""
    argv = ["train", str(config), "--out", str(out), "--quiet", "--topology.workers=2",
            f"--train.rounds={args.rounds}", f"--train.eval_every={args.rounds}", f"--run.seed={seed}",
            f"--verify.loss_gain_batches={args.loss_gain_batches}", "--verify.loss_gain_action=reject",
            *([] if attack == "honest" else [f"--adversary.1={attack}"]), *[f"--{o}" for o in args.set]]
    from audit_memory import veriloco  # `veriloco ARGV` in a fresh interpreter, the package at src

    done, _, _ = veriloco(src, *argv)
    if done.returncode != 0:
        raise SystemExit(f"two_workers: {attack} seed {seed} with {src} failed: "
                         f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    refused = [r["round"] for r in records if r["verdicts"][1] != "accept"]
    return {"refused": len(refused), "rounds": len(records), "first_refused": refused[0] + 1 if refused else None,
            "false_refusals": sum(r["verdicts"][0] != "accept" for r in records),
            "eval_loss": next(r["eval_loss"] for r in reversed(records) if r["eval_loss"] is not None)}


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for attack in dict.fromkeys(r["attack"] for r in rows):
        for side in ("old", "new"):
            mine = [r for r in rows if (r["attack"], r["side"]) == (attack, side)]
            if not mine:
                continue
            firsts = [r["first_refused"] for r in mine if r["first_refused"] is not None]
            out.append({
                "attack": attack, "side": side, "seeds": len(mine),
                # both workers are honest in the honest runs: worker 1's refusals are false ones too
                "refused": round(sum(r["refused"] for r in mine) / sum(r["rounds"] for r in mine), 4),
                "rounds_to_detect": max(firsts) if len(firsts) == len(mine) else None,
                "false_refusals": sum(r["false_refusals"] for r in mine) + (
                    sum(r["refused"] for r in mine) if attack == "honest" else 0),
                "honest_submissions": sum(r["rounds"] for r in mine) * (2 if attack == "honest" else 1),
                "eval_loss": round(sum(r["eval_loss"] for r in mine) / len(mine), 4),
            })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None, help="also run git revision REV's src (side 'old')")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2", help="run seeds, comma-separated")
    ap.add_argument("--config", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    ap.add_argument("--loss-gain-batches", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="an override for every run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "two_workers.json"))
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be integers, got {args.seeds!r}")
    attacks = [a for a in args.attacks.split(",") if a]
    if unknown := [a for a in attacks if a not in ATTACKS]:
        ap.error(f"unknown attack(s) {', '.join(unknown)}; known: {', '.join(ATTACKS)}")
    if args.rounds < 1 or args.loss_gain_batches < 1 or not seeds or not attacks:
        ap.error("--rounds and --loss-gain-batches must be >= 1, with at least one seed and one attack")
    from round_cost import source_of

    config = ROOT / "configs" / f"{args.config}.toml"
    rows = []
    with tempfile.TemporaryDirectory(prefix="veriloco-bench-two-") as tmp:
        sides = {"new": ROOT / "src"}
        if args.old is not None:
            (Path(tmp) / "old").mkdir()
            sides = {"old": source_of(args.old, Path(tmp) / "old"), **sides}
        for attack in attacks:
            for seed in seeds:
                for side, src in sides.items():
                    row = {"attack": attack, "side": side, "seed": seed,
                           **run_once(src, config, attack, seed, args, Path(tmp) / f"{side}-{attack}-{seed}")}
                    rows.append(row)
                    print(f"{attack:10s} seed {seed} {side:3s} | worker 1 refused {row['refused']:3d}/{row['rounds']} "
                          f"(first {row['first_refused']}) | worker 0 refused {row['false_refusals']} | "
                          f"eval {row['eval_loss']:.4f}", flush=True)
    summary = summarise(rows)
    result = {"old": args.old, "config": args.config, "rounds": args.rounds, "seeds": seeds,
              "loss_gain_batches": args.loss_gain_batches, "set": args.set, "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("\n| attack | side | refused | rounds to detect (worst seed) | honest refused / submitted | eval loss |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['attack']} | {s['side']} | {s['refused']:.1%} | {s['rounds_to_detect']} | "
              f"{s['false_refusals']} / {s['honest_submissions']} | {s['eval_loss']:.4f} |")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
