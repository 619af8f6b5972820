"""What a lazy worker's delta looks like to the screens: norm and loss gain, against honest ones.

    python bench/lazy_screens.py [--config default] [--inner-steps 100] [--rounds 4]
                                 [--rounds-checked 1,2,3] [--out bench/results/lazy_screens.json]

A clean run (4 workers, configs/`--config`.toml, H = `--inner-steps`, inner state reset per round
so every round starts from public state) gives the honest side: each round's delta norms as
ratios to the round's median (what the screen's NORM_OUTLIER band, 1/3-3x, compares). Then, for
the rounds in `--rounds-checked`, worker 1's round is replayed from the round's global params the
way a cheater would run it, and each variant is compared with worker 1's honest delta (the
100-step replay, bit for bit its packet on CPU):

- `lazy xS`: the first (1 - skip) of the H steps (`--skip`, 0.25), the short delta times S for each
  S in `--scales` (1.0 is lazy's `scale=none`; H / steps is `scale=steps`; the ones between are an
  attacker that scales just enough to reach the honest norm band);
- `skim`: every step on the first (1 - skip) of each batch's rows (the skim adversary).

For each: its norm over the round's median honest norm, and its own-batch loss gain (loss of G
minus loss of G - delta on worker 1's batch of a step) next to the honest delta's on the same
batch, over every one of the H batches: the mean ratio, and the share of batches on which it
falls to or below 0.25 / 0.5 / 0.75 of the honest delta's gain (the loss-gain test compares a
delta's gain on one drawn batch with `[verify] loss_gain_floor` times the round's median gain;
the honest delta on the same batch stands in for that median). Writes
`{"honest_norm_ratios": [...], "rounds": [{"round": r, "variants": {...}}], "config": {...}}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as st_load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify import FLOORS, ROOT, run_one  # noqa: E402
from verify import _norm as norm  # noqa: E402

from veriloco.config import config_from_dict  # noqa: E402
from veriloco.model import build_model  # noqa: E402
from veriloco.packet import decode_bundle, decode_packet  # noqa: E402
from veriloco.store import LocalStore  # noqa: E402
from veriloco.task import CorpusTask  # noqa: E402
from veriloco.verify.replay import replay_delta  # noqa: E402


def honest_norms(run_dir: Path) -> list[list[float]]:
    """Each round's packet norms (decoded fp32 deltas), worker order."""
    man = json.loads((run_dir / "manifest.json").read_text())
    cfg = config_from_dict(man["config"])
    shapes = {k: tuple(v.shape) for k, v in build_model(cfg.model, cfg.run.seed).named_parameters()}
    store = LocalStore(run_dir / "store")
    out = []
    for line in (run_dir / "rounds.jsonl").read_text().splitlines():
        norms = []
        for digest in json.loads(line)["bundles"]:
            _, packet, _ = decode_bundle(store.get(digest))
            norms.append(norm(decode_packet(packet, shapes, len(packet))))
        out.append(norms)
    return out


