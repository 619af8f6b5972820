"""The DDP baseline: the same model on the same batches, all-reduce of gradients every step.

`--train.mode=ddp` trains with PyTorch DistributedDataParallel: worker w's step s of "round" r
uses exactly the batch DiLoCo would give it (`batch(seed, w, r, s)`), with the same AdamW and
LR schedule, so loss and traffic compare side by side. Bytes are counted in a DDP comm hook:
each bucket handed to all-reduce is counted as ring all-reduce traffic, 2 (W-1)/W times the
bucket's bytes sent (and as many received) per worker — what NCCL/gloo ring all-reduce puts on
each worker's link. Records have the same shape as DiLoCo's, one line per H steps.
"""

from __future__ import annotations

import inspect
import json
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import Config
from .inner import InnerLoop
from .procs import die_with_parent, start_workers, warm
from .records import RunDir
from .round import init_distributed, progress_line
from .run import check_device, free_port, prepare_run
from .task import CorpusTask, Task, on_device, process_device, take_device


class _CommCounter:
    """State of the comm hook: bytes handed to all-reduce, and the optional slow link."""

    def __init__(self, world: int, link=None) -> None:
        self.world, self.link = world, link
        self.bytes = 0
        self.paced_s = 0.0


def _counting_allreduce(state: _CommCounter, bucket):  # noqa: ANN001 - DDP rejects string annotations here
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    wire = int(2 * (state.world - 1) / state.world * nbytes)
    state.bytes += wire
    started = time.perf_counter()
    buf.div_(state.world)
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        if state.link is not None:
            from .link import pace

            state.paced_s += pace(started, wire, wire, state.link)
        return f.value()[0]

    return fut.then(done)


def _ddp_worker(rank: int, world: int, cfg: Config, task: Task, run_dir: str, port: int, quiet: bool, link) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends the workers on Ctrl-C (procs.start_workers)
    die_with_parent()
    init_distributed(cfg, rank, world, f"tcp://127.0.0.1:{port}")
    try:
        torch.set_num_threads(cfg.train.threads)
        run = RunDir(run_dir)
        device = process_device(cfg, rank)
        take_device(device, exact=False)
        task = on_device(task, device, cfg.train.precision)
        model = task.make_model()
        # buffers are not synced every step (the GPT has none); torch >= 2.13 names that
        # forward_sync_buffers and warns on the older broadcast_buffers
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **{no_sync: False})
        counter = _CommCounter(world, link)
        ddp.register_comm_hook(counter, _counting_allreduce)
        inner = InnerLoop(ddp, cfg.train, cfg.train.rounds * cfg.train.inner_steps, task.loss)
        eval_set = task.eval_batches()[rank::world]

        def evaluate() -> float:
            total = torch.zeros(2, dtype=torch.float64)
            with torch.no_grad():
                for x, y in eval_set:
                    total[0] += float(task.loss(model, x, y)) * y.numel()
                    total[1] += y.numel()
            dist.all_reduce(total)
            return float(total[0] / total[1])

        eval_start = evaluate()
        wall0, tokens = time.perf_counter(), 0
        for r in range(cfg.train.rounds):
            t0, sent0 = time.perf_counter(), counter.bytes
            res = inner.run(lambda s, r=r: task.batch(rank, r, s), cfg.train.inner_steps)
            tokens += res.tokens * world
            last = r == cfg.train.rounds - 1
            ev = evaluate() if (r + 1) % cfg.train.eval_every == 0 or last else None
            loss = torch.tensor([res.mean_loss], dtype=torch.float64)
            losses = [torch.zeros_like(loss) for _ in range(world)]
            dist.all_gather(losses, loss)
            sent = counter.bytes - sent0
            rec = {
                "round": r, "mode": "ddp", "eval_loss": ev, "eval_loss_start": eval_start,
                "train_loss": [float(x) for x in losses], "bytes_sent": [sent] * world,
                "bytes_received": [sent] * world, "verdicts": ["accept"] * world,
                "round_s": round(time.perf_counter() - t0, 4), "tokens": res.tokens * world,
                "inner_s": [round(res.seconds, 4)] * world,
            }
            if rank == 0:
                elapsed = time.perf_counter() - wall0
                run.append_round(rec)
                run.append_metrics({"round": r, "eval_loss": ev, "train_loss": rec["train_loss"],
                                    "tokens": tokens, "elapsed_s": round(elapsed, 3),
                                    "tokens_per_s": round(tokens / elapsed, 1)})
                if not quiet:
                    print(progress_line(rec, cfg.train.rounds, elapsed, tokens / elapsed), flush=True)
        if rank == 0:
            wall = time.perf_counter() - wall0
            recs = run.rounds()
            run.write_summary({
                "mode": "ddp", "eval_loss_start": eval_start, "eval_loss_end": recs[-1]["eval_loss"],
                "tokens": tokens, "rounds": len(recs), "workers": world, "wall_s": round(wall, 3),
                "tokens_per_s": round(tokens / wall, 1), "bytes_sent_per_worker": counter.bytes,
                "final_checkpoint": None,
            })
        # drop DDP's reducer before the group: its destructor joins gloo threads that may be
        # waiting for the GIL held here, which hung some workers at exit
        del ddp, inner
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_ddp(cfg: Config, out: str | None = None, quiet: bool = False, link=None) -> tuple[RunDir, dict]:
    """Run the DDP baseline with cfg's model, data and schedule; returns (run dir, summary). Its
    all-reduces are paced on `link` (link.Link), by default cfg's [link]."""
    if link is None:
        from .link import Link

        link = Link.paced(cfg.link.bandwidth, cfg.link.latency)
    check_device(cfg)
    warm()
    run, task = prepare_run(cfg, out)
    try:
        return run, launch_ddp(cfg, task.as_task(), run, quiet, link)
    finally:
        run.release()


def launch_ddp(cfg: Config, task: Task, run: RunDir, quiet: bool = False, link=None) -> dict:
    world = cfg.topology.workers
    start_workers(_ddp_worker, (world, cfg, task, str(run.root), free_port(), quiet, link), world)
    return json.loads(run.summary_path.read_text())


__all__ = ["train_ddp", "launch_ddp", "CorpusTask"]
