"""What a worker process holds of the corpus: the whole of it (`task.load_stored_corpus`, how
every worker read it before) or a chunk at a time (`task.StoredCorpus`, how workers read it now).

    python bench/corpus_memory.py [--mb 256] [--steps 200] [--repeats 3] [--parts workers,prepare,text]
                                  [--text-mb 64] [--before SRC] [--out bench/results/corpus_memory.json]

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
make the same Merkle root. `--parts text`: the prepare step's part for a text source that
`[data] tokenizer` tokenizes (`--text-mb` MB of standard-library source in 16 files, a byte-level
BPE of 4096 tokens trained here on one module, `[data] eos` after each file): whole (`load_corpus`)
against streamed (`prepare_corpus`: read a block at a time, tokenized a few pieces at a time into
an unnamed scratch file, hashed and put from it), and with `--before SRC` (the `src` directory of
another checkout, e.g. a worktree of the commit before the streaming) that code's
`prepare_corpus` too; all must make the same root. On the CPU.
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
from stage_build import entry, print_table, write_result  # noqa: E402

WAYS = ("whole", "stored")
PREPARE = ("whole", "streamed")
PARTS = ("workers", "prepare", "text")


def prepare_child(spec: dict) -> dict:
    """The prepare step's corpus work in this fresh interpreter: read, check and store the chunks."""
    import inspect
    import time

    if spec.get("src"):  # another checkout's code (--before)
        sys.path.insert(0, spec["src"])
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
            scratch = {"scratch": spec["store"]} if "scratch" in inspect.signature(prepare_corpus).parameters else {}
            prepared = prepare_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx, **scratch)
            prepared.put_chunks(store.put)
            getattr(prepared, "close", lambda: None)()
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
    ap.add_argument("--parts", default="workers,prepare", help="comma-separated: workers, prepare, text")
    ap.add_argument("--text-mb", type=int, default=64, help="--parts text: MB of text")
    ap.add_argument("--before", default="", help="--parts text: the src directory of another checkout, measured too")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "corpus_memory.json"))
    args = ap.parse_args(argv)
    if min(args.mb, args.steps, args.repeats, args.text_mb) < 1:
        ap.error("--mb, --text-mb, --steps and --repeats must be >= 1")
    parts = args.parts.split(",")
    if not parts or not set(parts) <= set(PARTS):
        ap.error(f"--parts takes workers, prepare and/or text, got {args.parts!r}")
    if args.before and not (Path(args.before) / "veriloco" / "data.py").is_file():
        ap.error(f"--before {args.before!r}: not a checkout's src directory (no veriloco/data.py in it)")

    import numpy as np

    from veriloco.config import load_config
    from veriloco.run import prepare_run

    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    prep: dict[str, list[dict]] = {way: [] for way in PREPARE}
    text_ways = (*PREPARE, *(["before"] if args.before else []))
    text: dict[str, list[dict]] = {way: [] for way in text_ways}
    chunks, text_chunks = None, None
    with tempfile.TemporaryDirectory() as tmp:
        if {"workers", "prepare"} & set(parts):
            tokens = Path(tmp) / "tokens.bin"
            rng = np.random.default_rng(0)
            with tokens.open("wb") as f:  # written in 16 MB pieces: this process need not hold the corpus
                for _ in range(args.mb):
                    rng.integers(0, 256, 1 << 19, dtype=np.uint16).tofile(f)
            data = [f"--data.source={tokens}", "--data.bin_dtype=uint16", "--data.max_bytes=0", "--data.chunk_bytes=65536"]
            cfg = load_config(ROOT / "configs" / "tiny.toml", data)
            run, task = prepare_run(cfg, str(Path(tmp) / "run"))
            run.release()  # no workers run into it: only its store is read
            chunks = len(task.corpus.chunk_hashes)
        for _ in range(args.repeats if "workers" in parts else 0):
            for way in WAYS:
                runs[way].append(measured("child", {"config": cfg.to_dict(), "store": str(run.store_dir),
                                                    "digest": task.corpus_manifest, "way": way, "steps": args.steps}))
        for k in range(args.repeats if "prepare" in parts else 0):
            for way in PREPARE:
                prep[way].append(measured("prepare", {"config": cfg.to_dict(), "store": str(Path(tmp) / f"store-{way}-{k}"),
                                                      "way": way}))
        if "text" in parts:
            text_cfg = load_config(ROOT / "configs" / "tiny.toml", text_corpus(Path(tmp), args.text_mb))
        for k in range(args.repeats if "text" in parts else 0):
            for way in text_ways:
                spec = {"config": text_cfg.to_dict(), "store": str(Path(tmp) / f"text-{way}-{k}"),
                        "way": "streamed" if way == "before" else way, "src": args.before if way == "before" else ""}
                text[way].append(measured("prepare", spec))
                text_chunks = sum(p.is_file() for p in Path(spec["store"]).rglob("*")) if text_chunks is None else text_chunks
                shutil.rmtree(spec["store"])
    if len({r["root"] for way in PREPARE for r in prep[way]} | ({task.corpus.root} if chunks else set())) > 1:
        raise SystemExit("the two ways of preparing made different corpus roots")
    if len({r["root"] for way in text_ways for r in text[way]}) > 1:
        raise SystemExit("the ways of preparing the text made different corpus roots")
    if len({r["batches_hash"] for way in WAYS for r in runs[way]}) > 1:
        raise SystemExit("the two ways drew different batches")
    rows = []
    for way in WAYS if "workers" in parts else ():
        rows.append({"way": way, "peak_mb": round(max(r["peak_mb"] for r in runs[way]), 1),
                     "open_s": round(statistics.median(r["open_s"] for r in runs[way]), 3),
                     "batch_ms": round(statistics.median(r["batch_ms"] for r in runs[way]), 3),
                     "chunks_read": runs[way][0]["chunks_read"]})
    prepare_rows, text_rows = summary(prep), summary(text)
    result = {"corpus_mb": args.mb, "chunks": chunks, "steps": args.steps, "repeats": args.repeats, "rows": rows,
              "peak_ratio": round(rows[1]["peak_mb"] / rows[0]["peak_mb"], 4) if rows and rows[0]["peak_mb"] else None,
              "prepare": prepare_rows, "text_mb": args.text_mb if text_rows else None, "text_files": text_chunks,
              "text": text_rows, "before": args.before or None}
    if chunks:
        print(f"a {args.mb} MB token corpus in {chunks} chunks; {args.steps} batches and the eval batches, "
              f"{args.repeats} repeats; peak MB above the imports")
    if rows:
        print("| way | peak MB | open s | ms per batch | chunks read |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['way']} | {r['peak_mb']:.1f} | {r['open_s']:.3f} | {r['batch_ms']:.3f} | {r['chunks_read']} |")
    if prepare_rows:
        print("\nthe prepare step's corpus work (read, check, put every chunk into a fresh store)")
        print_table(["prepare", "peak MB", "s"], [[r["way"], f"{r['peak_mb']:.1f}", f"{r['seconds']:.2f}"]
                                                 for r in prepare_rows])
    if text_rows:
        print(f"\nthe prepare step's work for {args.text_mb} MB of text that [data] tokenizer tokenizes "
              f"({text_chunks} files in the store), {args.repeats} repeats; peak MB above the imports")
        print_table(["prepare", "peak MB", "s"], [[r["way"], f"{r['peak_mb']:.1f}", f"{r['seconds']:.2f}"]
                                                 for r in text_rows])
    return write_result(args.out, result)


