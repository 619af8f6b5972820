"""Launching a run: the manifest, the run id, local worker processes or torchrun, and resume.

A local run starts workers * stages processes (one per stage of each worker; topology.py) from a
forkserver that has torch imported (procs.py), joined by gloo on loopback at a free port. Under `torchrun` the same worker entry point (`python -m veriloco.run`)
reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment torchrun sets.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import __version__
from .config import Config, ConfigError, config_from_dict, load_config
from .data import prepare_corpus
from .hashing import TENSOR_HASH, canonical_json, json_hash, sha256_hex
from .hf import transformers_version
from .model import build_meta, build_model
from .procs import Terminated, die_with_parent, start_workers, warm
from .records import (
    RunDir,
    RunDirError,
    RunInUse,
    checkpoint_blobs,
    make_dirs,
    prune_checkpoints,
    remove_dirs,
    users_task,
)
from .round import init_distributed, state_history, train_worker
from .store import LocalStore, StagedBlob, run_ref
from .task import CorpusTask, Task, initial_digest
from .verify.identity import IdentityError
from .weights import read_init, write_initial

if TYPE_CHECKING:
    from .elastic import Placement


def admitted_keys(cfg: Config) -> dict[str, str]:
    """{worker: public key hex} for the manifest: from [verify] key_dir (each worker's .pub, else the
    public half of its .key) or derived from the seed. Among parties each machine's key_dir holds
    every worker's .pub and only its own workers' .key (`veriloco keygen --worker W`)."""
    from .round import worker_key
    from .verify.identity import load_public_key, public_key_hex

    out = {}
    for w in range(cfg.topology.workers):
        pub = Path(cfg.verify.key_dir) / f"worker-{w}.pub" if cfg.verify.key_dir else None
        if pub is not None and pub.exists():
            if not pub.is_file():
                raise IdentityError(f"public key file {pub} is not a file")
            out[str(w)] = public_key_hex(load_public_key(pub.read_bytes(), source=f"public key file {pub}"))
        elif pub is not None and not pub.with_suffix(".key").exists():
            raise IdentityError(f"verify.key_dir {cfg.verify.key_dir} has neither worker-{w}.pub nor worker-{w}.key: "
                                "every worker's public key must be there (its private key only where it runs)")
        else:
            out[str(w)] = public_key_hex(worker_key(cfg, w))
    return out


def check_own_keys(cfg: Config, workers: Iterable[int] | None, admitted: dict[str, str] | None = None) -> None:
    """The workers started here (None: all) each have their private key in [verify] key_dir, and
    it is the key the run admits (`admitted`: the manifest's; else each .pub, as `admitted_keys`).
    Checked before anything is written: a worker found it out at its start, after the run
    directory was made, and the run failed with exit 1."""
    if not cfg.verify.key_dir:
        return
    from .round import worker_key
    from .verify.identity import public_key_hex

    where = "the run manifest's key for worker {w}" if admitted is not None else "its worker-{w}.pub"
    admitted = admitted_keys(cfg) if admitted is None else admitted
    for w in range(cfg.topology.workers) if workers is None else workers:
        if not (Path(cfg.verify.key_dir) / f"worker-{w}.key").exists():
            raise IdentityError(f"worker {w} runs here and verify.key_dir {cfg.verify.key_dir} has no worker-{w}.key "
                                "(a machine holds the private keys of the workers it runs)")
        if public_key_hex(worker_key(cfg, w)) != admitted.get(str(w)):
            raise IdentityError(f"worker-{w}.key in verify.key_dir {cfg.verify.key_dir} is not the key the run admits "
                                f"({where.format(w=w)})")


def check_launch(cfg: Config, placement, out: str | Path | None, admitted: dict[str, str] | None = None) -> None:
    """What this machine needs before a launcher (train, train_task, resume) or a joiner writes anything: the
    private keys of the workers it starts (`check_own_keys`; `admitted`: a resumed run's manifest
    keys), and for an elastic run a file system that takes locks where the run is or will be
    (`elastic.check_commit_lock`)."""
    check_own_keys(cfg, placement.local if placement is not None else None, admitted)
    if cfg.run.membership == "elastic":  # its rounds are recorded under a lock
        from .elastic import check_commit_lock

        check_commit_lock(nearest_dir(Path(out) if out else Path("runs")))


def nearest_dir(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a run directory will be made)."""
    return next((d for d in (path, *path.parents) if d.is_dir()), Path("."))


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_run(cfg: Config, out: str | None) -> tuple[RunDir, CorpusTask]:
    """Load the corpus into the run's store, write the manifest; the run id is its hash. G_0 is
    written into the store one tensor at a time (from `[model] init`'s files, read a tensor at a
    time, or from the seed's model), so this holds at most the model, never its bytes beside it."""
    home = Path(out).parent if out else Path("runs")  # G_0 (and tokenized text) is staged beside the run directory
    if out and Path(out).exists() and not Path(out).is_dir():
        raise RunDirError(f"--out {out} is a file, not a run directory")
    made = make_dirs(home)
    run = None
    try:
        with prepare_corpus(cfg.data, cfg.model.vocab_size, cfg.model.ctx, scratch=home) as corpus, StagedBlob(home) as g0:
            if cfg.model.init:  # start from weights on disk: checked from their headers, read a tensor at a time
                initial = read_init(cfg.model, build_meta(cfg.model))
            else:
                initial = {k: p.detach() for k, p in build_model(cfg.model, cfg.run.seed).named_parameters()}
            init_hash = write_initial(g0, initial)  # G_0, kept in the store: workers and stages read it (a stage its slice)
            del initial
            manifest = {
                "config": cfg.to_dict(),
                "corpus_root": corpus.root,
                "model_init_hash": init_hash,
                "initial_params": g0.close(),
                "code_version": __version__,
                "tensor_hash": TENSOR_HASH,  # how every params, trace and aggregate hash of the run is computed
                "torch_version": torch.__version__,  # exact replays compare bits: one torch for the run (check_torch)
                "worker_keys": admitted_keys(cfg),
            }
            if cfg.model.arch != "gpt":  # its forward is transformers' code: replays reproduce under the same version
                manifest["transformers_version"] = transformers_version()
            if corpus.tokenizer_json is not None:  # what made the committed tokens (put into the store below)
                manifest["tokenizer"] = sha256_hex(corpus.tokenizer_json)
            if cfg.model.init:
                manifest["init"] = manifest["initial_params"]  # G_0 is weights from disk, not the seed's
            run_id = json_hash(manifest)
            run, fresh = (RunDir(out), None) if out else default_run_dir(home, run_id)
            fresh = run.claim() if fresh is None else fresh  # held until train returns (RunInUse: nothing made)
            made += [run.root] if fresh else []
            if run.rounds_path.exists() and run.rounds():
                raise RunDirError(f"{run.root} already holds a run; use --resume {run.root} or another --out")
            store = LocalStore(run.store_dir)
            store.put(canonical_json(manifest))  # named by its hash, the run id: a store says which runs it holds
            corpus.put_chunks(store.put)
            if corpus.tokenizer_json is not None:
                store.put(corpus.tokenizer_json)
            store.adopt(g0)
        manifest["corpus_manifest"] = store.put(corpus.manifest_bytes())
        manifest["run_id"] = run_id
        run.write_manifest(manifest)
    except BaseException:  # nothing half-written: a run directory this made goes, and the directories made for it
        if run is not None:
            run.release()
        if run is not None and run.root in made:
            shutil.rmtree(run.root, ignore_errors=True)
        remove_dirs(made)
        raise
    return run, CorpusTask(cfg, run.store_dir, manifest["corpus_manifest"], manifest["initial_params"])


def default_run_dir(home: Path, run_id: str) -> tuple[RunDir, bool]:
    """Where a run goes without --out: `home`/<run id's first 16 hex digits>, or, when a run of
    the same config is there already (the same run id), the first of -2, -3, ... holding none, so
    that `make run` twice trains twice. A stopped one there is named on stderr, to --resume. The
    directory returned is claimed (`RunDir.claim`; with whether this made it); one another launcher
    holds is passed over."""
    name = run_id[:16]
    for n in itertools.count(1):
        run = RunDir(home / (name if n == 1 else f"{name}-{n}"))
        if not run.has_records():
            try:
                made = run.claim()
            except RunInUse:  # the same config, started a moment ago: its records are not written yet
                continue
            if not run.has_records():
                return run, made
            run.release()
        try:
            summary = json.loads(run.summary_path.read_text())
        except (OSError, ValueError):
            summary = None
        if not (isinstance(summary, dict) and summary.get("complete") is True):
            print(f"veriloco: {run.root} holds this config's run, stopped before its end (continue it with "
                  f"`veriloco train --resume {run.root}`); this run goes to the next free directory", file=sys.stderr)
    raise AssertionError("unreachable")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: `terminated`) while a run's workers ran: `run_dir` is the run, to
    continue with --resume."""

    def __init__(self, run_dir: Path, terminated: bool = False) -> None:
        super().__init__(str(run_dir))
        self.run_dir, self.terminated = run_dir, terminated


def _spawned(
    rank: int, world: int, cfg: Config, task: Task, run_dir: str, start_round: int, port: int,
    quiet: bool, stop_after: int | None,
) -> None:
    # Ctrl-C reaches every process of the terminal's group: the launcher stops the workers, which
    # would otherwise each print a KeyboardInterrupt from wherever it happened to land
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    init_distributed(cfg, rank, world, f"tcp://127.0.0.1:{port}")
    try:
        summary = train_worker(cfg, rank, world, task, run_dir, start_round, quiet, stop_after)
        if summary is not None:
            _finish(RunDir(run_dir), cfg, summary)
    finally:
        dist.destroy_process_group()


def _finish(run: RunDir, cfg: Config, summary: dict) -> None:
    """The recorder's last act: signed checkpoint manifest (complete runs), then the summary."""
    from .round import worker_key
    from .signing import write_signed_manifest

    manifest = run.read_manifest()
    if summary.get("complete") and summary.get("final_checkpoint") and "run_id" in manifest:
        write_signed_manifest(run, manifest["run_id"], summary["final_checkpoint"], summary["rounds"] - 1,
                              worker_key(cfg, 0))
        publish_run(run, manifest["run_id"])
    run.write_summary(summary)


