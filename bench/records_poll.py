"""What polling a run's rounds.jsonl costs as the run grows: the whole file read and parsed
(`RunDir.rounds`) against only what was appended (`RoundsFollower`, what the elastic launcher and
a worker awaiting a record poll, every 50 and 20 ms).

    python bench/records_poll.py [--rounds 100,1000,10000] [--workers 4] [--config FILE]
                                 [--out bench/results/records_poll.json]

A real record first: a 1-round run of `--config` (default `configs/default.toml`) with `--topology.workers W`
(`--train.inner_steps=1`); its rounds.jsonl line is then written N times. For each N: the median
of 5 whole reads, the follower's first read, and the median of 1000 polls after it with nothing
new, then with one record appended before each poll. Both must give the same records.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from veriloco.records import RoundsFollower, RunDir  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn()."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", default="100,1000,10000", help="record counts, comma-separated")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"), help="the config of the run whose record is copied")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "records_poll.json"))
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.rounds.split(",")]
    except ValueError:
        ap.error(f"--rounds must be integers, got {args.rounds!r}")
    if not counts or min(counts) < 1 or args.workers < 2:
        ap.error("--rounds must be >= 1 and --workers >= 2")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        done = subprocess.run([sys.executable, "-m", "veriloco.cli", "train", args.config,
                               "--out", str(src), "--quiet", "--train.rounds=1", "--train.inner_steps=1",
                               "--train.eval_batches=1", f"--topology.workers={args.workers}"],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
        if done.returncode != 0:
            raise SystemExit(f"records_poll: the run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        line = (src / "rounds.jsonl").read_bytes().splitlines()[0] + b"\n"
        print(f"a record of {args.workers} workers: {len(line):,} bytes", flush=True)
        for n in counts:
            run = RunDir(Path(tmp) / f"run-{n}")
            run.root.mkdir()
            run.rounds_path.write_bytes(line * n)
            whole = timed(run.rounds, 5)
            follower = RoundsFollower(run)
            t0 = time.perf_counter()
            first = follower.rounds()
            first_s = time.perf_counter() - t0
            if first != run.rounds():
                raise SystemExit("records_poll: the follower read other records than RunDir.rounds")
            idle = timed(follower.rounds, 1000)

            def grown(run: RunDir = run, follower: RoundsFollower = follower) -> None:
                with run.rounds_path.open("ab") as f:
                    f.write(line)
                follower.rounds()

            appended = timed(grown, 1000)
            if len(follower.rounds()) != n + 1000 or follower.rounds() != run.rounds():
                raise SystemExit("records_poll: the follower lost an appended record")
            rows.append({"records": n, "file_bytes": len(line) * n, "whole_read_ms": round(whole * 1e3, 3),
                         "follower_first_ms": round(first_s * 1e3, 3), "poll_idle_us": round(idle * 1e6, 2),
                         "poll_one_appended_us": round(appended * 1e6, 2)})
            r = rows[-1]
            print(f"{n:>7,} records ({r['file_bytes'] / 1e6:8.2f} MB): whole read {r['whole_read_ms']:9.2f} ms, follower "
                  f"first {r['follower_first_ms']:9.2f} ms, then a poll {r['poll_idle_us']:7.2f} us "
                  f"({r['poll_one_appended_us']:7.2f} us with a record appended)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workers": args.workers, "record_bytes": len(line), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
