"""How long a small run takes to start and finish: worker processes from the forkserver
(`procs.py`, torch preloaded) against spawn (each worker imports torch anew), side by side.

    python bench/startup.py [--repeats 3] [--workers 4] [--out bench/results/startup.json]
    python bench/startup.py --cold REV [--repeats 5] [--workers 2] [--out bench/results/startup-cold.json]

Each repeat trains configs/tiny.toml for 1 round of 1 inner step with W workers, once per start
method, alternating (the machine is shared and noisy). The forkserver's first run also starts
the server (imports torch and the engine once); later runs fork from it. Prints a table and
writes `{"rows": [{"start_method", "run", "seconds"}...], "median_s": {...}, "ratio": x}`.

`--cold REV`: whole commands as a user types them, each in a fresh interpreter (so the server
starts anew too): `veriloco train configs/tiny.toml` for 1 round of 1 inner step (its report
included; every worker's round sampled for a replay, `--verify.replay_probability=1.0`, with
`--train.inner_state=reset --verify.trace_every=1`), `veriloco audit` of that run, `veriloco
audit --replay 100` of it (audit-replay: the audit also replays the sampled segments, so it builds
inner loops), `veriloco config`, which starts no run, and
`veriloco train` of a config file that is not there (bad-config: exit 2, one line) and of one
with a codec out of range (bad-codec: `--compress.codec=int8:block=0`, exit 2); git
revision REV's `src` (from `git archive`) against the working tree's, alternating. Prints the
wall seconds and the CPU seconds of the command and every process it started (children's
rusage), medians and new/old ratios, and writes `{"rows": [{"command", "side", "run", "wall_s",
"cpu_s", "orphans"}...], "median": {command: {side: ...}}, "ratio": {command: ...}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from veriloco import procs
from veriloco.config import load_config
from veriloco.run import train

ROOT = Path(__file__).resolve().parents[1]


def one_run(workers: int, method: str, out: Path) -> float:
    procs.START_METHOD = method
    cfg = load_config(ROOT / "configs" / "tiny.toml",
                      [f"--topology.workers={workers}", "--train.rounds=1", "--train.inner_steps=1"])
    t0 = time.perf_counter()
    train(cfg, str(out), quiet=True)
    return time.perf_counter() - t0


def cold_run(src: Path, argv: list[str], code: int = 0) -> tuple[float, float, int]:
    """`veriloco ARGV...` as typed, with the package at `src`: its wall seconds, the CPU seconds of
    it and every process it started (the forkserver's and the workers' included), and how many of
    those outlived it (reaped here). It must exit with `code`."""
    from audit_memory import veriloco

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done, wall, _ = veriloco(src, *argv)
    orphans = reap_orphans()  # the forkserver outlives the command by a moment: its CPU (and its workers') counts too
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != code:
        raise SystemExit(f"startup: veriloco {argv[0]} with {src} exited {done.returncode}, not {code}: "
                         f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), orphans


def reap_orphans(timeout: float = 60.0) -> int:
    """Wait for the processes a command left behind (reparented to this one, a subreaper), so that
    their CPU time is in RUSAGE_CHILDREN; how many there were."""
    deadline, reaped = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            time.sleep(0.01)
        else:
            reaped += 1
    raise SystemExit(f"startup: processes the run started were still running {timeout:g} s after it ended")


def become_subreaper() -> None:
    """Orphaned descendants (the forkserver, once the command exits) are reparented to this process
    (Linux prctl PR_SET_CHILD_SUBREAPER) instead of init, so reap_orphans can count them."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        raise SystemExit(f"startup: --cold needs Linux's PR_SET_CHILD_SUBREAPER (errno {ctypes.get_errno()})")


# a 1-round tiny run, its audit without and with replays, the config reference, and `veriloco train` of a config
# file that is not there and of a bad codec (exit 2: how long a user waits for the one-line error)
COMMANDS = ("train", "audit", "audit-replay", "config", "bad-config", "bad-codec")


