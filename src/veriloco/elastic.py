"""The round loop under elastic membership: quorum, commit or retry, heal.

`[run] membership = "elastic"` (membership.py). One process per worker (which starts its
`[topology] replicas`, if any, itself: WorkerReplicas), no fixed world. Round r on
worker w:

    1-2. inner steps and encode, as in round.py (run_inner_and_send); the bundle is held
    3.   join the quorum for round r (torchft's Lighthouse): it forms once at least min_workers
         joined and every live worker joined or the round deadline passed
         - the quorum's round is higher than r: w is behind (late, or back from the dead):
           heal from the last committed round and drop this round's work
         - too few members are at round r: ask again (nothing is committed without a quorum)
    4-6. exchange, checks, aggregate, outer step, eval over a gloo group of the active members
         (round.finish_round with their Participants); workers outside it are recorded as late
         (alive: still heartbeating) or absent
    commit: the first member to finish appends the ledger entry and the round record under a file
         lock; the others check the record names the params they computed
    any failure in 3-6 (a member died mid-round): the outer step is undone and the round retried
         with a new quorum from the same packets: nothing is half-applied

With `[outer] delay = 1`, step 3 and the exchange of round r run in a thread (`_Flight`) while
round r+1's inner steps run; steps 4-6 and the commit of round r follow those steps (`settle`).

Healing (a worker that rejoins, or joins for the first time): load the checkpoint its next
round starts from (the last recorded round's; with delay 1 the one before) from the store,
check it against the record's params hash, set the inner step counter to where the schedule is,
drop its error feedback, and take the round's decoded packets (the newest deltas the next
start points and replays use) and the screen's previous round from the record and the store.
A worker joins round r's quorum only once round r-1 is recorded, and stops heartbeating while
it heals toward a round the others are not forming yet, so that nobody waits for it; healed,
it names the round it heads for (Membership.heading), whose quorums wait for it.

The launcher (`launch_elastic`) starts the coordinator and one process per worker (in network
namespaces when a partition fault asks for it), applies the faults, restarts dead workers as
`[run] max_restarts` allows, and writes RUN/events.jsonl. Across machines it starts some of the
workers, and `join_elastic` (`veriloco join`) the others, from RUN/coordinator.json in the
shared run directory.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

from safetensors.torch import load as st_load

from .compress import ErrorFeedback
from .config import Config, ConfigError
from .exchange import Exchange, ExchangeError
from .faults import Fault, Injector, first_death
from .hashing import tensors_hash
from .link import Link
from .membership import Membership, MembershipError, PgComm, QuorumView
from .outer import OuterOptimizer
from .packet import PacketError, decode_bundle, decode_packet
from .procs import sigterm_as_interrupt
from .records import RoundsFollower, RunDir, metrics_of, prune_checkpoints, pruned
from .round import (
    Participants,
    RowTampered,
    Sent,
    StepSchedule,
    Worker,
    append_entry,
    carried,
    finish_round,
    keep_seen,
    load_seen,
    mark_out,
    open_ledger,
    progress_line,
    run_inner_and_send,
    setup_worker,
)
from .store import StoreError, atomic_write
from .task import Task, on_device
from .verify import ABSENT, LATE
from .verify.commitment import CommitmentError, parse_signed_commitment


@dataclass
class Held:
    """An exchange that has not started: the bundle (and the salt to reveal after it) waits for
    the round's quorum."""

    bundle: bytes
    reveal: bytes | None = None


class HoldingExchange:
    """Stands in for round.py's Exchange until the quorum is known (start/wait seam)."""

    holds = True  # the bundle goes out later (round.mark_out notes when)

    def start(self, bundle: bytes, reveal: bytes | None = None, on_packets=None) -> Held:
        return Held(bundle, reveal)


def train_worker_elastic(
    cfg: Config, worker: int, task: Task, run_dir: str, lighthouse_addr: str, store_port: int,
    faults: list[Fault], first: list[int], quiet: bool = False, eval_start: float | None = None,
    store_host: str = "127.0.0.1", stop_after: int | None = None, replicas: WorkerReplicas | None = None,
) -> None:
    """The whole run of one worker process under elastic membership (see the module docstring).

    `first`: the workers the launcher starts together at round 0 (they wait for each other once);
    `eval_start`: the initial model's eval loss (the launcher's); `store_host`: the coordinator's;
    `stop_after`: stop once that many rounds are committed (a preemption point; a resumed run's
    workers heal from the last record, as a restarted worker does); `replicas`: the worker's
    other processes, started (`[topology] replicas`)."""
    if (replicas is None) != (cfg.topology.replicas == 1):
        raise ValueError(f"worker {worker}: topology.replicas = {cfg.topology.replicas} needs its WorkerReplicas started")
    end = cfg.train.rounds if stop_after is None else min(stop_after, cfg.train.rounds)
    injector = Injector(faults, worker)
    members = Membership(worker, lighthouse_addr, store_port, cfg.run.timeout_s, cfg.run.heartbeat_timeout_s,
                         host=store_host, round_deadline_s=cfg.run.round_deadline, workers=cfg.topology.workers,
                         clock=injector.clock())
    w = setup_worker(cfg, worker, cfg.topology.workers, task, run_dir, 0, elastic=True,
                     process_rank=worker * cfg.topology.replicas)
    w.exchange = HoldingExchange()
    w.defer_entry = True  # commit() appends the ledger entry, once, under the commit lock
    base_task_batch = w.task.batch

    def batch(j: int, r: int, step: int):  # where a declarative "dies at round r, step s" fires
        if j == worker:
            injector.at_step(r, step)
        return base_task_batch(j, r, step)

    w.task = _with_batch(w.task, batch)
    done = len(w.run.rounds())
    members.announce(first, wait=done == 0 and worker in first)
    ctx = _Ctx(w, members, injector, eval_start, quiet, cfg.run.min_workers or cfg.topology.workers // 2 + 1,
               _paced(cfg, w.encoder.link))
    r = heal(w, done) if done else 0
    if done:
        members.heading(r)
    pending: _Flight | None = None  # delay 1: the round whose exchange runs under the next one's inner steps
    while r < end or pending is not None:
        sent, behind = None, None
        if r < end:
            catch_up(w, r - 1 - cfg.outer.delay)  # after a heal (delay 1), the round the others just committed
            follow_schedule(w, r)
            if cfg.outer.overlap_steps:  # the previous round lands inside this one, after overlap_steps
                try:
                    sent = run_inner_and_send(w, r, _lander(ctx, r, pending))
                except _Behind as e:  # it was committed without this worker's packet
                    behind = e.view
                    if w.inner.keep is not None:  # the states kept for this round's replays
                        w.inner.keep.release()
                        w.inner.keep = None
                pending = None  # settled inside the round, or dropped
            else:
                sent = run_inner_and_send(w, r)
            if injector.late_s(r) and cfg.outer.delay == 0:  # a late packet (delay 1: in _Flight)
                time.sleep(injector.late_s(r))
        if behind is None and cfg.outer.delay == 0:
            behind = settle(ctx, _Flight(sent, sent.handle))
        elif behind is None and pending is not None:  # finish the previous round (overlap_steps: the last)
            behind = settle(ctx, pending, time.perf_counter() - sent.started if sent is not None else 0.0)
            pending = None
        if behind is not None:  # the others committed without this worker's packet: drop its work, heal
            target = behind.round + 1 + cfg.outer.delay if len(behind.active) >= ctx.min_active else behind.round
            _say(quiet, f"worker {worker}: a round was committed without it (quorum at round {behind.round}); "
                 f"healing to round {target}")
            if target > behind.round + 1:  # delay 1: round behind.round+1 forms without it; do not
                members.pause()  # make the others wait for it (quorum() resumes the heartbeats)
            r, pending = heal_toward(w, members, target, quiet), None
            members.heading(r)  # the others' quorums of round r wait for it again
            continue
        if cfg.outer.delay and sent is not None:
            pending = _Flight(sent, sent.handle)
            pending.start(ctx)  # the quorum and the exchange, in the background
        r += 1
    if replicas is not None:
        w.replicas.end()
        replicas.join()
    members.close()


