"""torchft's DiLoCo on veriloco's task: the peer comparison for bench/comm.py.

    python bench/torchft_diloco.py                                  # configs/default.toml, 4 workers
    python bench/torchft_diloco.py configs/tiny.toml --train.rounds=2 --link.bandwidth=1gbit \\
        --link.latency=50ms --out /tmp/torchft.json

What runs: `torchft.local_sgd.DiLoCo` (torchft 0.2.0; Douillard et al. 2023, arXiv 2311.08105)
with W worker processes, each its own torchft replica group of one (a `Manager` with a
reconfigurable gloo process group on loopback), joined by a `LighthouseServer` on loopback.
Everything a veriloco run with the same config fixes is the same here:
- model: `veriloco.model.build_model(cfg.model, cfg.run.seed)` (identical init on every worker,
  so the Manager's `init_sync` is off: nothing needs healing at step 0);
- batches: worker w's inner step s of round r trains on `veriloco.data.batch(seed, w, r, s)`;
- inner optimizer: `veriloco.inner.InnerLoop` itself (AdamW, decay / no-decay groups, warmup +
  cosine `lr_at`, gradient clipping); torchft hooks its `opt` and syncs after every H =
  `train.inner_steps` optimizer steps (`sync_every`);
- outer optimizer: `torch.optim.SGD(lr=outer.lr, momentum=outer.momentum, nesterov=...)` on the
  averaged pseudo-gradient (torchft restores the global params, sets `.grad`, steps);
- eval: the global params after the last round on `veriloco.data.eval_batches`, each worker its
  `[rank::W]` share, summed as veriloco's `evaluate` does.

Communication: DiLoCo hands the pseudo-gradient (fp32) to `Manager.allreduce`, which calls the
process group's `allreduce`. With `use_bucketization=True` and torchft's default 1 GiB bucket,
that is ONE allreduce of the whole flattened model per round (per-parameter allreduce would be
~50 tensors, each paying the link latency again; one bucket is how one would run torchft on a
slow link, and it matches veriloco's model of one exchange per round).
- Bytes: `PacedGloo.allreduce` counts the bytes of the tensors handed to it (`bytes_handed`)
  and reports `bytes_per_worker` = 2 (W-1)/W x that: what a ring all-reduce puts on each
  worker's link in each direction, the same convention as the DDP baseline's comm hook.
- Slow link: the same emulation as veriloco's exchange (`veriloco.link.pace`): the allreduce
  runs at loopback speed, then its `wait()` does not return before
  `start + latency + wire_bytes * 8 / bandwidth` (one latency per exchange, full duplex).
  torchft's DiLoCo starts the allreduce and waits for it in the same step (`prepare_sync` then
  `perform_sync`, `fragment_sync_delay=0`), so the emulated link time lands on the critical
  path, exactly as it would on a real link.
- Not paced: torchft's control traffic (quorum via the lighthouse and the `should_commit` RPC,
  once per round each) travels over loopback at loopback latency. On a real 50 ms link each
  would add at least one round trip per round, so this bench *favours* torchft slightly.

Times: `inner_s` is the time spent in inner steps, measured as `InnerLoop.run`'s time minus the
time spent inside DiLoCo's `prepare_sync` / `perform_sync` (which torchft runs in the optimizer
step hook of the H-th step); `wall_s` runs from a barrier after setup to the end of the final
eval on the slowest worker (like veriloco's, which starts after the first eval and includes the
last one); `utilisation` = mean inner_s / wall_s; `tokens_per_s` = all workers' tokens / wall_s.

If torchft is missing or fails, `run_torchft_diloco` returns a row with `skipped` set to the
error message instead of raising, so a bench that includes it still finishes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from veriloco.config import Config, load_config
from veriloco.link import Link

ROOT = Path(__file__).resolve().parents[1]


def _paced_gloo_class() -> type:
    """torchft's reconfigurable gloo group with a byte-counting, link-pacing `allreduce`.

    Built lazily so that importing this module never needs torchft.
    """
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from veriloco.link import pace

    class _PacedWork(dist._Work):
        """An allreduce in flight; `wait()` returns no sooner than the emulated link allows."""

        def __init__(self, work: dist._Work, started: float, wire_bytes: int, owner: Any) -> None:
            super().__init__()
            self._work, self._started, self._wire, self._owner = work, started, wire_bytes, owner
            self._paced = False

        def _pace(self) -> None:
            if not self._paced:  # once: wait() and the future callback may both get here
                self._paced = True
                self._owner.paced_s += pace(self._started, self._wire, self._wire, self._owner.link)

        def wait(self, timeout: timedelta | None = None) -> bool:
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
            self._pace()
            return ok

        def get_future(self) -> torch.futures.Future:
            def paced(fut: torch.futures.Future) -> Any:
                self._pace()
                return fut.value()

            return self._work.get_future().then(paced)

    class PacedGloo(ProcessGroupGloo):
        """Counts what is handed to allreduce; paces each allreduce on `link` (None: no pacing)."""

        def __init__(self, link: Link | None, world: int, timeout: timedelta) -> None:
            super().__init__(timeout=timeout)
            self.link, self.world = link, world
            self.bytes_handed = 0  # bytes of the tensors given to allreduce, summed
            self.wire_bytes = 0  # ring all-reduce traffic per worker, each direction
            self.allreduces = 0
            self.paced_s = 0.0

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist._Work:
            handed = sum(t.numel() * t.element_size() for t in tensors)
            wire = int(2 * (self.world - 1) / self.world * handed)
            self.bytes_handed += handed
            self.wire_bytes += wire
            self.allreduces += 1
            started = time.perf_counter()
            work = super().allreduce(tensors, opts)
            return work if self.link is None else _PacedWork(work, started, wire, self)

    return PacedGloo


def torch_adamw(opt: Any) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over the same groups (lr, betas, eps, weight decay) as the inner loop's
    `veriloco.inner.AdamW`, before any step: torchft's DiLoCo registers a step pre-hook on the
    optimizer it is given, which only `torch.optim.Optimizer` has. The same kernel call, so the
    same steps bit for bit (tests/test_inner_adamw.py compares the two classes)."""
    if any(opt.state.values()):
        raise ValueError("torch_adamw: the optimizer has already stepped")
    return torch.optim.AdamW([dict(g) for g in opt.param_groups], foreach=opt.foreach)  # each group names its lr, betas, eps, decay


