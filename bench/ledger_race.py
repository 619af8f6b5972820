"""Several processes opening one new SQLite ledger at the same moment, as an elastic run's workers do.

    python bench/ledger_race.py [--trials 20] [--procs 6]

Each trial starts `--procs` processes that wait for a common start time, then each opens a new
ledger file (`SqliteLedger`, which switches it to WAL) and closes it. Prints how many opens
failed and the errors. Before the open retried on "database is locked" some failed at once;
to see that, run it against the older code:
`git worktree add /tmp/old cd85dcb~1 && PYTHONPATH=/tmp/old/src python bench/ledger_race.py`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

from veriloco.ledger import SqliteLedger  # imported before the processes fork


def _open_at(path: str, t0: float, errors) -> None:
    while time.time() < t0:
        pass
    try:
        SqliteLedger(path).close()
    except Exception as e:  # noqa: BLE001 - counted and printed, the point of the bench
        errors.put(f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--procs", type=int, default=6)
    args = ap.parse_args(argv)
    if args.trials < 1 or args.procs < 2:
        ap.error("--trials must be >= 1 and --procs >= 2")
    ctx = mp.get_context("fork")  # forked: every process is ready at once, so the opens really collide
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            t0 = time.time() + 0.5  # every process forked and waiting
            procs = [ctx.Process(target=_open_at, args=(str(Path(tmp) / f"{trial}.sqlite"), t0, errors))
                     for _ in range(args.procs)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
    failed = []
    while not errors.empty():
        failed.append(errors.get())
    print(f"{len(failed)} of {args.trials * args.procs} opens failed")
    for e in failed:
        print(f"  {e}")
    return {"opens": args.trials * args.procs, "failed": len(failed)}


if __name__ == "__main__":
    main()
