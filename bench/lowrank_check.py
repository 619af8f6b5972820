"""What an exact replay's PowerSGD check (`replay.lowrank_distance`, bound `LOWRANK_TOLERANCE`)
measures on honest packets, and what it leaves a worker, on the decoded tensors themselves (no
training: the deltas are drawn, the packets encoded by `lowrank` as a worker's are).

    python bench/lowrank_check.py [--out bench/results/lowrank_check.json]

Rows:
- honest: warm-started encodings (4 rounds a key, as a worker's codec carries Q), shapes 256x32 ..
  3072x768 and one 3-D, three spectra (flat, low-rank plus noise, heavy-tailed); min and max.
- honest, smallest: rank 1 of the smallest matrices the codec factors (3x3 .. 8x8), 4000 draws each
  of heavy-tailed values: their fp16 rounding comes near the bound (README).
- x1.01: the same encodings checked against the delta scaled by 1.01 (a worker sending 1% more).
- push: an honest packet plus a matrix of the worker's choosing in the packet's own column space
  (its first column times a fixed direction), at 1.8e-3 and 1e-2 of the packet's norm: the first
  passes, the second does not (the README's "push of its choosing under 2e-3").
- drop: a packet that is the delta projected onto one row (its weakest): a subspace the worker
  chose, which passes, though it carries a tiny share of the delta.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from veriloco.compress import codec_from_spec  # noqa: E402
from veriloco.verify.replay import LOWRANK_TOLERANCE, lowrank_distance  # noqa: E402

SHAPES = [(256, 32), (96, 32), (768, 3072), (3072, 768), (50, 4, 64)]


def spectra(shape: tuple[int, ...], gen: torch.Generator) -> list[torch.Tensor]:
    m, n = shape[0], int(torch.tensor(shape[1:]).prod())
    flat = torch.randn(m, n, generator=gen) * 1e-3
    low = torch.randn(m, 8, generator=gen) @ torch.randn(8, n, generator=gen) * 1e-4 + torch.randn(m, n, generator=gen) * 1e-5
    heavy = torch.randn(m, n, generator=gen) ** 3 * 1e-6
    return [x.reshape(shape) for x in (flat, low, heavy)]


def rank_of(shape: tuple[int, ...], rank: int) -> int:
    return min(rank, shape[0], int(torch.tensor(shape[1:]).prod()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    honest, scaled = [], []
    for shape in SHAPES:
        for kind in range(3):
            codec = codec_from_spec("lowrank:rank=16")
            for _ in range(4):
                delta = spectra(shape, gen)[kind]
                sent = codec.decode(codec.encode("w", delta), shape)
                honest.append(lowrank_distance(delta, sent, rank_of(shape, 16)))
                scaled.append(lowrank_distance(delta * 1.01, sent, rank_of(shape, 16)))
    small: dict[str, list[float]] = {}
    for shape in [(3, 3), (4, 4), (2, 8), (8, 2), (3, 16), (8, 8)]:
        codec = codec_from_spec("lowrank:rank=1")
        for t in range(4000):
            delta = torch.randn(shape, generator=gen) ** 3
            small.setdefault("x".join(map(str, shape)), []).append(
                lowrank_distance(delta, codec.decode(codec.encode(f"w{t % 3}", delta), shape), 1))
    # push and drop, on a 768 x 3072 flat delta at rank 16
    shape = (768, 3072)
    delta = spectra(shape, gen)[0]
    codec = codec_from_spec("lowrank:rank=16")
    parts = codec.encode("w", delta)
    sent = codec.decode(parts, shape)
    column = parts["p"].to(torch.float32).reshape(768, 16)[:, 0]
    direction = torch.randn(3072, generator=torch.Generator().manual_seed(1))
    push = torch.outer(column / column.norm(), direction / direction.norm())
    pushes = {f: lowrank_distance(delta, sent + f * float(sent.norm()) * push, 16) for f in (1.8e-3, 1e-2)}
    weakest = int(delta.norm(dim=1).argmin())
    dropped = torch.zeros_like(delta)
    dropped[weakest] = delta[weakest]
    drop = {"distance": lowrank_distance(delta, dropped, 16),
            "share_of_delta_sq_norm": float(dropped.norm() ** 2 / delta.norm() ** 2)}
    rows = {"tolerance": LOWRANK_TOLERANCE,
            "honest": {"n": len(honest), "min": min(honest), "max": max(honest)},
            "honest_smallest_rank1": {k: {"n": len(v), "p99.9": sorted(v)[int(len(v) * 0.999)], "max": max(v)}
                                      for k, v in small.items()},
            "scaled_1.01": {"min": min(scaled)},
            "push": {str(f): {"distance": d, "passes": d <= LOWRANK_TOLERANCE} for f, d in pushes.items()},
            "drop_to_weakest_row": drop | {"passes": drop["distance"] <= LOWRANK_TOLERANCE}}
    print(f"tolerance {LOWRANK_TOLERANCE:g}")
    print(f"honest ({len(honest)} encodings): {min(honest):.2e} .. {max(honest):.2e}")
    for k, v in small.items():
        print(f"honest, {k} at rank 1 ({len(v)} heavy-tailed draws): p99.9 {sorted(v)[int(len(v) * 0.999)]:.2e}, "
              f"max {max(v):.2e}")
    print(f"delta x1.01: min {min(scaled):.2e}")
    for f, d in pushes.items():
        print(f"push of {f:g} of the packet's norm in its columns: {d:.2e} ({'passes' if d <= LOWRANK_TOLERANCE else 'refused'})")
    print(f"drop to the weakest row ({drop['share_of_delta_sq_norm']:.2e} of the delta's squared norm): "
          f"{drop['distance']:.2e} ({'passes' if drop['distance'] <= LOWRANK_TOLERANCE else 'refused'})")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