class WorkerReplicas:
    """`[topology] replicas` under elastic membership: the worker's process (replica 0) starts its
    other replicas as its own children, and the R processes make their default torch.distributed
    group over a TCPStore it hosts on loopback (a worker's replicas share a machine; the worker
    joins the run's quorums alone). They then run what a fixed world's replicas run
    (round.replica_steps, driven by round.ReplicaSync). Their lives are the worker's: a replica
    whose worker died (killed, crashed) exits at once (`_replica_main`'s watch), and a worker
    whose replica died fails at its next step with it, so the launcher sees one death and, under
    `[run] max_restarts`, starts the worker again with fresh replicas (a healed worker sends them
    the inner state it loaded: `heal`)."""

    def __init__(self, cfg: Config, task: Task, worker: int, run_dir: str) -> None:
        import torch.distributed as dist

        from .procs import context

        R, timeout = cfg.topology.replicas, timedelta(seconds=cfg.run.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, world_size=R, is_master=True, wait_for_workers=False, timeout=timeout)
        ctx = context()
        # the replicas' watch on this process: the write end stays here alone, so its death is their EOF
        alive, self._alive = ctx.Pipe(duplex=False)
        self.procs = [ctx.Process(target=_replica_main, args=(cfg, task, worker, i, store.port, run_dir, alive),
                                  daemon=True) for i in range(1, R)]
        for p in self.procs:
            p.start()
        alive.close()
        _join_replicas(cfg, store, 0)
        self.store = store  # hosted here: kept alive with the group

    def lost(self) -> str | None:
        """Which replica has exited, if one has (after a failure of the worker's: the cause of a
        collective that lost it)."""
        for i, p in enumerate(self.procs, start=1):
            p.join(timeout=1.0)  # its exit code arrives as its process is reaped
            if p.exitcode is not None:
                return f"its replica {i} exited (code {p.exitcode})"
        return None

    def join(self) -> None:
        """After the replicas were told to stop (`ReplicaSync.end`): wait for them to exit."""
        for p in self.procs:
            p.join(timeout=30)


def _join_replicas(cfg: Config, store, index: int) -> None:
    """This process's default torch.distributed group: its worker's replicas (WorkerReplicas), over
    the worker's store, as replica `index`."""
    import torch.distributed as dist

    from .round import process_backend

    dist.init_process_group(process_backend(cfg, cfg.topology.replicas), store=dist.PrefixStore("replicas", store),
                            rank=index, world_size=cfg.topology.replicas,
                            timeout=timedelta(seconds=cfg.run.timeout_s))


def _replica_main(cfg: Config, task: Task, worker: int, index: int, port: int, run_dir: str, alive) -> None:
    """Replica `index` of elastic worker `worker` (WorkerReplicas): its steps until the worker says
    stop, or until the worker is gone (`alive`, the read end of a pipe only the worker writes to,
    ends: killed, or crashed)."""
    import sys

    import torch.distributed as dist

    from .round import replica_steps

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([alive])  # nothing is ever sent (nor read: no unpickling): ready only when the worker's end closes
        os._exit(1)  # the worker died: nothing of this replica outlives it

    threading.Thread(target=watch, daemon=True).start()
    R, timeout = cfg.topology.replicas, timedelta(seconds=cfg.run.timeout_s)
    try:
        _join_replicas(cfg, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout), index)
        replica_steps(cfg, task, worker * R + index, worker, 0, dist.group.WORLD)
    except Exception:  # its worker fails with it; the error is named in the run directory
        # (unless the worker is gone: then its death is the story, not this). A killed worker's
        # sockets may close before its end of the pipe does, and a collective fail here first:
        # wait a moment for the pipe, which a live worker never closes (seen once in a fresh
        # clone's `make test` on 2 processes: the replica's "Connection closed" named a kill -9)
        if not alive.poll(1.0):
            import traceback

            (Path(run_dir) / f"error-{worker}-replica-{index}.txt").write_text(traceback.format_exc())
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as a forkserver child does: no teardown that would wait on the group


class _Behind(Exception):
    """Raised out of a round's inner steps when the round landing inside it (`[outer] overlap_steps`)
    was committed without this worker: its work is dropped and it heals."""

    def __init__(self, view: QuorumView) -> None:
        super().__init__(f"behind: quorum at round {view.round}")
        self.view = view


def _lander(ctx: _Ctx, r: int, pending: _Flight | None) -> Callable[[float], None]:
    """`[outer] overlap_steps`: what happens before inner step tau of round r. Round r-1 (pending)
    is settled and committed, as in the static loop; a worker that has no round in flight (round 0,
    or it healed into round r, starting from round r-2's params) takes round r-1's params from its
    record, as the others commit it. Either way round r's delta is then taken from G after r-1."""

    def land(overlapped_s: float) -> None:
        if pending is not None:
            behind = settle(ctx, pending, overlapped_s)
            if behind is not None:
                raise _Behind(behind)
        else:
            catch_up(ctx.w, r - 1)

    return land


@dataclass
class _Ctx:
    """What settling a round needs besides the round."""

    w: Worker
    members: Membership
    injector: Injector
    eval_start: float | None
    quiet: bool
    min_active: int
    pace: Link | None  # what the exchange paces in software (_paced)

    def seen(self, members: list[int], r: int) -> Callable:
        """The exchange's on_packets for a try of round r among `members`: round.keep_seen, the
        round's first-try members asked of the coordinator (Membership.first_try)."""
        return partial(keep_seen, self.w, members=members, round=r, first_try=partial(self.members.first_try, r))


class _Flight:
    """A round's bundle on its way: with delay 1, the quorum and the exchange run in a thread
    (started after the round's inner steps, joined after the next round's)."""

    def __init__(self, sent: Sent, held: Held) -> None:
        self.sent, self.bundle, self.reveal = sent, held.bundle, held.reveal
        self._thread: threading.Thread | None = None
        self.first: tuple | None = None  # (view, comm, handle, error) of the background try

    def start(self, ctx: _Ctx) -> None:
        def run() -> None:
            view = comm = handle = None
            try:
                time.sleep(ctx.injector.late_s(self.sent.round))  # a packet late on the wire
                _await_record(ctx.w, self.sent.round - 1)
                view = ctx.members.quorum(self.sent.round)
                if view.round == self.sent.round and len(view.active) >= ctx.min_active:
                    view, comm = _group(ctx, view)
                    ctx.injector.in_exchange(self.sent.round)
                    mark_out(ctx.w, self.sent.round, self.sent.bundle_hash)
                    handle = Exchange(None, ctx.w.cfg.run.max_packet_bytes, link=ctx.pace, comm=comm,
                                      on_packets=ctx.seen(view.active, self.sent.round)).start(
                        self.bundle, reveal=self.reveal)
                    handle.wait()  # the bytes move now, under the next round's inner steps
                self.first = (view, comm, handle, None)
            except Exception as e:  # settle() decides: retry, or behind
                self.first = (view, comm, handle, e)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def take_first(self) -> tuple | None:
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, first, self.first = None, self.first, None
        return first


