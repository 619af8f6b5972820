"""What a trace entry's hash costs: the `TENSOR_HASH` tree (`hashing.tensors_hash`: 1 MiB leaves
hashed on `hash_threads()` threads, and on 1 thread) against the one sha256 stream that runs before
it recorded (the code before 2026-12-07, written out here), on the same tensors, side by side.

    python bench/tensor_hash.py [--n-layer 24] [--d-model 1024] [--n-head 16] [--repeats 3]
                                [--out bench/results/tensor_hash.json]

The tensors are what `InnerLoop.state_hash` hashes: a GPT's params and its two AdamW moments,
fp32, random values (configs/default.toml's GPT with --n-layer, --d-model and --n-head; by default
the 303M model of README "On GPUs", 3.64 GB). Each repeat times the three ways one after another
(the machine is shared and noisy); per way the best of --repeats seconds, GB/s and the ratio to
the one stream. The tree's digest on 1 thread and on all is checked to be the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from veriloco import hashing  # noqa: E402
from veriloco.config import load_config  # noqa: E402
from veriloco.model import build_meta  # noqa: E402


def one_stream(tensors: dict[str, torch.Tensor]) -> str:
    """The scheme before the tree: one sha256 over each tensor's `name|dtype|shape|` and raw bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def state_of(n_layer: int, d_model: int, n_head: int) -> dict[str, torch.Tensor]:
    cfg = load_config(ROOT / "configs" / "default.toml", [f"--model.n_layer={n_layer}", f"--model.d_model={d_model}",
                                                        f"--model.n_head={n_head}"])
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in build_meta(cfg.model).named_parameters():
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            state[f"{kind}/{name}"] = torch.randn(p.shape, generator=g)
    return state


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tensor_hash.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    state = state_of(args.n_layer, args.d_model, args.n_head)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    threads = hashing.hash_threads()
    one_thread = ThreadPoolExecutor(1)
    pools = {"tree": hashing._leaf_pool(), "tree-1-thread": one_thread}

    def tree(pool: ThreadPoolExecutor) -> str:
        hashing._pool = pool  # the module's pool, for this hash (the digest does not depend on it)
        return hashing.tensors_hash(state)

    ways = {"one-stream": lambda: one_stream(state), "tree-1-thread": lambda: tree(pools["tree-1-thread"]),
            "tree": lambda: tree(pools["tree"])}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    digests: dict[str, set[str]] = {w: set() for w in ways}
    for _ in range(args.repeats):
        for way, f in ways.items():
            t = time.perf_counter()
            digests[way].add(f())
            seconds[way].append(time.perf_counter() - t)
    hashing._pool = pools["tree"]
    if digests["tree"] != digests["tree-1-thread"] or len(digests["tree"]) != 1:
        raise SystemExit("tensor_hash: the tree's digest changed with its threads")
    base = min(seconds["one-stream"])
    rows = [{"way": w, "threads": {"one-stream": 1, "tree-1-thread": 1, "tree": threads}[w], "best_s": min(s),
             "gb_per_s": nbytes / min(s) / 1e9, "vs_one_stream": min(s) / base, "seconds": s} for w, s in seconds.items()]
    print(f"{len(state)} tensors, {nbytes / 1e9:.2f} GB (params + 2 AdamW moments, fp32); best of {args.repeats}")
    print(f"{'way':16s}{'threads':>8s}{'best s':>9s}{'GB/s':>8s}{'vs one stream':>15s}")
    for r in rows:
        print(f"{r['way']:16s}{r['threads']:8d}{r['best_s']:9.3f}{r['gb_per_s']:8.2f}{r['vs_one_stream']:15.3f}")
    result = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head, "bytes": nbytes,
              "tensors": len(state), "repeats": args.repeats, "scheme": hashing.TENSOR_HASH, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
