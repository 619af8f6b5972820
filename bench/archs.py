"""The `make run` job with each model architecture: the built-in GPT and transformers' own.

    python bench/archs.py [--rounds 14] [--quick] [--archs gpt,llama,qwen2,qwen3] [--set SECTION.KEY=VALUE]
                          [--out bench/results/archs.json]

configs/default.toml (4 workers, d_model 128, 4 layers, 4 heads, ctx 128, 14 rounds x H = 30, the
same seed and batches) with `[model] arch` set to each of `--archs`, one run after another in one
process. transformers archs take their MLP width from `[model] ffn` (0: 8/3 d_model rounded up to
32, 352 here, so their parameter count is about the GPT's). Prints and writes per row: parameters,
eval loss, its difference from the first row, tokens/s and its ratio to the first row's, wall
seconds: `{"rows": [{"arch", "params", "eval_loss", "vs_first_pct", "tokens_per_s",
"speed_vs_first", "wall_s"}], "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verified_cost import rounds_of, row_bench_args, run_rows  # noqa: E402
from verify import ROOT  # noqa: E402

from veriloco.config import ConfigError, load_config  # noqa: E402
from veriloco.model import build_model  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    row_bench_args(ap, 14, "archs.json")
    ap.add_argument("--archs", default="gpt,llama,qwen2,qwen3", help="comma-separated [model] arch values, in order")
    args = ap.parse_args(argv)
    rounds = rounds_of(ap, args)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    if not archs:
        ap.error("--archs names no architecture")
    sets = [f"--train.rounds={rounds}", *(f"--{s}" for s in args.set)]
    try:
        cfgs = [(arch, load_config(ROOT / "configs" / "default.toml", [*sets, f"--model.arch={arch}"])) for arch in archs]
    except ConfigError as e:
        ap.error(str(e))
    rows = []
    for arch, cfg, _, summary, wall in run_rows(cfgs):
        params = sum(p.numel() for p in build_model(cfg.model, cfg.run.seed).parameters())
        rows.append({"arch": arch, "params": params, "eval_loss": summary["eval_loss_end"],
                     "tokens_per_s": round(summary["tokens_per_s"], 1), "wall_s": round(wall, 1)})
        print(f"{arch}: eval {summary['eval_loss_end']:.4f}, {summary['tokens_per_s']:.0f} tok/s", flush=True)
    first = rows[0]
    for r in rows:
        r["vs_first_pct"] = round(100 * (r["eval_loss"] / first["eval_loss"] - 1), 3)
        r["speed_vs_first"] = round(r["tokens_per_s"] / first["tokens_per_s"], 3)
    print(f"\n{rounds} rounds of configs/default.toml")
    print(f"{'arch':<8} {'params':>8} {'eval loss':>9} {'vs ' + first['arch']:>9} {'tok/s':>8} {'speed':>6} {'wall':>7}")
    for r in rows:
        print(f"{r['arch']:<8} {r['params']:>8} {r['eval_loss']:>9.4f} {r['vs_first_pct']:>+8.2f}% "
              f"{r['tokens_per_s']:>8.0f} {r['speed_vs_first']:>5.3f}x {r['wall_s']:>6.1f}s")
    out = {"rows": rows, "config": {"rounds": rounds, "archs": archs, "set": args.set}}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
