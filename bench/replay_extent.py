"""How far a drawn replay should run: the whole round, or to a drawn segment (`[verify] replay_extent`).

    python bench/replay_extent.py [--seeds 3] [--rounds 12] [--inner-steps 20] [--trace-every 5]
                                  [--replay 0.5] [--attack lazy:skip=0.25,scale=none]
                                  [--extents round,segment,state] [--out bench/results/replay_extent.json]

Side by side on the same seeds: 4 workers of configs/tiny.toml, inner state reset per round,
H = `--inner-steps` in segments of `--trace-every`, every worker's round replayed with
probability `--replay`, worker 1 attacking (`--attack`: a lazy worker trains its first steps
honestly and skips the rest). Bans are off, so the attacker is replayed round after round, and
the loss-gain screen is off (`loss_gain_batches = 0`): it would make suspects, which are replayed
whole under either extent, and this measures the drawn replays only. For each extent: the
attacker's drawn replays and how many convicted it, the replay CPU seconds (every worker's
`replay_cpu_s`) against the inner steps' (`inner_cpu_s`), and catches per round of replay cost,
the number to compare (the extents draw the same workers, auditors and rounds: the seed
does not depend on it). "state" replays only the drawn segment, from the start state the worker
sends (its bytes: `state_bytes_per_worker_round`, every worker's `state_bytes_sent` over the
worker-rounds, beside the packets' `bytes_sent`). Writes `{"rows": [...], "ratio": ...,
"ratios": {...}, "config": {...}}`; `ratio` is round / segment, `ratios` each extent against
"round".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify import ROOT, run_one  # noqa: E402

EXTENTS = ("round", "segment", "state")
ATTACKER = 1


def tally(recs: list[dict], worker: int = ATTACKER) -> dict:
    """The attacker's drawn replays and convictions in `recs` (round records), and what a replay
    costs: the replay CPU seconds (all workers' `replay_cpu_s`) of the rounds that convicted no
    one, over the replays they made. (A reported failure is replayed again by every member before
    it convicts, so a conviction costs W replays; that is the price of a catch, not of the sample.)"""
    replays = catches = pool_n = 0
    pool_cpu = 0.0
    segments = []
    for rec in recs:
        evidence = rec.get("evidence") or {}
        ev = evidence.get(str(worker)) or {}
        if rec["verdicts"][worker] == "replay_mismatch":
            replays, catches = replays + 1, catches + 1
            segments.append(ev.get("segment"))
        elif "replayed" in ev:
            replays += 1
            segments.append(ev["replayed"].get("segment"))
        if "replay_mismatch" not in rec["verdicts"]:
            pool_n += sum(1 for e in evidence.values() if "replayed" in e)
            pool_cpu += sum(x for x in rec["replay_cpu_s"] if x)
    inner = sum(sum(x for x in rec["inner_cpu_s"] if x) for rec in recs)
    worker_rounds = sum(sum(1 for v in rec["train_loss"] if v is not None) for rec in recs)
    return {"replays": replays, "catches": catches, "segments": segments, "inner_cpu_s": round(inner, 3),
            "worker_rounds": worker_rounds, "pool_replays": pool_n, "pool_replay_cpu_s": round(pool_cpu, 3),
            "state_bytes": sum(sum(rec.get("state_bytes_sent") or [0]) for rec in recs),
            "packet_bytes": sum(sum(rec.get("bytes_sent") or [0]) for rec in recs)}


def summarize(extent: str, runs: list[dict]) -> dict:
    """One row: the runs' totals; a replay's cost in worker-rounds (replay CPU per replay over
    the mean inner CPU of a worker-round) and the attacker's catches per worker-round of replay."""
    keys = ("replays", "catches", "inner_cpu_s", "worker_rounds", "pool_replays", "pool_replay_cpu_s", "state_bytes",
            "packet_bytes")
    tot = {k: sum(r[k] for r in runs) for k in keys}
    per_round = tot["inner_cpu_s"] / tot["worker_rounds"]
    cost = tot["pool_replay_cpu_s"] / tot["pool_replays"] / per_round if tot["pool_replays"] else None
    catch = tot["catches"] / tot["replays"] if tot["replays"] else None
    return {"extent": extent, **tot, "catch_per_replay": None if catch is None else round(catch, 4),
            "replay_cost_worker_rounds": None if cost is None else round(cost, 3),
            "catches_per_replayed_round": round(catch / cost, 4) if catch is not None and cost else None,
            "state_bytes_per_worker_round": round(tot["state_bytes"] / tot["worker_rounds"]),
            "packet_bytes_per_worker_round": round(tot["packet_bytes"] / tot["worker_rounds"]),
            "per_seed": runs}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--trace-every", type=int, default=5)
    ap.add_argument("--replay", type=float, default=0.5)
    ap.add_argument("--attack", default="lazy:skip=0.25,scale=none")
    ap.add_argument("--extents", default=",".join(EXTENTS), help="comma-separated, from round, segment, state")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "replay_extent.json"))
    args = ap.parse_args(argv)
    if args.inner_steps % args.trace_every:
        ap.error(f"--trace-every ({args.trace_every}) must divide --inner-steps ({args.inner_steps})")
    extents = args.extents.split(",")
    if not extents or any(e not in EXTENTS for e in extents):
        ap.error(f"--extents must name some of {', '.join(EXTENTS)}, got {args.extents!r}")
    base = ["--topology.workers=4", f"--train.rounds={args.rounds}", f"--train.inner_steps={args.inner_steps}",
            f"--verify.trace_every={args.trace_every}", "--train.inner_state=reset",
            f"--verify.replay_probability={args.replay}", "--verify.loss_gain_batches=0", "--verify.ban=false",
            "--verify.aggregator=trimmed_mean", f"--adversary.{ATTACKER}={args.attack}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for extent in extents:
            runs = []
            for seed in range(args.seeds):
                recs = run_one(base, [f"--verify.replay_extent={extent}", f"--run.seed={seed}"],
                               Path(tmp) / f"{extent}-{seed}")
                runs.append({"seed": seed, **tally(recs)})
            rows.append(summarize(extent, runs))
    per = {r["extent"]: r["catches_per_replayed_round"] for r in rows}

    def ratio(a: str, b: str) -> float | None:
        return round(per[a] / per[b], 3) if per.get(a) is not None and per.get(b) else None

    out = {"rows": rows, "ratio": ratio("round", "segment"),
           "ratios": {e: ratio(e, "round") for e in per if e != "round"},
           "config": {k: getattr(args, k) for k in ("seeds", "rounds", "inner_steps", "trace_every", "replay", "attack",
                                                   "extents")}}
    print(f"{'extent':<8} {'drawn replays':>13} {'caught':>6} {'catch/replay':>12} {'replay cost (worker-rounds)':>27} "
          f"{'catches per replayed worker-round':>33} {'state MB / worker-round':>23} {'packet MB / worker-round':>24}")
    for r in rows:
        print(f"{r['extent']:<8} {r['replays']:>13} {r['catches']:>6} {r['catch_per_replay']!s:>12} "
              f"{r['replay_cost_worker_rounds']!s:>27} {r['catches_per_replayed_round']!s:>33} "
              f"{r['state_bytes_per_worker_round'] / 1e6:>23.3f} {r['packet_bytes_per_worker_round'] / 1e6:>24.3f}")
    print(f"round / segment, catches per replayed round: {out['ratio']}; against round: {out['ratios']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
