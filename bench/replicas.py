"""A worker on several processes (`[topology] replicas`): how much faster its inner steps run,
and that the run is the one-process run bit for bit.

    python bench/replicas.py [--workers 1] [--replicas 2] [--stages 1] [--rounds 3] [--repeats 2] [--bucket-mb 25]
                             [--config configs/default.toml] [--set section.key=value ...]
                             [--out bench/results/replicas.json]

Each repeat trains the config with `--workers` workers and `train.grad_accum = --replicas`, once
on one process per worker and once on `--replicas` processes per worker (each runs one of the
step's grad_accum parts), alternating (the machine is shared and noisy). With `--stages S` > 1
a worker is an S-stage pipeline with `topology.microbatches = --replicas`, once on S processes
and once on S x replicas (each replica's pipeline runs one micro-batch). A third way runs the
replicas with `topology.shard_optimizer = false` (each steps the whole AdamW, against the default
ZeRO-1 sharding). With one stage the replicas' gradient reduce runs in buckets of `--bucket-mb`
started inside the backward (`topology.bucket_mb`), and a fourth way runs it after the backward
(bucket_mb = 0), both sharded. Per way: the median
tokens/s of the run and the median inner-step seconds per round (`inner_s` in the records,
averaged over workers). The two ways must record the same params hash and eval loss in every
round, or the bench fails. On this 2-core machine, run it with as many processes in all
(workers x replicas) as there are cores, or the replicas only share them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from stage_build import print_table, write_result  # noqa: E402


def one_run(config: str, overrides: list[str], out: Path) -> dict:
    from veriloco.config import load_config
    from veriloco.run import train

    run, summary = train(load_config(config, overrides), str(out), quiet=True)
    records = run.rounds()
    return {"tokens_per_s": summary["tokens_per_s"],
            "inner_s": statistics.median(sum(r["inner_s"]) / len(r["inner_s"]) for r in records),
            "rounds": [(r["params_hash"], r["eval_loss"]) for r in records]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="the replicas' topology.bucket_mb (one stage; a fourth way runs them with 0)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "replicas.json"))
    args = ap.parse_args(argv)
    if min(args.workers, args.rounds, args.repeats, args.stages) < 1 or args.replicas < 2:
        ap.error("--workers, --stages, --rounds and --repeats must be >= 1, --replicas >= 2")
    if not args.bucket_mb >= 0:
        ap.error(f"--bucket-mb must be >= 0, got {args.bucket_mb}")
    split = ([f"--topology.stages={args.stages}", f"--topology.microbatches={args.replicas}"] if args.stages > 1
             else [f"--train.grad_accum={args.replicas}"])
    common = [f"--topology.workers={args.workers}", *split, f"--train.rounds={args.rounds}", *(f"--{s}" for s in args.set)]
    alone, many = ("1 process", f"{args.replicas} replicas") if args.stages == 1 else \
        (f"{args.stages} stages", f"{args.stages} stages x {args.replicas} replicas")
    bucket = [f"--topology.bucket_mb={args.bucket_mb}"] if args.stages == 1 else []
    ways = {alone: common, many: [*common, f"--topology.replicas={args.replicas}", *bucket]}
    ways[f"{many}, whole optimizer"] = [*ways[many], "--topology.shard_optimizer=false"]  # against ZeRO-1, the default
    if args.stages == 1:  # the reduce in buckets started inside the backward, against after it
        ways[f"{many}, reduce after the backward"] = [*common, f"--topology.replicas={args.replicas}",
                                                      "--topology.bucket_mb=0"]
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for way, overrides in ways.items():
                runs[way].append(one_run(args.config, overrides, Path(tmp) / f"{k}-{way.replace(' ', '-')}"))
    if len({json.dumps(r["rounds"]) for rs in runs.values() for r in rs}) != 1:
        raise SystemExit("the ways recorded different params or eval losses")
    rows = [{"way": way, "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
             "inner_s": round(statistics.median(r["inner_s"] for r in rs), 3)} for way, rs in runs.items()]
    result = {"config": Path(args.config).name, "workers": args.workers, "replicas": args.replicas,
              "stages": args.stages, "rounds": args.rounds, "repeats": args.repeats, "set": args.set, "rows": rows,
              "bucket_mb": args.bucket_mb if args.stages == 1 else None,
              "speedup": round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3),
              "final": runs[alone][0]["rounds"][-1]}
    print(f"{result['config']}, {args.workers} worker(s), {' '.join(split)}, {args.rounds} rounds, "
          f"{args.repeats} repeats (medians); the same params hash and eval loss every round")
    print_table(["way", "tok/s", "inner s per round"], [[r["way"], f"{r['tokens_per_s']:.0f}", f"{r['inner_s']:.2f}"]
                                                         for r in rows])
    print(f"speedup: {result['speedup']:.2f}x")
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
