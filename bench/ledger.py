"""Ledger benchmark: appends per second for realistic round entries (4 commitments each), and
the time `veriloco audit` takes per round as a share of the training time per round.

    python bench/ledger.py                       # 2000 entries per SQLite backend, 100 on the EVM,
                                                 # audit of a real run (default.toml, 2 workers)
    python bench/ledger.py --quick               # 200 / 20 entries, audit of a tiny run
    python bench/ledger.py --n 5000 --out bench/results/ledger.json
    python bench/ledger.py --backends sqlite-full --no-audit

Each row is measured from the clock: `appends_per_s` is N / wall time of N `Ledger.append`
calls (entry validation, chain check, Merkle root, the backend's commit), `verify_s` the wall
time of `verify_chain` over the N entries, `proof_ms` the mean time of an inclusion proof plus a
consistency proof at full size. Another backend adds a row with
`bench_backend(name, make_ledger, n)`, or by adding a factory to `BACKENDS`.

The `evm-inproc` row is `veriloco.ledger.evm.bench_evm(n)`: an `EvmLedger` on an in-process
eth-tester/py-evm chain, one block per append (its entries are `bench_evm`'s own, smaller than
the SQLite rows'; `entry_bytes` says how big). It is skipped, with a note, if web3 is missing.

The audit part trains a real run (`--audit-config`, default configs/default.toml with 2 workers
and few, shorter rounds; `--quick`: configs/tiny.toml), then times `audit_run` on it, which
re-verifies everything except replaying inner steps: manifest, corpus, ledger chain, every
bundle's signature and checks, aggregate, outer step and checkpoint. It reports
`audit_s_per_round` = audit wall time / rounds (setup included, so an upper bound) against the
mean `round_s` from rounds.jsonl and `train wall_s / rounds`; the target is an audit without
replay of <= 10% of the training time per round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
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


EVM = "evm-inproc"  # not in BACKENDS: bench_evm builds its own chain and entries


def bench_evm_row(n: int) -> dict[str, Any] | None:
    """The EVM row from `veriloco.ledger.evm.bench_evm(n)`, or None (with a note) without web3."""
    try:
        from veriloco.ledger.evm import bench_evm
    except ImportError as e:
        print(f"note: {EVM} skipped: {e}", file=sys.stderr)
        return None
    return bench_evm(n)


ROOT = Path(__file__).resolve().parents[1]
AUDIT_FULL = (ROOT / "configs" / "default.toml",
              ["--topology.workers=2", "--train.rounds=5", "--train.inner_steps=10",
               "--train.eval_batches=4"])
AUDIT_QUICK = (ROOT / "configs" / "tiny.toml", ["--train.rounds=3"])


def prefix_of_run(src: Path, dst: Path, rounds: int) -> None:
    """Copy run `src` to `dst` keeping only its first `rounds` rounds (records and ledger)."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ledger.sqlite*"))
    lines = (src / "rounds.jsonl").read_text().splitlines(keepends=True)
    (dst / "rounds.jsonl").write_text("".join(lines[:rounds]))
    with SqliteLedger(src / "ledger.sqlite") as old, SqliteLedger(dst / "ledger.sqlite") as new:
        for i in range(rounds):
            new.append_bytes(old.entry_bytes(i))


def bench_audit(config: Path, overrides: list[str], workdir: Path,
                threads: int | None = None) -> dict[str, Any]:
    """Train a run with `config` + `overrides`, audit it, and compare per-round times.

    The audits run with `threads` torch threads (default: the run's `train.threads`, what each
    training worker process uses); one more audit with torch's default thread count in this
    process is reported as `audit_s_default_threads`."""
    import torch

    from veriloco.audit import audit_run
    from veriloco.config import load_config
    from veriloco.model import build_model
    from veriloco.records import RunDir
    from veriloco.run import train

    cfg = load_config(config, overrides)
    out = workdir / "audit-run"
    t0 = time.perf_counter()
    _, summary = train(cfg, str(out), quiet=True)
    train_call_s = time.perf_counter() - t0
    records = RunDir(out).rounds()
    rounds = len(records)
    # the same run cut to its first round (a prefix of a run is a run): audit time minus that
    # is what the other rounds cost, without the fixed setup (model, corpus, ledger open)
    one = workdir / "audit-run-1"
    prefix_of_run(out, one, 1)
    default_threads = torch.get_num_threads()
    threads = threads or cfg.train.threads
    torch.set_num_threads(threads)
    try:
        # the first audit in this process also pays one-time costs (lazy imports, torch
        # kernels' first use); the figures are the faster of two later audits
        first = audit_run(out)
        report = min((audit_run(out) for _ in range(2)), key=lambda rep: rep.seconds)
        report_1 = min((audit_run(one) for _ in range(2)), key=lambda rep: rep.seconds)
    finally:
        torch.set_num_threads(default_threads)
    report_dt = audit_run(out)
    for rep in (first, report, report_1, report_dt):
        if not rep.ok:
            raise RuntimeError(f"audit of a fresh run failed: {rep.first_failure}")
    marginal = (report.seconds - report_1.seconds) / (rounds - 1) if rounds > 1 else None
    round_s = [float(r["round_s"]) for r in records]
    audit_per_round = report.seconds / rounds
    mean_round = statistics.fmean(round_s)
    wall_per_round = float(summary["wall_s"]) / rounds
    n_params = sum(p.numel() for p in build_model(cfg.model, cfg.run.seed).parameters())
    return {
        "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
        "overrides": overrides, "workers": cfg.topology.workers, "rounds": rounds,
        "inner_steps": cfg.train.inner_steps, "params": n_params,
        "store_bytes": sum(f.stat().st_size for f in (out / "store").rglob("*") if f.is_file()),
        "train_call_s": round(train_call_s, 3), "train_wall_s": round(float(summary["wall_s"]), 3),
        "round_s_mean": round(mean_round, 4), "round_s": round_s,
        "train_wall_s_per_round": round(wall_per_round, 4),
        "audit_threads": threads, "audit_s_first_call": round(first.seconds, 4),
        "default_threads": default_threads, "audit_s_default_threads": round(report_dt.seconds, 4),
        "audit_s": round(report.seconds, 4), "audit_s_per_round": round(audit_per_round, 4),
        "audit_share_of_round_s": round(audit_per_round / mean_round, 4),
        "audit_share_of_wall_per_round": round(audit_per_round / wall_per_round, 4),
        "audit_1_round_s": round(report_1.seconds, 4),
        "audit_marginal_s_per_round": None if marginal is None else round(marginal, 4),
        "audit_marginal_share_of_round_s": None if marginal is None else round(marginal / mean_round, 4),
        "target_share": 0.10, "replay": False, "checked": report.checked,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["backend", "entries", "entry_bytes", "appends_per_s", "append_s", "verify_s",
            "proof_ms"]
    widths = [max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c, "-")).rjust(w) for c, w in zip(cols, widths, strict=True)))


