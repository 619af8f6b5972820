"""What the prepare step holds while it writes G_0 into the run's store: the whole model and its
bytes (how it wrote G_0 before) or one tensor at a time (`weights.write_initial` into a
`store.StagedBlob`, how `run.prepare_run` writes it now).

    python bench/init_memory.py [--layers 12] [--d-model 768] [--vocab 32000] [--repeats 3]
                                [--out bench/results/init_memory.json]

Two sources of G_0, each measured both ways in a fresh interpreter, the ways alternating
`--repeats` times:
- `init`: `[model] init` from a bf16 checkpoint on disk (a GPT of `--layers` x `--d-model` with a
  `--vocab` embedding and head, written here). Before: every file read whole (`load_file`),
  converted to float32, then `safetensors.torch.save` made the blob's bytes, which the store
  took. Now: `weights.read_init` checks the headers and reads each tensor when `write_initial`
  asks for it.
- `seed`: the model `run.seed` initialises. Before: its params, then `save`'s bytes beside them.
  Now: its params written one tensor at a time.
Per way: the peak resident memory above what the process held after its imports (VmHWM reset
just before), the largest over the repeats, and the median seconds. Both ways must put the same
blob (the same digest) into the store and make the same model-init hash, or the bench fails.
On the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from stage_build import entry, write_result  # noqa: E402

WAYS = ("whole", "streamed")
SOURCES = ("init", "seed")


def _overrides(args: argparse.Namespace) -> list[str]:
    return [f"--model.n_layer={args.layers}", f"--model.d_model={args.d_model}", f"--model.n_head={args.d_model // 64}",
            f"--model.vocab_size={args.vocab}", "--model.ctx=256"]


def child(spec: dict) -> dict:
    """G_0 into a fresh store, one way, in this fresh interpreter."""
    import time

    import torch
    from safetensors.torch import load_file
    from safetensors.torch import save as st_save
    from stage_build import measured_peak

    from veriloco.config import load_config
    from veriloco.hashing import tensors_hash
    from veriloco.model import build_meta, build_model
    from veriloco.store import LocalStore, StagedBlob
    from veriloco.weights import read_init, write_initial

    torch.set_num_threads(1)
    overrides = spec["overrides"] + ([f"--model.init={spec['checkpoint']}"] if spec["source"] == "init" else [])
    cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
    store = LocalStore(spec["store"])
    with measured_peak() as peak:
        t0 = time.perf_counter()
        if spec["way"] == "whole":
            if spec["source"] == "init":
                found = load_file(spec["checkpoint"])
                params = {k: found.pop(k).to(torch.float32).contiguous() for k in sorted(found)}
            else:
                params = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}
            init_hash = tensors_hash(params)
            digest = store.put(st_save({k: params[k].contiguous() for k in sorted(params)}))
        else:
            if spec["source"] == "init":
                params = read_init(cfg.model, build_meta(cfg.model))
            else:
                params = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}
            with StagedBlob(spec["store"]) as blob:
                init_hash = write_initial(blob, params)
                digest = store.adopt(blob)
        seconds = time.perf_counter() - t0
    return {"peak_mb": peak["peak_mb"], "seconds": seconds, "digest": digest, "init_hash": init_hash}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "init_memory.json"))
    args = ap.parse_args(argv)
    if min(args.layers, args.repeats, args.vocab) < 1 or args.d_model < 64 or args.d_model % 64:
        ap.error("--layers, --vocab and --repeats must be >= 1, --d-model a multiple of 64")

    import torch
    from safetensors.torch import save_file

    from veriloco.config import load_config
    from veriloco.model import build_model

    cfg = load_config(ROOT / "configs" / "tiny.toml", _overrides(args))
    model = build_model(cfg.model, 1)  # not the run's seed: the checkpoint is other weights
    n_params = sum(p.numel() for p in model.parameters())
    rows: dict[str, dict[str, list[dict]]] = {s: {w: [] for w in WAYS} for s in SOURCES}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model.safetensors"
        save_file({k: p.detach().to(torch.bfloat16) for k, p in model.named_parameters()}, str(checkpoint))
        del model
        for source in SOURCES:
            for k in range(args.repeats):
                for way in WAYS:
                    spec = {"overrides": _overrides(args), "checkpoint": str(checkpoint), "source": source, "way": way,
                            "store": str(Path(tmp) / f"store-{source}-{way}-{k}")}
                    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                         text=True, check=False)
                    if out.returncode:
                        raise SystemExit(f"a measurement failed: {out.stderr.strip().splitlines()[-1:]}")
                    rows[source][way].append(json.loads(out.stdout.strip().splitlines()[-1]))
        checkpoint_mb = checkpoint.stat().st_size / 1e6
    for source in SOURCES:
        if len({(r["digest"], r["init_hash"]) for way in WAYS for r in rows[source][way]}) != 1:
            raise SystemExit(f"{source}: the two ways stored different G_0 blobs or hashes")
    table = [{"source": source, "way": way, "peak_mb": round(max(r["peak_mb"] for r in rows[source][way]), 1),
              "seconds": round(statistics.median(r["seconds"] for r in rows[source][way]), 3)}
             for source in SOURCES for way in WAYS]
    result = {"params": n_params, "g0_mb": round(n_params * 4 / 1e6, 1), "checkpoint_mb": round(checkpoint_mb, 1),
              "repeats": args.repeats, "rows": table,
              "peak_ratio": {s: round(table[2 * i + 1]["peak_mb"] / table[2 * i]["peak_mb"], 4)
                             for i, s in enumerate(SOURCES)}}
    print(f"G_0 of a {n_params / 1e6:.1f}M-param GPT ({result['g0_mb']} MB in float32; the bf16 checkpoint "
          f"{result['checkpoint_mb']} MB), {args.repeats} repeats; peak MB above the imports")
    print("| source | way | peak MB | s |")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['source']} | {r['way']} | {r['peak_mb']:.1f} | {r['seconds']:.2f} |")
    return write_result(args.out, result)


if __name__ == "__main__":
    entry(main, child=child)
