"""How long the per-round LR ramp should be when the inner AdamW state is reset every round.

    python bench/reset_ramp.py [--rounds 14] [--inner-steps 30] [--ramps 5,10]
                               [--out bench/results/reset_ramp-h30.json]

Replays need `[train] inner_state = "reset"` (a round from public data only), and from empty
moments AdamW's first steps are sign steps at the full LR. `[train] round_warmup_steps = w` ramps
the inner LR over each round's first w steps. Side by side in one process, configs/default.toml
(the `make run` job: 4 workers, the default GPT, same seed and batches) at H = `--inner-steps`
for `--rounds` rounds: the moments kept (`keep`), reset (`reset`), and reset with each ramp
length in `--ramps`. Prints each run's final eval loss and its difference from `keep`; writes
`{"rows": [{"name", "round_warmup_steps", "inner_state", "eval_loss", "vs_keep_pct", "wall_s"}],
"config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verified_cost import run_rows  # noqa: E402
from verify import ROOT  # noqa: E402

from veriloco.config import ConfigError, load_config  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--ramps", default="5,10", help="comma-separated round_warmup_steps to try with reset")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an override for every row (e.g. model size, for tests)")
    ap.add_argument("--out", default=None, help="default bench/results/reset_ramp-h{H}.json")
    args = ap.parse_args(argv)
    try:
        ramps = [int(x) for x in args.ramps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ramps must be comma-separated integers, got {args.ramps!r}")
    rows_spec = [("keep", "keep", 0), ("reset", "reset", 0), *((f"reset+ramp{w}", "reset", w) for w in ramps)]
    base = [f"--train.rounds={args.rounds}", f"--train.inner_steps={args.inner_steps}", *(f"--{s}" for s in args.set)]
    try:
        cfgs = [(name, load_config(ROOT / "configs" / "default.toml",
                                   [*base, f"--train.inner_state={state}", f"--train.round_warmup_steps={w}"]))
                for name, state, w in rows_spec]
    except ConfigError as e:
        ap.error(str(e))
    rows = []
    for name, cfg, _, summary, wall in run_rows(cfgs):
        rows.append({"name": name, "inner_state": cfg.train.inner_state,
                     "round_warmup_steps": cfg.train.round_warmup_steps, "eval_loss": summary["eval_loss_end"],
                     "wall_s": round(wall, 1)})
        print(f"{name}: eval {summary['eval_loss_end']:.4f}", flush=True)
    keep = rows[0]["eval_loss"]
    for r in rows:
        r["vs_keep_pct"] = round(100 * (r["eval_loss"] / keep - 1), 3)
    print(f"\nH = {args.inner_steps}, {args.rounds} rounds")
    print(f"{'row':<14} {'eval loss':>9} {'vs keep':>8}")
    for r in rows:
        print(f"{r['name']:<14} {r['eval_loss']:>9.4f} {r['vs_keep_pct']:>+7.2f}%")
    out = {"rows": rows, "config": {"rounds": args.rounds, "inner_steps": args.inner_steps, "ramps": ramps,
                                    "set": args.set}}
    path = Path(args.out or ROOT / "bench" / "results" / f"reset_ramp-h{args.inner_steps}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
