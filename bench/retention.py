"""What `[run] keep_checkpoints` saves: the same run keeping every round's checkpoint and keeping
the newest N, side by side, each then audited.

    python bench/retention.py [--keep 2] [--rounds 6] [--config FILE] [--set KEY=VALUE ...]
                              [--out bench/results/retention.json]

Both runs train the same config (default: round_cost.py's, `configs/default.toml` widened to 43.0M
params: a checkpoint of G and its outer momentum is 344 MB) with `veriloco train` in a fresh
interpreter, keep_checkpoints = 0 first, then = N; then `veriloco audit` runs on each. They must
record the same params hash every round, both audits must pass, and the pruned run's audit must
name the rounds it recomputed without their checkpoints, or the script stops.

Per run: the bytes of the run's store at the end (every blob: corpus, G_0, bundles, packets,
checkpoints), the checkpoints it holds, the median round_s over rounds 1.., the run's wall time
(`veriloco train`, start to end) and the audit's. Prints the table and kept/all ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from round_cost import SIZE

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("store_bytes", "checkpoints_held", "round_s", "train_s", "audit_s")


def veriloco(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """`veriloco ARGV...` in a fresh interpreter with this tree's package; the result and seconds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    code = f"import sys; from veriloco.cli import main; sys.argv = ['veriloco', *{list(argv)!r}]; main()"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return done, time.perf_counter() - t0


def store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def one_run(config: str, overrides: list[str], rounds: int, keep: int, out: Path) -> dict:
    """Train and audit one run; its figures, params hashes and the audit's line."""
    done, train_s = veriloco("train", config, "--out", str(out), "--quiet", f"--train.rounds={rounds}",
                             f"--run.keep_checkpoints={keep}", *[f"--{o}" for o in overrides])
    if done.returncode != 0:
        raise SystemExit(f"retention: the run with keep {keep} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    store = out / "store"
    held = sum((store / r["checkpoint"][:2] / r["checkpoint"][2:]).exists() for r in records)
    audit, audit_s = veriloco("audit", str(out))
    if audit.returncode != 0:
        raise SystemExit(f"retention: the audit of the run with keep {keep} failed: {audit.stderr.strip()}")
    row = {"keep": keep, "store_bytes": store_bytes(store), "checkpoints_held": held,
           "round_s": statistics.median(r["round_s"] for r in records[1:]), "train_s": round(train_s, 2),
           "audit_s": round(audit_s, 2), "audit": audit.stdout.strip(), "params": [r["params_hash"] for r in records]}
    shutil.rmtree(out)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=int, default=2, help="run.keep_checkpoints of the pruned run (>= 2)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"), help="the config both runs train")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for both runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "retention.json"))
    args = ap.parse_args()
    if args.keep < 2 or args.rounds <= args.keep:
        ap.error("--keep must be >= 2 and --rounds > --keep (else nothing is pruned)")
    overrides = SIZE + args.set
    with tempfile.TemporaryDirectory() as tmp:
        rows = [one_run(args.config, overrides, args.rounds, keep, Path(tmp) / f"keep-{keep}") for keep in (0, args.keep)]
    if rows[0]["params"] != rows[1]["params"]:
        raise SystemExit("retention: the two runs recorded different params")
    pruned = args.rounds - args.keep
    if f"({pruned} pruned from the store" not in rows[1]["audit"] or "pruned" in rows[0]["audit"]:
        raise SystemExit(f"retention: the audits do not say what was pruned: {rows[0]['audit']!r} / {rows[1]['audit']!r}")
    print(f"{args.rounds} rounds; store at the end, checkpoints it holds, median round (rounds 1..), train and audit wall")
    print(f"{'keep':>6s}" + "".join(f"{k:>18s}" for k in FIELDS))
    for r in rows:
        print(f"{r['keep']:6d}" + "".join(f"{r[k]:18,.2f}" if isinstance(r[k], float) else f"{r[k]:18,d}" for k in FIELDS))
    ratio = {k: rows[1][k] / rows[0][k] if rows[0][k] else float("nan") for k in FIELDS}
    print(f"{'ratio':>6s}" + "".join(f"{ratio[k]:18.3f}" for k in FIELDS))
    for r in rows:
        print(f"audit, keep {r['keep']}: {r['audit']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"keep": args.keep, "rounds": args.rounds, "overrides": overrides,
                                          "rows": [{k: v for k, v in r.items() if k != "params"} for r in rows],
                                          "ratio": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
