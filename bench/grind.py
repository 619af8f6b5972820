"""The last sender's grinding of the replay draw, before and after the commit-reveal.

    python bench/grind.py [--old c503d70] [--seeds 0,1,2,3,4] [--rounds 4] [--p 0.5]
                          [--out bench/results/grind.json]

4 workers of configs/tiny.toml (H = 6 in one segment, inner state reset), each worker's round
replayed with probability `--p`. Worker 3 attacks, either with `skim` (trains every step on half
of its batch: no screen sees it, only a replay) or with `red_team:GrindSkim` (tests/red_team.py:
skim, and it receives every other bundle before it sends its own, then re-signs its commitment
with its last loss nudged until the round's base and commitment digests draw no replay of it).
Every seed (`--run.seed`) trains both attackers with `--old` (default: the revision before the
commit-reveal) and with the working tree. Per side and attacker: in how many runs it was
convicted (`replay_mismatch`), the round of each conviction, and how many of its rounds were
accepted (its skimmed update in the model). Every run is audited (`veriloco audit --replay
100`) with its own side's code. Writes `{"rows": [...], "summary": {...}, "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from round_cost import source_of

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = 3
ATTACKS = ("skim", "red_team:GrindSkim:p={p},segments=1,workers=4")


def veriloco(src: Path, *argv: str) -> subprocess.CompletedProcess:
    """`veriloco ARGV...` with the package at `src` and tests/ (the red team) on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (src, ROOT / "tests"))))
    return subprocess.run([sys.executable, "-m", "veriloco.cli", *argv], env=env, capture_output=True, text=True,
                          cwd=ROOT)


def new_side() -> str:
    """The working tree the new side ran: its HEAD, and "+changes" when it differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src", "tests"], cwd=ROOT, capture_output=True, text=True).stdout
    return head + ("+changes" if dirty.strip() else "")


def seeds_of(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """--seeds "0,1,2" -> [0, 1, 2]; ap.error (exit 2) for anything else or a seed twice."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"--seeds must be integers, got {text!r}")
    if len(set(seeds)) != len(seeds):
        ap.error(f"--seeds has a seed twice: {text!r}")
    return seeds


def sides_of(ap: argparse.ArgumentParser, old: str, tmp: Path) -> dict[str, Path]:
    """{"old": `src` of git revision `old` unpacked under tmp, "new": the working tree's `src`}."""
    (tmp / "old").mkdir()
    try:
        return {"old": source_of(old, tmp / "old"), "new": ROOT / "src"}
    except subprocess.CalledProcessError:
        ap.error(f"--old {old!r} is not a git revision of {ROOT}")


def run_one(src: Path, attack: str, seed: int, rounds: int, p: float, out: Path) -> dict:
    """One run of worker 3's `attack` at `seed`: its verdicts, and whether the run's audit passed."""
    done = veriloco(src, "train", str(ROOT / "configs" / "tiny.toml"), "--topology.workers=4", f"--train.rounds={rounds}",
                    "--train.inner_steps=6", "--verify.trace_every=6", "--train.inner_state=reset",
                    f"--verify.replay_probability={p}", f"--run.seed={seed}", f"--adversary.{ATTACKER}={attack}",
                    "--out", str(out), "--quiet")
    if done.returncode != 0:
        raise SystemExit(f"grind: the run failed ({src}, {attack}, seed {seed}): "
                         f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    recs = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    verdicts = [rec["verdicts"][ATTACKER] for rec in recs]
    audit = veriloco(src, "audit", str(out), "--replay", "100")
    return {"verdicts": verdicts, "convicted_round": verdicts.index("replay_mismatch") if "replay_mismatch" in verdicts
            else None, "accepted_rounds": verdicts.count("accept"), "audit_ok": audit.returncode == 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="c503d70", help="git revision of the old side (default: before the commit-reveal)")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.5, help="[verify] replay_probability")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grind.json"))
    args = ap.parse_args()
    seeds = seeds_of(ap, args.seeds)
    if not 0 < args.p <= 1 or args.rounds < 1:
        ap.error("--p must be in (0, 1] and --rounds at least 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides = sides_of(ap, args.old, Path(tmp))
        for seed in seeds:
            for side, src in sides.items():
                for i, attack in enumerate(ATTACKS):
                    spec = attack.format(p=args.p)
                    row = {"side": side, "attack": spec.split(":")[1] if ":" in spec else spec, "seed": seed,
                           **run_one(src, spec, seed, args.rounds, args.p, Path(tmp) / f"{side}-{seed}-{i}")}
                    rows.append(row)
                    print(f"{side:4s} seed {seed} {row['attack']:10s} convicted in round {row['convicted_round']!s:4s} "
                          f"accepted {row['accepted_rounds']} of {args.rounds}, audit {'ok' if row['audit_ok'] else 'FAILED'}",
                          flush=True)
    summary = {}
    for side in sides:
        for attack in ("skim", "GrindSkim"):
            mine = [r for r in rows if r["side"] == side and r["attack"] == attack]
            summary[f"{side}/{attack}"] = {"runs": len(mine), "convicted": sum(r["convicted_round"] is not None for r in mine),
                                           "accepted_rounds": sum(r["accepted_rounds"] for r in mine),
                                           "audits_ok": sum(r["audit_ok"] for r in mine)}
    print()
    for key, s in summary.items():
        print(f"{key:15s} convicted in {s['convicted']} of {s['runs']} runs; its update accepted in "
              f"{s['accepted_rounds']} of {s['runs'] * args.rounds} rounds; audits passed {s['audits_ok']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "config": {
        "old": args.old, "new": new_side(), "seeds": seeds, "rounds": args.rounds, "p": args.p, "workers": 4, "inner_steps": 6}},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
