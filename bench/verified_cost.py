"""What verification costs a user: `make run`'s job plain and with configs/verified.toml, side by side.

    python bench/verified_cost.py [--rounds 14] [--quick] [--out bench/results/verified_cost.json]

Five runs of the same job (4 workers, the default GPT, same seed and batches), one after another
in one process:

- `plain`: configs/default.toml, what `make run` does (inner AdamW state kept across rounds,
  mean aggregate; the checks every run has: signatures, batch roots, decoding, the screen);
- `reset`: the same with `train.inner_state = "reset"` (AdamW moments start empty every round),
  the one change to training that replays need, alone;
- `reset+ramp`: reset with configs/verified.toml's `train.round_warmup_steps` (10: the inner LR
  ramps up over each round's first 10 steps, while the fresh moments fill);
- `keep+ramp`: the ramp without the reset, the control: is the ramp a gain of its own?
- `verified`: configs/verified.toml (reset with the ramp, trimmed mean, the loss-gain screen,
  replays at p = 0.1).

For each: final eval loss, wall seconds, tokens/s, bytes sent per worker, honest rejections, and
the verification compute by part in CPU seconds of each worker's thread (bench/verify.py's
`overhead_of`: checks, loss gains, replays, as shares of the inner steps' CPU seconds), with
ratios to `plain`. `--quick`: 4 rounds. Writes `{"rows": [...], "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify import ROOT, overhead_of  # noqa: E402

from veriloco.config import Config, ConfigError, load_config  # noqa: E402
from veriloco.run import train  # noqa: E402

RAMP = "--train.round_warmup_steps={}"  # the verified config's ramp, for the rows that take it alone
ROWS = (("plain", "default.toml", []), ("reset", "default.toml", ["--train.inner_state=reset"]),
        ("reset+ramp", "default.toml", ["--train.inner_state=reset", RAMP]),
        ("keep+ramp", "default.toml", [RAMP]),
        ("verified", "verified.toml", []))


def row_of(name: str, summary: dict, recs: list[dict], wall: float, probability: float) -> dict:
    """One row from a finished run: its summary, its round records and the measured wall time."""
    over = overhead_of([recs], probability)
    rejected = sum(v != "accept" for rec in recs for v in rec["verdicts"])
    # replays of loss-gain suspects (replayed whether drawn or not), beside the drawn ones
    suspects = sum(isinstance(e, dict) and "suspect" in e for rec in recs for e in (rec.get("evidence") or {}).values())
    return {"name": name, "eval_loss": summary["eval_loss_end"], "wall_s": round(wall, 2),
            "tokens_per_s": summary["tokens_per_s"], "bytes_per_worker": summary["bytes_sent_per_worker"],
            "rejections": rejected, "submissions": sum(len(rec["verdicts"]) for rec in recs),
            "replays": over["replays"], "suspect_replays": suspects, "verify_cpu": over.get("cpu", {})}


def run_rows(cfgs: list[tuple[str, Config]]) -> Iterator[tuple[str, Config, list[dict], dict, float]]:
    """Each (name, cfg) run to the end in turn, in a temporary directory: (name, cfg, its round
    records, its summary, its wall seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in cfgs:
            t0 = time.perf_counter()
            run, summary = train(cfg, str(Path(tmp) / name), quiet=True)
            wall = time.perf_counter() - t0
            yield name, cfg, [json.loads(line) for line in run.rounds_path.read_text().splitlines()], summary, wall


def row_bench_args(ap: argparse.ArgumentParser, rounds: int, out: str) -> None:
    """The arguments of a bench that runs whole configs row by row: --rounds, --quick, --set, --out."""
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--quick", action="store_true", help="4 rounds")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an override for every row (e.g. model size, for tests)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out))


def rounds_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--rounds, or 4 with --quick; exits 2 (argparse) when it is not >= 1."""
    rounds = 4 if args.quick else args.rounds
    if rounds < 1:
        ap.error(f"--rounds must be >= 1, got {rounds}")
    return rounds


def _pct(shares: dict, key: str) -> str:
    return f"{100 * shares[key]:.2f}%" if key in shares else "-"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    row_bench_args(ap, 14, "verified_cost.json")
    args = ap.parse_args(argv)
    rounds = rounds_of(ap, args)
    sets = [f"--train.rounds={rounds}", *(f"--{s}" for s in args.set)]
    try:
        ramp = load_config(ROOT / "configs" / "verified.toml", sets).train.round_warmup_steps
        cfgs = [(name, load_config(ROOT / "configs" / config, [*(x.format(ramp) for x in extra), *sets]))
                for name, config, extra in ROWS]
    except ConfigError as e:
        ap.error(str(e))
    rows = []
    for name, cfg, recs, summary, wall in run_rows(cfgs):
        rows.append(row_of(name, summary, recs, wall, cfg.verify.replay_probability))
        print(f"{name}: {rows[-1]}", flush=True)
    base = rows[0]
    for r in rows:
        r["loss_vs_plain_pct"] = round(100 * (r["eval_loss"] / base["eval_loss"] - 1), 2)
        r["tokens_per_s_vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    print(f"\n{'row':<10} {'eval loss':>9} {'vs plain':>8} {'wall':>7} {'tok/s':>8} {'vs plain':>8} {'replays':>7} "
          f"{'suspects':>8} {'checks':>7} {'gains':>7} {'replay':>7} {'rejected':>8}")
    for r in rows:
        c = r["verify_cpu"]
        print(f"{r['name']:<10} {r['eval_loss']:>9.4f} {r['loss_vs_plain_pct']:>+7.2f}% {r['wall_s']:>6.1f}s "
              f"{r['tokens_per_s']:>8.0f} {r['tokens_per_s_vs_plain']:>7.3f}x {r['replays']:>7} "
              f"{r['suspect_replays']:>8} {_pct(c, 'checks'):>7} "
              f"{_pct(c, 'loss_gain'):>7} {_pct(c, 'replay'):>7} {r['rejections']:>4}/{r['submissions']}")
    out = {"rows": rows, "config": {"rounds": rounds, "set": args.set}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