def publish_run(run: RunDir, run_id: str) -> None:
    """Make the run's store self-sufficient for `veriloco audit --ledger L --store URL`: the
    files the signed checkpoint manifest lists (manifest.json, rounds.jsonl) become blobs under
    their digests, the EVM ledger's entry bodies join them, and the signed manifest itself is
    the ref `runs/<run id>.sig.json`. Copy RUN/store anywhere (s3://, gs://...) to publish."""
    from .signing import FILE

    store = LocalStore(run.store_dir)
    store.put(run.manifest_path.read_bytes())
    store.put(run.rounds_path.read_bytes())
    bodies = run.root / "ledger-bodies"  # where round.py's EVM ledger mirrors entry bodies
    if bodies.is_dir():
        mirror = LocalStore(bodies)
        for digest in mirror.digests():
            store.put(mirror.get(digest))
    store.put_ref(run_ref(run_id), (run.root / FILE).read_bytes())


def launch(
    cfg: Config, task: Task, run: RunDir, start_round: int = 0, quiet: bool = False,
    stop_after: int | None = None, faults: list[str] | None = None, placement=None,
) -> dict:
    """Run workers (each `stages` processes) as local processes; returns the summary.
    `placement` (elastic only, elastic.Placement): the coordinator's address and which workers
    start here (the others join from other machines)."""
    try:  # Ctrl-C or SIGTERM (procs.Terminated): the workers are ended, and the run named to resume
        if cfg.run.membership == "elastic":
            from .elastic import launch_elastic

            return launch_elastic(cfg, task, run, faults or [], quiet, stop_after, placement)
        if faults:
            raise ConfigError("fault injection (--fault) needs run.membership = 'elastic'")
        check_placement(cfg, placement)
        world = cfg.topology.workers * cfg.topology.stages * cfg.topology.replicas
        start_workers(_spawned, (world, cfg, task, str(run.root), start_round, free_port(), quiet, stop_after), world)
    except KeyboardInterrupt as e:
        raise Interrupted(run.root, isinstance(e, Terminated)) from None
    return json.loads(run.summary_path.read_text())


