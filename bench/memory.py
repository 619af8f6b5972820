"""What `[train] grad_accum` and `[model] checkpoint` cost and save, on one inner step.

    python bench/memory.py [--layers 4] [--d-model 64] [--ctx 64] [--batch 4] [--batches 5]
                           [--out bench/results/memory.json]

For each of `--batches` random batches, one AdamW step (veriloco's `InnerLoop`, the tiny config's
training settings) from the same initial GPT, run plainly, with grad_accum = 2 and 4, and with
activation checkpointing. Per variant: the most bytes the autograd graph holds for the backward
at once (a saved-tensors hook counts each tensor saved until autograd releases it; weights saved
by several ops count each time; the largest over the batches), the step's wall time (median),
and how far the params end from the plain step's (largest absolute difference over the batches;
0 means bit for bit). With checkpointing, the backward recomputes one block at a time under
autograd's own hooks, which this count does not see: add about one block's share of the plain
row while it runs. On the CPU; a GPU's activation memory follows the same tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from veriloco.config import load_config  # noqa: E402
from veriloco.inner import InnerLoop  # noqa: E402
from veriloco.model import build_model, lm_loss  # noqa: E402

VARIANTS = {"plain": [], "grad_accum=2": ["--train.grad_accum=2"], "grad_accum=4": ["--train.grad_accum=4"],
            "checkpoint": ["--model.checkpoint=true"]}


class _Held:
    """A tensor saved for the backward, counted in `live` = [bytes held now, most held] until
    autograd releases it."""

    def __init__(self, t: torch.Tensor, live: list[int]) -> None:
        self.t, self.n, self.live = t, t.numel() * t.element_size(), live
        live[0] += self.n
        live[1] = max(live[1], live[0])

    def __del__(self) -> None:
        self.live[0] -= self.n


def one_step(overrides: list[str], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """(params after one step, most bytes held for the backward at once, seconds) for a fresh model."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    model = build_model(cfg.model, 0)
    loop = InnerLoop(model, cfg.train, 10, lambda m, a, b: lm_loss(m(a), b))
    live = [0, 0]
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, live), lambda h: h.t):
        loop.step(x, y)
    seconds = time.perf_counter() - t0
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), live[1], seconds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = ap.parse_args(argv)
    if min(args.layers, args.d_model, args.ctx, args.batches) < 1 or args.batch % 4 or args.d_model % 2:
        ap.error("--layers, --d-model, --ctx, --batches must be >= 1; --batch a multiple of 4; --d-model even")
    torch.set_num_threads(1)
    shape = [f"--model.n_layer={args.layers}", f"--model.d_model={args.d_model}", "--model.n_head=2",
             f"--model.ctx={args.ctx}", f"--train.batch_size={args.batch}"]
    stats = {name: {"saved": 0, "seconds": [], "max_diff": 0.0} for name in VARIANTS}
    for b in range(args.batches):
        g = torch.Generator().manual_seed(b)
        x = torch.randint(0, 256, (args.batch, args.ctx), generator=g)
        y = torch.randint(0, 256, (args.batch, args.ctx), generator=g)
        plain = None
        for name, extra in VARIANTS.items():
            params, saved, seconds = one_step([*shape, *extra], x, y)
            plain = params if plain is None else plain
            st = stats[name]
            st["saved"] = max(st["saved"], saved)
            st["seconds"].append(seconds)
            st["max_diff"] = max(st["max_diff"], float((params - plain).abs().max()))
    rows = [{"variant": name, "saved_bytes": st["saved"], "saved_vs_plain": round(st["saved"] / stats["plain"]["saved"], 3),
             "step_s": round(statistics.median(st["seconds"]), 5),
             "time_vs_plain": round(statistics.median(st["seconds"]) / statistics.median(stats["plain"]["seconds"]), 2),
             "max_param_diff": st["max_diff"]} for name, st in stats.items()]
    print(f"GPT {args.layers} layers, d_model {args.d_model}, ctx {args.ctx}, batch {args.batch}, "
          f"{args.batches} batches, one AdamW step each\n")
    print("| variant | held for the backward (peak) | vs plain | step | vs plain | largest param difference |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['saved_bytes'] / 1e6:.2f} MB | {r['saved_vs_plain']:.2f} | "
              f"{1e3 * r['step_s']:.1f} ms | {r['time_vs_plain']:.2f} | {r['max_param_diff']:.2g} |")
    print(f"\ncheckpoint: plus one block's activations while the backward recomputes it (not counted: "
          f"about {stats['plain']['saved'] / 1e6 / (args.layers + 1):.2f} MB here, a layer's share of plain)")
    out = {"rows": rows, "config": vars(args)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
