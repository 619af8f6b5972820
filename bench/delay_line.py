"""Is the kernel link's userspace delay line ever the bottleneck? Transfers with and without it.

    python bench/delay_line.py [--mb 3.5] [--count 6] [--links 3] [--latency 1ms] [--flows 3]
                               [--out bench/results/delay_line.json]

netns.py's delay line is a Python process in the hub namespace that holds every frame of the
kernel-shaped link for half the latency on each node's path (AF_PACKET, frames with their
virtio-net header, so GSO frames cross whole). The kernel link's figures at 1 Gbit/s (the
exchange, `bench/tcp_idle.py`) are only about TCP if the line forwards faster than that.

Per setting, `--links` fresh 2-node links; on each, `--count` transfers of `--mb` MB over one TCP
connection back to back (`ShapedLink.measure_transfers`, idle 0); the first is a new
connection's, the others are warm, and their median is the link's figure:

  1gbit, no line        tc tbf at 1 Gbit/s, latency 0 (no delay line)
  1gbit, line           the same with the delay line at `--latency` (small, so TCP's window is
                        never what limits: the bandwidth-delay product is a few hundred KB)
  unshaped, no line     the veths alone: what the machine moves between two namespaces
  unshaped, line        the line alone limits: its forwarding rate
  1gbit xF, no line     F = `--flows` nodes, F flows at once (0->1, 1->2, ..., F-1->0: every port
  1gbit xF, line        sends and receives at 1 Gbit/s), as in an exchange; the one line process
                        forwards all of them

Also the line's CPU seconds over its link's transfers (from /proc), per GB forwarded. A setting's
figure is the median over its links of the median warm transfer (with 3 flows, the slowest flow's). Needs root
(network namespaces); says so and exits 0 without it. Writes `{"rows": [...]}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its own, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_link(bandwidth: float, latency: float, nbytes: int, count: int, flows: int) -> tuple[list[float], float | None]:
    """`count` back-to-back transfers over one connection on a fresh link of max(2, flows) nodes, on
    `flows` connections at once (node i to node i+1, round the ring): the seconds of each transfer
    (the slowest flow's, transfer by transfer), and the delay line's CPU seconds (None without one)."""
    import threading

    from veriloco import netns

    n = max(2, flows)
    with netns.shaped_link(bandwidth, n=n, latency_s=latency) as link:
        line = link.delay_line
        before = cpu_seconds(line.pid) if line else 0.0
        got: dict[int, list[float]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, link.measure_transfers(nbytes, count, 0.0, src=i,
                                                                                                   dst=(i + 1) % n)))
                   for i in range(flows)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if len(got) != flows:
            raise SystemExit("delay_line.py: a transfer failed")
        times = [max(got[i][k] for i in range(flows)) for k in range(count)]
        return times, (cpu_seconds(line.pid) - before if line else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=3.5, help="MB a transfer (default 3.5: the comm bench's fp32 packet)")
    ap.add_argument("--count", type=int, default=6, help="transfers per connection (the first is cold)")
    ap.add_argument("--links", type=int, default=3, help="fresh links per setting")
    ap.add_argument("--latency", default="1ms", help="the line's one-way latency (default 1ms)")
    ap.add_argument("--flows", type=int, default=3, help="nodes and flows at once in the xF settings")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "delay_line.json"))
    args = ap.parse_args()
    from veriloco import netns
    from veriloco.link import parse_duration

    try:
        latency = parse_duration(args.latency)
    except ValueError as e:
        ap.error(str(e))
    if not 0 < latency <= 0.1 or args.mb <= 0 or args.count < 2 or args.links < 1 or not 2 <= args.flows <= 8:
        ap.error("needs 0 < --latency <= 100ms, --mb > 0, --count >= 2, --links >= 1 and 2 <= --flows <= 8")
    ok, why = netns.available()
    if not ok:
        print(f"delay_line.py: skipped: {why}")
        return 0
    nbytes = int(args.mb * 1e6)
    settings = [("1gbit, no line", 1e9, 0.0, 1), ("1gbit, line", 1e9, latency, 1),
                ("unshaped, no line", float("inf"), 0.0, 1), ("unshaped, line", float("inf"), latency, 1),
                (f"1gbit x{args.flows}, no line", 1e9, 0.0, args.flows), (f"1gbit x{args.flows}, line", 1e9, latency, args.flows)]
    rows = []
    for name, bw, lat, flows in settings:
        warm, cold, cpu = [], [], []
        for _ in range(args.links):
            times, line_cpu = one_link(bw, lat, nbytes, args.count, flows)
            cold.append(times[0])
            warm.append(statistics.median(times[1:]))
            if line_cpu is not None:
                cpu.append(line_cpu / (flows * nbytes * args.count / 1e9))
        w = statistics.median(warm)
        row = {"setting": name, "bandwidth_bps": None if bw == float("inf") else bw, "latency_s": lat, "flows": flows,
               "warm_s": round(w, 5), "warm_gbit_s": round(nbytes * 8 / w / 1e9, 3),  # per flow
               "cold_s": round(statistics.median(cold), 5), "warm_per_link_s": [round(x, 5) for x in warm],
               "line_cpu_s_per_gb": round(statistics.median(cpu), 3) if cpu else None}
        rows.append(row)
        print(f"{name:>18}: warm {row['warm_s'] * 1e3:7.2f} ms ({row['warm_gbit_s']:.2f} Gbit/s), "
              f"cold {row['cold_s'] * 1e3:7.2f} ms"
              + (f", line CPU {row['line_cpu_s_per_gb']:.2f} s per GB" if cpu else ""), flush=True)
    by = {r["setting"]: r for r in rows}
    print(f"\n1 Gbit/s with the line / without: {by['1gbit, line']['warm_s'] / by['1gbit, no line']['warm_s']:.3f}x "
          f"(the line's {latency * 1e3:g} ms is {latency / by['1gbit, no line']['warm_s']:.1%} of the transfer); "
          f"the line alone forwards {by['unshaped, line']['warm_gbit_s']:.2f} Gbit/s "
          f"({by['unshaped, no line']['warm_gbit_s']:.2f} without it); {args.flows} flows at 1 Gbit/s with the line / "
          f"without: {by[f'1gbit x{args.flows}, line']['warm_s'] / by[f'1gbit x{args.flows}, no line']['warm_s']:.3f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"mb": args.mb, "count": args.count, "links": args.links, "flows": args.flows,
                                          "latency": args.latency, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
