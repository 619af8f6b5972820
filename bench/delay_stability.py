"""Is delay 1 stable at the default outer optimizer? Eval loss per round, side by side.

    python bench/delay_stability.py [--rounds 16] [--out bench/results/delay_stability.json]

configs/tiny.toml with 3 workers, static membership, no faults: delay 0 at the default outer
optimizer (lr 0.7, Nesterov momentum 0.9) and at momentum 0.5, and delay 1 with the eager
correction at the default, at momentum 0.5 and at outer lr 0.4, and with the local correction
and the lookahead at the default. Deterministic on CPU (the same numbers every run). Prints each row's
eval loss per round and writes `{"rows": [{"name", "overrides", "eval_loss": [...]}]}`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from veriloco.config import load_config
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    ("delay 0", ["--outer.delay=0"]),
    ("delay 0, momentum 0.5", ["--outer.delay=0", "--outer.momentum=0.5"]),
    ("delay 1 eager", ["--outer.delay=1"]),
    ("delay 1 eager, momentum 0.5", ["--outer.delay=1", "--outer.momentum=0.5"]),
    ("delay 1 eager, outer lr 0.4", ["--outer.delay=1", "--outer.lr=0.4"]),
    ("delay 1 local+lookahead", ["--outer.delay=1", "--outer.correction=local", "--outer.lookahead=true"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "delay_stability.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(ROWS):
            cfg = load_config(ROOT / "configs" / "tiny.toml",
                              ["--topology.workers=3", f"--train.rounds={args.rounds}", *overrides])
            run, _ = train(cfg, str(Path(tmp) / str(i)), quiet=True)
            recs = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
            rows.append({"name": name, "overrides": overrides, "eval_loss": [round(r["eval_loss"], 4) for r in recs]})
            print(f"{name:30s} " + " ".join(f"{x:.3f}" for x in rows[-1]["eval_loss"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