def _worker(
    rank: int, world: int, cfg: Config, link: Link | None, lighthouse: str, barrier: Any, out_dir: str,
) -> None:
    """One torchft replica group of one process: train, eval its share, write worker-<rank>.json."""
    result: dict[str, Any] = {"rank": rank}
    manager = None
    try:
        import torch.distributed as dist
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager

        from veriloco.data import batch, eval_batches, load_corpus
        from veriloco.inner import InnerLoop
        from veriloco.model import build_model, lm_loss

        logging.getLogger("torchft").setLevel(logging.ERROR)  # per-step warnings about NCCL tracing
        torch.set_num_threads(cfg.train.threads)
        t, m = cfg.train, cfg.model
        corpus = load_corpus(cfg.data, m.vocab_size, m.ctx)
        model = build_model(m, cfg.run.seed)

        def loss_fn(mod: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(mod(x), y)

        inner = InnerLoop(model, t, t.rounds * t.inner_steps, loss_fn)
        inner.opt = torch_adamw(inner.opt)  # torchft hooks the optimizer's step: it needs torch's class
        o = cfg.outer
        outer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                                nesterov=o.nesterov and o.momentum > 0)
        timeout = timedelta(seconds=cfg.run.timeout_s)
        pg = _paced_gloo_class()(link, world, timeout)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=world,
            use_async_quorum=False,  # DiLoCo requires a synchronous quorum
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
            lighthouse_addr=lighthouse, replica_id=f"veriloco_bench_{rank}", hostname="127.0.0.1",
            init_sync=False,  # every worker builds the same init from the seed
        )
        with DiLoCo(manager, [model], inner.opt, outer, sync_every=t.inner_steps,
                    backup_device=torch.device("cpu"), pin_memory=False, use_bucketization=True) as diloco:
            sync = {"s": 0.0}
            fragment = diloco._fragments[0]  # one fragment: the whole model (plain DiLoCo)
            for name in ("prepare_sync", "perform_sync"):
                fn = getattr(fragment, name)

                def timed(fn: Any = fn) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return fn()
                    finally:
                        sync["s"] += time.perf_counter() - t0

                setattr(fragment, name, timed)
            barrier.wait()
            wall0 = time.perf_counter()
            inner_s, rounds, commits = 0.0, [], 0
            for r in range(t.rounds):
                before = sync["s"]
                res = inner.run(lambda s, r=r: batch(corpus, cfg.run.seed, rank, r, s, t.batch_size, m.ctx),
                                t.inner_steps)
                this_sync = sync["s"] - before
                inner_s += res.seconds - this_sync
                rounds.append({"round": r, "train_loss": res.mean_loss, "inner_s": round(res.seconds - this_sync, 4),
                               "sync_s": round(this_sync, 4), "manager_step": manager.current_step()})
            commits = manager.current_step()  # one step per committed outer sync
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for x, y in eval_batches(corpus, t.eval_batches, t.batch_size, m.ctx)[rank::world]:
                total[0] += float(loss_fn(model, x, y)) * y.numel()
                total[1] += y.numel()
        result.update({
            "wall_s": time.perf_counter() - wall0, "inner_s": inner_s, "sync_s": sync["s"],
            "eval_sum": float(total[0]), "eval_n": float(total[1]),
            "tokens": t.rounds * t.inner_steps * t.batch_size * m.ctx,
            "bytes_handed": pg.bytes_handed, "wire_bytes": pg.wire_bytes, "allreduces": pg.allreduces,
            "paced_s": pg.paced_s, "commits": commits, "rounds": rounds,
        })
    except Exception as e:  # reported in the row, never raised: the bench must finish
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        result["traceback"] = traceback.format_exc()[-2000:]
    finally:
        if manager is not None:
            try:
                manager.shutdown(wait=False)
            except Exception:  # noqa: BLE001 - shutting down a half-built manager
                pass
        Path(out_dir, f"worker-{rank}.json").write_text(json.dumps(result))