def settle(ctx: _Ctx, flight: _Flight, overlapped_s: float = 0.0) -> QuorumView | None:
    """Steps 3-6 of flight's round and its commit, retried with new quorums until it commits;
    returns the quorum's view instead when the others are past this round (this worker is behind)."""
    w, r = ctx.w, flight.sent.round
    t0 = time.perf_counter()
    first = flight.take_first()
    flight.sent.waited_s += time.perf_counter() - t0  # idle: the background try was not done yet
    while True:
        if first is not None:
            view, comm, handle, error = first
            first = None
        else:
            comm = handle = error = None
            t0 = time.perf_counter()
            try:
                _await_record(w, r - 1)
                view = ctx.members.quorum(r)
            except MembershipError as e:  # partitioned from the coordinator, or too few alive
                _say(ctx.quiet, f"worker {w.worker}: round {r}: {e}; asking again")
                time.sleep(0.5)
                continue
            finally:
                flight.sent.waited_s += time.perf_counter() - t0
        if view is None:  # the background try failed before a quorum formed
            _say(ctx.quiet, f"worker {w.worker}: round {r}: {error}; asking again")
            time.sleep(0.5)
            continue
        if view.round > r:
            return view
        if len(view.active) < ctx.min_active:
            time.sleep(0.05)  # e.g. a member is healing into this round: it will join
            continue
        if _try_round(ctx, flight, view, comm, handle, error, overlapped_s):
            return None


def _try_round(ctx: _Ctx, flight: _Flight, view: QuorumView, comm, handle, error, overlapped_s: float) -> bool:
    """Steps 3-6 and the commit of the round among view.active; False (nothing applied) on failure."""
    w, sent, r = ctx.w, flight.sent, flight.sent.round
    catch_up(w, r - 1)  # a healed worker (delay 1) has not applied the last round: the record has it
    saved = _snapshot(w)
    try:
        if error is not None:
            raise error
        if handle is None:
            view, comm = _group(ctx, view)
            ctx.injector.in_exchange(r)
            mark_out(w, r, sent.bundle_hash)
            handle = Exchange(None, w.cfg.run.max_packet_bytes, link=ctx.pace, comm=comm,
                              on_packets=ctx.seen(view.active, r)).start(flight.bundle, reveal=flight.reveal)
        sent.handle = handle
        ctx.injector.after_sent(r, handle.wait)
        outside = [j for j in range(w.workers) if j not in view.active]
        alive = ctx.members.alive_times([j for j in outside if j not in view.rounds])  # one round trip for all
        now = ctx.members.now()
        absent = {j: _absence(alive, view, j, ctx.members.heartbeat_timeout_s, now) for j in outside}
        rec = finish_round(w, sent, overlapped_s, Participants(view.active, comm, comm, absent))
    except (ExchangeError, MembershipError, RuntimeError) as e:
        if "disagree on the global params" in str(e) or isinstance(e, RowTampered):
            raise
        if isinstance(comm, PgComm) and comm.given_up is None:  # the others may wait in a collective of it
            comm.give_up(f"worker {w.worker} failed the round: {str(e).splitlines()[0][:120]}")
        _pin(w, r, handle)
        _restore(w, saved)
        _say(ctx.quiet, f"worker {w.worker}: round {r} failed among workers {view.active} "
             f"({str(e).splitlines()[0][:160]}); retrying with a new quorum")
        return False
    rec["eval_loss_start"] = ctx.eval_start  # the launcher's, over the whole eval set
    commit(w, rec)
    w.applied = r
    ctx.members.keep(r, comm)
    return True


def _pin(w: Worker, r: int, handle) -> None:
    """The commitments of round r that this worker received in a try that failed (after every
    bundle was in: in the reveal, say): kept by its equivocation detector, so that a sender whose
    next try carries another commitment is convicted (EQUIVOCATION, both signed). Else a worker
    that saw every salt could fail the try on purpose and commit again, choosing its salt and its
    commitment so that the retry's draw leaves it out (the review of the commit-reveal, thirty-ninth
    session). Every honest worker resends the very bundle it sent (`_Flight`), so its retry is
    the same commitment."""
    for data in (handle.received() or []) if handle is not None else []:
        try:
            signed = parse_signed_commitment(decode_bundle(data, view=True)[0])
        except (PacketError, CommitmentError):
            continue
        if signed.commitment.run_id == w.identity.run_id and signed.commitment.round == r:
            w.identity.equivocation.observe(signed)


def _group(ctx: _Ctx, view: QuorumView) -> tuple[QuorumView, PgComm]:
    """The round's members and group: the last round's group again when the quorum is the same
    (Membership.reuse), else a new one over the members that reach each other."""
    comm = ctx.members.reuse(view)
    if comm is not None:
        return view, comm
    view = _connected(ctx, view)
    return view, ctx.members.group(view)


def _connected(ctx: _Ctx, view: QuorumView) -> QuorumView:
    """The quorum's members that reach each other (Membership.connected): MembershipError (the
    round is retried, or committed without this worker) if this worker is not among them, or if
    fewer than min_workers are."""
    reached = ctx.members.connected(view)
    if len(reached.active) < ctx.min_active:
        raise MembershipError(f"only workers {reached.active} of the quorum {view.active} reach each other, "
                              f"fewer than min_workers = {ctx.min_active}")
    return reached


def _paced(cfg: Config, link: Link | None) -> Link | None:
    """The link the exchange paces in software: all of it when emulated; none with `[link] shaping
    = "kernel"` (tc tbf shapes the bandwidth, netns.py's delay line holds every frame for the
    latency). The encoder keeps the whole link either way: the adaptive codec's budget and
    adaptive H need its bandwidth."""
    return None if cfg.link.shaping == "kernel" else link


def _absence(alive: dict[int, float], view: QuorumView, j: int, heartbeat_timeout_s: float, now: float) -> str:
    """LATE for a worker that is alive (heartbeating: `alive`, Membership.alive_times) but not in the
    round, else ABSENT; `now`: Membership.now(), the clock the stamps are in."""
    if j in view.rounds:  # in the quorum but behind: it is healing, it has no packet for this round
        return ABSENT
    # a live worker beats every 0.2 s; the quorum left a dead one out only after heartbeat_timeout_s
    return LATE if now - alive[j] < max(heartbeat_timeout_s / 2, 0.6) else ABSENT


_FOLLOWERS: dict[Path, RoundsFollower] = {}


def _records(run: RunDir) -> list[dict]:
    """The run's records as they stand, read incrementally by this process's follower of them
    (every member reads them each round to commit it; a whole read is 0.7 s at 10,000 rounds)."""
    if run.root not in _FOLLOWERS:
        _FOLLOWERS[run.root] = RoundsFollower(run)
    return _FOLLOWERS[run.root].rounds()