def train(
    cfg: Config, out: str | None = None, quiet: bool = False, stop_after: int | None = None,
    faults: list[str] | None = None, placement=None,
) -> tuple[RunDir, dict]:
    """Train the built-in GPT task with `cfg`; returns the run directory and the summary.
    `faults`: declarative fault specs (faults.py), elastic membership only; `placement`: see launch."""
    check_stop_after(stop_after)
    check_placement(cfg, placement)
    check_device(cfg)
    check_chain(cfg)
    if faults:  # a bad spec fails before anything is written
        from .faults import parse_faults

        if cfg.run.membership != "elastic":
            raise ConfigError("fault injection (--fault) needs run.membership = 'elastic'")
        parse_faults(faults, cfg.topology.workers)
    check_launch(cfg, placement, out)
    warm()  # the workers' server imports while the corpus and G_0 are prepared here
    run, task = prepare_run(cfg, out)
    try:
        start_warnings(cfg, run, 0)
        return run, launch(cfg, task.as_task(), run, 0, quiet, stop_after, faults, placement)
    finally:
        run.release()


def start_warnings(cfg: Config, run: RunDir, done: int) -> None:
    """A line on stderr when the run's rounds from `done` on will not fit on its disk as it is now
    (`plan.disk_warning`), and one when its replays leave its packets unchecked
    (`plan.unchecked_packets`: error feedback); the run goes on (a DDP baseline writes no
    checkpoints and replays nothing: nothing said)."""
    if cfg.train.mode != "diloco":
        return
    from .plan import disk_warning, unchecked_packets

    disk, unchecked = disk_warning(cfg, run.root, done), unchecked_packets(cfg)
    for warning in (disk, unchecked and f"warning: {unchecked}"):
        if warning:
            print(warning, file=sys.stderr, flush=True)


