"""A worker frozen inside a round's exchange: what it costs the others, for freezes of several lengths.

    python bench/elastic_freeze.py [--freezes 2,4,8] [--trials 3] [--delays 0,1] [--rounds 30] [--out results.json]

3 workers, the tiny GPT, 30 rounds, a 0.4 s link latency (rounds long enough for the frozen
worker to come back), `heartbeat_timeout_s = 1.5`, `timeout_s = 30`. Worker 1 is stopped
(SIGSTOP, `--fault stop:1@2+T`) inside round 2's exchange, after the round's gloo group formed,
and sent SIGCONT T seconds later. A frozen process keeps its sockets open, so gloo alone does not
notice it: the others would wait until it thaws (then go on with it) or until `timeout_s`. With
the members watched while a collective waits (`membership.PgComm`), the others give the group up
once its heartbeat is stale and commit the round without it. Per trial: the frozen round's
`round_s` and members, the round from which worker 1 is a member again, the run's wall time and
whether the audit passes. If the watch works, the frozen round's time does not grow with T.
Trials of the freeze lengths alternate, so all see the same machine load. Writes
`{"rows": [...], "trials": [...]}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from veriloco.audit import audit_run
from veriloco.config import load_config
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]
ROUND = 2
OVERRIDES = ["--topology.workers=3", "--link.latency=400ms", "--run.membership=elastic", "--run.timeout_s=30",
             "--run.heartbeat_timeout_s=1.5"]


def trial(freeze_s: float, delay: int, out: Path, rounds: int = 30) -> dict:
    overrides = OVERRIDES + [f"--train.rounds={rounds}", f"--outer.delay={delay}"] + \
        (["--outer.momentum=0.5"] if delay else [])
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    t0 = time.perf_counter()
    run, summary = train(cfg, str(out), quiet=True, faults=[f"stop:1@{ROUND}+{freeze_s:g}"])
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
    members = [r.get("members", list(range(cfg.topology.workers))) for r in recs]
    out_of = [i for i, m in enumerate(members) if 1 not in m]
    back = next((i for i in range(len(recs)) if out_of and i > out_of[0] and all(1 in m for m in members[i:])), None)
    frozen = recs[ROUND]
    return {"freeze_s": freeze_s, "delay": delay, "complete": summary["complete"], "wall_s": round(wall, 2),
            "frozen_round_s": frozen["round_s"], "frozen_round_members": members[ROUND],
            "first_round_without_1": out_of[0] if out_of else None, "back_from_round": back,
            "rounds_without_1": len(out_of), "audit_ok": audit_run(run.root).ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--freezes", default="2,4,8", help="freeze lengths in seconds")
    ap.add_argument("--trials", type=int, default=3, help="trials per freeze length and delay")
    ap.add_argument("--delays", default="0,1")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per run (the freeze is in round 2)")
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    args = ap.parse_args()
    try:
        freezes = [float(f) for f in args.freezes.split(",")]
        delays = [int(d) for d in args.delays.split(",")]
    except ValueError:
        ap.error("--freezes and --delays are comma-separated numbers")
    if not all(0 < f <= 60 for f in freezes) or not set(delays) <= {0, 1}:
        ap.error("--freezes must be seconds in (0, 60], --delays 0 and/or 1")
    if args.trials < 1 or args.rounds < ROUND + 2:
        ap.error(f"--trials must be >= 1 and --rounds >= {ROUND + 2}")
    trials: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="veriloco-elastic-freeze-") as tmp:
        for i in range(args.trials):
            for delay in delays:
                for f in freezes:
                    t = trial(f, delay, Path(tmp) / f"{f:g}-{delay}-{i}", args.rounds) | {"i": i}
                    trials.append(t)
                    print(f"freeze {f:g} s delay {delay} #{i}: round {ROUND} {t['frozen_round_s']:.2f} s "
                          f"members {t['frozen_round_members']}  back from round {t['back_from_round']}  "
                          f"wall {t['wall_s']:.1f} s  audit {t['audit_ok']}", flush=True)
    rows = []
    for delay in delays:
        for f in freezes:
            ts = [t for t in trials if t["delay"] == delay and t["freeze_s"] == f]
            rows.append({
                "freeze_s": f, "delay": delay, "trials": len(ts),
                "frozen_round_median_s": round(statistics.median(t["frozen_round_s"] for t in ts), 2),
                "frozen_round_max_s": max(t["frozen_round_s"] for t in ts),
                "trials_frozen_worker_in_round": sum(1 in t["frozen_round_members"] for t in ts),
                "rounds_without_1_median": statistics.median(t["rounds_without_1"] for t in ts),
                "never_back": sum(t["back_from_round"] is None for t in ts),
                "incomplete_or_audit_failed": sum(not (t["complete"] and t["audit_ok"]) for t in ts),
            })
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.out:
        Path(args.out).write_text(json.dumps({"overrides": OVERRIDES + [f"--train.rounds={args.rounds}"], "round": ROUND,
                                              "rows": rows, "trials": trials},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
