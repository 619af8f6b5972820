"""What a worker process holds of the corpus: the whole of it (`task.load_stored_corpus`, how
every worker read it before) or a chunk at a time (`task.StoredCorpus`, how workers read it now).

    python bench/corpus_memory.py [--mb 256] [--steps 200] [--repeats 3] [--parts workers,prepare]
                                  [--out bench/results/corpus_memory.json]

Writes a token .bin of `--mb` MB (uint16, random ids below 256) and prepares a run on it (its
chunks go into the run's store, 64 KiB each), then, in a fresh interpreter per measurement, the
two ways alternating `--repeats` times: open the run's corpus and draw `--steps` inner steps'
batches of worker 0 (the tiny config's batch: 4 sequences of 32 tokens) plus its 4 eval batches.
Per way: the process's peak resident memory above what it held after its imports (VmHWM reset
just before opening; the largest over the repeats), the time to open the corpus and the time per
batch (medians), and how many chunks were read. Both ways must give the same batches (a hash of
all of them is compared), or the bench fails. Then the prepare step's part, the same way: read
the file, check it and put its chunks into a fresh store, whole (`load_corpus`, how the prepare
step read a .bin before) or streamed (`data.prepare_corpus`: a chunk at a time, twice); both must
make the same Merkle root. On the CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from stage_build import entry, write_result  # noqa: E402

WAYS = ("whole", "stored")
PREPARE = ("whole", "streamed")


def prepare_child(spec: dict) -> dict:
    """The prepare step's corpus work in this fresh interpreter: read, check and store the chunks."""
    import time

    from stage_build import measured_peak

    from veriloco.config import config_from_dict
    from veriloco.data import load_corpus, prepare_corpus
    from veriloco.store import LocalStore

    cfg = config_from_dict(spec["config"])
    store = LocalStore(spec["store"])
    with measured_peak() as peak:
        t0 = time.perf_counter()
        if spec["way"] == "whole":  # how the prepare step read it before: the whole file, its chunks put from memory
            corpus = load_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx)
            for chunk in corpus.chunks:
                store.put(chunk)
            root = corpus.root
        else:
            prepared = prepare_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx)
            prepared.put_chunks(store.put)
            root = prepared.root
        seconds = time.perf_counter() - t0
    return {"peak_mb": peak["peak_mb"], "seconds": seconds, "root": root}


