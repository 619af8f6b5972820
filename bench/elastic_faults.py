"""Deaths and restarts under elastic membership: an older revision against the current code.

    python bench/elastic_faults.py [--old REV] [--trials 6] [--delays 0,1] [--load N] [--out results.json]

The fault scenario of `tests/test_elastic.py`'s death test, run again and again: 3 workers, the
tiny GPT, 8 rounds; worker 2 is killed (kill -9) at round 1, step 2 and restarted 3 s later;
worker 1 is killed inside round 4's exchange. Trials of the old revision (checked out with
`git worktree` at --old) and of this tree alternate, each in a process of its own with that
revision's `src` first on PYTHONPATH (the worker processes inherit it), so both see the same
machine load. Per revision and delay: wall seconds of `train` (median, max), worker-rounds in
which a live worker was left out (`late`) or a worker had no packet (`absent`), the seconds from
worker 2's restart to the first committed round it is a member of, and trials that did not
complete. `--load N` keeps N extra processes spinning on the CPU meanwhile (the test suite's load
on a 2-core machine, under which the death test used to go wrong). Writes `{"rows": [...],
"trials": [...]}`.
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

from chaos import recoveries

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "e46785d"  # the last commit before the quorum judge and the group watchdog (membership.py)
FAULTS = ["die:2@1.2", "restart:2+3", "die:1@4"]
ELASTIC = ["--topology.workers=3", "--train.rounds=8", "--run.membership=elastic", "--run.timeout_s=30",
           "--run.heartbeat_timeout_s=1.5"]
TRIAL = '''
import json, sys, time
from veriloco.config import load_config
from veriloco.run import train
if __name__ == "__main__":
    cfg = load_config(sys.argv[1], json.loads(sys.argv[2]))
    t0 = time.perf_counter()
    run, summary = train(cfg, sys.argv[3], quiet=True, faults=json.loads(sys.argv[4]))
    print(json.dumps({"wall_s": round(time.perf_counter() - t0, 2), "complete": summary["complete"]}))
'''


def trial(src: Path, delay: int, out: Path, script: Path) -> dict:
    overrides = ELASTIC + [f"--outer.delay={delay}"] + (["--outer.momentum=0.5"] if delay else [])
    env = dict(os.environ, PYTHONPATH=str(src))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), str(src.parent / "configs" / "tiny.toml"),
                           json.dumps(overrides), str(out), json.dumps(FAULTS)],
                          env=env, capture_output=True, text=True, timeout=600)
    result = {"delay": delay, "rc": done.returncode, "wall_s": round(time.perf_counter() - t0, 2), "complete": False}
    if done.returncode == 0:
        result |= json.loads(done.stdout.strip().splitlines()[-1])
    else:
        result["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
    rounds = out / "rounds.jsonl"
    recs = [json.loads(line) for line in rounds.read_text().splitlines()] if rounds.exists() else []
    verdicts = [v for r in recs for v in r["verdicts"]]
    back = [x["recovery_s"] for x in (recoveries(out) if (out / "events.jsonl").exists() else []) if x["worker"] == 2]
    return result | {"rounds_committed": len(recs), "late": verdicts.count("late"), "absent": verdicts.count("absent"),
                     "restart_to_member_s": back[0] if back else None}


def summarize(which: str, rev: str, delay: int, trials: list[dict]) -> dict:
    walls = [t["wall_s"] for t in trials]
    backs = [t["restart_to_member_s"] for t in trials if t["restart_to_member_s"] is not None]
    return {
        "code": which, "rev": rev, "delay": delay, "trials": len(trials),
        "incomplete": sum(not t["complete"] for t in trials),
        "wall_median_s": round(statistics.median(walls), 2), "wall_max_s": max(walls),
        "late_worker_rounds": sum(t["late"] for t in trials), "absent_worker_rounds": sum(t["absent"] for t in trials),
        "trials_with_late": sum(t["late"] > 0 for t in trials),
        "restart_to_member_median_s": round(statistics.median(backs), 2) if backs else None,
        "restart_never_member": len(trials) - len(backs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=BEFORE, help="git revision to compare with")
    ap.add_argument("--trials", type=int, default=6, help="trials per revision and delay")
    ap.add_argument("--delays", default="0,1")
    ap.add_argument("--load", type=int, default=0, help="processes spinning on the CPU during the trials")
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    args = ap.parse_args()
    delays = [int(d) for d in args.delays.split(",")]
    rev = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="veriloco-elastic-faults-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
        try:
            script = Path(tmp) / "trial.py"
            script.write_text(TRIAL)
            codes = {"old": old_tree / "src", "new": ROOT / "src"}
            trials: list[dict] = []
            for i in range(args.trials):
                for delay in delays:
                    for which, src in codes.items():  # alternate: both see the same load
                        t = trial(src, delay, Path(tmp) / f"{which}-{delay}-{i}", script) | {"code": which, "i": i}
                        trials.append(t)
                        print(f"{which} delay {delay} #{i}: {t['wall_s']:6.1f} s  complete {t['complete']}  "
                              f"late {t['late']}  absent {t['absent']}  restart->member {t['restart_to_member_s']}",
                              flush=True)
        finally:
            for p in spinners:
                p.kill()
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
    rows = [summarize(which, rev if which == "old" else "this tree", delay,
                      [t for t in trials if t["code"] == which and t["delay"] == delay])
            for delay in delays for which in ("old", "new")]
    cols = ["code", "delay", "trials", "incomplete", "wall_median_s", "wall_max_s", "late_worker_rounds",
            "trials_with_late", "absent_worker_rounds", "restart_to_member_median_s", "restart_never_member"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.out:
        Path(args.out).write_text(json.dumps({"old": rev, "load": args.load, "faults": FAULTS, "overrides": ELASTIC,
                                              "rows": rows,
                                              "trials": trials}, indent=1) + "\n")


if __name__ == "__main__":
    main()
