"""Fuzz every decoder of peer input with 100,000 hostile inputs; report crashes, time, memory.

    python bench/fuzz.py [--n 100000] [--out bench/results/fuzz.json]

Inputs are random bytes and mutations (bit flips, insertions, deletions, truncations) of valid
packets (every codec), bundles, signed commitments, ledger entries, round records, store
blobs and safetensors files (tests/fuzz_targets.py). Each input must be either accepted or rejected with the decoder's
own error type; anything else is a crash. The slowest single input and the peak RSS show there
is no hang and no unbounded allocation (size limits are checked before allocating).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzz_targets import TARGETS, mutate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz.json"))
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    names = sorted(TARGETS)
    stats = {n: {"inputs": 0, "rejected": 0, "accepted": 0, "crashes": 0, "max_ms": 0.0, "reasons": set()} for n in names}
    crashes = []
    t0 = time.perf_counter()
    for i in range(args.n):
        name = names[i % len(names)]
        decoder, allowed, seeds = TARGETS[name]
        if rnd.random() < 0.3:
            data = rnd.randbytes(rnd.randrange(0, 600))
        else:
            data = mutate(seeds[rnd.randrange(len(seeds))], rnd)
        s = stats[name]
        s["inputs"] += 1
        t = time.perf_counter()
        try:
            decoder(data)
            s["accepted"] += 1
        except allowed as e:
            s["rejected"] += 1
            s["reasons"].add(str(e).split(":")[0][:60])
        except Exception as e:  # a crash: any other exception type
            s["crashes"] += 1
            crashes.append({"target": name, "error": f"{type(e).__name__}: {str(e)[:200]}", "input_hex": data[:200].hex()})
        s["max_ms"] = max(s["max_ms"], (time.perf_counter() - t) * 1e3)
    wall = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = [{"target": n, **{k: v for k, v in stats[n].items() if k != "reasons"}, "distinct_reasons": len(stats[n]["reasons"])} for n in names]
    result = {"inputs": args.n, "wall_s": round(wall, 2), "peak_rss_mb": round(peak_mb, 1), "rows": rows, "crashes": crashes[:20]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| decoder | inputs | rejected | accepted | crashes | slowest input ms | distinct reasons |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['inputs']} | {r['rejected']} | {r['accepted']} | {r['crashes']} | {r['max_ms']:.1f} | {r['distinct_reasons']} |")
    print(f"\n{args.n} inputs in {wall:.1f}s, peak RSS {peak_mb:.0f} MB, crashes: {len(crashes)}  -> {args.out}")
    sys.exit(1 if crashes else 0)


if __name__ == "__main__":
    main()
