"""Training over a real kernel-shaped link against the software emulation of the same link.

    python bench/kernel_link.py [--bandwidth 10mbit] [--latency 0ms] [--rounds 8] [--trials 2] [--out results.json]

The same elastic run (3 workers, the tiny GPT, fp32 packets, delay 0) twice per trial, one after
the other:

  emulated  `[link] shaping = "emulated"`: workers on loopback, each exchange paced in software to
            latency + max(sent, received) * 8 / bandwidth (link.py)
  kernel    `[link] shaping = "kernel"`: every worker in its own network namespace, its veth
            shaped to the bandwidth by tc tbf at both ends, every path `--latency` long one way
            (netns.py's userspace delay line holds every frame, ACKs too); the exchange's bytes
            cross that link through gloo's TCP, and nothing is paced in software

Per run: each round's exchange time (`exchange_s`: from the exchange's start to the end of its
wait, median over the workers), the wall time, the final eval loss and every round's params
hash. What the kernel link adds over the model shows as the ratio of the median exchange times
(kernel / emulated): TCP/IP headers (~4.5% at MTU 1500), gloo's own messages, tbf's burst, and
the exchange's start-up; with latency, also TCP's slow start, which the emulation (latency once,
then the bytes at the link's rate) leaves out. The losses and params hashes must be equal: the link changes when bytes
arrive, never what they are. Needs root (network namespaces); says so and exits 0 without it.
Writes `{"rows": [...], "trials": [...]}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(shaping: str, args, out: Path) -> dict:
    from veriloco.config import load_config
    from veriloco.run import train

    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"--topology.workers={args.workers}", f"--train.rounds={args.rounds}", "--run.membership=elastic",
        f"--link.bandwidth={args.bandwidth}", f"--link.latency={args.latency}", f"--link.shaping={shaping}",
        "--compress.codec=fp32", "--run.timeout_s=60"])
    t0 = time.perf_counter()
    run, summary = train(cfg, str(out), quiet=True)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
    per_round = [statistics.median(r["exchange_s"]) for r in recs]
    return {"shaping": shaping, "complete": summary["complete"], "wall_s": round(wall, 2),
            "exchange_s": [round(x, 4) for x in per_round],
            "exchange_median_s": round(statistics.median(per_round[1:] or per_round), 4),  # round 0 warms up
            "bytes_sent_per_round": statistics.median(max(r["bytes_sent"]) for r in recs),
            "eval_loss": summary["eval_loss_end"], "params_hashes": [r["params_hash"] for r in recs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", default="10mbit")
    ap.add_argument("--latency", default="0ms")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel_link.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from veriloco import netns
    from veriloco.link import parse_bandwidth, parse_duration

    try:
        bw, lat = parse_bandwidth(args.bandwidth), parse_duration(args.latency)
    except ValueError as e:
        print(f"kernel_link.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if bw == float("inf") or lat < 0 or args.rounds < 2 or args.workers < 2 or args.trials < 1:
        print("kernel_link.py: needs a finite --bandwidth, --rounds >= 2, --workers >= 2, --trials >= 1", file=sys.stderr)
        raise SystemExit(2)
    ok, why = netns.available()
    if not ok:
        print(f"kernel_link.py: skipped: {why}")
        return
    trials = []
    with tempfile.TemporaryDirectory(prefix="veriloco-kernel-link-") as tmp:
        for t in range(args.trials):
            for shaping in ("emulated", "kernel"):
                row = {"trial": t, **one_run(shaping, args, Path(tmp) / f"{shaping}-{t}")}
                trials.append(row)
                print(f"trial {t} | {shaping:>8} | exchange median {row['exchange_median_s']:.3f} s | wall "
                      f"{row['wall_s']:.1f} s | eval {row['eval_loss']:.4f}", flush=True)
    rows = []
    for shaping in ("emulated", "kernel"):
        mine = [x for x in trials if x["shaping"] == shaping]
        rows.append({"name": shaping, "exchange_median_s": round(statistics.median(x["exchange_median_s"] for x in mine), 4),
                     "wall_s": round(statistics.median(x["wall_s"] for x in mine), 2), "eval_loss": mine[0]["eval_loss"],
                     "bytes_sent_per_round": mine[0]["bytes_sent_per_round"]})
    ratio = rows[1]["exchange_median_s"] / rows[0]["exchange_median_s"]
    same = len({tuple(x["params_hashes"]) for x in trials}) == 1
    model_s = lat + rows[0]["bytes_sent_per_round"] * 8 / bw
    print(f"kernel / emulated exchange time: {ratio:.3f} (the model: {model_s:.3f} s per exchange); "
          f"params hashes {'identical' if same else 'DIFFER'} across all {len(trials)} runs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "trials": trials, "ratio_kernel_vs_emulated": round(ratio, 3),
                                          "model_exchange_s": round(model_s, 4), "params_identical": same,
                                          "bandwidth": args.bandwidth, "latency": args.latency,
                                          "rounds": args.rounds, "workers": args.workers}, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
