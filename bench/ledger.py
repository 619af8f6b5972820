"""Ledger benchmark: appends per second for realistic round entries (4 commitments each).

    python bench/ledger.py                       # 2000 entries per backend, table + JSON
    python bench/ledger.py --quick               # 200 entries, a few seconds
    python bench/ledger.py --n 5000 --out results/ledger.json
    python bench/ledger.py --backends sqlite-full

Each row is measured from the clock: `appends_per_s` is N / wall time of N `Ledger.append`
calls (entry validation, chain check, Merkle root, the backend's commit), `verify_s` the wall
time of `verify_chain` over the N entries, `proof_ms` the mean time of an inclusion proof plus a
consistency proof at full size. Another backend adds a row with
`bench_backend(name, make_ledger, n)`, or by adding a factory to `BACKENDS`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from veriloco.ledger import Ledger, SqliteLedger, entry_bytes, make_entry, verify_chain

RUN_ID = hashlib.sha256(b"bench-run").hexdigest()


def _digest(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def realistic_entry(r: int, prev_entry_hash: str, workers: int = 4) -> dict[str, Any]:
    """Round `r`'s entry with `workers` signed commitments (one rejected), as `round.py` writes."""
    commitments = [
        {
            "worker": w, "round": r, "run_id": RUN_ID, "base_hash": _digest(f"G{r}"),
            "batches_root": _digest(f"b{r}.{w}"), "trace_root": _digest(f"t{r}.{w}"),
            "losses": [3.2 - 0.001 * r + 0.01 * w, 3.1 - 0.001 * r], "packet_hash": _digest(f"p{r}.{w}"),
            "packet_bytes": 1_048_576, "codec": "topk-int8", "public_key": _digest(f"k{w}"),
            "signature": _digest(f"s{r}.{w}") * 2,
            "verdict": {"worker": w, "reason": "accept" if w != workers - 1 else "cosine_outlier",
                        "evidence": {"cosine": 0.62 if w != workers - 1 else -0.91}},
        }
        for w in range(workers)
    ]
    return make_entry(
        run_id=RUN_ID, round=r, prev_entry_hash=prev_entry_hash, checkpoint=_digest(f"ckpt{r}"),
        commitments=commitments, aggregate_hash=_digest(f"agg{r}"),
        codecs={str(w): "topk-int8" for w in range(workers)}, eval_loss=2.5 - r * 1e-4,
        bytes_sent=4 * 1_048_576, replayed=[{"worker": 1, "segment": [8, 16]}],
    )


def bench_backend(name: str, make_ledger: Callable[[], Ledger], n: int) -> dict[str, Any]:
    """Append `n` realistic entries to a fresh ledger from `make_ledger()`; return one row."""
    ledger = make_ledger()
    try:
        if ledger.size() != 0:
            raise ValueError(f"bench needs an empty ledger, {name} has {ledger.size()} entries")
        sizes = []
        t0 = time.perf_counter()
        for r in range(n):
            e = realistic_entry(r, ledger.head_hash())
            ledger.append(e)
            if r < 8:
                sizes.append(len(entry_bytes(e)))
        append_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        problems = verify_chain(ledger)
        verify_s = time.perf_counter() - t0
        if problems:
            raise RuntimeError(f"{name}: verify_chain found {problems[0]}")
        reps = 5
        t0 = time.perf_counter()
        for k in range(reps):
            ledger.inclusion_proof((k * 7919) % n)
            ledger.consistency_proof(max(1, n // 2 - k))
        proof_ms = (time.perf_counter() - t0) / reps * 1e3
        return {
            "backend": name, "entries": n, "entry_bytes": round(sum(sizes) / len(sizes)),
            "append_s": round(append_s, 4), "appends_per_s": round(n / append_s, 1),
            "verify_s": round(verify_s, 4), "proof_ms": round(proof_ms, 3),
        }
    finally:
        ledger.close()


# name -> factory given a scratch directory
BACKENDS: dict[str, Callable[[Path], Ledger]] = {
    "sqlite-full": lambda d: SqliteLedger(d / "full.db", synchronous="FULL"),
    "sqlite-normal": lambda d: SqliteLedger(d / "normal.db", synchronous="NORMAL"),
}


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["backend", "entries", "entry_bytes", "appends_per_s", "append_s", "verify_s",
            "proof_ms"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="entries per backend")
    ap.add_argument("--quick", action="store_true", help="200 entries per backend")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated names")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    n = 200 if args.quick else args.n
    names = [b for b in args.backends.split(",") if b]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or n < 1:
        print(f"error: unknown backend {unknown} (have {list(BACKENDS)}) or n={n} < 1",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="veriloco-bench-ledger-") as tmp:
        for name in names:
            rows.append(bench_backend(name, lambda name=name: BACKENDS[name](Path(tmp)), n))
    print_table(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"bench": "ledger", "python": platform.python_version(),
                  "machine": platform.machine(), "rows": rows}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
