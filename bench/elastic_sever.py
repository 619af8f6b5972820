"""Two workers that cannot reach each other (a partial partition): with and without the probes.

    python bench/elastic_sever.py [--cuts 5,20,60] [--rounds 12] [--out results.json]

3 workers, the tiny GPT, a 0.4 s emulated link latency, `timeout_s = 20`, `heartbeat_timeout_s =
1.5`. Once round 2 is recorded, workers 1 and 2 lose each other for T seconds (`--fault
sever:1-2@2+T`: network namespaces, each one's neighbour entry for the other points at a MAC
address nobody has); both still reach the coordinator and worker 0, so their heartbeats stay
fresh. Two variants of this tree, run alternately, each as `veriloco train` in its own process:

  probes   the code as it is: before a round's group forms its members probe each other and all
           drop the same members (membership.Membership.connected), and a collective that waits
           probes too
  off      the same source with both probes switched off (a copy of src/ with `connected`
           returning the quorum as it is and the watch's probe disabled): the behaviour before
           the seventeenth session, when every try of a round waited gloo's timeout

Per run: whether it completed (the launcher stops a run with no round committed for
max(3 x timeout_s, 60 s)), the rounds committed while the cut lasted, the longest round, the wall
time. Writes `{"rows": [...]}`, one object per (cut, variant). Needs root (network namespaces);
says so and exits 0 without them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["--topology.workers=3", "--link.latency=400ms", "--run.membership=elastic", "--run.timeout_s=20",
             "--run.heartbeat_timeout_s=1.5"]
# what "off" changes in membership.py: each must match exactly once, or the bench stops
PROBES_OFF = [
    ('        key = f"reach/{view.key}"\n', '        return view  # (bench: probes off)\n        key = f"reach/{view.key}"\n'),
    ("            if why is None and time.monotonic() >= probe_at[0]:", "            if False:  # (bench: probes off)"),
]


def probes_off(into: Path) -> Path:
    """A copy of src/ with the probes switched off; returns the directory for PYTHONPATH."""
    src = into / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    path = src / "veriloco" / "membership.py"
    text = path.read_text()
    for old, new in PROBES_OFF:
        if text.count(old) != 1:
            raise SystemExit(f"elastic_sever.py: membership.py changed: {old.strip()!r} is not there once")
        text = text.replace(old, new)
    path.write_text(text)
    return src


def one_run(cut_s: float, src: Path, out: Path, rounds: int) -> dict:
    cmd = [sys.executable, "-m", "veriloco.cli", "train", str(ROOT / "configs" / "tiny.toml"), *OVERRIDES,
           f"--train.rounds={rounds}", "--fault", f"sever:1-2@2+{cut_s:g}", "--out", str(out), "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(src)))
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()] if (out / "rounds.jsonl").exists() else []
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    cut = next(e for e in events if e["event"] == "cut")
    back = next((e for e in events if e["event"] == "reconnected"), None)
    end = back["t"] if back else float("inf")
    during = [e for e in events if e["event"] == "committed" and cut["t"] <= e["t"] < end]
    error = [ln for ln in p.stderr.splitlines() if ln.startswith("veriloco: error")]
    return {"cut_s": cut_s, "complete": p.returncode == 0 and len(recs) == rounds, "rounds_committed": len(recs),
            "rounds_committed_during_cut": len(during),
            "members_during_cut": sorted({tuple(e["members"]) for e in during}),
            "longest_round_s": max((r["round_s"] for r in recs), default=None), "wall_s": round(wall, 1),
            "error": error[-1][:200] if error else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuts", default="5,20,60", help="seconds each cut lasts, comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--variants", default="probes,off")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "elastic_sever.json"))
    args = ap.parse_args()
    try:
        cuts = [float(x) for x in args.cuts.split(",")]
    except ValueError:
        cuts = []
    if not cuts or not all(0 < c <= 120 for c in cuts):
        print("elastic_sever.py: --cuts must be seconds in (0, 120], comma-separated", file=sys.stderr)
        raise SystemExit(2)
    variants = args.variants.split(",")
    if not variants or not set(variants) <= {"probes", "off"} or args.rounds < 4:
        print("elastic_sever.py: --variants takes probes and/or off, and --rounds must be >= 4", file=sys.stderr)
        raise SystemExit(2)
    sys.path.insert(0, str(ROOT / "src"))
    from veriloco import netns

    ok, why = netns.available()
    if not ok:
        print(f"elastic_sever.py: skipped: {why}")
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="veriloco-sever-") as tmp:
        srcs = {"probes": ROOT / "src", "off": probes_off(Path(tmp)) if "off" in variants else None}
        for cut_s in cuts:
            for v in variants:
                row = {"variant": v, **one_run(cut_s, srcs[v], Path(tmp) / f"{v}-{cut_s:g}", args.rounds)}
                rows.append(row)
                print(f"cut {cut_s:>5g} s | {v:>6} | complete {row['complete']!s:>5} | rounds during the cut "
                      f"{row['rounds_committed_during_cut']:>3} (members {row['members_during_cut']}) | longest round "
                      f"{row['longest_round_s']} s | wall {row['wall_s']} s" + (f" | {row['error']}" if row["error"] else ""),
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "rounds": args.rounds, "overrides": OVERRIDES}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
