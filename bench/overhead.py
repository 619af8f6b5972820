"""Overhead of veriloco vs a bare PyTorch loop: same model, same tokens, 1 worker.

    python bench/overhead.py [--quick] [--repeats N] [--out bench/results/overhead.json]

Both sides train the default GPT (configs/default.toml's model) on the same batches
(`data.batch(seed, 0, round, step)`) with AdamW, the same LR schedule and grad clipping, one
process with one thread each. veriloco adds what a round costs on top of the inner steps:
encoding the packet, the exchange (a group of one), the outer step, writing the packet,
checkpoint and inner state to the store with fsync, and the round record. Eval is disabled on
both sides (eval_every = rounds) so only the round machinery is measured. The two run
alternately, `--repeats` times each, and the ratio of median tokens/s is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from veriloco.config import load_config
from veriloco.data import batch, load_corpus
from veriloco.inner import lr_at
from veriloco.model import build_model, lm_loss
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(cfg, box) -> None:
    """The plain PyTorch loop (runs in its own process, like a veriloco worker)."""
    torch.set_num_threads(cfg.train.threads)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx)
    model = build_model(cfg.model, cfg.run.seed)
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), foreach=False)
    total = t.rounds * t.inner_steps
    tokens, t0 = 0, time.perf_counter()
    for step in range(total):
        x, y = batch(corpus, cfg.run.seed, 0, step // t.inner_steps, step % t.inner_steps, t.batch_size, cfg.model.ctx)
        for g in opt.param_groups:
            g["lr"] = lr_at(t, step, total)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=False)
        opt.step()
        tokens += y.numel()
    box["wall_s"] = time.perf_counter() - t0
    box["tokens"] = tokens
    box["loss"] = float(loss)


def run_bare(cfg) -> dict:
    with mp.Manager() as m:
        box = m.dict()
        p = mp.get_context("spawn").Process(target=bare_loop, args=(cfg, box))
        p.start()
        p.join()
        return dict(box)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repeats of 3 rounds x 40 steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.inner_steps = 2, 3, 40
    cfg = load_config(ROOT / "configs" / "default.toml", [
        "--topology.workers=1", f"--train.rounds={args.rounds}", f"--train.inner_steps={args.inner_steps}",
        f"--train.eval_every={args.rounds}", "--train.eval_batches=1",
    ])
    rows = {"veriloco": [], "bare": []}
    for rep in range(args.repeats):
        order = ("veriloco", "bare") if rep % 2 == 0 else ("bare", "veriloco")
        for name in order:
            if name == "veriloco":
                with tempfile.TemporaryDirectory() as d:
                    _, s = train(cfg, str(Path(d) / "run"), quiet=True)
                    # wall_s spans the rounds; the final eval of the last round is subtracted
                    rows[name].append(s["tokens"] / s["wall_s"])
            else:
                b = run_bare(cfg)
                rows[name].append(b["tokens"] / b["wall_s"])
            print(f"repeat {rep + 1}/{args.repeats} {name:8s} {rows[name][-1] / 1e3:7.2f}k tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = med["veriloco"] / med["bare"]
    result = {
        "config": {"rounds": args.rounds, "inner_steps": args.inner_steps, "repeats": args.repeats,
                   "model": cfg.to_dict()["model"], "batch_size": cfg.train.batch_size},
        "tokens_per_s": rows, "median_tokens_per_s": med, "ratio_veriloco_vs_bare": ratio,
        "overhead_pct": round(100 * (1 - ratio), 2),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n| side | median tok/s |\n|---|---|\n| bare PyTorch | {med['bare']:.0f} |\n| veriloco (1 worker) | {med['veriloco']:.0f} |")
    print(f"ratio veriloco/bare = {ratio:.4f}  (overhead {100 * (1 - ratio):.2f}%)  -> {args.out}")


if __name__ == "__main__":
    main()
