"""Time of one round's check with the screen of an older revision and with the current one.

    python bench/check_speed.py [--config configs/default.toml] [--set KEY=VALUE ...] [--workers 4] [--repeats 7]
                                [--threads 1] [--old REV] [--earlier] [--verdicts-only] [--out results.json]

Builds the model of `--config` (build_model), makes `--workers` random deltas of its parameter
shapes for this round and as many for the previous round (honest-looking: a common direction
plus noise, so every check runs, the robust centre included), signs them into fp32 bundles, and
times `check_round` (signatures, decode, screen) and `screen_round` alone. The old screen and
aggregate modules are read from git at `--old` (default: the last commit before the batched
reductions) and loaded next to the current ones; old and new run alternately in this process,
`--repeats` times each, after one warm-up. Both must return the same verdicts and evidence, bit
for bit, or the script stops. Prints median milliseconds and the old/new ratio.

A screen that remembers the squares of the deltas it screened (the twenty-eighth session's)
knows the previous round's, as in a run, and not this round's: `screen_round` forgets the
current deltas' before every call (`check_round` decodes fresh ones anyway).

`--earlier`: also a third set of deltas as the round before's (the screen's `earlier_deltas`,
as with the update a whole round late). `--verdicts-only`: old and new need only give the same
verdicts, for an old revision whose evidence numbers differ in the last bits (before the eighth
session's screen, distances were summed from difference vectors, not derived from the dots).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from veriloco.compress import build_codecs
from veriloco.config import load_config
from veriloco.hashing import canonical_json, sha256_hex
from veriloco.model import build_model
from veriloco.packet import encode_bundle, encode_packet
from veriloco.verify.check import check_round, hex_root
from veriloco.verify.commitment import Commitment, EquivocationDetector, sign_commitment
from veriloco.verify.identity import derive_worker_key, public_key_hex

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "6706b2da26b6ccb53cee71ef44a625048e069d9f"  # the last commit with the per-pair det_norm/det_dot screen and sorted median
RUN, BASE = sha256_hex(b"check_speed run"), sha256_hex(b"check_speed G_r")


def load_old(rev: str) -> ModuleType:
    """veriloco.verify.screen (and the aggregate it imports) as of git revision `rev`."""
    mods: dict[str, ModuleType] = {}
    for name in ("aggregate", "screen"):
        path = f"src/veriloco/verify/{name}.py"
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.replace("from .aggregate import", "from ._old_aggregate import")
        full = f"veriloco.verify._old_{name}"
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(full, loader=None))
        mod.__package__ = "veriloco.verify"
        sys.modules[full] = mod
        exec(compile(source, f"{rev}:{path}", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["screen"]


def make_round(
    shapes: dict[str, tuple[int, ...]], workers: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    common = {k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()}
    return [
        {k: common[k] + torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()}
        for _ in range(workers)
    ]


def bundle(
    worker: int, delta: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> bytes:
    packet = encode_packet(delta, build_codecs("fp32", shapes))
    trace = (sha256_hex(b"state %d" % worker),)
    c = Commitment(
        run_id=RUN, round=1, worker=worker, base_hash=BASE,
        batch_root=sha256_hex(b"batches %d" % worker), trace_root=hex_root(list(trace)),
        trace=trace, losses=(2.5,), packet_hash=sha256_hex(packet), packet_bytes=len(packet),
        codec="fp32", salt_hash=sha256_hex(b"salt %d" % worker),
    )  # fmt: skip
    signed = canonical_json(sign_commitment(c, derive_worker_key(0, worker)))
    return encode_bundle(signed, packet)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/default.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. --set model.d_model=768 (round_cost.py's model: d_model 768, 12 heads, 6 layers)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--old", default=BEFORE, help="git revision of the old screen")
    ap.add_argument("--earlier", action="store_true", help="also screen against a round before the previous one")
    ap.add_argument("--verdicts-only", action="store_true", help="old and new must agree on verdicts, not evidence bits")
    ap.add_argument("--out", default=None, help="also write the numbers here as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"--{kv.removeprefix('--')}" for kv in args.set])
    model = build_model(cfg.model, seed=0)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    n = sum(v.numel() for v in model.parameters())
    W = args.workers
    current, previous = make_round(shapes, W, 1), make_round(shapes, W, 2)
    bundles = [bundle(w, current[w], shapes) for w in range(W)]
    keys = {w: public_key_hex(derive_worker_key(0, w)) for w in range(W)}
    prev = {w: d for w, d in enumerate(previous)}
    prev_hashes = {w: sha256_hex(b"previous %d" % w) for w in range(W)}
    earlier = dict(enumerate(make_round(shapes, W, 3))) if args.earlier else None

    check_module = importlib.import_module("veriloco.verify.check")
    screens = {"old": load_old(args.old).screen_round, "new": check_module.screen_round}

    def check(which: str) -> Any:
        check_module.screen_round = screens[which]  # check_round looks it up at call time
        try:
            r = check_round(
                bundles, run_id=RUN, round=1, base_hash=BASE, admitted_keys=keys,
                shapes=shapes, max_packet_bytes=1 << 30,
                batch_root_of=lambda w: sha256_hex(b"batches %d" % w),
                equivocation=EquivocationDetector(keys), previous=(prev_hashes, prev), earlier=earlier,
            )  # fmt: skip
        finally:
            check_module.screen_round = screens["new"]
        return r.verdicts if args.verdicts_only else (r.verdicts, r.evidence)

    def screen(which: str) -> Any:
        # a screen remembers each delta's square (screen._SQUARES): in a run the previous round's are known
        # from their own round and this round's are not, as in check() (which decodes fresh deltas every call)
        known = getattr(sys.modules[screens[which].__module__], "_SQUARES", {})
        for d in current:
            known.pop(id(d[sorted(d)[0]]), None)
        out = screens[which](dict(enumerate(current)), previous_deltas=prev, earlier_deltas=earlier)
        return json.dumps([v.reason if args.verdicts_only else v.to_dict() for v in out.values()])

    times: dict[str, list[float]] = {}
    for name, fn in (("check_round", check), ("screen_round", screen)):
        results = {which: fn(which) for which in ("old", "new")}  # warm-up
        if results["old"] != results["new"]:
            raise SystemExit(f"{name}: old and new results differ (an old revision from before the eighth session "
                             f"differs in evidence bits: try --verdicts-only):\n{results}")
        for _ in range(args.repeats):
            for which in ("old", "new"):
                seconds, out = timed(lambda f=fn, w=which: f(w))
                if out != results[which]:
                    raise SystemExit(f"{name} ({which}) gave a different result on a rerun")
                times.setdefault(f"{name} {which}", []).append(seconds)
    verdicts = check("new") if args.verdicts_only else check("new")[0]
    print(
        f"{n:,} parameters ({len(shapes)} tensors), {W} workers + {W} previous deltas"
        f"{f' + {W} earlier' if args.earlier else ''}, {args.threads} thread(s), {args.repeats} repeats; "
        f"old = {args.old}; verdicts {sorted(set(verdicts.values()))}, identical old/new"
        f"{' (verdicts compared, not evidence bits)' if args.verdicts_only else ''}"
    )
    summary: dict[str, Any] = {
        "parameters": n, "workers": W, "threads": args.threads, "repeats": args.repeats,
        "old": args.old, "earlier": args.earlier, "verdicts_only": args.verdicts_only,
    }  # fmt: skip
    for name in ("check_round", "screen_round"):
        old = statistics.median(times[f"{name} old"]) * 1e3
        new = statistics.median(times[f"{name} new"]) * 1e3
        summary[name] = {"old_ms": old, "new_ms": new, "ratio": old / new}
        print(f"{name:>13}: old {old:8.1f} ms   new {new:8.1f} ms   old/new {old / new:5.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
