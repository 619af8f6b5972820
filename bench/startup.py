"""How long a small run takes to start and finish: worker processes from the forkserver
(`procs.py`, torch preloaded) against spawn (each worker imports torch anew), side by side.

    python bench/startup.py [--repeats 3] [--workers 4] [--out bench/results/startup.json]

Each repeat trains configs/tiny.toml for 1 round of 1 inner step with W workers, once per start
method, alternating (the machine is shared and noisy). The forkserver's first run also starts
the server (imports torch and the engine once); later runs fork from it. Prints a table and
writes `{"rows": [{"start_method", "run", "seconds"}...], "median_s": {...}, "ratio": x}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from veriloco import procs
from veriloco.config import load_config
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]


def one_run(workers: int, method: str, out: Path) -> float:
    procs.START_METHOD = method
    cfg = load_config(ROOT / "configs" / "tiny.toml",
                      [f"--topology.workers={workers}", "--train.rounds=1", "--train.inner_steps=1"])
    t0 = time.perf_counter()
    train(cfg, str(out), quiet=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for method in ("forkserver", "spawn"):
                s = one_run(args.workers, method, Path(tmp) / f"{method}-{i}")
                rows.append({"start_method": method, "run": i, "seconds": round(s, 3)})
                print(f"run {i} {method:10s} {s:6.2f} s", flush=True)
    # the forkserver's first run pays for starting the server; the median is over the later ones
    later = {m: [r["seconds"] for r in rows if r["start_method"] == m and (r["run"] > 0 or m == "spawn")]
             for m in ("forkserver", "spawn")}
    median = {m: statistics.median(v) for m, v in later.items() if v}
    result = {"rows": rows, "workers": args.workers, "median_s": median,
              "ratio": round(median["spawn"] / median["forkserver"], 2) if len(median) == 2 else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmedian seconds per run (forkserver: after its first): {median}; spawn / forkserver = "
          f"{result['ratio']}  -> {args.out}")


if __name__ == "__main__":
    main()