def train_task(task: Task, cfg: Config, out: str, quiet: bool = False, stop_after: int | None = None,
               host: str | None = None, workers: list[int] | None = None) -> dict:
    """Train a user's Task (own model and data) through the same round engine; returns the
    summary. A run stopped (`stop_after` rounds) or killed goes on with `resume_task`. Elastic
    runs across machines (`[run] membership = "elastic"`): `host`, the address this machine's
    coordinator listens on, and `workers`, the ones started here, as `veriloco train --host
    --workers`; the others join from machines that share `out`, with `join_task`."""
    from .round import check_splittable

    placement = placement_of(host, workers)
    check_stop_after(stop_after)
    check_placement(cfg, placement)
    check_splittable(task, cfg.topology.stages)
    check_device(cfg)
    check_launch(cfg, placement, out)
    warm()
    run = RunDir(out)
    run.claim()
    try:
        write_task_manifest(run, task, cfg)
        start_warnings(cfg, run, 0)
        return launch(cfg, task, run, 0, quiet, stop_after, None, placement)
    finally:
        run.release()


def write_task_manifest(run: RunDir, task: Task, cfg: Config) -> None:
    """A user's Task's run manifest (its config, code and torch versions, admitted keys and the
    task's name; no corpus: the batches are the task's), into a directory that holds no run."""
    if run.has_records():  # its rounds would be appended to another run's (and its manifest replaced)
        raise RunDirError(f"{run.root} already holds a run; train into another directory")
    manifest = {"config": cfg.to_dict(), "code_version": __version__, "tensor_hash": TENSOR_HASH, "torch_version": torch.__version__,
                "worker_keys": admitted_keys(cfg), "task": getattr(task.make_model, "__qualname__", repr(task.make_model))}
    manifest["run_id"] = json_hash(manifest)
    run.write_manifest(manifest)


def torchrun_task(task: Task, cfg: Config, out: str, quiet: bool = False) -> dict | None:
    """Train a user's Task under torchrun, static membership: call it from the script torchrun
    starts in every process (`torchrun --nnodes=N --nproc-per-node=P ... script.py`), each machine
    with a run directory `out` of its own, as `python -m veriloco.run` does for the built-in task.
    The workers are torchrun's processes divided by `stages x replicas`. Returns the summary in
    the recorder's process (rank 0), None in the others."""
    from .round import check_splittable

    if cfg.run.membership == "elastic":
        raise ConfigError("run.membership = 'elastic' starts its workers with train_task(..., host=, workers=) and "
                          "join_task on other machines, not torchrun")
    rank, world, cfg = _torchrun_world(cfg)
    check_splittable(task, cfg.topology.stages)
    check_device(cfg)

    def prepare() -> RunDir:
        run = RunDir(out)
        run.claim()
        try:
            write_task_manifest(run, task, cfg)
        except BaseException:
            run.release()
            raise
        start_warnings(cfg, run, 0)
        return run

    run = _torchrun_start(cfg, rank, world, out, prepare)
    try:
        summary = train_worker(cfg, rank, world, task, str(run.root), 0, quiet)
        if summary is not None:
            _finish(run, cfg, summary)
        return summary
    finally:
        dist.destroy_process_group()
        run.release()


