"""Where in a round the loss-gain screen sees an honest delta best, and what testing a drawn batch
instead of the first one costs in honest suspects.

    python bench/lossgain_profile.py [--seeds 2] [--rounds 20] [--out bench/results/lossgain_profile.json]

Clean runs of bench/verify.py's tiny setting (4 workers, H = 20, inner state reset per round, no
screen of loss gains, so nothing is replayed). Afterwards, from the stored checkpoints and
packets, every honest delta's own-batch gain loss(G_r) - loss(G_r - delta) is computed at every
inner step's batch: a table [round, worker, step]. Then the screen's rule (a gain must exceed a
quarter of the median gain of the round's deltas, tested at the same step: lossgain.gain_floor)
is applied two ways: at step 0 for every round (what the test did until the eighth session) and
at a step drawn uniformly (what it does now: `lossgain.gain_steps`; the expected count is the
mean over the H steps, since the draw is uniform), and at two drawn steps (`loss_gain_batches =
2`: the mean gain over every pair of steps). Each failing honest delta is a suspect: it is
replayed (and passes), so the counts are replays the screen costs. Prints the mean gain by step
and both counts; deterministic on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load

ROOT = Path(__file__).resolve().parents[1]

from veriloco.config import load_config  # noqa: E402
from veriloco.model import build_model  # noqa: E402
from veriloco.packet import decode_bundle, decode_packet  # noqa: E402
from veriloco.run import train  # noqa: E402
from veriloco.store import LocalStore  # noqa: E402
from veriloco.task import CorpusTask  # noqa: E402
from veriloco.verify.lossgain import gain_floor  # noqa: E402
from veriloco.verify.screen import LossGain  # noqa: E402

WORKERS, H = 4, 20


def gains_of_run(rounds: int, seed: int, tmp: Path) -> torch.Tensor:
    """[round, worker, step] own-batch gains of a clean run's deltas."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"--topology.workers={WORKERS}", f"--train.rounds={rounds}", f"--train.inner_steps={H}",
        f"--verify.trace_every={H}", "--train.inner_state=reset", "--verify.aggregator=trimmed_mean",
        "--train.eval_every=1000", f"--run.seed={seed}"])
    run, _ = train(cfg, str(tmp / f"clean-{seed}"), quiet=True)
    recs = [json.loads(line) for line in run.rounds_path.read_text().splitlines()]
    store = LocalStore(run.root / "store")
    task = CorpusTask(cfg, run.store_dir, run.read_manifest()["corpus_manifest"]).as_task()
    model = build_model(cfg.model, cfg.run.seed)
    G = {k: v.detach().clone() for k, v in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in G.items()}

    def loss(params: dict[str, torch.Tensor], j: int, r: int, s: int) -> float:
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(params[k])
            return float(task.loss(model, *task.batch(j, r, s)))

    out = torch.zeros(rounds, WORKERS, H, dtype=torch.float64)
    for r, rec in enumerate(recs):
        for j in range(WORKERS):
            delta = decode_packet(decode_bundle(store.get(rec["bundles"][j]))[1], shapes, 1 << 30)
            after = {k: G[k] - delta[k] for k in G}
            out[r, j] = torch.tensor([loss(G, j, r, s) - loss(after, j, r, s) for s in range(H)], dtype=torch.float64)
        ckpt = st_load(store.get(rec["checkpoint"]))
        G = {k[len("param/"):]: v for k, v in ckpt.items() if k.startswith("param/")}
    return out


def suspects_at(gains: torch.Tensor, step: int | tuple[int, ...]) -> int:
    """Honest deltas of one round failing the screen's rule when every worker is tested at `step`
    (several steps: on their mean gain, as a test of `loss_gain_batches` > 1 averages the losses)."""
    steps = (step,) if isinstance(step, int) else step
    tested = {j: LossGain.on_own_batches(float(g), 0.0) for j, g in enumerate(gains[:, list(steps)].mean(dim=1))}
    floor = gain_floor(tested)
    return sum(t.own_gain <= floor for t in tested.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lossgain_profile.json"))
    args = ap.parse_args()
    if args.seeds < 1 or args.rounds < 1:
        raise SystemExit("--seeds and --rounds must be >= 1")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="veriloco-bench-lg-") as tmp:
        tables = [gains_of_run(args.rounds, seed, Path(tmp)) for seed in range(args.seeds)]
    first = sum(suspects_at(t[r], 0) for t in tables for r in range(args.rounds))
    drawn = sum(suspects_at(t[r], s) for t in tables for r in range(args.rounds) for s in range(H)) / H
    pairs = list(itertools.combinations(range(H), 2))  # loss_gain_batches = 2: two drawn steps
    drawn2 = sum(suspects_at(t[r], p) for t in tables for r in range(args.rounds) for p in pairs) / len(pairs)
    honest = args.seeds * args.rounds * WORKERS
    by_step = torch.stack(tables).mean(dim=(0, 1, 2))
    late = torch.stack(tables)[:, args.rounds // 4:].mean(dim=(0, 1, 2))  # past the LR warmup's rounds
    print("mean own-batch gain by step (nats), all rounds:", [round(x, 4) for x in by_step.tolist()])
    print(f"the same from round {args.rounds // 4} on:", [round(x, 4) for x in late.tolist()])
    print(f"honest suspects in {honest} honest worker-rounds: tested at step 0: {first}; "
          f"at a uniformly drawn step: {drawn:.1f} expected; at two drawn steps (loss_gain_batches = 2, "
          f"twice the forward passes): {drawn2:.1f} expected")
    result = {"seeds": args.seeds, "rounds": args.rounds, "workers": WORKERS, "inner_steps": H,
              "gain_by_step": [round(x, 6) for x in by_step.tolist()],
              "gain_by_step_from_round": {"round": args.rounds // 4, "gains": [round(x, 6) for x in late.tolist()]},
              "honest_worker_rounds": honest, "suspects_first_batch": first, "suspects_drawn_batch": round(drawn, 2),
              "suspects_two_drawn_batches": round(drawn2, 2),
              "total_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out} ({result['total_s']}s)")


if __name__ == "__main__":
    sys.exit(main())
