"""What a round costs outside its inner steps, at a model size where it shows: an older revision
of veriloco against the working tree, the same run, alternately.

    python bench/round_cost.py [--old REV] [--repeats 2] [--rounds 4] [--config FILE]
                               [--set KEY=VALUE ...] [--no-fsync] [--out bench/results/round_cost.json]

Both sides train the same config (default: `--config configs/default.toml` widened to d_model 768, 12
heads, 6 layers: 43.0M params, 172 MB of fp32; 2 workers, 2 inner steps of batch 2, fp32
packets) with `veriloco train` in a fresh interpreter each, `--old` from `git archive REV src`
on PYTHONPATH and the working tree's `src` for the new side, alternating, `--repeats` times each.
The inner steps are kept few and small so that a round is mostly what happens around them: the
checks of every bundle (hashes, signature, decode, screen), the aggregate and outer step, the
checkpoint and private state written with fsync, the agreement hash, the record. Both sides must
record the same packets every round (each worker's packet hash: the bytes it sent, whatever
scheme the two revisions hash tensors with), or the script stops.

From each run's round records (rounds 1..; round 0 also starts the processes), per round:
`round_s` (the recorder's round, start to record), the slowest worker's `inner_s`, `wait_s`
(waiting for the exchange) and `verify_s` (the checks), and `other_s`, what is left: aggregate,
outer step, checkpoint, state, hashes, record; and `peak_rss_mb`, the largest worker process's
peak resident memory so far (MB). Prints the medians and new/old ratios.

`hash_s`: the most seconds a worker process spent in `veriloco.hashing.tensors_hash` (G's, the
trace's, the aggregate's hashes), per round of the whole run, timed by the same `sitecustomize.py`
(it wraps the function as the module is first imported).

`write_mb`: what the worker processes wrote to disk, MB per round (their `write_bytes` in
/proc/self/io, summed over the processes, over the whole run / rounds; every file: store, private
state, records). Read as each worker process ends (its `os._exit`), by a `sitecustomize.py` this
script puts first on both sides' PYTHONPATH, so the old revision is measured the same way
without knowing of it.

`--no-fsync`: the new side's processes run with `os.fsync` made a no-op by that same
`sitecustomize.py`: with `--old HEAD` both sides are the same code, and the difference is what
waiting for the disk costs a round (an upper bound on what moving the fsyncs off the round's path
could save; such a run is not durable, so it is a measurement only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = ["model.d_model=768", "model.n_head=12", "model.n_layer=6", "topology.workers=2", "train.inner_steps=2",
        "train.batch_size=2", "train.eval_batches=1", "train.eval_every=100"]
FIELDS = ("round_s", "inner_s", "wait_s", "verify_s", "other_s", "hash_s", "peak_rss_mb", "write_mb")
# each forked process (a worker) leaves its /proc/self/io write_bytes, and the seconds it spent in
# veriloco.hashing.tensors_hash, in $ROUND_COST_IO as it ends
IO_HOOK = """import importlib.abc
import importlib.machinery
import os
import sys
import time

_hash_s = [0.0]


class _TimeTensorsHash(importlib.abc.MetaPathFinder):
    # wraps tensors_hash as veriloco.hashing is first imported, before any module binds it by name,
    # and without importing it (nor torch) in processes that never do

    def find_spec(self, name, path, target=None):
        if name != "veriloco.hashing":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            inner = module.tensors_hash

            def tensors_hash(tensors):
                t = time.perf_counter()
                try:
                    return inner(tensors)
                finally:
                    _hash_s[0] += time.perf_counter() - t

            module.tensors_hash = tensors_hash

        spec.loader.exec_module = exec_module
        return spec


def _count():
    exit_now = os._exit  # how a forked process ends (multiprocessing clears its finalizers as it starts)

    def _exit(code):
        try:
            with open("/proc/self/io") as f:
                io = dict(line.split(": ") for line in f.read().splitlines())
            with open(os.path.join(os.environ["ROUND_COST_IO"], str(os.getpid())), "w") as f:
                f.write(f"{io['write_bytes']} {_hash_s[0]}")
        except (OSError, KeyError):
            pass
        exit_now(code)

    os._exit = _exit


if os.environ.get("ROUND_COST_IO") and os.path.exists("/proc/self/io"):
    os.register_at_fork(after_in_child=_count)
    sys.meta_path.insert(0, _TimeTensorsHash())
"""


def source_of(rev: str, into: Path) -> Path:
    """`src` of git revision `rev`, unpacked under `into`; its path for PYTHONPATH."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def alternating(old: str | None, trials: int, tmp: Path, run: Callable[[Path, Path], dict],
                show: Callable[[dict], str]) -> tuple[list[str], list[dict]]:
    """`trials` trials of run(src, out) with side "new" the working tree's `src` and, with `old`,
    side "old" `git archive old src` (unpacked under `tmp`), alternately, each trial starting with
    the other side than the last, so the machine's drift falls on both. Prints show(row) for each
    run; returns the sides and the rows ({"side", "trial", **run's result}) in run order."""
    sides = [("new", ROOT / "src")]
    if old:
        old_dir = tmp / "old"
        old_dir.mkdir()
        sides.append(("old", source_of(old, old_dir)))
    rows = []
    for trial in range(trials):
        for side, src in sides if trial % 2 == 0 else sides[::-1]:
            rows.append({"side": side, "trial": trial, **run(src, tmp / f"run-{side}-{trial}")})
            print(show(rows[-1]), flush=True)
    return [side for side, _ in sides], rows


