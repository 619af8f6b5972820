"""The replicas' gradient reduce in buckets started inside the backward (`[topology] bucket_mb`)
against the reduce after the backward, step by step on the same two processes.

    python bench/buckets.py [--config configs/default.toml] [--set section.key=value ...]
                            [--buckets 0,25] [--steps 30] [--out bench/results/buckets.json]

Two replicas of the config's model (one worker, `train.grad_accum = 2`: one part each) take
`--steps` inner steps for each bucket size of `--buckets` (MB; 0 = after the backward), the sizes
taking turns step by step, so the machine's drift between runs (several percent on this shared
2-core machine, more than the effect) falls on every size alike. Per size: the median seconds of
a step (forward, backward, reduce, clip, AdamW, the owners' broadcast), its ratio to the first
size's, and how many buckets the model's gradients make. Every size must leave the same params
after its steps (the reduce is the same floats), or the bench fails.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from stage_build import print_table, write_result  # noqa: E402


def _replica(rank: int, port: int, config: str, overrides: list[str], sizes: list[float], steps: int, out: str) -> None:
    """One of the two replicas: its part of every step, the sizes taking turns; rank 0 writes the
    step times and every size's params hash."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from veriloco.config import load_config
    from veriloco.hashing import tensors_hash
    from veriloco.inner import InnerLoop, Replicas
    from veriloco.model import build_model
    from veriloco.task import _gpt_loss

    cfg = load_config(config, [*overrides, "--train.grad_accum=2"])
    torch.set_num_threads(cfg.train.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    loops = []
    for mb in sizes:
        model = build_model(cfg.model, cfg.run.seed)
        inner = InnerLoop(model, cfg.train, steps, _gpt_loss)
        inner.replicas = Replicas(dist.group.WORLD, rank, 2, shard=True, bucket_bytes=int(mb * 1e6))
        loops.append(inner)
    gen = torch.Generator().manual_seed(cfg.run.seed)
    batches = [torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.ctx + 1), generator=gen)
               for _ in range(steps)]
    times: list[list[float]] = [[] for _ in sizes]
    for s in range(steps):
        for i, inner in enumerate(loops):
            x, y = batches[s][:, :-1], batches[s][:, 1:]
            dist.barrier()
            t0 = time.perf_counter()
            inner.step(x, y)
            times[i].append(time.perf_counter() - t0)
    if rank == 0:
        buckets = [len(inner.replicas._watched.buckets) if mb else 0 for inner, mb in zip(loops, sizes, strict=True)]
        hashes = [tensors_hash(dict(inner.model.named_parameters())) for inner in loops]
        torch.save({"times": torch.tensor(times), "buckets": torch.tensor(buckets), "same": len(set(hashes)) == 1,
                    "grad_mb": sum(p.numel() * 4 for p in loops[0].model.parameters()) / 1e6}, out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--buckets", default="0,25", help="bucket sizes in MB, comma-separated (0: after the backward)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "buckets.json"))
    args = ap.parse_args(argv)
    try:
        sizes = [float(x) for x in args.buckets.split(",")]
    except ValueError:
        ap.error(f"--buckets must be numbers of MB, comma-separated, got {args.buckets!r}")
    if not sizes or min(sizes) < 0 or args.steps < 3:
        ap.error("--buckets must be sizes >= 0 and --steps >= 3")
    import torch

    from veriloco.procs import start_workers

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        start_workers(_replica, (port, args.config, [f"--{s}" for s in args.set], sizes, args.steps, out), 2)
        res = torch.load(out, weights_only=True)
    if not res["same"]:
        raise SystemExit("the bucket sizes left different params: the reduce is not the same floats")
    medians = [statistics.median(t[1:]) for t in res["times"].tolist()]  # the first step warms up
    rows = [{"bucket_mb": mb, "buckets": int(b), "step_s": round(m, 4), "vs_first": round(m / medians[0], 4)}
            for mb, b, m in zip(sizes, res["buckets"].tolist(), medians, strict=True)]
    result = {"config": Path(args.config).name, "set": args.set, "steps": args.steps,
              "grad_mb": round(res["grad_mb"], 2), "rows": rows}
    print(f"{result['config']} {' '.join(args.set)}: {result['grad_mb']} MB of float32 gradients, 2 replicas, "
          f"{args.steps} steps per size, taking turns; the same params after every size")
    print_table(["bucket_mb", "buckets", "median s a step", "vs the first"],
                [[f"{r['bucket_mb']:g}", str(r["buckets"]), f"{r['step_s']:.4f}", f"{r['vs_first']:.3f}"] for r in rows])
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