def cold(args: argparse.Namespace) -> None:
    from round_cost import source_of

    become_subreaper()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old").mkdir()
        sides = {"old": source_of(args.cold, Path(tmp) / "old"), "new": ROOT / "src"}
        for i in range(args.repeats):
            for side, src in sides.items():
                for command in COMMANDS:
                    run = str(Path(tmp) / f"{side}-{i}")
                    argv = {"config": ["config"], "audit": ["audit", run], "audit-replay": ["audit", run, "--replay", "100"],
                            "bad-config": ["train", str(Path(tmp) / "missing.toml"), "--out", run + "-bad"],
                            "bad-codec": ["train", str(ROOT / "configs" / "tiny.toml"), "--compress.codec=int8:block=0",
                                          "--out", run + "-badcodec"]}.get(command) or [
                        "train", str(ROOT / "configs" / "tiny.toml"), "--out", run, "--quiet",
                        f"--topology.workers={args.workers}", "--train.rounds=1", "--train.inner_steps=1",
                        "--verify.replay_probability=1.0", "--train.inner_state=reset", "--verify.trace_every=1"]
                    wall, cpu, orphans = cold_run(src, argv, 2 if command.startswith("bad-") else 0)
                    rows.append({"command": command, "side": side, "run": i, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                                 "orphans": orphans})
                    print(f"run {i} {side:4s} {command:10s} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    median = {c: {side: {k: statistics.median(r[k] for r in rows if (r["command"], r["side"]) == (c, side))
                         for k in ("wall_s", "cpu_s")} for side in ("old", "new")} for c in COMMANDS}
    ratio = {c: {k: round(m["new"][k] / m["old"][k], 3) for k in ("wall_s", "cpu_s")} for c, m in median.items()}
    result = {"old": args.cold, "workers": args.workers, "rows": rows, "median": median, "ratio": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmedians, {args.cold} -> working tree:")
    for c, m in median.items():
        print(f"  veriloco {c:10s} wall {m['old']['wall_s']:.2f} -> {m['new']['wall_s']:.2f} s (new/old {ratio[c]['wall_s']}), "
              f"cpu {m['old']['cpu_s']:.2f} -> {m['new']['cpu_s']:.2f} s (new/old {ratio[c]['cpu_s']})")
    print(f"-> {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=None, help="default 3; 5 with --cold")
    ap.add_argument("--workers", type=int, default=None, help="default 4; 2 with --cold")
    ap.add_argument("--cold", metavar="REV", help="fresh `veriloco train`, `audit`, `audit --replay`, `config`, bad-config and bad-codec commands: REV's src "
                         "against the working tree's")
    ap.add_argument("--out", default=None, help="default bench/results/startup.json (startup-cold.json with --cold)")
    args = ap.parse_args()
    cold_mode = args.cold is not None
    args.repeats = args.repeats if args.repeats is not None else 5 if cold_mode else 3
    args.workers = args.workers if args.workers is not None else 2 if cold_mode else 4
    args.out = args.out or str(ROOT / "bench" / "results" / ("startup-cold.json" if cold_mode else "startup.json"))
    if args.repeats < 1 or args.workers < 1:
        ap.error("--repeats and --workers must be >= 1")
    if cold_mode:
        cold(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for method in ("forkserver", "spawn"):
                s = one_run(args.workers, method, Path(tmp) / f"{method}-{i}")
                rows.append({"start_method": method, "run": i, "seconds": round(s, 3)})
                print(f"run {i} {method:10s} {s:6.2f} s", flush=True)
    # the forkserver's first run pays for starting the server; the median is over the later ones
    later = {m: [r["seconds"] for r in rows if r["start_method"] == m and (r["run"] > 0 or m == "spawn")]
             for m in ("forkserver", "spawn")}
    median = {m: statistics.median(v) for m, v in later.items() if v}
    result = {"rows": rows, "workers": args.workers, "median_s": median,
              "ratio": round(median["spawn"] / median["forkserver"], 2) if len(median) == 2 else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmedian seconds per run (forkserver: after its first): {median}; spawn / forkserver = "
          f"{result['ratio']}  -> {args.out}")


if __name__ == "__main__":
    main()