def commit(w: Worker, rec: dict) -> None:
    """Record round rec["round"] once: the first member to get here appends the ledger entry and
    the record; a later one checks the record it finds names the same params."""
    r = rec["round"]
    with _locked(w.run.root / ".commit.lock"):
        records = _records(w.run)
        entry_commitments = rec.pop("_entry_commitments", None)
        if len(records) > r:
            if records[r]["params_hash"] != rec["params_hash"]:
                raise RuntimeError(f"round {r}: the recorded params differ from this worker's; refusing to continue")
            return
        if len(records) < r:
            raise RuntimeError(f"round {r}: round {len(records)} was never recorded")
        if w.ledger is not None:
            rec["entry"] = append_entry(w, rec, entry_commitments)
        w.run.append_round(rec)
        if w.cfg.run.keep_checkpoints:  # the committer prunes: every machine of an elastic run shares its directory
            prune_checkpoints(w.store, [*records[-w.cfg.run.keep_checkpoints:], rec], w.cfg.run.keep_checkpoints)
        elapsed = sum(p["round_s"] for p in records) + rec["round_s"]
        tokens = sum(p["tokens"] for p in records) + rec["tokens"]
        w.run.append_metrics(metrics_of(rec, tokens, elapsed) | {"members": rec.get("members")})
        # (the progress line is the launcher's and each joiner's, `Progress`, for every round)


class Progress:
    """The progress line of every round as it is recorded, printed by the process that supervises
    a machine's workers (the launcher, and `veriloco join` on each other machine), from the rounds
    it follows. Until the thirty-sixth session the worker that committed a round printed it, so
    each machine showed the rounds its own workers happened to commit first: 4, 7, 9, 13, ... on a
    joining machine. A resumed run's earlier rounds are not shown again."""

    def __init__(self, cfg: Config, records: list[dict], quiet: bool) -> None:
        self.rounds, self.quiet, self.shown = cfg.train.rounds, quiet, len(records)
        self.elapsed = sum(p["round_s"] for p in records)
        self.tokens = sum(p["tokens"] for p in records)

    def show(self, records: list[dict]) -> None:
        for rec in records[self.shown:]:
            self.shown += 1
            self.elapsed += rec["round_s"]
            self.tokens += rec["tokens"]
            if not self.quiet:
                print(progress_line(rec, self.rounds, self.elapsed, self.tokens / self.elapsed), flush=True)


def heal(w: Worker, to_round: int) -> int:
    """Catch up to the start of round `to_round`: the params and outer state its inner steps start
    from (round to_round-1's with delay 0, to_round-2's with delay 1), from the store, checked
    against the round record (waiting up to run.timeout_s for it), with what the members who
    finished that round hold from it (catch_up), and with delay 1 its own newest delta.
    Returns to_round."""
    catch_up(w, to_round - 1 - w.cfg.outer.delay)
    follow_schedule(w, to_round)
    w.inner.step_count = w.schedule.before(to_round)  # the LR schedule is the run's, not the worker's
    if w.encoder.feedback is not None:
        w.encoder.feedback = ErrorFeedback()  # what it dropped belongs to rounds it was not in
    own = w.run.worker_dir(w.rank) / f"state-{to_round - 1}.safetensors"
    if own.exists():  # it committed that round (a resume, or a restart): its state as round to_round began goes on
        state = st_load(own.read_bytes())
        w.inner.load_state_tensors({k: v for k, v in state.items() if k.startswith("inner/")})
        w.encoder.load_state_tensors(state)
        if w.replicas is not None:  # the whole inner state goes to its replicas with the next round
            w.replicas.state_sent = False
    load_seen(w, to_round)  # what it received of round to_round before it died (a restart)
    w.own_decoded, w.own_packet = [], None
    w.bases, w.base_hashes, w.base_momenta, w.start_states, w.starts = {}, {}, {}, {}, {}  # (for rounds it will not finish)
    done = w.run.rounds()[:to_round]  # the bans in force: the last record it can see
    w.banned, w.disputes = carried(done[-1] if done else None)
    if w.cfg.outer.delay and len(done) == to_round > 0:
        # round to_round starts from its own newest delta, if round to_round-1 has a packet of its (a
        # restart: of the process before it), as the others and the audit assume (round.start_point).
        # Not recorded yet: it had no packet in flight for it (it was behind), so none will be in it
        decoded, packets = _decoded(w, done[-1])
        if w.worker in decoded:
            w.own_decoded, w.own_packet = [decoded[w.worker]], packets[w.worker]
    return to_round


def _decoded(w: Worker, record: dict) -> tuple[dict, dict]:
    """Every packet of a recorded round that decodes, and the packets, by worker (from the store)."""
    shapes = {k: tuple(v.shape) for k, v in w.outer.params.items()}
    decoded, packets = {}, {}
    for j, h in enumerate(record["bundles"]):
        if h is None:
            continue
        try:
            packets[j] = decode_bundle(w.store.get(h))[1]
            decoded[j] = decode_packet(packets[j], shapes, w.cfg.run.max_packet_bytes)
        except (PacketError, ValueError):  # the others could not decode it either: it was rejected
            continue
    return decoded, packets


def _take_views(w: Worker, round: int, record: dict) -> None:
    """What a member that finished `round` holds from it (round.finish_round), for a worker that
    takes the round from its record instead: every decoded packet as its worker's newest delta
    (the eager correction of that worker's next start point, in replays) and the screen's
    previous round (its packets, and the accepted deltas). Otherwise the healer's replays and
    screen would judge the next round from other start points than the others'."""
    decoded, _ = _decoded(w, record)
    w.history = {j: [d] for j, d in decoded.items()}
    w.history_rounds = dict.fromkeys(decoded, round)
    accepted = {j: decoded[j] for j, v in enumerate(record["verdicts"]) if v == "accept" and j in decoded}
    w.previous = ({j: h for j, h in enumerate(record["packets"]) if h is not None}, accepted)


def heal_toward(w: Worker, members: Membership, target: int, quiet: bool = False) -> int:
    """`heal(w, target)`, which waits for the record of the round before target (target - 2 with
    delay 1). That round may never be recorded without this worker: a member of its quorum died
    mid-exchange, and the rest are fewer than min_workers without it (while it heals it joins no
    quorum, and with delay 1 it does not even heartbeat). Then, after run.timeout_s, it heals to
    the first round not recorded, the one the others retry, and joins it. Returns the round."""
    try:
        return heal(w, target)
    except MembershipError as e:
        members.resume()
        now = len(w.run.rounds())
        _say(quiet, f"worker {w.worker}: {e}; healing to round {now}, the one the others are retrying")
        return heal(w, now)


def follow_schedule(w: Worker, r: int) -> None:
    """Adaptive H: every H up to round r's, from the records (round r's H follows round r-2's
    record, which exists by the time round r starts: this worker committed it, or caught up to
    it). A worker left out of a round, or whose try of it failed, grew its schedule differently
    or not at all; the records are what every member agrees on."""
    if w.schedule.adaptive:
        w.schedule = StepSchedule.of(w.cfg, _records(w.run)[: max(r - 1, 0)])
        if len(w.schedule.steps) <= r:
            raise RuntimeError(f"worker {w.worker}: round {r}'s H is not decided yet (round {r - 2} is not recorded)")


