"""A worker killed once its round's packet is out, then started again: before and after the sent
and seen notes (round.sent_note, round.keep_seen; fortieth and forty-first sessions).

    python bench/restart_redo.py [--old 3d73748] [--seeds 0,1,2] [--rounds 5]
                                 [--kinds honest,nondeterministic,recommit,junk_first]
                                 [--out bench/results/restart_redo.json]

3 workers of configs/tiny.toml. Worker 2 is killed (kill -9) once its round-3 exchange returned
(every other member holds its bundle and reveal), the first time only (`red_team:DiesOnceSent`,
a patch that old and new code both take). Four workers 2 (`--kinds`):
- `honest`: elastic membership, `min_workers = 3` (no round commits without the dead one),
  `max_restarts = 1` (the launcher starts it again), the adaptive codec on a 20 Mbit/s, 1 ms
  link (its budget, and so its rungs, follow the measured seconds of the inner steps); its redo
  is deterministic on this CPU;
- `nondeterministic`: the same, with `jitter=1` (1e-6 of fresh noise on its delta in each
  process, as a GPU's kernels may give);
- `recommit`: an attacker in a static run (replays at p = 0.5, so every worker reveals a
  salt): its death stops the run, which is resumed (`veriloco train --resume`); started again,
  it deletes its note of what it sent and commits anew for round 3, having seen every salt;
- `junk_first`: an attacker in a static run that sends junk as its first bundle of round 3, so
  signs nothing, yet receives every salt, and skims every round (`red_team:JunkFirst`: only a
  replay catches it); its death stops the run, and in the resume it commits for the first time.
  Replays at p = 0.0001: the draw passes it over, as a salt ground against the salts it saw
  would make it.
Every seed (`--run.seed`) runs each kind with `--old` (default: the revision before the notes)
and with the working tree. Per run: did it complete, worker 2's verdicts, every verdict that is
not `accept`, the audit, the wall time, and whether the new side's redo sent its noted bundle
again. Writes `{"rows": [...], "summary": {...}, "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from grind import new_side, seeds_of, sides_of, veriloco

ROOT = Path(__file__).resolve().parents[1]
WORKERS = {"honest": "DiesOnceSent:jitter=0", "nondeterministic": "DiesOnceSent:jitter=1",
           "recommit": "DiesOnceSent:recommit={out}", "junk_first": "JunkFirst:recommit={out}"}
STATIC = {"recommit": 0.5, "junk_first": 0.0001}  # static runs (resumed after the death): their replay probability
CONVICTED = ("equivocation", "replay_mismatch")
AT = 3  # the round worker 2 dies in; its note (kept two rounds) is read after the run


def run_one(src: Path, worker: str, seed: int, rounds: int, out: Path) -> dict:
    """One run: the restarted worker 2's verdicts, what else was not accepted, the audit."""
    t0 = time.perf_counter()
    kind, params = WORKERS[worker].format(out=out).split(":")
    spec = f"red_team:{kind}:at={AT},once={out.parent / (out.name + '.died')},{params}"
    common = (str(ROOT / "configs" / "tiny.toml"), "--topology.workers=3", f"--train.rounds={rounds}", f"--run.seed={seed}",
              f"--adversary.2={spec}", "--out", str(out), "--quiet")
    if worker in STATIC:  # a static run: its death stops the run, which is then resumed
        killed = veriloco(src, "train", *common, "--train.inner_state=reset", "--verify.trace_every=5",
                           f"--verify.replay_probability={STATIC[worker]}")
        done = veriloco(src, "train", "--resume", str(out), "--quiet") if killed.returncode != 0 else killed
    else:
        done = veriloco(src, "train", *common, "--run.membership=elastic", "--run.min_workers=3", "--run.max_restarts=1",
                        "--run.timeout_s=10", "--run.heartbeat_timeout_s=1.5", "--compress.codec=adaptive",
                        "--link.bandwidth=20mbit", "--link.latency=1ms")
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()] if (out / "rounds.jsonl").exists() else []
    audit = veriloco(src, "audit", str(out), "--replay", "100") if done.returncode == 0 else None
    note = out / "workers" / "2" / f"sent-{AT}.json"  # the new side's: did its redo resend the noted bundle
    resent = json.loads(note.read_text())["resent"] if note.exists() else None
    return {"complete": done.returncode == 0 and len(recs) == rounds, "recorded_rounds": len(recs),
            "verdicts_2": [rec["verdicts"][2] for rec in recs],
            "not_accepted": sorted({v for rec in recs for v in rec["verdicts"] if v != "accept"}),
            "audit_ok": audit is not None and audit.returncode == 0, "wall_s": round(wall, 1), "resent": resent,
            "error": None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1][:300]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="3d73748", help="git revision of the old side (default: before the sent note)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(WORKERS), help="which workers 2 (comma-separated)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "restart_redo.json"))
    args = ap.parse_args()
    seeds = seeds_of(ap, args.seeds)
    kinds = args.kinds.split(",")
    if not kinds or len(set(kinds)) != len(kinds) or not set(kinds) <= set(WORKERS):
        ap.error(f"--kinds must be distinct names among {', '.join(WORKERS)}, got {args.kinds!r}")
    if args.rounds < AT + 2:
        ap.error(f"--rounds must be >= {AT + 2} (worker 2 dies in round {AT}), got {args.rounds}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides = sides_of(ap, args.old, Path(tmp))
        for seed in seeds:
            for side, src in sides.items():
                for worker in kinds:
                    row = {"side": side, "worker": worker, "seed": seed,
                           **run_one(src, worker, seed, args.rounds, Path(tmp) / f"{side}-{seed}-{worker}")}
                    rows.append(row)
                    print(f"{side:4s} seed {seed} {worker:16s} complete {row['complete']!s:5s} "
                          f"worker 2: {' '.join(row['verdicts_2']) or '-'}; audit {'ok' if row['audit_ok'] else 'no'}; "
                          f"{row['wall_s']:.1f} s; resent {row['resent']}" + (f"; {row['error']}" if row["error"] else ""), flush=True)
    summary = {}
    for side in sides:
        for worker in kinds:
            mine = [r for r in rows if r["side"] == side and r["worker"] == worker]
            summary[f"{side}/{worker}"] = {"runs": len(mine), "complete": sum(r["complete"] for r in mine),
                                           "audits_ok": sum(r["audit_ok"] for r in mine),
                                           "convicted": sum(any(v in CONVICTED for v in r["verdicts_2"]) for r in mine),
                                           "wall_s": round(sum(r["wall_s"] for r in mine) / len(mine), 1)}
    print()
    for key, s in summary.items():
        print(f"{key:21s} complete {s['complete']} of {s['runs']}; audits passed {s['audits_ok']}; "
              f"worker 2 convicted in {s['convicted']}; mean wall {s['wall_s']} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary, "config": {
        "old": args.old, "new": new_side(), "seeds": seeds, "rounds": args.rounds, "kinds": kinds, "workers": 3, "min_workers": 3,
        "codec": "adaptive (elastic rows)", "link": "20mbit, 1ms (elastic rows)", "dies": f"worker 2, round {AT}, once its exchange returned"}},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