def measured(kind: str, spec: dict) -> dict:
    """Run the `--kind` child on `spec` in a fresh interpreter; its result."""
    out = subprocess.run([sys.executable, __file__, f"--{kind}", json.dumps(spec)], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise SystemExit(f"a measurement ({kind}) failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(measurements: dict[str, list[dict]]) -> list[dict]:
    """Per way with measurements: the largest peak and the median seconds."""
    return [{"way": way, "peak_mb": round(max(r["peak_mb"] for r in ms), 1),
             "seconds": round(statistics.median(r["seconds"] for r in ms), 3)} for way, ms in measurements.items() if ms]


def text_corpus(tmp: Path, mb: int) -> list[str]:
    """`mb` MB of text in 16 files (the embedded corpus's bytes, cycled) and a byte-level BPE of
    4096 tokens trained on one module: the overrides of a run that tokenizes it."""
    from corpus_roots import byte_bpe

    from veriloco.data import text_blocks

    source = b"".join(text_blocks("stdlib"))
    docs = tmp / "text"
    docs.mkdir()
    for i in range(16):
        with (docs / f"{i:02d}.txt").open("wb") as f:
            left, at = mb * (1 << 20) // 16, i * 7919
            while left:
                piece = source[at % len(source):][:left]
                f.write(piece)
                left, at = left - len(piece), at + len(piece)
    byte_bpe(4096, tmp / "tokenizer.json")
    return [f"--data.source={docs}", f"--data.tokenizer={tmp / 'tokenizer.json'}", "--data.eos=<|endoftext|>",
            "--model.vocab_size=4096", "--data.max_bytes=0", "--data.chunk_bytes=65536"]


if __name__ == "__main__":
    entry(main, child=child, prepare=prepare_child)