def catch_up(w: Worker, round: int) -> None:
    """Make G the params after `round` (and its outer state) from the store, unless it already is."""
    if round < 0 or w.applied >= round:
        return
    record = _await_record(w, round)
    try:
        ckpt = st_load(w.store.get(record["checkpoint"]))  # the store checks the blob's hash
    except StoreError:
        if pruned(w.cfg.run.keep_checkpoints, len(_records(w.run)), round):  # the others went on while it healed
            raise MembershipError(f"round {round}'s checkpoint was pruned (run.keep_checkpoints = "
                                  f"{w.cfg.run.keep_checkpoints}) before this worker read it") from None
        raise
    params = {k[len("param/"):]: v for k, v in ckpt.items() if k.startswith("param/")}
    if tensors_hash(params) != record["params_hash"]:
        raise RuntimeError(f"checkpoint of round {round} does not match its record")
    w.outer = OuterOptimizer(params, w.cfg.outer)
    w.outer.load_state_tensors(ckpt)
    _take_views(w, round, record)
    w.applied = round


def _await_record(w: Worker, round: int) -> dict | None:
    """The record of `round` once it is written (None for round < 0). A worker joins the quorum of
    round r only after r-1 is recorded: a worker that healed ahead of the others (its first round
    computed while they still finish the one before) must not make them look behind."""
    if round < 0:
        return None
    deadline = time.monotonic() + w.cfg.run.timeout_s
    while True:
        records = _records(w.run)  # polled every 20 ms: only what was appended is parsed
        if len(records) > round:
            return records[round]
        if time.monotonic() > deadline:
            raise MembershipError(f"worker {w.worker}: round {round} was not recorded within "
                                  f"{w.cfg.run.timeout_s:g} s")
        time.sleep(0.02)


def _snapshot(w: Worker) -> dict:
    """What finish_round changes, to undo a round that failed part-way."""
    return {
        "params": {k: v.clone() for k, v in w.outer.params.items()},
        "outer": {k: v.clone() for k, v in w.outer.state_tensors().items()},
        "history": dict(w.history), "history_rounds": dict(w.history_rounds), "previous": w.previous,
        "bases": dict(w.bases), "starts": dict(w.starts),
        "base_hashes": dict(w.base_hashes), "banned": set(w.banned), "base_momenta": dict(w.base_momenta),
        "disputes": set(w.disputes),
    }


def _restore(w: Worker, saved: dict) -> None:
    w.outer = OuterOptimizer(saved["params"], w.cfg.outer)
    w.outer.load_state_tensors(saved["outer"])
    w.history, w.previous, w.bases, w.base_hashes = saved["history"], saved["previous"], saved["bases"], saved["base_hashes"]
    w.banned, w.base_momenta, w.history_rounds = saved["banned"], saved["base_momenta"], saved["history_rounds"]
    w.disputes, w.starts = saved["disputes"], saved["starts"]


@contextmanager
def _locked(path):
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_commit_lock(directory: str | Path) -> None:
    """`directory` (a run directory, or where one will be made) is on a file system that takes
    locks: an elastic round is recorded once, by whichever member holds RUN/.commit.lock first
    (`commit`). Without locks (an NFS mount without its lock manager: ENOLCK) that flock raises
    in the worker, at its first commit, after the run directory was made (read from the code;
    every file system here takes locks). Refused in one line before anything is written or
    started. A file of its own is locked, so a member committing is not waited for."""
    from .records import RunDirError

    probe = Path(directory) / f".lock-check-{os.getpid()}"
    try:
        with open(probe, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raise RunDirError(f"{directory} is on a file system without locks ({e.strerror or e}): an elastic run records "
                          "each round under RUN/.commit.lock (on NFS, mount it with its lock manager)") from None
    finally:
        probe.unlink(missing_ok=True)


def _with_batch(task: Task, batch) -> Task:
    import dataclasses

    return dataclasses.replace(task, batch=batch)


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, flush=True)




def summarize(cfg: Config, records: list[dict], eval_start: float, wall: float) -> dict:
    """The run's summary.json from its records (an elastic run has no single process that saw it all)."""
    evals = [p["eval_loss"] for p in records if p["eval_loss"] is not None]
    tokens = sum(p["tokens"] for p in records)
    W = cfg.topology.workers
    last = records[-1] if records else {}
    return {
        "eval_loss_start": eval_start, "eval_loss_end": evals[-1] if evals else None,
        "tokens": tokens, "rounds": len(records), "workers": W, "stages": 1, "replicas": cfg.topology.replicas,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "bytes_sent_per_worker": int(sum(sum(p["bytes_sent"]) for p in records) / W),
        "utilisation": round(sum(sum(p["inner_s"]) for p in records) / W / wall, 4) if wall > 0 else 0.0,
        "final_checkpoint": last.get("checkpoint"), "final_params_hash": last.get("params_hash"),
        "mode": "diloco", "membership": "elastic", "complete": len(records) == cfg.train.rounds,
        "rounds_with_absent": sum(1 for p in records if any(v in (ABSENT, LATE) for v in p["verdicts"])),
        "ledger_head": last.get("entry"), "ledger_root": None,
    }


# --- the launcher: a coordinator, one process per worker, and the faults that happen to them ---


@dataclass(frozen=True)
class Placement:
    """Where an elastic run's processes are. `host`: the address the coordinator listens on and the
    workers reach it at (127.0.0.1: this machine only); `local`: the workers this launcher starts
    (None: all of them). The others are started by `veriloco join RUN --workers ...` on machines
    that share the run directory (`join_elastic`), from RUN/coordinator.json."""

    host: str = "127.0.0.1"
    local: tuple[int, ...] | None = None


COORDINATOR_FILE = "coordinator.json"  # in the run directory while its launcher runs