def torchft_available() -> tuple[bool, str]:
    """(True, version) when torchft imports here, else (False, the import error)."""
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken native extension
        return False, f"torchft unavailable: {type(e).__name__}: {e}"
    from importlib.metadata import version

    return True, version("torchft")


def run_torchft_diloco(cfg: Config, link: Link | None, name: str = "torchft DiLoCo") -> dict:
    """Train cfg's GPT with torchft's DiLoCo on W processes; one bench row (or `skipped`)."""
    # torchft's Rust side logs every quorum at INFO; keep the bench output readable (an
    # explicit RUST_LOG from the user still wins). Set before torchft loads; children inherit it.
    os.environ.setdefault("RUST_LOG", "error")
    ok, info = torchft_available()
    row: dict[str, Any] = {"name": name, "system": "torchft", "codec": "fp32 allreduce", "delay": 0}
    if not ok:
        return row | {"skipped": info}
    row["torchft_version"] = info
    from torchft.coordination import LighthouseServer

    world = cfg.topology.workers
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world, join_timeout_ms=100)
    try:
        with tempfile.TemporaryDirectory(prefix="veriloco-torchft-") as out_dir:
            ctx = mp.get_context("spawn")
            barrier = ctx.Barrier(world)
            procs = [ctx.Process(target=_worker, args=(w, world, cfg, link, lighthouse.address(), barrier, out_dir))
                     for w in range(world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + cfg.run.timeout_s + 60 * cfg.train.rounds
            for p in procs:
                p.join(max(deadline - time.monotonic(), 1))
            for p in procs:
                if p.is_alive():  # our own child, stuck: end it by its handle
                    p.kill()
                    p.join()
            results = []
            for w in range(world):
                f = Path(out_dir, f"worker-{w}.json")
                results.append(json.loads(f.read_text()) if f.exists() else {"rank": w, "error": "no result (killed?)"})
    finally:
        lighthouse.shutdown()
    errors = [f"worker {r['rank']}: {r['error']}" for r in results if "error" in r]
    if errors:
        return row | {"skipped": "torchft run failed: " + "; ".join(errors),
                      "traceback": next((r.get("traceback") for r in results if r.get("traceback")), None)}
    wall = max(r["wall_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    eval_loss = sum(r["eval_sum"] for r in results) / sum(r["eval_n"] for r in results)
    inner_s = sum(r["inner_s"] for r in results) / world
    return row | {
        "eval_loss": eval_loss,
        "bytes_per_worker": int(sum(r["wire_bytes"] for r in results) / world),
        "bytes_handed_per_worker": int(sum(r["bytes_handed"] for r in results) / world),
        "allreduces_per_worker": results[0]["allreduces"],
        "wall_s": round(wall, 3),
        "inner_s": round(inner_s, 3),
        "sync_s": round(sum(r["sync_s"] for r in results) / world, 3),
        "paced_s": round(sum(r["paced_s"] for r in results) / world, 3),
        "utilisation": round(inner_s / wall, 4),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "commits": min(r["commits"] for r in results),
        "rounds": cfg.train.rounds,
        "train_loss_last": sum(r["rounds"][-1]["train_loss"] for r in results) / world,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs" / "default.toml"))
    ap.add_argument("--out", default="", help="write the row as JSON here")
    args, overrides = ap.parse_known_args()
    cfg = load_config(args.config, overrides)
    link = Link.from_strings(cfg.link.bandwidth, cfg.link.latency)
    row = run_torchft_diloco(cfg, None if link.unlimited else link)
    text = json.dumps(row, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if "skipped" in row:
        raise SystemExit(f"skipped: {row['skipped']}")
    if not math.isfinite(row["eval_loss"]):
        raise SystemExit("eval loss is not finite")


if __name__ == "__main__":
    main()