def print_audit(a: dict[str, Any]) -> None:
    print(f"\naudit of a real run: {a['config']} {' '.join(a['overrides'])}")
    print(f"  {a['workers']} workers x {a['rounds']} rounds x H={a['inner_steps']}, "
          f"{a['params'] / 1e6:.2f}M params, store {a['store_bytes'] / 1e6:.1f} MB")
    rows = [("train: mean round_s (rounds.jsonl)", a["round_s_mean"]),
            ("train: wall_s / rounds (summary.json)", a["train_wall_s_per_round"]),
            ("audit: audit_s / rounds (no replay)", a["audit_s_per_round"]),
            ("audit: marginal s per round (no setup)", a["audit_marginal_s_per_round"])]
    for name, v in rows:
        print(f"  {name:<40} {'-' if v is None else f'{v:8.3f}'} s")
    ok = "meets" if a["audit_share_of_round_s"] <= a["target_share"] else "MISSES"
    print(f"  audit per round / mean round_s: {a['audit_share_of_round_s']:.1%} "
          f"(/ wall per round: {a['audit_share_of_wall_per_round']:.1%}); "
          f"{ok} the <= {a['target_share']:.0%} target")
    if a["audit_marginal_share_of_round_s"] is not None:
        print(f"  marginal audit per round / mean round_s: {a['audit_marginal_share_of_round_s']:.1%} "
              f"(setup: 1-round audit took {a['audit_1_round_s']:.2f} s)")
    print(f"  (audit figures: {a['audit_threads']} torch thread(s), faster of 2 warm audits of "
          f"{a['audit_s']:.2f} s; the first audit in the process took {a['audit_s_first_call']:.2f} s; "
          f"with torch's default {a['default_threads']} threads {a['audit_s_default_threads']:.2f} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="entries per backend")
    ap.add_argument("--quick", action="store_true", help="200 entries per backend")
    ap.add_argument("--evm-n", type=int, default=100, help=f"entries on {EVM} (--quick: 20)")
    ap.add_argument("--backends", default=",".join([*BACKENDS, EVM]), help="comma-separated names")
    ap.add_argument("--no-audit", action="store_true", help="skip the audit-time measurement")
    ap.add_argument("--audit-config", type=Path, default=None,
                    help="config of the run to audit (default: configs/default.toml, 2 workers, "
                         "5 rounds, H=10; --quick: configs/tiny.toml, 3 rounds)")
    ap.add_argument("--audit-set", action="append", default=None, metavar="--SECTION.KEY=VALUE",
                    help="override for the audited run (repeatable; replaces the default ones)")
    ap.add_argument("--audit-threads", type=int, default=None,
                    help="torch threads for the audit (default: the run's train.threads)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    n = 200 if args.quick else args.n
    evm_n = 20 if args.quick else args.evm_n
    names = [b for b in args.backends.split(",") if b]
    unknown = [b for b in names if b not in BACKENDS and b != EVM]
    if unknown or n < 1 or evm_n < 1:
        print(f"error: unknown backend {unknown} (have {[*BACKENDS, EVM]}) or n={n} / "
              f"evm-n={evm_n} < 1", file=sys.stderr)
        return 2
    default_cfg, default_set = AUDIT_QUICK if args.quick else AUDIT_FULL
    audit_cfg = args.audit_config or default_cfg
    audit_set = args.audit_set if args.audit_set is not None else (
        default_set if args.audit_config is None else [])
    rows = []
    audit = None
    with tempfile.TemporaryDirectory(prefix="veriloco-bench-ledger-") as tmp:
        for name in names:
            if name == EVM:
                row = bench_evm_row(evm_n)
                if row is not None:
                    rows.append(row)
            else:
                rows.append(bench_backend(name, lambda name=name: BACKENDS[name](Path(tmp)), n))
        if not args.no_audit:
            audit = bench_audit(audit_cfg, audit_set, Path(tmp), args.audit_threads)
    if rows:
        print_table(rows)
    if audit:
        print_audit(audit)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"bench": "ledger", "python": platform.python_version(),
                  "machine": platform.machine(), "cpus": os.cpu_count(),
                  "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "rows": rows,
                  "audit": audit}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
