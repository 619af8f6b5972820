"""What the lazy target costs with whole-round replays and with segments replayed from sent states.

    python bench/state_replay.py [--rounds 8] [--inner-steps 100] [--trace-every 5] [--skip 0.25]
                                 [--target 0.95] [--within 30] [--quick] [--out bench/results/state_replay.json]

The issue's target: a lazy worker that skips >= 25% of its inner steps is caught with >= 95%
probability within 30 rounds, at <= 5% of the training compute. Against a lazy worker that no
screen sees (it does its first steps honestly and sends its short delta as it is) only a drawn
replay catches it, so the replay probability p must give 1 - (1 - p c)^30 >= 0.95, where c is the
chance that one drawn replay catches it:

- `round` (`[verify] replay_extent = "round"`): the whole round from its public start, c = 1, so
  p_round = 1 - 0.05^(1/30) = 0.0950, and each replay costs a worker-round of compute;
- `state` (`replay_extent = "state"`): one segment of k = `--trace-every` steps drawn from the
  H / k, from the start state the worker sends its auditor. c = the share of segments whose end
  lies past the steps it did (the last `--skip` of them), so p_state = p_round / c, and a replay
  costs k / H of a worker-round, plus moving the state (params and both AdamW moments, 3x the
  model) over the link: the traffic this mode pays instead of compute.

Clean runs (no attacker) of configs/verified.toml (the `make run` model with every check on:
loss-gain screen, trimmed mean, inner state reset with the LR ramp) at H = `--inner-steps` and
`--rounds` rounds, 4 workers, one after another in one process:

- `no replays`: p = 0, one trace segment per round: the inner steps' own CPU, the baseline (its
  loss gains are computed by every worker for every packet: without replays there is nothing to
  settle a disputed gain, so they are not the other rows');
- `round`: p_round, one trace segment per round (`trace_every = H`);
- `state`: p_state, `trace_every = k`: the finer trace costs hashing every k steps, and the
  worker keeps a copy of the state behind each trace entry until its round is checked.

Per row, in CPU seconds of the workers' threads per worker-round (bench/verify.py's
`overhead_of`), as shares of the baseline row's inner-step CPU: the checks, the loss gains, the
replays as measured and as expected at p (a run draws few replays: p x one replay's measured
cost), and the extra inner-step CPU against the baseline (trace hashing and kept states); the
total expected overhead; the same total with the finer trace's price timed by its parts in this
process instead (`trace_cost`: an inner step, a trace entry, a kept one;
`overhead_expected_paired`), because runs one after another drift by a few percent of inner CPU
on this shared machine (the `round` row's trace is the baseline's, and it still differs); the state bytes each worker sent per round beside its packets'; the
eval loss (replays do not change training: all three the same). The chance to catch within
`--within` rounds is computed from p and c; `bench/replay_extent.py` and `bench/verify.py`
measure c and the catches on the tiny model. `--quick`: 1 round at H = 10 of a one-layer model, for the test.
`--trace-cost-only`: only `trace_cost` (with `PYTHONPATH` at an older checkout's `src`, that
code's price: `bench/results/trace_cost-before-hash-fix.json`). `--keep-states-only`: only the
state row, with its states kept in memory and then on disk (`[verify] keep_states`): peak
resident memory per worker, inner CPU, eval loss (`bench/results/keep_states.json`).
Writes `{"rows": [...], "p": {...}, "c": ..., "config": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify import ROOT, overhead_of  # noqa: E402

from veriloco.config import load_config  # noqa: E402
from veriloco.inner import InnerLoop  # noqa: E402
from veriloco.model import build_model, lm_loss  # noqa: E402
from veriloco.run import train  # noqa: E402
from veriloco.verify.replay import state_layout  # noqa: E402

try:  # keep_states (fourteenth session); --trace-cost-only also times older code on PYTHONPATH
    from veriloco.verify.kept import InMemory, OnDisk
except ImportError:
    InMemory = OnDisk = None


def catch_share(inner_steps: int, trace_every: int, skip: float) -> float:
    """c: the share of an H-step round's segments whose replay from its start state reaches a step
    that a worker doing only round(H (1 - skip)) steps, the first ones, did not do (a segment ends
    at a trace entry the worker could only make up)."""
    done = max(1, round(inner_steps * (1 - skip)))
    n = inner_steps // trace_every
    return sum(1 for j in range(n) if (j + 1) * trace_every > done) / n


def probability_for(target: float, within: int, c: float = 1.0) -> float:
    """The replay probability p with 1 - (1 - p c)^within = target."""
    return min(1.0, (1 - (1 - target) ** (1 / within)) / c)


def trace_cost(inner_steps: int, trace_every: int, repeats: int = 20) -> dict:
    """The inner steps' own price of the finer trace, from its parts timed in this process (one
    thread, the `make run` model): CPU seconds of one inner step, of one trace entry (hashing the
    state) and of one entry whose state is also kept (copied into the memory of a state done with,
    as from a run's second round), each the median of `repeats`; the extra share of a round's
    inner CPU = ((H/k + 1) x kept - 2 x plain) / (H x step). (Whole runs of H steps with and
    without the finer trace, alternating in one process, differ by -4% to +3% from run to run on
    this shared machine: more than the thing measured.)"""
    cfg = load_config(ROOT / "configs" / "verified.toml", [])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loop = InnerLoop(build_model(cfg.model, cfg.run.seed), cfg.train, 10**6, lambda m, x, y: lm_loss(m(x), y))
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.ctx), generator=gen)
                for _ in range(2))

        def cpu(f) -> float:
            out = []
            for _ in range(repeats):
                c0 = time.thread_time()
                f()
                out.append(time.thread_time() - c0)
            return statistics.median(out)

        step = cpu(lambda: loop.step(x, y))
        plain = cpu(loop.state_hash)
        disk = disk_wall = None
        if InMemory is None:  # older code on PYTHONPATH: a list, its copies reused from loop.spare
            loop.keep = []
            cpu(loop.state_hash)
            loop.spare, loop.keep = loop.keep, []
            kept = cpu(loop.state_hash)
        else:
            loop.keep = InMemory(state_layout(loop.model), [])
            cpu(loop.state_hash)
            loop.keep.release()  # a round's states, done with: the next round's memory
            loop.keep = InMemory(state_layout(loop.model), loop.keep.pool)
            kept = cpu(loop.state_hash)
            with tempfile.TemporaryDirectory() as tmp:  # keep_states = "disk": written to a file instead
                loop.keep = OnDisk(state_layout(loop.model), Path(tmp) / "kept.bin")
                w0 = time.perf_counter()
                disk = cpu(loop.state_hash)
                disk_wall = (time.perf_counter() - w0) / repeats
                loop.keep.release()
        loop.keep = None
    finally:
        torch.set_num_threads(threads)
    entries = inner_steps // trace_every + 1
    extra = (entries * kept - 2 * plain) / (inner_steps * step)
    extra_disk = (entries * disk - 2 * plain) / (inner_steps * step) if disk is not None else None
    return {"step_cpu_s": round(step, 5), "entry_cpu_s": round(plain, 5), "kept_entry_cpu_s": round(kept, 5),
            "disk_entry_cpu_s": _r(disk), "disk_entry_wall_s": _r(disk_wall),
            "entries": entries, "repeats": repeats, "extra_share": round(extra, 4), "extra_share_disk": _r(extra_disk, 4)}


def _write(path: str, out: dict) -> dict:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def _r(x: float | None, digits: int = 5) -> float | None:
    return round(x, digits) if x is not None else None


def row_of(name: str, recs: list[dict], summary: dict, p: float, base_inner: float | None) -> dict:
    """One row: the CPU shares per worker-round against `base_inner` (the baseline's inner CPU
    seconds per worker-round; None: this is the baseline)."""
    over = overhead_of([recs], p)
    cpu = over.get("cpu", {})
    worker_rounds = over["worker_rounds"]
    inner = cpu.get("inner_s", 0.0) / worker_rounds
    base = inner if base_inner is None else base_inner
    share = {k: cpu.get(k, 0.0) * inner / base for k in ("checks", "loss_gain", "replay")}
    cost = cpu.get("replay_cost_per_worker_round")  # one replay, in worker-rounds of this row's inner CPU
    replay_expected = p * cost * inner / base if cost is not None else (p if p else 0.0)
    extra_inner = inner / base - 1
    state_bytes = sum(sum(rec.get("state_bytes_sent") or [0]) for rec in recs) / worker_rounds
    packet_bytes = sum(sum(rec["bytes_sent"]) for rec in recs) / worker_rounds
    return {"name": name, "p": round(p, 4), "eval_loss": summary["eval_loss_end"], "worker_rounds": worker_rounds,
            "replays": over["replays"], "inner_cpu_per_worker_round": round(inner, 4),
            "extra_inner": round(extra_inner, 4), "checks": round(share["checks"], 4),
            "loss_gain": round(share["loss_gain"], 4), "replay_measured": round(share["replay"], 4),
            "replay_cost_worker_rounds": cost, "replay_expected": round(replay_expected, 4),
            "overhead_expected": round(extra_inner + share["checks"] + share["loss_gain"] + replay_expected, 4),
            "state_bytes_per_worker_round": round(state_bytes), "packet_bytes_per_worker_round": round(packet_bytes)}


def keep_states_rows(overrides: list[str], p: float, out_path: str) -> dict:
    """The state row with its states kept in memory, then on disk, one after the other: the
    workers' peak resident memory (each process's ru_maxrss, the record's `peak_rss_mb`: median
    and max over the workers at the run's end), their inner-step CPU per worker-round, the replays
    and state bytes, and the eval loss (the same in both: where the states wait changes nothing
    else)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for how in ("memory", "disk"):
            cfg = load_config(ROOT / "configs" / "verified.toml", [*overrides, f"--verify.keep_states={how}"])
            run, summary = train(cfg, str(Path(tmp) / how), quiet=True)
            recs = run.rounds()
            rss = recs[-1]["peak_rss_mb"]
            row = row_of(f"state, {how}", recs, summary, p, None)
            row |= {"keep_states": how, "peak_rss_mb_median": round(statistics.median(rss), 1), "peak_rss_mb_max": max(rss),
                    "kept_files_left": len(list(run.root.rglob("kept-*.bin")))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    mem, disk = rows
    out = {"rows": rows, "p": round(p, 4), "overrides": overrides,
           "rss_saved_mb_median": round(mem["peak_rss_mb_median"] - disk["peak_rss_mb_median"], 1),
           "inner_cpu_disk_over_memory": round(disk["inner_cpu_per_worker_round"] / mem["inner_cpu_per_worker_round"], 4)}
    print(f"peak RSS per worker (median): memory {mem['peak_rss_mb_median']:.0f} MB, disk {disk['peak_rss_mb_median']:.0f} MB; "
          f"inner CPU per worker-round disk / memory x{out['inner_cpu_disk_over_memory']:.3f}; eval loss "
          f"{mem['eval_loss']:.4f} / {disk['eval_loss']:.4f}")
    return _write(out_path, out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=100)
    ap.add_argument("--trace-every", type=int, default=5)
    ap.add_argument("--skip", type=float, default=0.25, help="the share of its steps the lazy worker skips")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--within", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="1 round at H = 10 of a one-layer model (a check that it runs)")
    ap.add_argument("--trace-cost-only", action="store_true",
                    help="only time the finer trace by its parts (trace_cost), e.g. against older code on PYTHONPATH")
    ap.add_argument("--keep-states-only", action="store_true",
                    help="only the state row, twice: its states kept in memory, then on disk ([verify] keep_states)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "state_replay.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.inner_steps = 1, 10
    if args.inner_steps % args.trace_every:
        ap.error(f"--trace-every ({args.trace_every}) must divide --inner-steps ({args.inner_steps})")
    if not 0 < args.skip < 1 or not 0 < args.target < 1 or args.within < 1:
        ap.error("--skip and --target must be in (0, 1), --within >= 1")
    c = catch_share(args.inner_steps, args.trace_every, args.skip)
    if c == 0:
        ap.error(f"no segment of {args.trace_every} steps reaches the skipped steps")
    H, k = args.inner_steps, args.trace_every
    p_round, p_state = probability_for(args.target, args.within), probability_for(args.target, args.within, c)
    base = [f"--train.rounds={args.rounds}", f"--train.inner_steps={H}", "--train.eval_every=1000"]
    if args.quick:  # a check that it runs: a one-layer model (the trace's price is still timed on the real one)
        base += ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.ctx=32",
                 "--train.batch_size=4", "--train.eval_batches=2"]
    rows_spec = [("no replays", 0.0, ["--verify.replay_probability=0", f"--verify.trace_every={H}"]),
                 ("round", p_round, [f"--verify.replay_probability={p_round}", f"--verify.trace_every={H}",
                                     "--verify.replay_extent=round"]),
                 ("state", p_state, [f"--verify.replay_probability={p_state}", f"--verify.trace_every={k}",
                                     "--verify.replay_extent=state"])]
    if args.keep_states_only:
        return keep_states_rows(base + rows_spec[2][2], p_state, args.out)
    cost = trace_cost(H, k, repeats=3 if args.quick else 20)
    print(f"an inner step {cost['step_cpu_s'] * 1e3:.1f} ms CPU, a trace entry {cost['entry_cpu_s'] * 1e3:.2f} ms, one "
          f"kept {cost['kept_entry_cpu_s'] * 1e3:.2f} ms: {cost['entries']} entries a round instead of 2 add "
          f"{cost['extra_share']:.2%} to its inner CPU"
          + (f"; kept on disk {cost['disk_entry_cpu_s'] * 1e3:.2f} ms CPU, {cost['disk_entry_wall_s'] * 1e3:.2f} ms wall: "
             f"{cost['extra_share_disk']:.2%}" if cost.get("disk_entry_cpu_s") is not None else ""), flush=True)
    if args.trace_cost_only:
        return _write(args.out, {"trace_cost": cost, "config": {"inner_steps": H, "trace_every": k}})
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, p, extra in rows_spec:
            cfg = load_config(ROOT / "configs" / "verified.toml", base + extra)
            run, summary = train(cfg, str(Path(tmp) / name.replace(" ", "-")), quiet=True)
            recs = run.rounds()
            rows.append(row_of(name, recs, summary, p, rows[0]["inner_cpu_per_worker_round"] if rows else None))
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        q = row["p"] * (c if row["name"] == "state" else 1.0)
        row["caught_within"] = round(1 - (1 - q) ** args.within, 4) if row["p"] else 0.0
        # the same total with the finer trace's price measured side by side (trace_cost) instead
        # of from runs one after another, whose inner CPU drifts by a few percent on this machine
        paired = cost["extra_share"] if row["name"] == "state" else 0.0
        row["overhead_expected_paired"] = round(row["overhead_expected"] - row["extra_inner"] + paired, 4)
    out = {"rows": rows, "trace_cost": cost, "p": {"round": round(p_round, 4), "state": round(p_state, 4)}, "c": c,
           "config": {k2: getattr(args, k2) for k2 in ("rounds", "inner_steps", "trace_every", "skip", "target", "within")}}
    print(f"\nconfigs/verified.toml, 4 workers, {args.rounds} rounds x H = {H}; lazy skipping {args.skip:.0%}: "
          f"c = {c:.3f} of {H // k} segments; p_round = {p_round:.4f}, p_state = {p_state:.4f}")
    print(f"{'row':<11} {'p':>6} {'replays':>7} {'extra inner':>11} {'checks':>7} {'loss gains':>10} "
          f"{'replay (meas.)':>14} {'replay (exp.)':>13} {'total (exp.)':>12} {'paired':>7} {'caught in ' + str(args.within):>12} "
          f"{'state MB/wr':>11} {'packet MB/wr':>12} {'eval loss':>9}")
    for r in rows:
        print(f"{r['name']:<11} {r['p']:>6.4f} {r['replays']:>7} {r['extra_inner']:>11.2%} {r['checks']:>7.2%} "
              f"{r['loss_gain']:>10.2%} {r['replay_measured']:>14.2%} {r['replay_expected']:>13.2%} "
              f"{r['overhead_expected']:>12.2%} {r['overhead_expected_paired']:>7.2%} {r['caught_within']:>12.1%} {r['state_bytes_per_worker_round'] / 1e6:>11.3f} "
              f"{r['packet_bytes_per_worker_round'] / 1e6:>12.3f} {r['eval_loss']:>9.4f}")
    return _write(args.out, out)


if __name__ == "__main__":
    main()
