"""The audit's peak memory against the run's length: one run, audited by an older revision and by
the working tree.

    python bench/audit_memory.py [--old REV] [--rounds 4,12] [--config FILE] [--set KEY=VALUE ...]
                                 [--out bench/results/audit_memory.json]

Trains one run with the working tree (default: round_cost.py's 43.0M-param config, 172 MB of
fp32, with `verify.replay_probability=0.01` (and the `train.inner_state=reset` and `verify.trace_every=1` it needs), which makes the audit keep start points for replays,
and `run.keep_checkpoints=2`): it stops after the shorter of `--rounds`, is copied (hard links:
blobs never change), and resumes to the longer. Each of the two runs is then audited with `--old`
(from `git archive REV src` on PYTHONPATH) and with the working tree, each in a fresh
interpreter; every audit must pass. Prints each audit's peak resident memory (`ru_maxrss`) and
seconds; the memory added per round is the slope between the two lengths.

An audit checks a run's tensor hashes the way the run made them (the manifest's `tensor_hash`),
and its commitments as that revision writes them, so where `--old` hashes tensors another way
(a revision before the sha256 tree, 37f07f7) or signs commitments without a `salt_hash` (before
the commit-reveal, thirty-ninth session), the old side audits the same two runs trained by
itself: the same config, so the same rounds, only hashed and signed its way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from round_cost import SIZE, source_of

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ["verify.replay_probability=0.01", "train.inner_state=reset", "verify.trace_every=1", "run.keep_checkpoints=2"]


def veriloco(src: Path, *argv: str, path: tuple[Path, ...] = ()) -> tuple[subprocess.CompletedProcess, float, float]:
    """`veriloco ARGV...` with the package at `src` (and `path` after it on PYTHONPATH), in a
    fresh interpreter: the result, its seconds and its peak resident memory in MB."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (src, *path))))
    code = (f"import resource, sys\nfrom veriloco.cli import main\nsys.argv = ['veriloco', *{list(argv)!r}]\n"
            "try:\n    main()\nfinally:\n"
            "    print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    rss = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("MAXRSS ")]
    return done, seconds, rss[-1] / 1024 if rss else float("nan")


TREE = 'TENSOR_HASH = "sha256-tree/1MiB"'  # the scheme's line in hashing.py
SALT = '"salt_hash",'  # a commitment field since the commit-reveal (verify/commitment.py's FIELDS)


def train_both(src: Path, config: str, lengths: list[int], overrides: list[str], into: Path) -> dict[int, Path]:
    """The run of the longer length trained with the package at `src`, stopped after the shorter
    and copied there (hard links: blobs never change; the rest is written in place), then resumed
    to the longer: {length: run directory}."""
    into.mkdir()
    runs = {n: into / f"run-{n}" for n in lengths}
    for argv in (["train", config, "--out", str(runs[lengths[1]]), "--quiet", f"--stop-after={lengths[0]}",
                  f"--train.rounds={lengths[1]}", *[f"--{o}" for o in overrides]],
                 ["train", "--resume", str(runs[lengths[1]]), "--quiet"]):
        done, train_s, _ = veriloco(src, *argv)
        if done.returncode != 0:
            raise SystemExit(f"audit_memory: the run failed: {(done.stderr.strip().splitlines() or ['?'])[-2:]}")
        if argv[1] != "--resume":
            short, long = runs[lengths[0]], runs[lengths[1]]
            short.mkdir()
            for item in long.iterdir():
                subprocess.run(["cp", "-al" if item.name == "store" else "-a", str(item), str(short)], check=True)
        print(f"trained in {train_s:.0f} s ({src})", flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="3cd58e7", help="git revision of the old side (default: before the audit kept only two rounds)")
    ap.add_argument("--rounds", default="4,12", help="two run lengths to audit, comma-separated")
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "audit_memory.json"))
    args = ap.parse_args()
    try:
        lengths = sorted({int(x) for x in args.rounds.split(",")})
    except ValueError:
        ap.error(f"--rounds must be two integers, got {args.rounds!r}")
    if len(lengths) != 2 or lengths[0] < 2:
        ap.error(f"--rounds must be two different lengths >= 2, got {args.rounds!r}")
    overrides = SIZE + EXTRA + args.set
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old").mkdir()
        sides = {"old": source_of(args.old, Path(tmp) / "old"), "new": ROOT / "src"}
        same_hash = (TREE in (sides["old"] / "veriloco" / "hashing.py").read_text()
                     and SALT in (sides["old"] / "veriloco" / "verify" / "commitment.py").read_text())
        trained = {side: train_both(src, args.config, lengths, overrides, Path(tmp) / f"runs-{side}")
                   for side, src in sides.items() if side == "new" or not same_hash}
        for n in lengths:
            for side, src in sides.items():
                copy = trained[side if side in trained else "new"][n]
                audit, seconds, rss = veriloco(src, "audit", str(copy))
                if audit.returncode != 0:
                    raise SystemExit(f"audit_memory: the {side} audit of {n} rounds failed: "
                                     f"{(audit.stderr.strip().splitlines() or ['?'])[0]}")
                rows.append({"side": side, "rounds": n, "peak_rss_mb": round(rss, 1), "seconds": round(seconds, 2)})
                print(f"{side:4s} {n:3d} rounds: peak {rss:9.1f} MB, {seconds:6.1f} s", flush=True)
    fig = {(r["side"], r["rounds"]): r for r in rows}
    a, b = lengths
    slope = {side: (fig[side, b]["peak_rss_mb"] - fig[side, a]["peak_rss_mb"]) / (b - a) for side in sides}
    print(f"\npeak memory added per round of the run: old {slope['old']:.1f} MB, new {slope['new']:.1f} MB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"old": args.old, "old_trained_its_own": not same_hash, "overrides": overrides, "rows": rows,
                                          "mb_per_round": slope}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
