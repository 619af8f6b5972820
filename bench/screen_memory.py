"""What the screen and the robust aggregate of one round hold beside their inputs, and how long
they take: an older revision of veriloco against the working tree, on the same model-sized deltas.

    python bench/screen_memory.py [--old REV] [--workers 2,4] [--calls screen,trimmed_mean]
                                  [--repeats 3] [--d-model 768] [--layers 6]
                                  [--out bench/results/screen_memory.json]

Deltas are a GPT's parameter tensors (default: round_cost.py's 43.0M-param model, 172 MB of
fp32 each) for W workers this round and W the round before: a shared direction plus each
worker's own noise (honest-looking: cosines to the centre near 0.5), made from a fixed seed. A
call is `screen` (`screen_round` on both rounds' deltas) or an aggregation method
(`aggregate(this round's deltas, METHOD)`: trimmed_mean, median, mean, ...). Each side runs each
call (`--old` from `git archive REV src` on PYTHONPATH, the new side the working tree's `src`) in a
fresh interpreter, alternating, `--repeats` times each, with a thread sampling the process's
resident memory every millisecond. Per side: the largest resident memory during the call above
what the process held just before it (the inputs, torch), and the call's seconds; medians over
repeats. Both sides must return the same result (the screen's verdicts and evidence as JSON,
every float's bits; the aggregate's tensors, every bit), or the script stops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from round_cost import source_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from veriloco.verify.aggregate import METHODS  # noqa: E402

# run in the measured interpreter: argv = [workers, d_model, layers, call]; prints one JSON line
CHILD = r"""
import hashlib, json, os, sys, threading, time
import torch
from veriloco.verify.aggregate import aggregate
from veriloco.config import ModelConfig
from veriloco.model import build_meta
from veriloco.verify.screen import screen_round

workers, d_model, layers = (int(x) for x in sys.argv[1:4])
call = sys.argv[4]
torch.manual_seed(0)
cfg = ModelConfig(d_model=d_model, n_head=max(1, d_model // 64), n_layer=layers)
shapes = {k: v.shape for k, v in build_meta(cfg).state_dict().items()}
common = {k: torch.randn(s) for k, s in shapes.items()}
def delta():
    return {k: common[k] + torch.randn(s) for k, s in shapes.items()}
deltas = {w: delta() for w in range(workers)}
previous = {w: delta() for w in range(workers)}
del common
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
peak, running = [0], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
before = rss()
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter()
if call == "screen":
    verdicts = screen_round(deltas, previous_deltas=previous,
                            packet_hashes={w: f"h{w}" for w in deltas},
                            previous_packet_hashes={w: f"p{w}" for w in previous})
else:
    out = aggregate(deltas, call)
seconds = time.perf_counter() - t0
running[0] = False; t.join()
peak[0] = max(peak[0], rss())
params = sum(s.numel() for s in shapes.values())
if call == "screen":
    result = json.dumps({w: [v.reason, v.evidence] for w, v in verdicts.items()}, sort_keys=True, allow_nan=True)
else:
    result = hashlib.sha256(b"".join(out[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(out))).hexdigest()
print(json.dumps({"params": params, "held_mb": (peak[0] - before) / 1e6, "seconds": seconds, "result": result}))
"""


def run_side(src: Path, workers: int, d_model: int, layers: int, call: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, "-c", CHILD, str(workers), str(d_model), str(layers), call],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"screen_memory: {call} with {src} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="df9f9c4", help="git revision of the old side (default: before the chunked sums "
                    "and the aggregates a tensor at a time)")
    ap.add_argument("--workers", default="2,4", help="comma-separated worker counts W (2W rows each)")
    ap.add_argument("--calls", default="screen,trimmed_mean", help="comma-separated: screen and/or aggregation methods")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "screen_memory.json"))
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers must be comma-separated ints, got {args.workers!r}")
    calls = args.calls.split(",")
    unknown = [c for c in calls if c != "screen" and c not in METHODS]
    if unknown:
        ap.error(f"--calls takes screen and {', '.join(METHODS)}; got {', '.join(unknown)}")
    if min(counts) < 1 or args.repeats < 1 or args.layers < 1 or args.d_model < 64 or args.d_model % 64:
        ap.error("--workers and --repeats must be >= 1, --layers >= 1, --d-model a multiple of 64")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_src = source_of(args.old, Path(tmp))
        for call, w in [(c, w) for c in calls for w in counts]:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for _ in range(args.repeats):
                for side, src in (("old", old_src), ("new", ROOT / "src")):
                    runs[side].append(run_side(src, w, args.d_model, args.layers, call))
            if len({r["result"] for side in runs.values() for r in side}) != 1:
                raise SystemExit(f"screen_memory: {call}, W={w}: the two sides' results differ")
            row = {"call": call, "workers": w, "params": runs["new"][0]["params"]}
            for side in ("old", "new"):
                row[f"{side}_held_mb"] = statistics.median(r["held_mb"] for r in runs[side])
                row[f"{side}_s"] = statistics.median(r["seconds"] for r in runs[side])
            row["held_ratio"] = row["new_held_mb"] / row["old_held_mb"] if row["old_held_mb"] > 0 else None
            row["time_ratio"] = row["new_s"] / row["old_s"]
            rows.append(row)
            rows_of = f"{2 * w} rows" if call == "screen" else f"{w} deltas"
            print(f"{call}, W={w} ({rows_of} of {row['params'] / 1e6:.1f}M params): held {row['old_held_mb']:.1f} -> "
                  f"{row['new_held_mb']:.1f} MB, {row['old_s']:.2f} -> {row['new_s']:.2f} s "
                  f"(x{row['time_ratio']:.3f}); results identical", flush=True)
    result = {"old": args.old, "repeats": args.repeats, "d_model": args.d_model, "layers": args.layers,
              "threads": os.environ.get("OMP_NUM_THREADS", "1"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