def _torchrun_world(cfg: Config) -> tuple[int, int, Config]:
    """(rank, world size, `cfg` with topology.workers = torchrun's processes / (stages x replicas))."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_worker = cfg.topology.stages * cfg.topology.replicas
    if world % per_worker:
        raise ConfigError(f"torchrun started {world} processes, not a multiple of topology.stages x topology.replicas "
                          f"({per_worker})")
    topology = {**cfg.to_dict()["topology"], "workers": world // per_worker}
    return rank, world, config_from_dict({**cfg.to_dict(), "topology": topology})


def _torchrun_start(cfg: Config, rank: int, world: int, out: str, prepare: Callable[[], RunDir]) -> RunDir:
    """Join torchrun's world once every machine's processes agree that all can start: the private
    keys of this machine's workers are here, and `prepare()` (by each machine's local rank 0) made
    its run directory. A machine refused alone left the others to fail naming nothing, their run
    directories written (its keys: a timeout in init_process_group after run.timeout_s; its
    corpus: "Connection closed by peer" in a barrier). Now every process stops at once, the refused
    ones with their own error, the others naming the lowest refused rank, and what this machine
    prepared is removed. Returns this machine's run directory."""
    from .cli import user_errors

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    first, per_worker = rank - local_rank, cfg.topology.stages * cfg.topology.replicas
    here = sorted({r // per_worker for r in range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1")))})
    refused, run = None, None
    before = nearest_dir(Path(out))  # what a refusal elsewhere leaves: what this machine made for its run goes
    entries = set(os.listdir(before)) if before == Path(out) else set()  # --out made beforehand: what it held
    try:
        check_own_keys(cfg, here)
        if local_rank == 0:
            run = prepare()
    except user_errors() as e:
        refused = e
    init_distributed(cfg, rank, world, "env://")
    lowest = torch.tensor([rank if refused is not None else world], dtype=torch.int64)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)  # (every rank is here after its machine's prepare: a barrier)
    if int(lowest) < world:
        dist.destroy_process_group()
        if run is not None:  # prepared here, refused elsewhere: nothing is left of it
            run.release()
            if run.root == before:
                for name in set(os.listdir(run.root)) - entries:
                    if (run.root / name).is_dir():
                        shutil.rmtree(run.root / name, ignore_errors=True)
                    else:
                        (run.root / name).unlink(missing_ok=True)
            else:
                shutil.rmtree(run.root, ignore_errors=True)
                remove_dirs([d for d in run.root.parents if before in d.parents])
        raise refused or RunDirError(f"rank {int(lowest)} (on its machine) refused to start, and said why there: "
                                     "nothing was written")
    return run or RunDir(out)


def join_task(task: Task, run_dir: str, workers: list[int], quiet: bool = False) -> dict[int, int]:
    """Start these workers of an elastic `train_task` run whose launcher runs on another machine
    sharing `run_dir` (`veriloco join`, for a user's Task: the workers run `task`, which the run
    directory does not hold). Returns each worker's last exit code."""
    from .elastic import join_elastic

    return join_elastic(run_dir, list(workers), quiet, task)


def resume_task(task: Task, run_dir: str, quiet: bool = False, stop_after: int | None = None,
                host: str | None = None, workers: list[int] | None = None) -> dict:
    """Continue a `train_task` run from its last complete round, with the same `task` (user code,
    which the run directory does not hold); returns the summary. On the CPU the resumed run ends
    where the uninterrupted one does, as `veriloco train --resume` does for the built-in tasks.
    `host`, `workers`: an elastic run's placement, as for `train_task`."""
    return resume(run_dir, quiet, stop_after, placement_of(host, workers), task)[1]


def placement_of(host: str | None, workers: list[int] | None) -> Placement | None:
    """An elastic run's placement (elastic.Placement) from `host` (the coordinator's address; an
    IPv6 one may come in brackets) and the workers started here; None when neither is given."""
    if host is None and workers is None:
        return None
    from .elastic import Placement

    if host and host.startswith("[") and host.endswith("]"):  # an IPv6 address as URLs write it
        host = host[1:-1]
    return Placement(host or "127.0.0.1", None if workers is None else tuple(workers))


def resume(run_dir: str, quiet: bool = False, stop_after: int | None = None, placement=None,
           task: Task | None = None) -> tuple[RunDir, dict]:
    """Continue a run from its last complete round (a torn last line is dropped). `task`: the
    user's Task of a `train_task` run (`resume_task`); the built-in tasks rebuild theirs."""
    check_stop_after(stop_after)
    run = RunDir(run_dir)
    manifest = run.read_own_manifest()
    users = users_task(manifest)  # train_task's: its model and data are user code
    if users is not None and task is None:
        raise RunDirError(f"{run.root} trained a user's Task ({users}): continue it with "
                          "veriloco.resume_task(task, RUN) and that Task")
    if task is not None and users is None:
        raise RunDirError(f"{run.root} trained a built-in task: continue it without a Task (veriloco train --resume)")
    cfg = config_from_dict(manifest["config"])
    if task is not None:
        from .round import check_splittable

        check_splittable(task, cfg.topology.stages)
    check_placement(cfg, placement)
    check_device(cfg)
    check_chain(cfg)
    check_launch(cfg, placement, run.root, manifest["worker_keys"])
    other = check_torch(manifest, cfg, "resume it")
    if other is not None:
        print(f"veriloco: warning: {other}; the run has no exact replays to compare, so it goes on", file=sys.stderr)
    run.claim()  # a second resume of this run (or the run itself, still going) is refused, not raced
    try:
        return _resume(run, manifest, cfg, quiet, stop_after, placement, task)
    finally:
        run.release()


def _resume(run: RunDir, manifest: dict, cfg: Config, quiet: bool, stop_after: int | None, placement,
            task: Task | None) -> tuple[RunDir, dict]:
    warm()
    records = run.rounds()
    done = len(records)
    if done >= cfg.train.rounds:  # (a metrics line the kill lost rebuilt first: rebuild_metrics)
        run.rebuild_metrics(records, done, elastic=cfg.run.membership == "elastic")
        return run, _sign_recorded(run, cfg, records)
    if done:
        check_carried(records[-1], cfg.topology.workers, f"{run.rounds_path} round {done - 1}")
    processes = cfg.topology.workers * cfg.topology.stages if cfg.run.membership == "static" and done else 0
    for rank in range(processes):  # private state is per process (elastic workers heal instead)
        state = run.worker_dir(rank) / f"state-{done - 1}.safetensors"
        if not state.exists():
            raise RunDirError(f"process {rank} has no saved state for round {done - 1} in {run.root}")
        try:
            state_history(state, cfg.topology.workers, done, manifest["run_id"], rank)
        except ValueError as e:
            raise RunDirError(str(e)) from None
    if done and cfg.ledger.backend == "sqlite":
        check_ledger(run, records)
    run.truncate_to(done, elastic=cfg.run.membership == "elastic")
    store = LocalStore(run.store_dir)
    prune_checkpoints(store, records, cfg.run.keep_checkpoints)  # what a crash between a record and its pruning left
    for rec in records[-1 - cfg.outer.delay:] if done else []:  # what the workers restore from
        for digest in sorted(checkpoint_blobs(rec)):
            if not store.has(digest):
                raise RunDirError(f"round {rec['round']}'s checkpoint {digest[:16]} is missing from {run.store_dir} "
                                  f"(a resume reads the newest {1 + cfg.outer.delay} rounds' checkpoints)")
    start_warnings(cfg, run, done)
    if task is None:
        task = CorpusTask(cfg, run.store_dir, manifest["corpus_manifest"], initial_digest(manifest)).as_task()
    return run, launch(cfg, task, run, done, quiet, stop_after, None, placement)


def _sign_recorded(run: RunDir, cfg: Config, records: list[dict]) -> dict:
    """The summary of a run whose every round is recorded: RunDirError when it is finished already
    (signed, and its summary says complete); else its launcher stopped after the last record and
    before or during its last act (`_finish`: sign, publish, summary), which this does now, so that
    `veriloco audit` finds the signed checkpoint manifest, and the published run, a complete run has."""
    from .elastic import summarize
    from .round import open_ledger
    from .signing import FILE

    try:
        finished = json.loads(run.summary_path.read_text()).get("complete") is True
    except (OSError, ValueError, AttributeError):
        finished = False
    if finished and (run.root / FILE).is_file():  # else its last act stopped part way (signed, not published): redone
        raise RunDirError(f"{run.root} is already complete ({len(records)}/{cfg.train.rounds} rounds)")
    if cfg.ledger.backend == "sqlite":
        check_ledger(run, records)
    summary = summarize(cfg, records, records[0].get("eval_loss_start"), sum(p["round_s"] for p in records))
    summary |= {"membership": cfg.run.membership, "stages": cfg.topology.stages}
    if cfg.ledger.backend != "none":
        with open_ledger(cfg, run) as ledger:
            summary["ledger_root"], summary["ledger_head"] = ledger.root(), ledger.head_hash()
    _finish(run, cfg, summary)
    return summary


def check_torch(manifest: dict, cfg: Config, what: str) -> str | None:
    """None when this process runs the torch the run's manifest names (or it names none: runs
    before the thirty-fifth session), else a line saying which each is. RunDirError when the run
    replays exactly (`[verify] replay_match = "exact"` with replays drawn): a replay compares the
    bits of a worker's trace, which another torch's kernels need not reproduce, so a worker under
    another torch would fail honest replays (and be banned) or have its own fail."""
    trained = manifest.get("torch_version")
    if trained is None or trained == torch.__version__:
        return None
    line = f"the run trained under torch {trained}, this machine has torch {torch.__version__}"
    if cfg.verify.replay_probability > 0 and cfg.verify.replay_match == "exact":
        raise RunDirError(f"{line}: its replays compare bits, which another torch need not reproduce; {what} "
                          f"under torch {trained}")
    return line


def check_ledger(run: RunDir, records: list[dict]) -> None:
    """RunDirError unless the run's SQLite ledger holds the entries of its recorded rounds, the last
    one the entry its record names (one more is a crash between an append and its record): a
    resume appends to it, and its workers found a missing or broken one only once started."""
    import sqlite3

    from .ledger import SqliteLedger
    from .ledger.entry import LedgerError, parse_entry

    path, done = run.root / "ledger.sqlite", len(records)
    if not path.is_file():
        raise RunDirError(f"{path} is missing: a resume appends to the ledger of the run's {done} recorded rounds")
    try:
        with SqliteLedger(path) as ledger:
            held = ledger.size()
            last = ledger.entry_hash(done - 1) if held >= done else None
            # what a resume starts from (the newest two rounds, with delay 1) is the ledger's
            newest = {r: parse_entry(ledger.entry_bytes(r)) for r in range(max(0, done - 2), min(done, held))}
    except LedgerError as e:  # names the file
        raise RunDirError(str(e).splitlines()[0]) from None
    except sqlite3.Error as e:
        raise RunDirError(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if held < done:
        raise RunDirError(f"{path} holds {held} entries for the run's {done} recorded rounds")
    if records[-1].get("entry") not in (None, last):
        raise RunDirError(f"{path}: entry {done - 1} is not the one round {done - 1}'s record names")
    for r, entry in newest.items():
        claimed = (entry["subject"][0]["digest"]["sha256"], entry["predicate"].get("params_hash"))
        if (records[r].get("checkpoint"), records[r].get("params_hash") if claimed[1] else None) != claimed:
            raise RunDirError(f"{run.rounds_path}: round {r}'s checkpoint or params hash is not its ledger entry's")


def check_chain(cfg: Config) -> None:
    """`[ledger] backend = "evm"`: ConfigError, before anything is written or started, unless the
    recorder's key file is good, the RPC answers and a contract is at the address (the workers
    found these once started: exit 1, the run directory left behind)."""
    if cfg.ledger.backend != "evm":
        return
    from .ledger.entry import LedgerError
    from .ledger.evm import open_contract

    try:
        open_contract(cfg.ledger.rpc_url, cfg.ledger.contract, cfg.ledger.key_file, timeout_s=min(cfg.run.timeout_s, 30))
    except LedgerError as e:
        raise ConfigError(f"[ledger]: {str(e).splitlines()[0]}") from None


def check_device(cfg: Config) -> None:
    """`[run] device = 'cuda'` on a machine whose torch sees no GPU: one line, before anything is
    written or started (the workers would each fail alike)."""
    from .task import process_device

    try:
        process_device(cfg, 0)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_placement(cfg: Config, placement) -> None:
    """ConfigError for a placement (elastic.Placement) the run cannot use, before anything is written."""
    if placement is None:
        return
    if cfg.run.membership != "elastic":
        raise ConfigError("--host and --workers need run.membership = 'elastic' (a static run spans machines "
                          "with torchrun)")
    W = cfg.topology.workers
    if placement.local is not None and any(not 0 <= j < W for j in placement.local):
        raise ConfigError(f"--workers must name workers of 0..{W - 1}, got {list(placement.local)}")
    try:  # the coordinator listens there: an address of this machine (it failed only once the run was made)
        family = socket.AF_INET6 if ":" in placement.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((placement.host, 0))
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"--host {placement.host}: not an address of this machine, or a name of one, to "
                          f"listen on ({getattr(e, 'strerror', None) or e})") from None


def check_stop_after(stop_after: int | None) -> None:
    """ConfigError unless `stop_after` (rounds to run before stopping) is None or >= 1."""
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ConfigError(f"--stop-after must be a number of rounds >= 1, got {stop_after}")


def check_carried(rec: dict, workers: int, where: str) -> None:
    """RunDirError unless what a resumed run carries on from its last record is well formed: the
    workers banned so far (a list of worker ids) and the pairs whose states now go in public
    (`disputes`: [auditor, worker] pairs of two different workers)."""
    def worker_id(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < workers

    banned, disputes = rec.get("banned", []), rec.get("disputes", [])
    if not isinstance(banned, list) or not all(worker_id(j) for j in banned):
        raise RunDirError(f"{where}: 'banned' must be a list of worker ids below {workers}, got {str(banned)[:80]}")
    if not isinstance(disputes, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(worker_id(j) for j in p) and p[0] != p[1] for p in disputes):
        raise RunDirError(f"{where}: 'disputes' must be a list of [auditor, worker] pairs of worker ids below "
                          f"{workers}, got {str(disputes)[:80]}")


def torchrun_main(argv: list[str]) -> None:
    """Entry point under torchrun: `python -m veriloco.run CONFIG.toml --out DIR [--k.v=x ...]`."""
    args = [a for a in argv if a.startswith("--") and "=" in a and not a.startswith("--out=")]
    rest = [a for a in argv if a not in args]
    out = None
    if "--out" in rest:
        i = rest.index("--out")
        out = rest[i + 1]
        rest = rest[:i] + rest[i + 2 :]
    cfg = load_config(rest[0] if rest else None, args)
    if cfg.run.membership == "elastic":  # its quorums and restarts need veriloco's own launcher
        raise ConfigError("run.membership = 'elastic' starts its workers with `veriloco train` (and `veriloco join` "
                          "on other machines), not torchrun")
    if out is None:  # (a machine's other processes read their run directory's path from here: the default's
        # runs/<run id> is known to the first only once it has prepared the run)
        raise ConfigError("under torchrun, give --out DIR: the run directory every process of this machine shares")
    rank, world, cfg = _torchrun_world(cfg)
    prepared: list[CorpusTask] = []

    def prepare() -> RunDir:
        run, task = prepare_run(cfg, out)
        prepared.append(task)
        start_warnings(cfg, run, 0)
        return run

    run = _torchrun_start(cfg, rank, world, out, prepare)
    if prepared:
        task = prepared[0]
    else:  # another process of this machine prepared it
        manifest = run.read_manifest()
        task = CorpusTask(cfg, run.store_dir, manifest["corpus_manifest"], initial_digest(manifest))
    try:
        summary = train_worker(cfg, rank, world, task.as_task(), str(run.root), 0)
        if summary is not None:
            _finish(run, cfg, summary)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
        run.release()  # held by each machine's local rank 0 since prepare_run


if __name__ == "__main__":
    try:
        torchrun_main(sys.argv[1:])
    except Exception as e:
        from .cli import user_errors

        if not isinstance(e, user_errors()):
            raise
        # bad input: one line and exit 2, as the CLI says it
        print(f"veriloco: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        sys.exit(2)
