"""What tied embeddings cost a pipelined worker per inner step (`[model] tie` with stages > 1):
the first stage sends the embedding to the last before every step and the last sends its
gradient back (`pipeline.TiedEnds`), where an untied model's last stage keeps a head of its own
and steps it with AdamW.

    python bench/tie_cost.py [--vocab 32000] [--d-model 256] [--steps 10] [--rounds 2] [--repeats 2]
                             [--out bench/results/tie_cost.json]

Each repeat trains configs/default.toml's GPT with `--vocab` tokens and `--d-model` on 1 worker
of 2 pipeline stages (gpipe, 2 micro-batches), `--rounds` rounds of `--steps` inner steps, tied
and untied, alternating (the machine is shared and noisy). Per way: the median over repeats of
the median inner-step seconds per round divided by the steps, the model's params, and
the bytes the tie moves per step between the stages (2 x vocab x d_model x 4, by arithmetic:
the messages are the embedding and its gradient in float32). On the CPU, over gloo on loopback.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from stage_build import print_table, write_result  # noqa: E402


def one_run(overrides: list[str], out: Path, steps: int) -> float:
    """Seconds per inner step of one run (the median round's inner seconds over its steps)."""
    from veriloco.config import load_config
    from veriloco.run import train

    run, _ = train(load_config(ROOT / "configs" / "default.toml", overrides), str(out), quiet=True)
    return statistics.median(max(r["inner_s"]) for r in run.rounds()) / steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tie_cost.json"))
    args = ap.parse_args(argv)
    if args.vocab < 256 or min(args.d_model, args.steps, args.rounds, args.repeats) < 1:
        ap.error("--vocab must be >= 256 (the byte corpus), --d-model, --steps, --rounds and --repeats >= 1")
    from veriloco.config import load_config
    from veriloco.model import build_meta

    common = [f"--model.vocab_size={args.vocab}", f"--model.d_model={args.d_model}", "--topology.workers=1",
              "--topology.stages=2", "--topology.microbatches=2", f"--train.rounds={args.rounds}",
              f"--train.inner_steps={args.steps}", f"--train.warmup_steps={args.steps}"]
    ways = {"untied": common, "tied": [*common, "--model.tie=true"]}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for way, overrides in ways.items():
                seconds[way].append(one_run(overrides, Path(tmp) / f"{way}-{k}", args.steps))
    params = {way: sum(p.numel() for p in build_meta(load_config(ROOT / "configs" / "default.toml", o).model)
                       .parameters()) for way, o in ways.items()}
    rows = [{"way": way, "params": params[way], "step_s": round(statistics.median(seconds[way]), 4),
             "tie_bytes_per_step": 2 * args.vocab * args.d_model * 4 if way == "tied" else 0} for way in ways]
    result = {"vocab": args.vocab, "d_model": args.d_model, "steps": args.steps, "rounds": args.rounds,
              "repeats": args.repeats, "rows": rows, "ratio": round(rows[1]["step_s"] / rows[0]["step_s"], 3)}
    print(f"GPT, vocab {args.vocab}, d_model {args.d_model}, 1 worker of 2 stages, {args.rounds} rounds x "
          f"{args.steps} steps, {args.repeats} repeats (medians)")
    print_table(["way", "params", "s per inner step", "tie MB per step"],
                [[r["way"], f"{r['params']:,}", f"{r['step_s']:.4f}", f"{r['tie_bytes_per_step'] / 1e6:.1f}"] for r in rows])
    print(f"tied / untied: {result['ratio']:.3f}x")
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
