"""What an idle connection between two rounds costs on a long link: TCP's window after the idle.

    python bench/tcp_idle.py [--bandwidth 1gbit] [--latency 50ms] [--bytes 3500000] [--idle 2]
                             [--repeats 3] [--out bench/results/tcp_idle.json]

A worker's exchange connections sit idle through a round's inner steps. On the kernel-shaped
link (netns.py: tc tbf at `--bandwidth`, a delay line of `--latency` one way; root only, and
says so and exits 0 without it) one sender sends `--bytes` (default: the comm bench's 3.5 MB
fp32 packet) three times over one TCP connection, idle `--idle` seconds before the second and
third, for each TCP congestion control (cubic, the usual Linux default, and bbr) and each value
of `net.ipv4.tcp_slow_start_after_idle` (1, the Linux default: a connection idle for longer than
its retransmission timeout starts over from a small window; 0: it keeps its window). Each
figure is one way, the sender's first send to the receiver's last byte (the median of
`--repeats` links), next to the emulation's latency + bytes / bandwidth (link.Link). Prints a
table and writes `{"rows": [{"congestion", "slow_start_after_idle", "new_s", "after_idle_s",
"emulated_s"}...], "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--latency", default="50ms")
    ap.add_argument("--bytes", type=int, default=3_500_000)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds the connection idles between transfers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tcp_idle.json"))
    args = ap.parse_args()
    from veriloco import netns
    from veriloco.link import Link

    try:
        modelled = Link.from_strings(args.bandwidth, args.latency)
    except ValueError as e:
        ap.error(str(e))
    bw, lat = modelled.bandwidth_bps, modelled.latency_s
    if args.bytes < 1 or args.idle < 0 or args.repeats < 1 or bw == float("inf"):
        ap.error("--bytes and --repeats must be >= 1, --idle >= 0, and --bandwidth finite")
    ok, why = netns.available()
    if not ok:
        print(f"skipped: {why}")
        return
    emulated = modelled.transfer_time(args.bytes, 0)
    rows = []
    for congestion in ("cubic", "bbr"):
        for setting in ("1", "0"):
            runs = []
            for _ in range(args.repeats):
                with netns.shaped_link(bw, 2, latency_s=lat) as link:
                    link.set_sysctl("net.ipv4.tcp_slow_start_after_idle", setting)
                    runs.append(link.measure_transfers(args.bytes, 3, args.idle, congestion=congestion))
            new = statistics.median(r[0] for r in runs)
            after = statistics.median(x for r in runs for x in r[1:])
            rows.append({"congestion": congestion, "slow_start_after_idle": int(setting), "new_s": round(new, 4),
                         "after_idle_s": round(after, 4), "emulated_s": round(emulated, 4),
                         "runs_s": [[round(x, 4) for x in r] for r in runs]})
            print(f"{congestion:5s} tcp_slow_start_after_idle={setting} | new connection {new:.3f} s | "
                  f"after {args.idle:g} s idle {after:.3f} s | emulated {emulated:.3f} s", flush=True)
    result = {"rows": rows, "config": {"bandwidth": args.bandwidth, "latency": args.latency, "bytes": args.bytes,
                                       "idle_s": args.idle, "repeats": args.repeats}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
