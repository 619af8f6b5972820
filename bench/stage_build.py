"""What a process pays to build its pipeline stage: from the seed (the full model, then cut) or
from the G_0 kept in the run's store (its slice alone: `model.model_from`).

    python bench/stage_build.py [--arch gpt] [--layers 12] [--d-model 768] [--heads 12] [--ctx 256]
                                [--stages 4] [--stage K] [--no-whole] [--repeats 3] [--out bench/results/stage_build.json]

Writes the model's G_0 into a temporary store once (what `veriloco train` does at prepare), then,
for each stage (every stage, or `--stage K`) and for the whole model (stages = 1; not with
`--no-whole`), builds it in a
fresh interpreter both ways, alternating, `--repeats` times: "seed" is `build_stage_model` from
`run.seed` (how every stage was built before G_0 was kept: the full model initialised, the other
stages' layers deleted), "stored" is `build_stage_model` from `StoredParams` (the blob's hash
checked as a stream, the stage's tensors read). Per build: the process's peak resident memory
above what it held after its imports (Linux's VmHWM, reset to the resident size just before the
build through /proc/self/clear_refs; elsewhere `ru_maxrss`), the largest over the repeats, and
the build's wall time (median). Both ways must give the same params (their hash is compared), or the bench
fails. On the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

WAYS = ("seed", "stored")


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int | None:
    """The resident KB now, after resetting the kernel's peak (VmHWM) to it; None where Linux's
    /proc/self/clear_refs is not there (the peak is then ru_maxrss, which includes the imports')."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return status_kb("VmRSS")
    except OSError:
        return None


@contextmanager
def measured_peak() -> Iterator[dict]:
    """Yields a dict whose "peak_mb", on leaving, is the process's peak resident MB above what it
    held on entering (VmHWM reset on entry: `reset_peak`; elsewhere `ru_maxrss`, which keeps the
    imports' peak)."""
    import resource

    out: dict = {}
    before, maxrss = reset_peak(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield out
    if before is None:
        out["peak_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss) / 1024
    else:
        out["peak_mb"] = (status_kb("VmHWM") - before) / 1024


def write_result(out: str, result: dict) -> dict:
    """A memory bench's JSON, written to `out`; returned."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table (what the README's benchmark tables are pasted from)."""
    for line in (header, ["---"] * len(header), *rows):
        print("| " + " | ".join(line) + " |")


def entry(main: Callable[[], object], **children: Callable[[dict], dict]) -> None:
    """A memory bench's `__main__`: `--NAME SPEC` runs children[NAME] on the JSON SPEC in this
    fresh interpreter and prints its JSON result (what the parent reads back); else `main()`."""
    if len(sys.argv) == 3 and sys.argv[1][2:] in children and sys.argv[1].startswith("--"):
        print(json.dumps(children[sys.argv[1][2:]](json.loads(sys.argv[2]))))
    else:
        main()


def child(spec: dict) -> dict:
    """One build in this fresh interpreter: {peak_mb above the imports, seconds, params hash}."""
    import time

    import torch

    from veriloco.config import load_config
    from veriloco.hashing import tensors_hash
    from veriloco.store import LocalStore
    from veriloco.task import StoredParams
    from veriloco.topology import build_stage_model

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "tiny.toml", spec["overrides"])
    from importlib import import_module

    from veriloco.procs import PRELOAD

    for name in PRELOAD:  # imported before the baseline, as a worker has them (from the forkserver)
        import_module(name)
    if cfg.model.arch != "gpt":
        import transformers  # noqa: F401  (likewise)
    with measured_peak() as peak:
        t0 = time.perf_counter()
        params = StoredParams(LocalStore(spec["store"]), spec["digest"]) if spec["way"] == "stored" else None
        model = build_stage_model(cfg.model, cfg.run.seed, spec["stage"], spec["stages"], params)
        seconds = time.perf_counter() - t0
    named = {k: p.detach() for k, p in model.named_parameters()}
    return {"peak_mb": peak["peak_mb"], "seconds": seconds, "params_hash": tensors_hash(named),
            "params": sum(p.numel() for p in named.values())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="gpt")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage", type=int, default=None, help="only this stage")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole model's row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stage_build.json"))
    args = ap.parse_args(argv)
    if min(args.layers, args.d_model, args.heads, args.ctx, args.repeats) < 1 or not 2 <= args.stages <= args.layers:
        ap.error("--layers, --d-model, --heads, --ctx, --repeats must be >= 1; --stages between 2 and --layers")
    if args.d_model % args.heads:
        ap.error("--d-model must be a multiple of --heads")
    if args.stage is not None and not 0 <= args.stage < args.stages:
        ap.error(f"--stage must be between 0 and {args.stages - 1}")

    import torch

    from veriloco.config import ConfigError, load_config
    from veriloco.model import build_model
    from veriloco.store import LocalStore
    from veriloco.weights import init_blob

    overrides = [f"--model.arch={args.arch}", f"--model.n_layer={args.layers}", f"--model.d_model={args.d_model}",
                 f"--model.n_head={args.heads}", f"--model.ctx={args.ctx}"]
    try:
        cfg = load_config(ROOT / "configs" / "tiny.toml", overrides)
        model = build_model(cfg.model, cfg.run.seed)
    except (ConfigError, ImportError) as e:
        ap.error(str(e).splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(tmp)
        digest = store.put(init_blob({k: p.detach() for k, p in model.named_parameters()}))
        blob_mb = store.path_of(digest).stat().st_size / 2**20
        full_params = sum(p.numel() for p in model.parameters())
        del model
        targets = [(s, args.stages) for s in ([args.stage] if args.stage is not None else range(args.stages))]
        targets += [] if args.no_whole else [(0, 1)]
        rows = []
        for stage, stages in targets:
            runs: dict[str, list[dict]] = {way: [] for way in WAYS}
            for _ in range(args.repeats):
                for way in WAYS:
                    spec = {"overrides": overrides, "store": tmp, "digest": digest, "way": way, "stage": stage,
                            "stages": stages}
                    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                         text=True, check=False)
                    if out.returncode:
                        raise SystemExit(f"a build failed: {out.stderr.strip().splitlines()[-1:]}")
                    runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
            hashes = {r["params_hash"] for way in WAYS for r in runs[way]}
            if len(hashes) != 1:
                raise SystemExit(f"stage {stage} of {stages}: the two ways built different params")
            row = {"stage": "whole" if stages == 1 else f"{stage} of {stages}", "params": runs["seed"][0]["params"]}
            for way in WAYS:
                row[f"{way}_peak_mb"] = round(max(r["peak_mb"] for r in runs[way]), 1)
                row[f"{way}_s"] = round(statistics.median(r["seconds"] for r in runs[way]), 3)
            row["peak_ratio"] = round(row["stored_peak_mb"] / row["seed_peak_mb"], 3) if row["seed_peak_mb"] else None
            row["time_ratio"] = round(row["stored_s"] / row["seed_s"], 3) if row["seed_s"] else None
            rows.append(row)
    result = {"arch": args.arch, "layers": args.layers, "d_model": args.d_model, "stages": args.stages,
              "model_params": full_params, "g0_blob_mb": round(blob_mb, 1), "repeats": args.repeats,
              "torch": torch.__version__, "rows": rows}
    print(f"{args.arch}, {full_params / 1e6:.1f}M params, G_0 blob {blob_mb:.0f} MB, {args.repeats} repeats; "
          "peak MB above the imports, build seconds (median)")
    print("| stage | params | seed: peak MB | stored: peak MB | peak ratio | seed: s | stored: s | time ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['params'] / 1e6:.1f}M | {r['seed_peak_mb']:.0f} | {r['stored_peak_mb']:.0f} | "
              f"{r['peak_ratio']}x | {r['seed_s']:.2f} | {r['stored_s']:.2f} | {r['time_ratio']}x |")
    return write_result(args.out, result)


if __name__ == "__main__":
    entry(main, child=child)
