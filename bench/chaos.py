"""Chaos benchmark: workers killed and restarted, a straggler, partitions, a freeze; does the run lose anything?

    python bench/chaos.py [--quick] [--rounds 32] [--seed 0] [--out bench/results/chaos.json]

Two elastic runs of the same config side by side (4 workers, the tiny GPT, an emulated link with
`--latency` per exchange so a round lasts long enough for a process to restart meanwhile):
  clean   no faults
  chaos   faults drawn from --seed: two workers die (kill -9) at random rounds and steps and are
          restarted 1 s later; one worker is 2 s late in one round (round deadline 1 s); one worker's
          network link is cut for 4 s (network namespaces; skipped, and said so, without root); one
          worker freezes (SIGSTOP) for 3 s inside a round's exchange, after the round's group formed;
          two workers lose each other (not the rest) for 4 s (network namespaces, as the cut)
Reported: final eval loss of each and the gap (target: chaos within 2% of clean); rounds lost
(rounds never committed: the run must commit every round) and worker-rounds missed (a worker
absent or late in a round: the work the faults cost); the recovery time of every rejoin (from the
restart or the reconnect to the first committed round the worker is a member of, process start-up
included); and whether `veriloco audit` of the chaos run passes. Writes `{"rows": [...],
"recoveries": [...], "faults": [...], "targets": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from veriloco import netns
from veriloco.audit import audit_run
from veriloco.config import load_config
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]


def draw_faults(rounds: int, workers: int, steps: int, seed: int, partition: bool) -> list[str]:
    """The chaos of one run, reproducible from `seed`: two deaths with restarts, a straggler, a cut, a
    freeze, a severed pair."""
    rng = random.Random(seed)
    dying = rng.sample(range(workers), 2)
    faults = []
    for j in dying:
        faults += [f"die:{j}@{rng.randrange(2, rounds // 2)}.{rng.randrange(steps)}", f"restart:{j}+1"]
    late = rng.choice([j for j in range(workers) if j not in dying])
    faults.append(f"late:{late}@{rng.randrange(rounds // 2, rounds - 6)}+2")
    if partition:
        faults.append(f"partition:{rng.randrange(workers)}@{rng.randrange(rounds // 2, rounds - 8)}+4")
    # drawn last, so that a seed draws the same faults as before it was added (sixteenth session)
    faults.append(f"stop:{rng.randrange(workers)}@{rng.randrange(rounds // 4, rounds - 6)}+3")
    if partition:  # and after it (seventeenth session): two workers lose each other, not the rest
        a, b = sorted(rng.sample(range(workers), 2))
        faults.append(f"sever:{a}-{b}@{rng.randrange(rounds // 4, rounds - 8)}+4")
    return faults


def recoveries(run_dir: Path) -> list[dict]:
    """Seconds from each restart / reconnect to the first committed round with that worker in it."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    out = []
    died = set()
    for i, e in enumerate(events):
        if e["event"] == "died":
            died.add(e["worker"])
        back = (e["event"] == "started" and e["worker"] in died) or e["event"] == "reconnected"
        if not back:
            continue
        j = e["worker"]
        died.discard(j)
        both = {j, e.get("peer", j)}  # a sever: back once the two are in a round together
        first = next((x for x in events[i + 1:] if x["event"] == "committed" and both <= set(x["members"])), None)
        how = "restart" if e["event"] == "started" else "reconnect" if "peer" not in e else f"reconnect to {e['peer']}"
        out.append({"worker": j, "how": how,
                    "at_round": e["round"], "rejoined_round": first["committed"] if first else None,
                    "recovery_s": round(first["t"] - e["t"], 2) if first else None})
    return out


def one_run(name: str, overrides: list[str], faults: list[str], out: Path) -> dict:
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    t0 = time.perf_counter()
    run, summary = train(cfg, str(out), quiet=True, faults=faults)
    recs = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
    missed = [[r["round"], j, v] for r in recs for j, v in enumerate(r["verdicts"]) if v in ("absent", "late")]
    report = audit_run(run.root)
    return {
        "name": name, "eval_loss": summary["eval_loss_end"], "rounds": cfg.train.rounds,
        "rounds_committed": len(recs), "rounds_lost": cfg.train.rounds - len(recs),
        "worker_rounds_missed": len(missed), "worker_rounds": cfg.train.rounds * cfg.topology.workers,
        "missed": missed,  # [round, worker, "absent" | "late"]: which faults cost what
        "wall_s": round(time.perf_counter() - t0, 1), "audit_ok": report.ok,
        "audit_failure": report.first_failure, "run_dir": str(run.root),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 rounds instead of 32")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="draws the faults")
    ap.add_argument("--latency", default="300ms", help="emulated link latency per exchange")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    args = ap.parse_args()
    rounds = 20 if args.quick else args.rounds
    if rounds < 17:  # the faults are drawn across the run's quarters and halves, the last ones >= 8 rounds before its end
        ap.error(f"--rounds must be >= 17 to hold the drawn faults, got {rounds}")
    workers, steps = 4, 10
    base = [f"--topology.workers={workers}", f"--train.rounds={rounds}", f"--train.inner_steps={steps}",
            "--train.eval_every=4", "--run.membership=elastic", "--run.min_workers=2", "--run.round_deadline=1",
            "--run.timeout_s=30", "--run.heartbeat_timeout_s=1.5", f"--link.latency={args.latency}",
            "--link.bandwidth=1gbit"]
    ok, why = netns.available()
    faults = draw_faults(rounds, workers, steps, args.seed, partition=ok)
    print(f"faults: {' '.join(faults)}" + ("" if ok else f"  (no partition: {why})"), flush=True)
    with tempfile.TemporaryDirectory(prefix="veriloco-chaos-") as tmp:
        rows = [one_run("clean", base, [], Path(tmp) / "clean"), one_run("chaos", base, faults, Path(tmp) / "chaos")]
        rec = recoveries(Path(tmp) / "chaos")
    clean, chaos = rows
    gap = (chaos["eval_loss"] - clean["eval_loss"]) / clean["eval_loss"]
    cols = ["name", "eval_loss", "rounds_committed", "rounds_lost", "worker_rounds_missed", "wall_s", "audit_ok"]
    print(" | ".join(f"{c:>20}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>20.4f}" if isinstance(r[c], float) and c == "eval_loss" else f"{r[c]!s:>20}"
                         for c in cols))
    for x in rec:
        print(f"worker {x['worker']} {x['how']} at round {x['at_round']}: back in round {x['rejoined_round']} "
              f"after {x['recovery_s']} s")
    targets = {
        "eval_loss_within_2pct_of_clean": abs(gap) <= 0.02, "eval_loss_gap": round(gap, 4),
        "no_round_lost": chaos["rounds_lost"] == 0, "audit_passes": chaos["audit_ok"],
        "every_rejoin_recovered": all(x["recovery_s"] is not None for x in rec),
        "partition": ok, "partition_skipped_because": None if ok else why,
    }
    print(f"eval loss gap chaos vs clean: {gap:+.2%} (target within 2%: {'met' if targets['eval_loss_within_2pct_of_clean'] else 'NOT met'})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("run_dir")
    Path(args.out).write_text(json.dumps({"rows": rows, "recoveries": rec, "faults": faults, "targets": targets,
                                          "seed": args.seed, "rounds": rounds}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