def side_medians(sides: list[str], rows: list[dict], fields: tuple[str, ...]) -> list[dict]:
    """Per side (`alternating`'s order), the median over its rows of each field, rounded to 4 places."""
    return [{"side": side, **{k: round(statistics.median(r[k] for r in rows if r["side"] == side), 4) for k in fields}}
            for side in sides]


def conclude(out: str, result: dict, rows: list[dict]) -> int:
    """Says whether every row recorded the same packets (`packets`: every round's packet hashes;
    params hashes would differ between revisions that hash tensors differently, packets do not),
    writes `result` (with `hashes_identical`) to `out` as JSON; 0 if they did, else 1."""
    same = len({json.dumps(r["packets"]) for r in rows}) == 1
    print(f"packets {'identical across all runs' if same else 'DIFFER between runs'}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result | {"hashes_identical": same}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if same else 1


def run_once(src: Path, config: str, overrides: list[str], rounds: int, out: Path,
             hook: Path) -> tuple[list[dict], float, float]:
    """`veriloco train` with the package at `src`; the round records, the MB its worker processes
    wrote to disk and the most seconds one of them spent in tensors_hash (IO_HOOK, from `hook`)."""
    io_dir = out.parent / f"{out.name}-io"
    io_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{src}", ROUND_COST_IO=str(io_dir))
    argv = ["train", config, "--out", str(out), "--quiet",
            f"--train.rounds={rounds}", *[f"--{o}" for o in overrides]]
    code = f"import sys; from veriloco.cli import main; sys.argv = ['veriloco', *{argv!r}]; main()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"round_cost: the run with {src} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    counts = [p.read_text().split() for p in io_dir.iterdir()]
    written, hashed = sum(int(c[0]) for c in counts) / 1e6, max(float(c[1]) for c in counts)
    shutil.rmtree(out)  # a round stores about 8x the model (checkpoint, bundles, packets, states)
    shutil.rmtree(io_dir)
    return records, written, hashed


def per_round(records: list[dict], written_mb: float = float("nan"), hash_s: float = float("nan")) -> dict[str, float]:
    """Medians over rounds 1.. of the FIELDS (seconds), and write_mb and hash_s: `written_mb` and
    `hash_s` / rounds (whole-run figures, round 0 included)."""
    rows = []
    for r in records[1:]:
        inner, wait, verify = max(r["inner_s"]), max(r["wait_s"]), max(r["verify_s"])
        rows.append({"round_s": r["round_s"], "inner_s": inner, "wait_s": wait, "verify_s": verify,
                     "other_s": r["round_s"] - inner - wait - verify, "peak_rss_mb": max(r["peak_rss_mb"])})
    out = {k: statistics.median(x[k] for x in rows) for k in FIELDS if k not in ("write_mb", "hash_s")}
    return out | {"write_mb": written_mb / len(records), "hash_s": hash_s / len(records)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="4a5212f", help="git revision of the old side (default: before this bench's changes)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.toml"), help="the config both sides train")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for both sides")
    ap.add_argument("--no-fsync", action="store_true", help="the new side without fsync (measurement only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "round_cost.json"))
    args = ap.parse_args()
    if args.repeats < 1 or args.rounds < 2:
        ap.error("--repeats must be >= 1 and --rounds >= 2 (round 0 is not counted)")
    overrides = SIZE + args.set
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    first: list[list[str]] | None = None  # the first run's packet hashes, round by round
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"old": source_of(args.old, Path(tmp)), "new": ROOT / "src"}
        hooks = {side: Path(tmp) / f"io-hook-{side}" for side in sides}
        for side, hook in hooks.items():
            hook.mkdir()
            no_fsync = "\nos.fsync = lambda fd: None  # --no-fsync\n" if side == "new" and args.no_fsync else ""
            (hook / "sitecustomize.py").write_text(IO_HOOK + no_fsync)
        for i in range(args.repeats):
            for side, src in sides.items():
                records, written, hashed = run_once(src, args.config, overrides, args.rounds, Path(tmp) / f"{side}-{i}", hooks[side])
                got = [r["packets"] for r in records]
                first = first or got
                if got != first:
                    raise SystemExit(f"round_cost: {side} (repeat {i}) recorded other packets than the first run")
                results[side].append(per_round(records, written, hashed))
                print(f"{side} {i}: " + "  ".join(f"{k} {v:.3f}" for k, v in results[side][-1].items()), flush=True)
    medians = {side: {k: statistics.median(x[k] for x in rows) for k in FIELDS} for side, rows in results.items()}
    print(f"\nmedian seconds a round over rounds 1-{args.rounds - 1}, {args.repeats} runs each (old = {args.old}"
          f"{'; new without fsync' if args.no_fsync else ''}); "
          "hash_s: the most a worker spent in tensors_hash; peak_rss_mb: the largest worker's; write_mb: all workers' "
          "disk writes; hash_s and write_mb per round of the whole run")
    print(f"{'':10s}" + "".join(f"{k:>12s}" for k in FIELDS))
    for side in ("old", "new"):
        print(f"{side:10s}" + "".join(f"{medians[side][k]:12.3f}" for k in FIELDS))
    ratio = {k: medians["new"][k] / medians["old"][k] if medians["old"][k] else float("nan") for k in FIELDS}
    print(f"{'new/old':10s}" + "".join(f"{ratio[k]:12.3f}" for k in FIELDS))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"old": args.old, "no_fsync": args.no_fsync, "overrides": overrides, "rounds": args.rounds,
                                          "repeats": args.repeats, "runs": results, "median": medians,
                                          "ratio": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
