"""What the one-step delay costs: delay 0 vs delay 1 with each correction, fp32 packets, side by side.

    python bench/delay.py [--rounds 10] [--inner-steps 20] [--momentum 0.0,0.5,0.9] [--out bench/results/delay.json]

The communication benchmark's eager row mixes two effects (the delay and the adaptive codec);
this one isolates the delay. Every row trains bench/comm.py's quick GPT (2 layers, d64) with W = 4
workers on the same batches, fp32 packets, no link emulation (the loss does not depend on it),
outer lr 0.7, Nesterov momentum from --momentum; per momentum, six rows:

    d0          delay 0: DiLoCo, wait for the exchange, then step
    eager       delay 1, S = G - c/W * own newest delta (Kale et al. 2025's eager updates; round.py)
    local       delay 1, S = G - c * own newest delta (the worker's delta stands in for the average)
    eager+la, local+la   the same with `--outer.lookahead=true`: also - lr mu^2 m, the momentum
                part of the outer step G still lacks
    naive       delay 1, S = G

and reports each delay-1 row's eval loss against d0's (the issue's target: eager within 0.5%).
Writes `{"rows": [...], "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm import shared_overrides  # noqa: E402

from veriloco.config import load_config  # noqa: E402
from veriloco.run import train  # noqa: E402

ROWS = {
    "d0": ["--outer.delay=0"],
    "eager": ["--outer.delay=1", "--outer.correction=eager"],
    "local": ["--outer.delay=1", "--outer.correction=local"],
    "eager+la": ["--outer.delay=1", "--outer.correction=eager", "--outer.lookahead=true"],
    "local+la": ["--outer.delay=1", "--outer.correction=local", "--outer.lookahead=true"],
    "naive": ["--outer.delay=1", "--outer.correction=naive"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--momentum", default="0.0,0.5,0.9")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "delay.json"))
    args = ap.parse_args()
    base = [o for o in shared_overrides(True, args.rounds, args.inner_steps, 4) if not o.startswith("--link")]
    base += ["--compress.codec=fp32", "--ledger.backend=none"]
    rows = []
    print(f"{'momentum':>8} | {'row':>10} | {'eval loss':>9} | {'vs d0':>8}", flush=True)
    for m in [float(x) for x in args.momentum.split(",")]:
        d0 = None
        for name, extra in ROWS.items():
            cfg = load_config(None, [*base, *extra, f"--outer.momentum={m}"])
            with tempfile.TemporaryDirectory(prefix="veriloco-delay-") as tmp:
                _, summary = train(cfg, str(Path(tmp) / "run"), quiet=True)
            loss = summary["eval_loss_end"]
            d0 = loss if name == "d0" else d0
            vs = 100 * (loss - d0) / d0
            rows.append({"momentum": m, "name": name, "eval_loss": loss, "vs_d0_pct": round(vs, 3)})
            print(f"{m:>8} | {name:>10} | {loss:>9.4f} | {vs:>+7.2f}%", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "config": {"overrides": base, "rounds": args.rounds,
                                          "inner_steps": args.inner_steps}}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