def median(xs: list[float]) -> float:
    # the upper middle for an even count, as gain_floor takes it; the norm screen takes the mean of
    # the middle two (aggregate.median_of), which differs from this by half the middle gap
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="default", choices=["tiny", "default"])
    ap.add_argument("--inner-steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rounds-checked", default="1,2,3", help="rounds whose worker-1 round is replayed as a cheater")
    ap.add_argument("--skip", type=float, default=0.25, help="share of the round a lazy / skim worker saves")
    ap.add_argument("--scales", default="1.0,1.1,1.2", help="factors for the lazy short delta; H / steps is added")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lazy_screens.json"))
    args = ap.parse_args()
    H = args.inner_steps
    try:
        checked = sorted({int(x) for x in args.rounds_checked.split(",") if x.strip()})
        scales = {float(x) for x in args.scales.split(",") if x.strip()}
    except ValueError:
        ap.error("--rounds-checked: comma-separated integers; --scales: comma-separated numbers")
    if H < 2 or args.rounds < 2 or not checked or min(checked) < 1 or max(checked) >= args.rounds:
        ap.error("need --inner-steps >= 2, --rounds >= 2 and --rounds-checked within 1 .. rounds - 1")
    if not 0 < args.skip < 1:
        ap.error(f"--skip must be in (0, 1), got {args.skip}")
    if not all(0 < s < math.inf for s in scales):
        ap.error("--scales must be positive and finite")
    steps = max(1, round(H * (1 - args.skip)))
    scales = sorted(scales | {round(H / steps, 4)})
    base = ["--topology.workers=4", f"--train.rounds={args.rounds}", f"--train.inner_steps={H}",
            f"--verify.trace_every={H}", "--verify.loss_gain_batches=1", "--train.inner_state=reset",
            "--verify.replay_probability=0", "--train.eval_every=1000"]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "clean"
        recs = run_one(base, ["--run.seed=0"], run_dir, args.config)
        norms = honest_norms(run_dir)
        man = json.loads((run_dir / "manifest.json").read_text())
        cfg = config_from_dict(man["config"])
        task = CorpusTask(cfg, run_dir / "store", man["corpus_manifest"]).as_task()
        store = LocalStore(run_dir / "store")
        total = cfg.train.rounds * H
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.train.threads)
        model = task.make_model()

        def losses(params: dict[str, torch.Tensor], batches: list) -> list[float]:
            """The loss of `params` on each of `batches`."""
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(params[k])
                return [float(task.loss(model, x, y)) for x, y in batches]

        def skim_loss(m, x, y):
            keep = max(1, round(x.shape[0] * (1 - args.skip)))
            return task.loss(m, x[:keep], y[:keep])

        rounds = []
        for r in checked:
            G = {k[6:]: v for k, v in st_load(store.get(recs[r - 1]["checkpoint"])).items() if k.startswith("param/")}
            batch = lambda step, r=r: task.batch(1, r, step)  # noqa: E731
            honest = replay_delta(task.make_model, task.loss, cfg.train, total, G, r * H, batch)
            short = replay_delta(task.make_model, task.loss, dataclasses.replace(cfg.train, inner_steps=steps),
                                 total, G, r * H, batch)
            variants = {"honest": honest, "skim": replay_delta(task.make_model, skim_loss, cfg.train, total, G, r * H,
                                                               batch)}
            variants |= {f"lazy x{s:g}": {k: s * v for k, v in short.items()} for s in scales}
            batches = [batch(step) for step in range(H)]
            before = losses(G, batches)
            gains = {name: [b - a for b, a in zip(before, losses({k: G[k] - d[k] for k in G}, batches), strict=True)]
                     for name, d in variants.items()}
            med = median(norms[r])
            row = {}
            for name, d in variants.items():
                g, h = gains[name], gains["honest"]
                row[name] = {
                    "norm_ratio": round(norm(d) / med, 4),
                    "gain_ratio_mean": round(statistics.mean(g) / statistics.mean(h), 4),
                    "fails_at_floor": {str(f): round(sum(a <= f * b for a, b in zip(g, h, strict=True)) / H, 4)
                                       for f in FLOORS},
                }
            rounds.append({"round": r, "honest_median_norm": round(med, 4), "variants": row})
            print(f"round {r}: " + "; ".join(f"{n} norm {v['norm_ratio']:.3f} gain {v['gain_ratio_mean']:.3f} "
                                             f"fails@0.25/0.5 {v['fails_at_floor']['0.25']:.2f}/"
                                             f"{v['fails_at_floor']['0.5']:.2f}" for n, v in row.items()), flush=True)
        torch.set_num_threads(threads)
    ratios = [round(n / median(ns), 4) for ns in norms[1:] for n in ns]
    out = {"honest_norm_ratios": sorted(ratios), "rounds": rounds,
           "config": {"config": args.config, "inner_steps": H, "rounds": args.rounds, "skip": args.skip,
                      "lazy_steps": steps, "scales": scales, "workers": 4}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nhonest norm ratios, rounds 1+ ({len(ratios)} worker-rounds): {min(ratios):.3f} - {max(ratios):.3f}")
    print("| round | variant | norm / median honest | loss gain / honest's | batches failing at floor 0.25 | 0.5 | 0.75 |")
    print("|---|---|---|---|---|---|---|")
    for rr in rounds:
        for name, v in rr["variants"].items():
            f = v["fails_at_floor"]
            print(f"| {rr['round']} | {name} | {v['norm_ratio']:.3f} | {v['gain_ratio_mean']:.3f} | "
                  f"{f['0.25']:.2f} | {f['0.5']:.2f} | {f['0.75']:.2f} |")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