@sigterm_as_interrupt()  # its supervisor loop kills the workers on the way out
def launch_elastic(cfg: Config, task: Task, run, fault_specs: list[str], quiet: bool = False,
                   stop_after: int | None = None, placement: Placement | None = None) -> dict:
    """Start the coordinator (torchft Lighthouse + TCPStore), one process per worker, and
    supervise them: a worker that dies is left out by the others (and started again if a
    `restart` fault says so, or `[run] max_restarts` allows), `join` faults start a worker late,
    `partition` faults cut a worker's network link and `sever` faults the path between two
    workers (then everything runs in network namespaces). Every start, death and cut goes to
    RUN/events.jsonl. With a `placement`, only its local workers start here: the rest are
    started by `veriloco join` elsewhere, from RUN/coordinator.json (no faults then). Returns the
    summary once the run is complete, or once `stop_after` rounds are committed (`veriloco train
    --resume` goes on from there)."""
    from .faults import parse_faults
    from .run import _finish

    faults = parse_faults(fault_specs, cfg.topology.workers)  # (its callers checked the commit lock: run.check_launch)
    W = cfg.topology.workers
    placement = placement or Placement()
    local = list(range(W)) if placement.local is None else sorted(set(placement.local))
    remote = [j for j in range(W) if j not in local]
    if remote and faults:
        raise ConfigError("--fault needs every worker started by this launcher (no --workers)")
    R = cfg.train.rounds if stop_after is None else min(stop_after, cfg.train.rounds)  # where this launch ends
    eval_start = _eval_loss(on_device(task, "cpu", cfg.train.precision))  # once, over the whole eval set, before any process starts
    before_s = sum(p["round_s"] for p in run.rounds())  # a resumed run's wall: its rounds so far, and this launch
    # an EVM ledger: register the run on chain once, before the workers (every one holds the
    # recorder's key and opens the ledger) race to do it with the same account's nonce
    ledger = open_ledger(cfg, run) if cfg.ledger.backend == "evm" else None
    cuts = sorted((f.round, f.worker, f.seconds, f.peer) for f in faults if f.kind in ("partition", "sever"))
    kernel = cfg.link.shaping == "kernel"
    if kernel and remote:
        raise ConfigError("link.shaping = 'kernel' needs every worker started by this launcher (no --workers)")
    host = _NetnsHost(cfg, task, run) if cuts or kernel else _LocalHost(cfg, task, run, placement.host)
    joins = {f.worker: f.round for f in faults if f.kind == "join"}
    restarts = {f.worker: f.seconds for f in faults if f.kind == "restart"}
    budget = dict.fromkeys(range(W), cfg.run.max_restarts)  # [run] max_restarts: restarts left per worker
    left = {j: [f for f in faults if f.worker == j and f.kind in ("die", "stop", "late", "skew")] for j in range(W)}
    first = [j for j in range(W) if j not in joins]
    procs: dict = {}
    seen = 0  # rounds recorded as of the last look at rounds.jsonl (read once per loop)
    pending: dict[int, float] = {}  # worker -> when to start it again
    healing: dict[tuple, float] = {}  # (worker, peer or None) -> when its cut link comes back
    errors: dict[int, str] = {}  # worker -> the last line of the error it died of (not a planned death)
    t0 = time.perf_counter()

    def died_of() -> str:
        return "".join(f"; worker {j} died of {e} ({run.root}/error-{j}.txt)" for j, e in sorted(errors.items()))

    def event(kind: str, j: int | None, **extra: object) -> None:
        run.append_jsonl(run.root / "events.jsonl", {"t": round(time.perf_counter() - t0, 3), "event": kind,
                                                     "worker": j, "round": seen, **extra})

    def start(j: int) -> None:
        for old in [run.root / f"error-{j}.txt", *run.root.glob(f"error-{j}-replica-*.txt")]:  # an earlier incarnation's
            old.unlink(missing_ok=True)
        procs[j] = host.start(j, dict(worker=j, faults=left[j], first=first, quiet=quiet, eval_start=eval_start,
                                      stop_after=stop_after))
        event("started", j)

    coordinator = run.root / COORDINATOR_FILE  # what `veriloco join` on another machine starts its workers from
    try:
        atomic_write(coordinator, json.dumps({"lighthouse": host.lighthouse, "store_host": host.store_host,
                                              "store_port": host.store_port, "eval_start": eval_start, "first": first,
                                              "stop_after": stop_after, "launcher_pid": os.getpid()}).encode())
        for j in first:
            if j in local:
                start(j)
        complete_at, progress_at = None, time.perf_counter()
        stall_s = max(3 * cfg.run.timeout_s, 60.0)
        rounds = RoundsFollower(run)  # polled every 50 ms: only what was appended is parsed
        progress = Progress(cfg, rounds.rounds(), quiet)
        while True:
            records = rounds.rounds()
            progress.show(records)
            done = len(records)
            if done > seen:
                progress_at = time.perf_counter()
            elif time.perf_counter() - progress_at > stall_s:
                dumped = _dump_stacks(procs, run.root)
                raise RuntimeError(f"elastic run stalled at round {done} of {R}: no round committed for "
                                   f"{stall_s:g} s (fewer than run.min_workers alive?)" + died_of()
                                   + (f"; the workers' stacks are in {run.root}/stacks-*.txt" if dumped else ""))
            for rec in records[seen:]:  # when each round was committed, and by whom (recovery times)
                seen = rec["round"] + 1
                event("committed", None, committed=rec["round"],
                      members=rec.get("members", list(range(W))))
            for j, r in list(joins.items()):
                if done >= r:
                    del joins[j]
                    start(j)
            while cuts and done >= cuts[0][0]:
                _, j, seconds, peer = cuts.pop(0)
                host.cut(j, True, peer)
                healing[j, peer] = time.perf_counter() + seconds
                event("cut", j, seconds=seconds, **({"peer": peer} if peer is not None else {}))
            for (j, peer), t in list(healing.items()):
                if time.perf_counter() >= t:
                    del healing[j, peer]
                    host.cut(j, False, peer)
                    event("reconnected", j, **({"peer": peer} if peer is not None else {}))
            for j, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                del procs[j]
                if code != 0:
                    error = _error_of(run.root, j)
                    if error is not None:
                        errors[j] = error
                    event("died", j, exitcode=code, **({"error": error} if error is not None else {}))
                    fired = first_death(left[j])
                    if fired is not None:
                        left[j].remove(fired)  # it fired: the restarted worker must not die there again
                    if j in restarts and done < R:
                        pending[j] = time.perf_counter() + restarts[j]
                    elif done < R and (at := _restart_at(budget, j, cfg)) is not None:
                        pending[j] = at
                        event("restarting", j, restarts_left=budget[j])
            for j, t in list(pending.items()):
                if time.perf_counter() >= t:
                    del pending[j]
                    start(j)
            if done >= R:
                complete_at = complete_at or time.perf_counter()
                if not procs or time.perf_counter() - complete_at > 5.0:  # a worker still healing: done
                    break
            elif not procs and not pending and not joins and not remote:
                raise RuntimeError(f"elastic run stopped at round {done} of {R}: every worker is gone" + died_of())
            time.sleep(0.05)
    finally:
        for p in procs.values():
            p.kill()
        coordinator.unlink(missing_ok=True)
        host.close()
    summary = summarize(cfg, run.rounds(), eval_start, time.perf_counter() - t0 + before_s)
    if cfg.ledger.backend != "none":
        with ledger or open_ledger(cfg, run) as opened:
            summary["ledger_root"] = opened.root()
            summary["ledger_head"] = opened.head_hash()
    _finish(run, cfg, summary)
    return summary


def _dump_stacks(procs: dict, root) -> bool:
    """Ask every live worker to write its threads' stacks to RUN/stacks-J.txt (SIGUSR1, see
    _stacks_on_signal) and copy them to stderr: what a stalled run was waiting on, for its report
    (a test's captured output). True if any worker was asked."""
    import os
    import signal
    import sys

    asked = []
    for j, p in sorted(procs.items()):
        pid = p.process.pid if isinstance(p, _Spawned) else p.pid
        try:
            os.kill(pid, signal.SIGUSR1)
            asked.append(j)
        except (OSError, TypeError):
            pass
    if asked:
        time.sleep(1.0)
    for j in asked:
        path = root / f"stacks-{j}.txt"
        if path.exists():
            print(f"--- worker {j}'s threads at the stall ({path}) ---\n{path.read_text()}", file=sys.stderr, flush=True)
    return bool(asked)


