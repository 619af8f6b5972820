"""Adaptive H on a link too slow for the configured H: fixed H against `[train] inner_steps_max`.

    python bench/adaptive_h.py [--rounds 10] [--bandwidth 5mbit] [--inner-steps 30] [--max 300]
                               [--quick] [--set SECTION.KEY=VALUE ...] [--out bench/results/adaptive_h.json]

`make run`'s job (configs/default.toml: 4 workers, the default GPT) with delay 1 (eager, outer
momentum 0.5) and fp32 packets on an emulated link of `--bandwidth` and 50 ms, where a round of
`--inner-steps` steps is too short to hide its exchange: each worker sends its 3.5 MB packet to 3
others, 17 s at 5 Mbit/s, against about 0.3 s per inner step here. (5 Mbit/s for a 0.9M-parameter
model on CPU is the ratio of a ~100M-parameter model on a GPU at 1 Gbit/s: seconds of exchange
per second of compute.) Three rows, one after another in one process:

- `fixed`: H = `--inner-steps` every round;
- `adaptive`: the same start, `train.inner_steps_max = --max`: from round 2 on, H grows to what
  the records' `hide_steps` say hides the exchange (so more tokens in the same rounds);
- `fixed, same tokens`: H = `--inner-steps` for as many rounds as it takes to train on the
  adaptive row's tokens (rounded to whole rounds): what the adaptive row's tokens cost at fixed H;
- `fixed, same wall`: H = `--inner-steps` for as many rounds as fit in the adaptive row's wall time
  at the fixed row's seconds per round: what the same time buys at fixed H;
- `adaptive codec`: H = `--inner-steps` with `compress.codec = "adaptive"` and error feedback: the
  controller picks codecs per tensor so the packet fits under the round's compute instead;
- `adaptive codec + H`: both (H grows only when even the smallest packets do not hide).

For each: eval loss, tokens, wall seconds, tokens/s, utilisation (mean inner-step seconds / wall),
the seconds spent waiting for exchanges, bytes sent per worker, and each round's H. `--quick`: 4
rounds. Writes `{"rows": [...], "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verified_cost import rounds_of, row_bench_args, run_rows  # noqa: E402
from verify import ROOT  # noqa: E402

from veriloco.config import ConfigError, load_config  # noqa: E402


def row_of(name: str, summary: dict, recs: list[dict], wall: float) -> dict:
    """One row from a finished run."""
    workers = len(recs[0]["inner_s"])
    return {
        "name": name, "eval_loss": summary["eval_loss_end"], "tokens": summary["tokens"], "rounds": len(recs),
        "wall_s": round(wall, 2), "run_wall_s": summary["wall_s"], "tokens_per_s": summary["tokens_per_s"],
        "utilisation": summary["utilisation"], "bytes_per_worker": summary["bytes_sent_per_worker"],
        "exchange_wait_s": round(sum(sum(r["wait_s"]) for r in recs) / workers, 2),
        "inner_steps": [r.get("inner_steps") for r in recs],
        "hide_steps": [r.get("hide_steps") for r in recs],
        # the recorder's codec per tensor in the last round, counted (the adaptive controller's choice)
        "codecs_last_round": dict(Counter((recs[-1].get("codec_log") or {}).get("codecs", {}).values())),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    row_bench_args(ap, 10, "adaptive_h.json")
    ap.add_argument("--bandwidth", default="5mbit")
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--max", type=int, default=300, help="train.inner_steps_max of the adaptive row")
    args = ap.parse_args(argv)
    rounds = rounds_of(ap, args)
    common = ["--outer.delay=1", "--outer.momentum=0.5", f"--link.bandwidth={args.bandwidth}", "--link.latency=50ms",
              f"--train.inner_steps={args.inner_steps}", *(f"--{s}" for s in args.set)]
    default = ROOT / "configs" / "default.toml"
    try:
        first = [("fixed", load_config(default, [*common, f"--train.rounds={rounds}"])),
                 ("adaptive", load_config(default, [*common, f"--train.rounds={rounds}", f"--train.inner_steps_max={args.max}"]))]
    except ConfigError as e:
        ap.error(str(e))
    rows = []
    for name, _, recs, summary, wall in run_rows(first):
        rows.append(row_of(name, summary, recs, wall))
        print(f"{name}: {rows[-1]}", flush=True)
    per_round = rows[0]["tokens"] / rows[0]["rounds"]
    same_tokens = max(1, round(rows[1]["tokens"] / per_round))
    same_wall = max(1, round(rows[1]["run_wall_s"] / (rows[0]["run_wall_s"] / rows[0]["rounds"])))
    codec = ["--compress.codec=adaptive", "--compress.error_feedback=true", f"--train.rounds={rounds}"]
    more = [("fixed, same tokens", [f"--train.rounds={same_tokens}"]), ("fixed, same wall", [f"--train.rounds={same_wall}"]),
            ("adaptive codec", codec), ("adaptive codec + H", [*codec, f"--train.inner_steps_max={args.max}"])]
    for name, _, recs, summary, wall in run_rows([(name, load_config(default, [*common, *extra])) for name, extra in more]):
        rows.append(row_of(name, summary, recs, wall))
        print(f"{name}: {rows[-1]}", flush=True)
    for r in rows:
        r["loss_vs_fixed_pct"] = round(100 * (r["eval_loss"] / rows[0]["eval_loss"] - 1), 2)
        r["tokens_per_s_vs_fixed"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    print(f"\n{'row':<19} {'eval loss':>9} {'vs fixed':>8} {'tokens':>9} {'rounds':>6} {'wall':>7} {'tok/s':>7} "
          f"{'util':>6} {'waited':>7} {'sent/worker':>11}  H per round")
    for r in rows:
        steps = r["inner_steps"] if r["inner_steps"][0] else args.inner_steps
        print(f"{r['name']:<19} {r['eval_loss']:>9.4f} {r['loss_vs_fixed_pct']:>+7.2f}% {r['tokens'] / 1e6:>8.2f}M "
              f"{r['rounds']:>6} {r['run_wall_s']:>6.1f}s {r['tokens_per_s']:>7.0f} {100 * r['utilisation']:>5.1f}% "
              f"{r['exchange_wait_s']:>6.1f}s {r['bytes_per_worker'] / 1e6:>9.1f}MB  {steps}"
              + (f"  codecs {r['codecs_last_round']}" if r["codecs_last_round"] else ""))
    out = {"rows": rows, "config": {"rounds": rounds, "bandwidth": args.bandwidth, "latency": "50ms",
                                    "inner_steps": args.inner_steps, "max": args.max, "set": args.set}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