def child(spec: dict) -> dict:
    """One measurement in this fresh interpreter."""
    import hashlib
    import time

    from stage_build import measured_peak

    from veriloco.config import config_from_dict
    from veriloco.data import batch, eval_batches
    from veriloco.store import LocalStore
    from veriloco.task import StoredCorpus, load_stored_corpus

    cfg = config_from_dict(spec["config"])
    store = LocalStore(spec["store"])
    with measured_peak() as peak:
        t0 = time.perf_counter()
        if spec["way"] == "whole":
            corpus = load_stored_corpus(store, spec["digest"], cfg)
        else:
            corpus = StoredCorpus(store, spec["digest"], cfg)
        opened = time.perf_counter() - t0
        t, h = cfg.train, hashlib.sha256()
        t0 = time.perf_counter()
        for step in range(spec["steps"]):
            x, y = batch(corpus, cfg.run.seed, 0, step // t.inner_steps, step % t.inner_steps, t.batch_size, cfg.model.ctx)
            h.update(x.numpy().tobytes() + y.numpy().tobytes())
        per_batch = (time.perf_counter() - t0) / spec["steps"]
        for x, y in eval_batches(corpus, t.eval_batches, t.batch_size, cfg.model.ctx):
            h.update(x.numpy().tobytes() + y.numpy().tobytes())
    reads = getattr(corpus, "reads", len(getattr(corpus, "chunks", [])))
    return {"peak_mb": peak["peak_mb"], "open_s": opened, "batch_ms": per_batch * 1000, "chunks_read": reads,
            "batches_hash": h.hexdigest()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="workers,prepare", help="comma-separated: workers, prepare")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "corpus_memory.json"))
    args = ap.parse_args(argv)
    if min(args.mb, args.steps, args.repeats) < 1:
        ap.error("--mb, --steps and --repeats must be >= 1")
    parts = args.parts.split(",")
    if not parts or not set(parts) <= {"workers", "prepare"}:
        ap.error(f"--parts takes workers and/or prepare, got {args.parts!r}")

    import numpy as np

    from veriloco.config import load_config
    from veriloco.run import prepare_run

    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.bin"
        rng = np.random.default_rng(0)
        with tokens.open("wb") as f:  # written in 16 MB pieces: this process need not hold the corpus
            for _ in range(args.mb):
                rng.integers(0, 256, 1 << 19, dtype=np.uint16).tofile(f)
        data = [f"--data.source={tokens}", "--data.bin_dtype=uint16", "--data.max_bytes=0", "--data.chunk_bytes=65536"]
        cfg = load_config(ROOT / "configs" / "tiny.toml", data)
        run, task = prepare_run(cfg, str(Path(tmp) / "run"))
        chunks = len(task.corpus.chunk_hashes)
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(args.repeats if "workers" in parts else 0):
            for way in WAYS:
                spec = {"config": cfg.to_dict(), "store": str(run.store_dir), "digest": task.corpus_manifest, "way": way,
                        "steps": args.steps}
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                     text=True, check=False)
                if out.returncode:
                    raise SystemExit(f"a measurement failed: {out.stderr.strip().splitlines()[-1:]}")
                runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
        prep: dict[str, list[dict]] = {way: [] for way in PREPARE}
        for k in range(args.repeats if "prepare" in parts else 0):
            for way in PREPARE:
                spec = {"config": cfg.to_dict(), "store": str(Path(tmp) / f"store-{way}-{k}"), "way": way}
                out = subprocess.run([sys.executable, __file__, "--prepare", json.dumps(spec)], capture_output=True,
                                     text=True, check=False)
                if out.returncode:
                    raise SystemExit(f"a prepare failed: {out.stderr.strip().splitlines()[-1:]}")
                prep[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(spec["store"])
    if len({r["root"] for way in PREPARE for r in prep[way]} | {task.corpus.root}) != 1:
        raise SystemExit("the two ways of preparing made different corpus roots")
    if len({r["batches_hash"] for way in WAYS for r in runs[way]}) > 1:
        raise SystemExit("the two ways drew different batches")
    rows = []
    for way in WAYS if "workers" in parts else ():
        rows.append({"way": way, "peak_mb": round(max(r["peak_mb"] for r in runs[way]), 1),
                     "open_s": round(statistics.median(r["open_s"] for r in runs[way]), 3),
                     "batch_ms": round(statistics.median(r["batch_ms"] for r in runs[way]), 3),
                     "chunks_read": runs[way][0]["chunks_read"]})
    prepare_rows = [{"way": way, "peak_mb": round(max(r["peak_mb"] for r in prep[way]), 1),
                     "seconds": round(statistics.median(r["seconds"] for r in prep[way]), 3)}
                    for way in (PREPARE if "prepare" in parts else ())]
    result = {"corpus_mb": args.mb, "chunks": chunks, "steps": args.steps, "repeats": args.repeats, "rows": rows,
              "peak_ratio": round(rows[1]["peak_mb"] / rows[0]["peak_mb"], 4) if rows and rows[0]["peak_mb"] else None,
              "prepare": prepare_rows}
    print(f"a {args.mb} MB token corpus in {chunks} chunks; {args.steps} batches and the eval batches, "
          f"{args.repeats} repeats; peak MB above the imports")
    if rows:
        print("| way | peak MB | open s | ms per batch | chunks read |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['way']} | {r['peak_mb']:.1f} | {r['open_s']:.3f} | {r['batch_ms']:.3f} | {r['chunks_read']} |")
    if prepare_rows:
        print("\nthe prepare step's corpus work (read, check, put every chunk into a fresh store)")
        print("| prepare | peak MB | s |")
        print("|---|---|---|")
        for r in prepare_rows:
            print(f"| {r['way']} | {r['peak_mb']:.1f} | {r['seconds']:.2f} |")
    return write_result(args.out, result)


if __name__ == "__main__":
    entry(main, child=child, prepare=prepare_child)