def _stacks_on_signal(run_dir: str, worker: int) -> None:
    """On SIGUSR1, append every thread's Python stack to RUN/stacks-WORKER.txt (faulthandler:
    works while the worker is blocked in a C call such as a quorum or a gloo collective)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        f = open(Path(run_dir) / f"stacks-{worker}.txt", "a")  # open for the process's life
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


def _eval_loss(task: Task) -> float:
    """Loss of the initial model over the whole eval set, on a copy of the task: a task holding
    its loaded corpus would be slow to hand to the processes started later."""
    import copy

    import torch

    mine = copy.deepcopy(task)
    model = mine.make_model()
    with torch.no_grad():
        pairs = [(float(mine.loss(model, x, y)), y.numel()) for x, y in mine.eval_batches()]
    return sum(a * n for a, n in pairs) / sum(n for _, n in pairs)


class _Spawned:
    """A worker started with torch.multiprocessing, seen like a Popen."""

    def __init__(self, process) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


class _LocalHost:
    """Workers as local processes (spawned), the coordinator in the launcher's process."""

    def __init__(self, cfg: Config, task: Task, run, host: str = "127.0.0.1") -> None:
        from .membership import Coordinator
        from .procs import context

        self.cfg, self.task, self.run_dir = cfg, task, str(run.root)
        W = cfg.topology.workers
        self.coord = Coordinator(cfg.run.min_workers or W // 2 + 1, cfg.run.round_deadline or cfg.run.timeout_s,
                                 cfg.run.heartbeat_timeout_s, host)
        self.lighthouse, self.store_host, self.store_port = self.coord.lighthouse_addr, host, self.coord.store_port
        self.ctx = context()

    def start(self, j: int, args: dict) -> _Spawned:
        return _spawn(self.ctx, self.cfg, self.task, self.run_dir, self.lighthouse, self.store_host, self.store_port, args)

    def cut(self, j: int, down: bool, peer: int | None = None) -> None:  # pragma: no cover - partition faults use _NetnsHost
        raise RuntimeError("a local run has no network link to cut")

    def close(self) -> None:
        self.coord.shutdown()


_NOBODY = "02:00:00:00:00:01"  # a locally administered MAC address no namespace has (sever faults)


