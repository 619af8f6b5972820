"""What a round costs outside its inner steps, at a model size where it shows: an older revision
of veriloco against the working tree, the same run, alternately.

    python bench/round_cost.py [--old REV] [--repeats 2] [--rounds 4] [--config FILE]
                               [--set KEY=VALUE ...] [--out bench/results/round_cost.json]

Both sides train the same config (default: `--config configs/default.toml` widened to d_model 768, 12
heads, 6 layers: 43.0M params, 172 MB of fp32; 2 workers, 2 inner steps of batch 2, fp32
packets) with `veriloco train` in a fresh interpreter each, `--old` from `git archive REV src`
on PYTHONPATH and the working tree's `src` for the new side, alternating, `--repeats` times each.
The inner steps are kept few and small so that a round is mostly what happens around them: the
checks of every bundle (hashes, signature, decode, screen), the aggregate and outer step, the
checkpoint and private state written with fsync, the agreement hash, the record. Both sides must
record the same params hash every round, or the script stops.

From each run's round records (rounds 1..; round 0 also starts the processes), per round:
`round_s` (the recorder's round, start to record), the slowest worker's `inner_s`, `wait_s`
(waiting for the exchange) and `verify_s` (the checks), and `other_s`, what is left: aggregate,
outer step, checkpoint, state, hashes, record; and `peak_rss_mb`, the largest worker process's
peak resident memory so far (MB). Prints the medians and new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = ["model.d_model=768", "model.n_head=12", "model.n_layer=6", "topology.workers=2", "train.inner_steps=2",
        "train.batch_size=2", "train.eval_batches=1", "train.eval_every=100"]
FIELDS = ("round_s", "inner_s", "wait_s", "verify_s", "other_s", "peak_rss_mb")


def source_of(rev: str, into: Path) -> Path:
    """`src` of git revision `rev`, unpacked under `into`; its path for PYTHONPATH."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def run_once(src: Path, config: str, overrides: list[str], rounds: int, out: Path) -> list[dict]:
    """`veriloco train` with the package at `src`; the round records."""
    env = dict(os.environ, PYTHONPATH=str(src))
    argv = ["train", config, "--out", str(out), "--quiet",
            f"--train.rounds={rounds}", *[f"--{o}" for o in overrides]]
    code = f"import sys; from veriloco.cli import main; sys.argv = ['veriloco', *{argv!r}]; main()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"round_cost: the run with {src} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    shutil.rmtree(out)  # a round stores about 8x the model (checkpoint, bundles, packets, states)
    return records


def per_round(records: list[dict]) -> dict[str, float]:
    """Medians over rounds 1.. of the FIELDS (seconds)."""
    rows = []
    for r in records[1:]:
        inner, wait, verify = max(r["inner_s"]), max(r["wait_s"]), max(r["verify_s"])
        rows.append({"round_s": r["round_s"], "inner_s": inner, "wait_s": wait, "verify_s": verify,
                     "other_s": r["round_s"] - inner - wait - verify, "peak_rss_mb": max(r["peak_rss_mb"])})
    return {k: statistics.median(x[k] for x in rows) for k in FIELDS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="4a5212f", help="git revision of the old side (default: before this bench's changes)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"), help="the config both sides train")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for both sides")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "round_cost.json"))
    args = ap.parse_args()
    if args.repeats < 1 or args.rounds < 2:
        ap.error("--repeats must be >= 1 and --rounds >= 2 (round 0 is not counted)")
    overrides = SIZE + args.set
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    first: list[str] | None = None  # the first run's params hashes, round by round
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"old": source_of(args.old, Path(tmp)), "new": ROOT / "src"}
        for i in range(args.repeats):
            for side, src in sides.items():
                records = run_once(src, args.config, overrides, args.rounds, Path(tmp) / f"{side}-{i}")
                got = [r["params_hash"] for r in records]
                first = first or got
                if got != first:
                    raise SystemExit(f"round_cost: {side} (repeat {i}) recorded other params than the first run")
                results[side].append(per_round(records))
                print(f"{side} {i}: " + "  ".join(f"{k} {v:.3f}" for k, v in results[side][-1].items()), flush=True)
    medians = {side: {k: statistics.median(x[k] for x in rows) for k in FIELDS} for side, rows in results.items()}
    print(f"\nmedian seconds a round over rounds 1-{args.rounds - 1}, {args.repeats} runs each (old = {args.old})")
    print(f"{'':10s}" + "".join(f"{k:>12s}" for k in FIELDS))
    for side in ("old", "new"):
        print(f"{side:10s}" + "".join(f"{medians[side][k]:12.3f}" for k in FIELDS))
    ratio = {k: medians["new"][k] / medians["old"][k] if medians["old"][k] else float("nan") for k in FIELDS}
    print(f"{'new/old':10s}" + "".join(f"{ratio[k]:12.3f}" for k in FIELDS))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"old": args.old, "overrides": overrides, "rounds": args.rounds,
                                          "repeats": args.repeats, "runs": results, "median": medians,
                                          "ratio": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