class _NetnsHost:
    """Workers in network namespaces 0..W-1 and the coordinator in namespace W, joined by veth
    pairs to one bridge (netns.shaped_link: unshaped, or shaped to the link's bandwidth with
    `[link] shaping = "kernel"`); a partition downs a worker's bridge port.
    Worker processes are programs of their own (`_main(ARGS.json)`): they rebuild the task from
    the run's manifest and store, so only the built-in GPT task runs here."""

    def __init__(self, cfg: Config, task: Task, run) -> None:
        import subprocess
        import sys

        from . import netns
        from .config import ConfigError
        from .link import parse_bandwidth, parse_duration
        from .task import corpus_task_of

        what = "link.shaping = 'kernel'" if cfg.link.shaping == "kernel" else "partition faults"
        ok, why = netns.available()
        if not ok:
            raise ConfigError(f"{what} need network namespaces: {why}")
        if corpus_task_of(task) is None:
            raise ConfigError(f"{what} run workers as separate programs: only the built-in GPT task can")
        self.cfg, self.run, W = cfg, run, cfg.topology.workers
        # [link] shaping = "kernel": every port shaped to the link's bandwidth (tc tbf) and every path
        # the link's latency long (a delay line), the coordinator's too (its traffic is heartbeats and
        # small keys, which wait as long as anyone's); else unshaped
        kernel = cfg.link.shaping == "kernel"
        bandwidth = parse_bandwidth(cfg.link.bandwidth) if kernel else math.inf
        latency = parse_duration(cfg.link.latency) if kernel else 0.0
        self._cm = netns.shaped_link(bandwidth, n=W + 1, latency_s=latency)
        self.link = self._cm.__enter__()
        self.coord_host = self.link.addresses[W]
        serve = "import sys; from veriloco.membership import serve; serve(sys.argv[1:])"
        self.coord = self.link.popen(W, [sys.executable, "-c", serve, self.coord_host,
                                         str(cfg.run.min_workers or W // 2 + 1),
                                         str(cfg.run.round_deadline or cfg.run.timeout_s),
                                         str(cfg.run.heartbeat_timeout_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"))
        line = netns._read_line(self.coord, timeout=60.0)
        if not line.strip():
            self.close()
            raise RuntimeError("the coordinator in its namespace did not start")
        info = json.loads(line)
        self.lighthouse, self.store_host, self.store_port = info["lighthouse"], self.coord_host, int(info["store_port"])

    def start(self, j: int, args: dict):
        import os
        import sys

        spec = self.run.root / f".elastic-worker-{j}.json"
        spec.write_text(json.dumps({
            "run_dir": str(self.run.root), "lighthouse": self.lighthouse, "store_host": self.coord_host,
            "store_port": self.store_port, **args, "faults": [f.__dict__ for f in args["faults"]],
        }))
        # gloo binds the namespace's veth, not lo; c10d would warn that peers have no DNS names
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", TORCH_CPP_LOG_LEVEL="ERROR")
        main = "import sys; from veriloco.elastic import _main; _main(sys.argv[1])"
        return self.link.popen(j, [sys.executable, "-c", main, str(spec)], env=env)

    def cut(self, j: int, down: bool, peer: int | None = None) -> None:
        """Down worker j's bridge port; or, with a peer (a sever fault), only the path between the
        two: each one's neighbour entry for the other names a MAC address nobody has, so what
        they send each other is lost on the bridge, with no error to either sender."""
        from .netns import _cmd

        if peer is None:
            _cmd(["ip", "-n", self.link.hub, "link", "set", f"p{j}", "down" if down else "up"])
            return
        for a, b in ((j, peer), (peer, j)):
            ns, addr = self.link.namespaces[a], self.link.addresses[b]
            if down:
                _cmd(["ip", "-n", ns, "neigh", "replace", addr, "dev", "eth0", "lladdr", _NOBODY, "nud", "permanent"])
            else:
                _cmd(["ip", "-n", ns, "neigh", "del", addr, "dev", "eth0"])

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self.coord.stdin.close()
            self.coord.wait(timeout=5)
        self._cm.__exit__(None, None, None)


def _spawn(ctx, cfg: Config, task: Task, run_dir: str, lighthouse: str, store_host: str, store_port: int,
           args: dict) -> _Spawned:
    p = ctx.Process(target=_worker_main, args=(cfg, task, run_dir, lighthouse, store_host, store_port, args))
    p.start()
    return _Spawned(p)


def _restart_at(budget: dict[int, int], j: int, cfg: Config) -> float | None:
    """`[run] max_restarts`: when to start worker j again (perf_counter seconds; once the others
    have left it out), spending one of its restarts; None when they are spent."""
    if budget[j] <= 0:
        return None
    budget[j] -= 1
    return time.perf_counter() + cfg.run.heartbeat_timeout_s


@sigterm_as_interrupt()  # its supervisor loop kills the workers on the way out
def join_elastic(run_dir: str, workers: list[int], quiet: bool = False, task: Task | None = None) -> dict[int, int]:
    """`veriloco join RUN --workers ...`: start these workers of an elastic run whose launcher
    (`veriloco train ... --workers`) runs on another machine that shares the run directory, from
    RUN/coordinator.json (waited for up to run.timeout_s). Supervises them as the launcher would:
    one that dies is started again up to `[run] max_restarts` times while the run is not complete.
    The built-in tasks are rebuilt from the manifest and the store; a user's Task's run
    (`train_task(..., host=, workers=)`) takes that `task` (`join_task`). Returns each worker's
    last exit code."""

    from .config import ConfigError, config_from_dict
    from .procs import context
    from .records import RunDirError, users_task
    from .task import CorpusTask, initial_digest

    run = RunDir(run_dir)
    manifest = run.read_own_manifest()
    users = users_task(manifest)
    if users is not None and task is None:
        raise RunDirError(f"{run.root} trains a user's Task ({users}): join it with veriloco.join_task(task, RUN, "
                          "workers) and that Task")
    if task is not None and users is None:
        raise RunDirError(f"{run.root} trains a built-in task: join it without a Task (veriloco join)")
    cfg = config_from_dict(manifest["config"])
    W = cfg.topology.workers
    if cfg.run.membership != "elastic":
        raise ConfigError(f"{run.root} is not an elastic run (run.membership = {cfg.run.membership!r})")
    if not workers or any(not 0 <= j < W for j in workers) or len(set(workers)) != len(workers):
        raise ConfigError(f"--workers must name distinct workers of 0..{W - 1}, got {workers}")
    from .procs import warm
    from .run import check_device, check_launch, check_torch

    check_device(cfg)
    check_launch(cfg, Placement(local=tuple(workers)), run.root, manifest["worker_keys"])
    for j in workers:  # running already (a second join of them, or the launcher's own): refused before anything starts
        os.close(hold_worker(run.root, j))
    other = check_torch(manifest, cfg, "join it")  # the launcher's machine prepared the manifest
    if other is not None:
        print(f"veriloco: warning: {other}; the run has no exact replays to compare, so these workers join",
              file=sys.stderr)
    warm()
    path, deadline = run.root / COORDINATOR_FILE, time.monotonic() + cfg.run.timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RunDirError(f"{path} did not appear within {cfg.run.timeout_s:g} s: is the launcher running "
                              "(veriloco train ... --workers) and the run directory shared?")
        time.sleep(0.2)
    try:
        info = json.loads(path.read_text())
        lighthouse, store_host, store_port = str(info["lighthouse"]), str(info["store_host"]), int(info["store_port"])
        first, eval_start, stop_after = [int(j) for j in info["first"]], info["eval_start"], info["stop_after"]
    except (ValueError, KeyError, TypeError) as e:
        raise RunDirError(f"{path} is not a coordinator file: {e}") from None
    import socket

    try:  # before any worker starts: a launcher killed without cleaning up leaves the file behind
        socket.create_connection((store_host, store_port), timeout=min(cfg.run.timeout_s, 10.0)).close()
    except OSError as e:
        raise RunDirError(f"the coordinator named in {path} ({store_host}:{store_port}) does not answer ({e}): "
                          "its launcher is gone (the file is stale), or that address is not reachable from here") from None
    if task is None:
        task = CorpusTask(cfg, run.store_dir, manifest["corpus_manifest"], initial_digest(manifest)).as_task()
    ctx, procs, codes = context(), {}, {}
    budget = dict.fromkeys(workers, cfg.run.max_restarts)
    end = cfg.train.rounds if stop_after is None else min(int(stop_after), cfg.train.rounds)

    def start(j: int) -> None:
        procs[j] = _spawn(ctx, cfg, task, str(run.root), lighthouse, store_host, store_port,
                          dict(worker=j, faults=[], first=first, quiet=quiet, eval_start=eval_start, stop_after=stop_after))

    for j in workers:
        start(j)
    pending: dict[int, float] = {}
    rounds = RoundsFollower(run)
    progress = Progress(cfg, rounds.rounds(), quiet)
    try:
        while procs or pending:
            progress.show(rounds.rounds())
            for j, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                del procs[j]
                codes[j] = code
                if code != 0 and len(rounds.rounds()) < end and (at := _restart_at(budget, j, cfg)) is not None:
                    pending[j] = at
                    _say(quiet, f"worker {j} exited with {code}; starting it again ({budget[j]} restarts left)")
            for j, t in list(pending.items()):
                if time.perf_counter() >= t:
                    del pending[j]
                    start(j)
            time.sleep(0.05)
        progress.show(rounds.rounds())  # what its workers (or the others) recorded last
    finally:
        for p in procs.values():
            p.kill()
    return codes


def hold_worker(run_dir: str | Path, worker: int) -> int:
    """Take elastic worker `worker`'s lock, RUN/workers/J.lock (an flock, held while the returned
    fd is open: by the worker's process, for its life), so that one worker id runs once however
    many launchers and joiners were started: a second `veriloco join RUN --workers J` ran a second
    worker J beside the first, signing with its key. RunInUse when another process holds it. On a
    file system without locks (ENOLCK) nothing is guarded, as before."""
    from .records import Held, RunInUse, lock_with_pid

    path = Path(run_dir) / "workers" / f"{worker}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return lock_with_pid(path)
    except Held as e:
        raise RunInUse(f"worker {worker} of {run_dir} is running already{e.pid()}: a worker id runs once (on this "
                       "machine or one sharing the run directory)") from None


def _worker_main(cfg: Config, task: Task, run_dir: str, lighthouse: str, store_host: str, store_port: int,
                 args: dict) -> None:
    from .procs import die_with_parent

    die_with_parent()  # a launcher (or joiner) killed outright takes its workers with it
    hold_worker(run_dir, args["worker"])  # held until this process ends
    _stacks_on_signal(run_dir, args["worker"])
    replicas = None
    try:
        if cfg.topology.replicas > 1:
            replicas = WorkerReplicas(cfg, task, args["worker"], run_dir)
        train_worker_elastic(cfg, args["worker"], task, run_dir, lighthouse, store_port, args["faults"],
                             args["first"], args["quiet"], args["eval_start"], store_host, args.get("stop_after"),
                             replicas)
    except Exception:  # a planned death exits without one; this is a failure the launcher should name
        import traceback

        lost = replicas.lost() if replicas is not None else None  # the cause, where a collective is all it saw
        last = f"RuntimeError: worker {args['worker']}: {lost}\n" if lost is not None else ""
        (Path(run_dir) / f"error-{args['worker']}.txt").write_text(traceback.format_exc() + last)
        raise


def _error_of(root: Path, j: int) -> str | None:
    """The last line of worker j's traceback (RUN/error-J.txt, see _worker_main), if it left one;
    when one of its replicas failed first (RUN/error-J-replica-I.txt, `_replica_main`), that one's,
    the cause (the worker's own is then a collective that lost the replica)."""
    for path in [*sorted(root.glob(f"error-{j}-replica-*.txt")), root / f"error-{j}.txt"]:
        try:
            lines = [line for line in path.read_text().splitlines() if line.strip()]
        except OSError:
            continue
        if lines:
            replica = path.stem.split("-replica-")[1] if "-replica-" in path.stem else None
            return (f"its replica {replica}: " if replica else "") + lines[-1].strip()[:300]
    return None


def _main(spec_path: str) -> None:
    """One worker of a partition run, a program of its own in its namespace (see _NetnsHost)."""
    import os
    import sys

    from .config import config_from_dict
    from .records import RunDir
    from .task import CorpusTask, initial_digest

    spec = json.loads(open(spec_path).read())
    run = RunDir(spec["run_dir"])
    manifest = run.read_manifest()
    cfg = config_from_dict(manifest["config"])
    task = CorpusTask(cfg, run.store_dir, manifest["corpus_manifest"], initial_digest(manifest)).as_task()
    spec["faults"] = [Fault(**f) for f in spec["faults"]]
    _worker_main(cfg, task, spec["run_dir"], spec["lighthouse"], spec["store_host"], spec["store_port"], spec)
    # as a forkserver child does: no interpreter teardown, which would wait for gloo's timeout on
    # any group given up mid-collective (membership.PgComm)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

