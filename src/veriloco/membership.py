"""Membership: who takes part in a round, decided per round by torchft's Lighthouse.

`[run] membership = "elastic"` replaces the fixed torch.distributed world with a quorum per round
(torchft, Meta's fault-tolerance library: its Lighthouse is the quorum server; we use its low-level
coordination API, `torchft.coordination`). The launcher (run.py) starts one `Coordinator`: a
LighthouseServer and a TCPStore (the rendezvous for each round's process group), outside every
worker, so no worker's death takes them down. Each worker process holds a `Membership`:

    heartbeat thread        every 0.2 s "I am alive" to the Lighthouse (a killed worker stops)
    quorum(round)           blocks until the Lighthouse forms a quorum: at least `min_workers`
                            joined, and every worker that is alive (heartbeating) joined or
                            `round_deadline` passed since the first one did (a straggler is left
                            out; a dead worker is out as soon as its heartbeat is stale)
    reuse(view)             the group the last round committed on, when the quorum's active
                            members are exactly its members (every member takes the same one)
    group(view)             else a new gloo process group over the quorum's *active* members,
                            rendezvoused under a key unique to that quorum

A member joins with the round whose packet it holds (its `step` in torchft's terms). Members at
the highest round are active; a member at a lower round is behind (it was late, dead, partitioned
away, or is new) and heals: it loads the last committed round's params and outer state from the
store, hash-checked against the round record (`round.py: heal`), and joins the next round.
A quorum with fewer than `min_workers` active members commits nothing: its members ask again.

The Lighthouse alone does not keep the deadline once a worker has been left out: its "fast
quorum" forms at once when every member of the previous quorum has joined again, without waiting
for anyone else. A worker left out of one round (late, or its heartbeats starved) would then be
left out of every round in which it asks last, however small its lag and however long the
deadline (tests/test_elastic.py: 0.5 s late against 2 s, left out). So each quorum is also checked here:
it stands only if every live worker (a fresh `alive/W` in the store) is in it or the deadline has
passed since the earliest of its members asked; otherwise its members discard it and ask again,
and the worker still on its way is in the next one. The first member to judge a quorum writes
the judgement to the store (compare-and-set) and the others take it, so all agree. A live worker
that missed a deadline is not waited for again until it next asks for a quorum, so a worker that
is stuck but heartbeating costs the deadline once, not every round; a healer is waited for in the
round it names (`heading`) only, even while its heartbeats are paused.

Everything a round needs from the others after the quorum (the exchange, replay verdicts, the
agreement check, eval, stats) runs on that group; if any of it fails (a member died mid-round),
the round is discarded whole and retried with a new quorum from the same packets. Its collectives
also watch the members while they wait (`PgComm`): a member that froze or was cut off holds its
sockets open, so gloo alone would wait `timeout_s` for it; the others give the group up as soon
as its heartbeat is stale.

On a long link every request to the coordinator and every collective costs round trips, so
they are kept few: the watch reads its keys in one round trip (`_texts`) from a thread beside the
wait (`wait_watching`), the quorum's judge writes the group proposal with its verdict, and a
stable quorum keeps its group (bench/elastic_latency.py: 9.4 -> 0.86 s a round at 50 ms).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# torchft's Rust side logs every quorum at INFO to stderr; keep a user's own RUST_LOG if set
os.environ.setdefault("RUST_LOG", "warn")

WATCH_S = 0.2  # how often a collective of a quorum's group checks its members (PgComm.wait)
CLOCK_KEY = "clock"  # the coordinator's wall clock, as it last wrote it (Coordinator._publish_clock)
CLOCK_EVERY_S = 0.02  # how often it writes it: the most a worker's reading of it can be stale
CLOCK_SAMPLES = 8  # reads of it a worker takes for its offset (offset_to)
CLOCK_REREAD_S = 10.0  # how often a worker reads it again: clocks drift, and NTP may step one mid-run


class MembershipError(RuntimeError):
    """No quorum could be formed in time (too few workers alive, or the coordinator is gone)."""


def replica_id(worker: int) -> str:
    return f"worker-{worker:04d}"  # zero-padded: torchft sorts participants by id


def worker_of(rid: str) -> int:
    if not rid.startswith("worker-") or not rid[7:].isdigit():
        raise MembershipError(f"quorum lists an unknown participant {rid!r}")
    return int(rid[7:])


def netloc(host: str) -> str:
    """`host` as the part of an address before `:port`: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Coordinator:
    """The launcher's Lighthouse (quorum server) and TCPStore (per-round rendezvous)."""

    def __init__(self, min_workers: int, round_deadline_s: float, heartbeat_timeout_s: float,
                 host: str = "127.0.0.1") -> None:
        from torchft.coordination import LighthouseServer

        self.host = host
        self.lighthouse = LighthouseServer(
            bind=f"{netloc(host)}:0", min_replicas=min_workers, join_timeout_ms=max(int(round_deadline_s * 1000), 1),
            quorum_tick_ms=20, heartbeat_timeout_ms=max(int(heartbeat_timeout_s * 1000), 100),
        )
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        # the run's clock: every worker stamps its keys in it (Membership.now), whatever its machine's says
        self._stop = threading.Event()
        threading.Thread(target=self._publish_clock, daemon=True).start()

    def _publish_clock(self) -> None:
        store = dist.TCPStore(self.host, self.store.port, is_master=False, timeout=timedelta(seconds=10))
        while not self._stop.is_set():
            try:
                store.set(CLOCK_KEY, repr(time.time()))
            except Exception:  # the store going down with the launcher: nobody left to read it
                return
            self._stop.wait(CLOCK_EVERY_S)

    @property
    def lighthouse_addr(self) -> str:
        # the Lighthouse names itself by hostname, which may not resolve where the workers are
        return f"http://{netloc(self.host)}:{self.lighthouse.address().rsplit(':', 1)[1]}"

    @property
    def store_port(self) -> int:
        return self.store.port

    def shutdown(self) -> None:
        self._stop.set()
        self.lighthouse.shutdown()


@dataclass
class QuorumView:
    """One quorum as every member sees it: who joined at which round, and who is active."""

    key: str  # unique per formed quorum (torchft's quorum id + creation time)
    rounds: dict[int, int]  # worker -> the round whose packet it holds
    round: int  # the highest of those: the round this quorum can commit
    active: list[int]  # workers at that round, ascending: the round's participants
    # the group its members run on, as its first judge proposed (Membership._stands): a kept group's
    # key, "-" for a new one; None if not decided yet (Membership.reuse decides)
    group: str | None = None

    def index(self, worker: int) -> int:
        return self.active.index(worker)


class Membership:
    """A worker's side: heartbeats, quorums, and the process group of each quorum."""

    def __init__(self, worker: int, lighthouse_addr: str, store_port: int, timeout_s: float,
                 heartbeat_timeout_s: float = 2.0, host: str = "127.0.0.1", round_deadline_s: float = 0.0,
                 workers: int = 0, clock: Callable[[], float] = time.time) -> None:
        from torchft.coordination import LighthouseClient

        self._clock = clock  # this machine's wall clock (a `skew` fault's, in tests); now() corrects it
        self.worker, self.timeout_s, self.heartbeat_timeout_s = worker, timeout_s, heartbeat_timeout_s
        self.workers = workers  # the admitted workers, 0..workers-1: whose liveness a quorum answers to
        self.deadline_s = round_deadline_s or timeout_s  # as the Coordinator's join timeout
        # a quorum may wait round_deadline for a straggler before it forms: ask for longer than that
        self.quorum_timeout_s = max(self.deadline_s, 0.0) + timeout_s
        self._paused = threading.Event()
        self._heard = threading.Event()  # set once the Lighthouse has had a heartbeat of this worker (announce)
        self._host, self._port = host, store_port
        self.rid = replica_id(worker)
        self._addr = lighthouse_addr
        self.client = LighthouseClient(addr=lighthouse_addr, connect_timeout=timedelta(seconds=timeout_s))
        self.store = dist.TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.offset = offset_to(self.store, clock)  # now() = this machine's wall clock + offset: the coordinator's
        # before this worker can be in any quorum, so its keys always exist (_silent and _stands read
        # them in one round trip, and a multi_get of a missing key would block)
        self.store.set(f"alive/{worker}", repr(self.now()))
        for kind in ("asked", "heading", "late"):  # "-" (none yet), unless a process before this one wrote it
            self.store.compare_set(f"{kind}/{worker}", "", "-")
        self._existing: set[str] = set()  # keys _texts found: one round trip to read them again
        self._kept: tuple[int, PgComm] | None = None  # (round, its group): `keep`, `reuse`
        self._found_cut: dict[int, float] = {}  # worker -> when a watch's probe could not reach it
        # the watches' own connection (Membership.group): a store connection serves one request at a
        # time, and a watch still reading when its collective ends must not hold up the next request
        self._watch_store = dist.TCPStore(host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self._stop = threading.Event()
        self._listen()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def now(self) -> float:
        """The coordinator's wall clock, as this worker reckons it: what every worker stamps its keys
        with (heartbeats, quorum requests, late marks) and reads the others' against. Each machine's
        own wall clock would do only where NTP keeps them within a fraction of heartbeat_timeout_s:
        a worker whose clock was 5 s behind looked silent to the others whenever a collective
        waited, and a run over a slow link never committed a round (tests/test_elastic.py)."""
        return self._clock() + self.offset

    def _listen(self) -> None:
        """Answer the others' reachability probes (`unreachable`): a TCP listener that accepts and
        closes, on the address this worker reaches the coordinator from (so the path the peers
        probe is the one its gloo groups use), published as reach/WORKER."""
        family = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_DGRAM)[0][0]  # IPv4 or IPv6
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((self._host, self._port))  # no packet is sent: only the route's source address
            me = s.getsockname()[0]
        self._listener = socket.create_server((me, 0), family=family, backlog=64)

        def serve() -> None:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                    conn.close()
                except OSError:  # closed by close()
                    return

        threading.Thread(target=serve, daemon=True).start()
        self.store.set(f"reach/{self.worker}", f"{me}:{self._listener.getsockname()[1]}")

    def _unlisten(self) -> None:
        """Stop answering probes. shutdown() first: close() alone does not wake the accept() blocked
        in the listener's thread, and until it returns the kernel goes on accepting."""
        import contextlib

        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def unreachable(self, workers: list[int], store: dist.TCPStore | None = None) -> list[int]:
        """Which of `workers` this one cannot open a TCP connection to within heartbeat_timeout_s
        (all probed at once). A peer that died has a stale heartbeat anyway; this finds the ones
        that are alive to the coordinator but not to this worker (a partial partition)."""
        lost: list[int] = []
        # read here: the probes only connect
        where = dict(zip(workers, self._texts([f"reach/{j}" for j in workers], store), strict=True))

        def probe(j: int) -> None:
            try:
                host, port = where[j].rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=self.heartbeat_timeout_s).close()
            except (OSError, ValueError, AttributeError):
                lost.append(j)

        threads = [threading.Thread(target=probe, args=(j,), daemon=True) for j in workers]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return sorted(lost)

    def connected(self, view: QuorumView) -> QuorumView:
        """`view` narrowed to members that all reach each other, before its group forms. Each
        member probes the others (`unreachable`) and posts what it could not reach; once every
        member posted, all of them drop the same members (`reachable_part`) and go on without
        them. Without this, two members that reach the coordinator but not each other held every
        round's group (whose members' heartbeats are all fresh) until gloo's timeout, and every
        retry with the same quorum again: nothing was committed while the cut lasted. Raises
        MembershipError in a member that is dropped (the round is committed without it, and it
        heals), or when a member goes silent before posting."""
        key = f"reach/{view.key}"
        others = [j for j in view.active if j != self.worker]
        # a member this worker's watch just found cut off (a collective of a reused group stalled on it)
        # is reported as it is, not probed again: a probe of a cut path takes heartbeat_timeout_s
        now, found, self._found_cut = time.monotonic(), self._found_cut, {}
        known = {j for j in others if now - found.get(j, -math.inf) < 2 * self.heartbeat_timeout_s}
        lost = sorted(known | set(self.unreachable([j for j in others if j not in known])))
        self.store.set(f"{key}/{self.worker}", " ".join(map(str, lost)) or "-")
        rows = [f"{key}/{j}" for j in view.active]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:  # returns as soon as every row is there; between waits, watch the members
                self.store.wait(rows, timedelta(seconds=WATCH_S))
                break
            except RuntimeError:  # (torch's DistStoreError) not yet
                pass
            why = self._silent(view)
            if why is not None or time.monotonic() > deadline:
                self._leave(view)
                raise MembershipError(f"{why or 'a member did not post its probes'} before the round's group formed")
        reports = {}
        for j, raw in zip(view.active, self.store.multi_get(rows), strict=True):
            text = raw.decode(errors="replace")
            try:
                reports[j] = set() if text == "-" else {int(x) for x in text.split()}
            except ValueError:
                raise MembershipError(f"worker {j} posted unreadable probes {text[:40]!r}") from None
        keep = reachable_part(view.active, reports)
        if keep == view.active:
            return view
        if self.worker not in keep:
            cut = sorted(reports[self.worker] | {j for j, r in reports.items() if self.worker in r})
            raise MembershipError(f"worker(s) {cut} of round {view.round}'s quorum cannot reach this one: "
                                  f"the round goes on among {keep}")
        return QuorumView(f"{view.key}/reach-{'.'.join(map(str, keep))}", view.rounds, view.round, keep)

    def _heartbeat(self) -> None:
        from torchft.coordination import LighthouseClient

        client = LighthouseClient(addr=self._addr, connect_timeout=timedelta(seconds=self.timeout_s))
        # its own store connection: "alive at t" for the others to tell a late worker from a dead one
        store = dist.TCPStore(self._host, self._port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        read_at = time.monotonic() + CLOCK_REREAD_S
        while not self._stop.is_set():
            if self._paused.is_set():
                self._stop.wait(0.2)
                continue
            try:
                if time.monotonic() >= read_at:  # the coordinator's clock again (drift, a step)
                    self.offset, read_at = offset_to(store, self._clock), time.monotonic() + CLOCK_REREAD_S
                client.heartbeat(self.rid, timedelta(seconds=2))
                self._heard.set()
                store.set(f"alive/{self.worker}", repr(self.now()))
            except Exception:  # the coordinator unreachable (partition): keep trying, quorum() decides
                pass
            self._stop.wait(0.2)

    def pause(self) -> None:
        """Stop heartbeating: while a worker heals toward a round the others are not forming yet,
        they must not wait for it (the Lighthouse waits for every live worker, up to the deadline);
        after heartbeat_timeout_s it counts as absent."""
        self._paused.set()

    def resume(self) -> None:
        if self._paused.is_set():
            self._paused.clear()
            try:  # at once, not at the heartbeat thread's next beat: a quorum may form right away,
                # and its members would find this worker's heartbeat stale (Membership._silent)
                self.client.heartbeat(self.rid, timedelta(seconds=2))
                self.store.set(f"alive/{self.worker}", repr(self.now()))
            except Exception:
                pass

    def heading(self, round: int) -> None:
        """Say which round this worker will ask for next (after a heal): the quorums of that round
        wait for it (up to the deadline) even while its heartbeats are paused; those of earlier
        rounds do not (paused, it is not live to them or to the Lighthouse)."""
        self.store.set(f"heading/{self.worker}", f"{round} {self.now()!r}")

    def announce(self, workers: list[int], wait: bool) -> None:
        """Start of a run: say "I am here"; with `wait`, wait (up to the timeout) until every
        worker in `workers` said so, so that round 0's quorum does not form without a slow starter.
        A worker says so once the Lighthouse has had a heartbeat of it, so then it counts every one
        of them as alive (until the forty-third session a fixed 0.5 s of sleep, two heartbeats,
        stood for that)."""
        self._heard.wait(self.heartbeat_timeout_s)  # (not heard by then: quorum() tells, within its timeout)
        self.store.set(f"hello/{self.worker}", "1")
        if wait:
            try:
                self.store.wait([f"hello/{w}" for w in workers], timedelta(seconds=self.timeout_s))
            except Exception as e:
                raise MembershipError(f"not every worker started within {self.timeout_s:g} s: {e}") from None

    def quorum(self, round: int) -> QuorumView:
        """Join the quorum for `round` (blocks) and return it once it stands (module docstring: a
        quorum that left out a live worker before the deadline is discarded and asked again);
        raises MembershipError after the timeout."""
        self.resume()
        self.store.set(f"asked/{self.worker}", f"{round} {self.now()!r}")  # when this worker began to ask
        give_up = time.monotonic() + self.quorum_timeout_s
        while True:
            view = self._join(round, give_up - time.monotonic())
            if self._stands(view):
                return view
            time.sleep(0.05)  # the live worker it lacks is on its way: let it ask first

    def _join(self, round: int, timeout_s: float) -> QuorumView:
        try:
            if timeout_s <= 0:
                raise TimeoutError("waited for live workers until the timeout")
            q = self.client.quorum(replica_id=self.rid, timeout=timedelta(seconds=timeout_s),
                                   address="", store_address="", step=round, world_size=1, shrink_only=False)
        except Exception as e:
            raise MembershipError(f"no quorum for round {round} within {self.quorum_timeout_s:g} s: "
                                  f"{str(e).splitlines()[0][:160]}") from None
        rounds = {worker_of(p.replica_id): int(p.step) for p in q.participants}
        top = max(rounds.values())
        created = f"{q.created.seconds}.{q.created.nanos}" if q.created is not None else ""
        return QuorumView(f"{q.quorum_id}/{created}/{top}", rounds, top, sorted(w for w, s in rounds.items() if s == top))

    def _stands(self, view: QuorumView) -> bool:
        """Whether `view` may be used: every worker it waits for (_awaited) is in it, or the deadline
        passed since the earliest of its active members began to ask. The first member to judge
        decides for all."""
        if not self.workers:
            return True
        now = self.now()
        outside = [j for j in range(self.workers) if j not in view.rounds]
        kinds = ("asked", "heading", "late", "alive")  # a worker's stamps, read for all of them in one round trip
        texts = iter(self._texts([f"{kind}/{j}" for j in outside for kind in kinds]))
        stamps = {j: [_parse_stamp(next(texts)) for _ in kinds] for j in outside}
        missing = [j for j in outside if self._awaited(view.round, now, *stamps[j])]
        if missing:  # it stands without them once the deadline passed since its earliest member asked
            asked = [_parse_stamp(t) for t in self._texts([f"asked/{j}" for j in view.active])]
            ok = now - min(t if r == view.round else float("-inf") for r, t in asked) >= self.deadline_s
        else:
            ok = True
        # the judge also proposes the group the round runs on (reuse), in the same round trip
        taken = self.store.compare_set(f"stands/{view.key}", "", f"1 {self._proposal(view)}" if ok else "0").decode()
        stands = taken.startswith("1 ")
        if stands:
            view.group = taken[2:]
            for j in missing:  # it stands without them: they missed the deadline
                self.store.set(f"late/{j}", repr(now))
        return stands

    def first_try(self, round: int, members: list[int]) -> list[int] | None:
        """The members of round `round`'s first try whose salts went out, as the coordinator's store
        holds them: `members` (this worker's answer: the try it is in, or the first one it noted)
        unless another member wrote first. round.keep_seen calls it between packets and reveal, so
        a worker that joins a retry learns it is a newcomer to the round, as the first try's
        members know from their own notes. Any worker can write the key: a value that is not a
        list of workers is None (no answer), and a false one misleads only the workers without a
        note: it adds or spares replays (replay.newcomer_audits), never moves the replay draw, and
        moves the screen's draws only by leaving out fewer than half the senders' say
        (check.screen_leaves_out); where the misled workers' verdicts then differ from the
        noters', the round's agreement check stops the run."""
        text = self.store.compare_set(f"first/{round}", "", " ".join(map(str, members))).decode()
        parts = text.split(" ")
        if not all(x.isascii() and x.isdigit() and len(x) <= 10 for x in parts):
            return None
        out = [int(x) for x in parts]
        return out if out == sorted(set(out)) and all(x < (self.workers or x + 1) for x in out) else None

    def _awaited(self, round: int, now: float, asked_stamp: tuple, heading_stamp: tuple, late_stamp: tuple,
                 alive_stamp: tuple) -> bool:
        """Whether a quorum of `round` waits for a worker not in it, given its stamps (`_parse_stamp`
        of its asked/, heading/, late/ and alive/ keys). A worker that healed since it last asked
        (membership.heading) is waited for in the round it heads for only, heartbeating or not; any
        other, if it is live and not past this round. Not a worker that missed a deadline and has
        not asked or healed since (stuck, or still computing a round long gone): that would cost
        every round the deadline."""
        (asked_round, asked), (heading_round, heading) = asked_stamp, heading_stamp
        if max(asked, heading) < late_stamp[1]:
            return False
        if heading > asked:
            return heading_round == round
        return (asked_round if asked_round is not None else -1) <= round and alive_stamp[1] > now - self.heartbeat_timeout_s

    def alive_times(self, workers: list[int]) -> dict[int, float]:
        """When each of `workers` last said it was alive (-inf: never), in one round trip."""
        return {j: _parse_stamp(t)[1] for j, t in zip(workers, self._texts([f"alive/{j}" for j in workers]), strict=True)}

    def _stamp_text(self, key: str, store: dist.TCPStore | None = None) -> str | None:
        """The value of `key`, or None if there is none (check() does not block; get() of a
        missing key would wait for it)."""
        try:
            store = store or self.store
            return store.get(key).decode() if store.check([key]) else None
        except (RuntimeError, UnicodeDecodeError):
            return None

    def _texts(self, keys: list[str], store: dist.TCPStore | None = None) -> list[str | None]:
        """The values of `keys` (None where one is missing or unreadable), in one round trip to the
        coordinator when they all exist (the usual case: the keys this reads are written when a worker
        starts), two the first time: on a long link each round trip is the link's latency, and a watch that
        read its keys one by one cost a second per collective at 50 ms."""
        if not keys:
            return []
        store = store or self.store
        try:
            if self._existing.issuperset(keys) or store.check(keys):
                self._existing.update(keys)  # no key this reads is ever deleted
                return [raw.decode() for raw in store.multi_get(keys)]
        except (RuntimeError, UnicodeDecodeError):
            pass
        return [self._stamp_text(k, store) for k in keys]

    def group(self, view: QuorumView) -> PgComm:
        """A gloo group over `view.active`, this worker's index = its position in the list.

        Forming it waits for every member to connect, up to timeout_s or, with gloo's connect
        retries, several times that (seen in tests/test_elastic.py's death test: a member died
        after it had joined the quorum). So it is formed in a thread, and given up on with a
        MembershipError (the round is retried with a new quorum) as soon as a member's heartbeat
        is stale (a death costs heartbeat_timeout_s) or, probed, it cannot be reached (a cut that
        came after `connected`; the retry drops it). The abandoned thread ends when gloo gives up."""
        # its own store connection: the rendezvous blocks in it, while the liveness reads below go on
        own = dist.TCPStore(self._host, self._port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        prefix = dist.PrefixStore(f"pg/{view.key}", own)
        rank, size, made = view.index(self.worker), len(view.active), {}
        probe_at = [time.monotonic() + self.heartbeat_timeout_s]

        def watch() -> str | None:
            """_silent(view), and, every heartbeat_timeout_s that the group's forming or one of its
            collectives waits, a probe of the other members: a path cut after `connected` probed
            holds gloo's connect, or its open sockets, until gloo's own timeout."""
            why = self._silent(view, self._watch_store)
            if why is None and time.monotonic() >= probe_at[0]:
                lost = self.unreachable([j for j in view.active if j != self.worker], self._watch_store)
                probe_at[0] = time.monotonic() + self.heartbeat_timeout_s
                if lost:
                    self._found_cut.update({j: time.monotonic() for j in lost})  # for the retry's `connected`
                    why = f"worker {lost[0]} of the quorum cannot be reached"
            return why

        def form() -> None:
            made["pg"] = dist.ProcessGroupGloo(prefix, rank, size, timedelta(seconds=self.timeout_s))

        why, error = wait_watching(form, watch)
        if why is not None:
            self._leave(view)  # the others still forming it stop waiting too
            raise MembershipError(f"{why} before the round's group formed")
        if error is not None:
            raise error
        probe_at[0] = time.monotonic() + self.heartbeat_timeout_s  # the collectives' waits count from here
        return PgComm(made["pg"], rank, size, watch=watch, leave=lambda: self._leave(view), key=view.key,
                      members=tuple(view.active))

    def keep(self, round: int, comm: object) -> None:
        """`round` committed on `comm`, every collective of it done on every member (a member
        that failed gave the group up): the next round may run on the same group (`reuse`)."""
        self._kept = (round, comm) if isinstance(comm, PgComm) and comm.given_up is None else None

    def reuse(self, view: QuorumView) -> PgComm | None:
        """The group the last round committed on, if the quorum of `view` runs on it again; None if it
        forms a new one (`connected`, then `group`).

        A group is formed once per quorum otherwise: a new TCP connection between every two members,
        each paying slow start, and a rendezvous through the coordinator, about 13 round trips (1.3 s
        of a round on a 50 ms link, bench/elastic_latency.py). The last round's group can be used again
        when this quorum's active members are exactly its members and every one of them committed the
        round before with it: all their collectives matched, so nothing is left in flight on it. Every
        member proposes what it holds (`_proposal`), and the first proposal is taken by all: the
        quorum's first judge writes it with its judgement (`_stands`, no extra round trip), or, where
        none judges, a compare-and-set on the coordinator does. A member that does not hold the
        group taken marks it given up, so the others' first collective on it stops within a watch
        (WATCH_S), and the round is retried with a new quorum and a new group. The reachability
        probes of `connected` are not repeated: a path cut since the last round stalls a collective
        on the reused group, its watch's probe finds the cut (within heartbeat_timeout_s), the group
        is given up, and the retry's `connected` reports the cut member without probing it again."""
        mine = self._proposal(view)
        kept, self._kept = self._kept, None
        taken = view.group
        if taken is None:
            try:
                taken = self.store.compare_set(f"group/{view.key}", "", mine).decode()
            except (RuntimeError, UnicodeDecodeError) as e:
                raise MembershipError(f"the coordinator cannot be reached: {str(e).splitlines()[0][:120]}") from None
        if taken == "-":
            return None
        if kept is not None and taken == mine:
            return kept[1]
        self._leave_key(taken)  # the others run on a group this worker does not hold: they must not wait for it
        raise MembershipError(f"the quorum's members hold different groups (they take {taken!r}); forming a new one")

    def _proposal(self, view: QuorumView) -> str:
        """The group this worker proposes for `view`'s round (`reuse`): the key of the group it kept, if
        it committed the round before on it with exactly these active members; "-" for a new one."""
        kept = self._kept
        if kept is not None and kept[0] + 1 == view.round and kept[1].members == tuple(view.active) \
                and kept[1].given_up is None:
            return kept[1].key
        return "-"

    def _leave(self, view: QuorumView) -> None:
        """Mark the group of `view` given up, for its other members' watches (_silent)."""
        self._leave_key(view.key)

    def _leave_key(self, key: str) -> None:
        self.store.set(f"leftby/{key}", str(self.worker))
        self.store.add(f"left/{key}", 1)

    def _silent(self, view: QuorumView, store: dist.TCPStore | None = None) -> str | None:
        """Why the group of `view` cannot go on, or None: a member's heartbeat is stale (killed,
        frozen, or cut off from the coordinator), or a member gave the group up (PgComm.wait)."""
        others = [j for j in view.active if j != self.worker]
        now = self.now()
        store = store or self.store
        for j, text in zip(others, self._texts([f"alive/{j}" for j in others], store), strict=True):
            if _parse_stamp(text)[1] < now - self.heartbeat_timeout_s:
                return f"worker {j} of the quorum went silent"
        try:  # add(0) reads a counter without waiting for it (get() of a missing key would wait)
            left = store.add(f"left/{view.key}", 0)
        except RuntimeError:
            return "the coordinator cannot be reached"
        if left:
            who = self._stamp_text(f"leftby/{view.key}", store)
            return f"worker {who or '?'} gave the round's group up"
        return None

    def close(self) -> None:
        """Stop heartbeating, and say so at once: no quorum waits for a worker that has finished."""
        self._stop.set()
        self._unlisten()
        self._beat.join(timeout=5)
        try:
            self.store.set(f"alive/{self.worker}", "0")
        except Exception:  # the coordinator already gone
            pass


def offset_to(store: dist.TCPStore, clock: Callable[[], float] = time.time, samples: int = CLOCK_SAMPLES) -> float:
    """The coordinator's clock minus `clock`, from `samples` reads of the one it publishes
    (CLOCK_KEY, rewritten every CLOCK_EVERY_S). A read between t0 and t1 (this clock) of a value v
    says the coordinator's clock was in [v, v + CLOCK_EVERY_S] at some instant in [t0, t1], so the
    offset is within CLOCK_EVERY_S / 2 plus half the round trip of v + CLOCK_EVERY_S / 2 - (t0 + t1)
    / 2. The median of the reads' figures: a value that is not a time, or one another process
    wrote there (the store takes anyone's keys), moves it only if it is half of them."""
    store.wait([CLOCK_KEY])
    figures = []
    for _ in range(samples):
        t0 = clock()
        text = store.get(CLOCK_KEY).decode(errors="replace")
        t1 = clock()
        try:
            v = float(text)
        except ValueError:
            continue
        if math.isfinite(v):
            figures.append(v + CLOCK_EVERY_S / 2 - (t0 + t1) / 2)
        time.sleep(CLOCK_EVERY_S / samples)
    if not figures:
        raise MembershipError(f"the coordinator's clock ({CLOCK_KEY!r} in its store) is not a time: {text[:40]!r}")
    return statistics.median(figures)


def _parse_stamp(text: str | None) -> tuple[int | None, float]:
    """(ROUND, T) of "ROUND T" or (None, T) of "T"; (None, -inf) for none, "-" or anything else."""
    try:
        *head, t = (text or "").split()
        return (int(head[0]) if head else None), float(t)
    except (ValueError, IndexError):
        return None, float("-inf")


def reachable_part(active: list[int], reports: dict[int, set[int]]) -> list[int]:
    """The members of `active` that go on when some cannot reach each other: while a reported pair
    (either side's report counts) is left in, drop the member in the most such pairs; on a tie the
    one that reported more of them itself, then the higher worker id. Deterministic, so every
    member drops the same ones from the same reports. A member that falsely reports every other
    as unreachable drops only itself; one that falsely reports one peer loses the tie to it."""
    bad = {(min(a, b), max(a, b)) for a, lost in reports.items() for b in lost if b in active and b != a}
    keep = list(active)
    while True:
        pairs = [p for p in bad if p[0] in keep and p[1] in keep]
        if not pairs:
            return keep
        keep.remove(max(keep, key=lambda j: (sum(j in p for p in pairs),
                                             sum(k in keep for k in reports.get(j, ())), j)))


class GroupComm:
    """Collectives over a torch.distributed group of the fixed world (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        dist.all_reduce(t, op=op, group=self.group)

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        dist.all_gather(out, t, group=self.group)

    def all_gather_start(self, out: list[torch.Tensor], t: torch.Tensor) -> dist.Work:
        """Starts an all-gather and returns its work (`is_completed()`, `wait()`)."""
        return dist.all_gather(out, t, group=self.group, async_op=True)

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t, group=self.group, group_dst=dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, group=self.group, group_src=src)

    def broadcast_from(self, t: torch.Tensor, src: int) -> None:
        dist.broadcast(t, group=self.group, group_src=src)


def wait_watching(run: Callable[[], object], watch: Callable[[], str | None]) -> tuple[str | None, BaseException | None]:
    """Run `run()` in a thread and wait for it, while another thread calls `watch()` every WATCH_S
    until `run` returns. Returns (None, the exception `run` raised or None) once it returns, or
    (watch's reason, None) as soon as watch names one first; `run`'s thread is then abandoned.

    The watch runs beside the wait, not between its slices: its reads cross the link to the
    coordinator, and on a long link a watch takes round trips of its own. Called between slices,
    it held each collective that outlived one slice until the watch's reads were back (0.9 s per
    collective on a 50 ms link, bench/elastic_latency.py), however soon the collective was done."""
    done, woken, box = threading.Event(), threading.Event(), {}

    def go() -> None:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        done.set()
        woken.set()

    def watching() -> None:
        while not done.wait(WATCH_S):
            try:
                why = watch()
            except Exception as e:  # noqa: BLE001 - a watch that cannot watch stops the wait, as it did in its thread
                why = f"the members' watch failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if why is not None:
                box["why"] = why
                woken.set()
                return

    threading.Thread(target=go, daemon=True).start()
    threading.Thread(target=watching, daemon=True).start()
    woken.wait()
    if done.is_set():  # finished, even if the watch found a reason meanwhile
        return None, box.get("error")
    return box["why"], None


_GIVEN_UP: list = []  # groups left mid-collective: destroying one would block until gloo's own timeout


class PgComm:
    """The same collectives over a bare process group (a quorum's; not part of any world).

    With a `watch` (Membership.group's), every wait watches the members: gloo notices a killed
    peer at once (its sockets close), but a member that is frozen (SIGSTOP, a paused VM) or cut
    off (a partition) holds its sockets open, and gloo would wait the whole collective timeout
    (`[run] timeout_s`). So a wait gives the group up as soon as `watch()` names a reason (a
    member's heartbeat is stale, or a member gave the group up): it raises MembershipError, the
    round is discarded whole and retried with a new quorum, and `leave()` tells the other members,
    so that one that was frozen and comes back finds out at its next collective instead of
    waiting for peers that moved on."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int,
                 watch: Callable[[], str | None] | None = None, leave: Callable[[], None] | None = None,
                 key: str = "", members: tuple[int, ...] = ()) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self.key, self.members = key, members  # the quorum it was formed for (Membership.reuse)
        self._watch, self._leave = watch, leave
        self.given_up: str | None = None

    def wait(self, work) -> None:
        """Wait for a collective of this group (see the class docstring)."""
        if self.given_up is not None:
            raise MembershipError(self.given_up)
        if self._watch is None:
            work.wait()
            return
        # work.wait() in a thread of its own (gloo's send/recv have no future, nor an is_completed()
        # that turns true: a thread is the one way for every op), watched from another
        why, error = wait_watching(work.wait, self._watch)
        if why is not None:
            self.give_up(why)
            raise MembershipError(why)
        if error is not None:
            raise error

    def give_up(self, why: str) -> None:
        self.given_up = why
        _GIVEN_UP.append(self.pg)
        if self._leave is not None:
            try:
                self._leave()
            except Exception:  # the coordinator unreachable: the others' own watch finds out
                pass

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.wait(self.pg.allreduce([t], opts))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        self.wait(self.pg.allgather([out], [t]))

    def broadcast(self, t: torch.Tensor, root: int):
        """Starts a broadcast and returns its work: wait for it with `wait`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.pg.broadcast([t], opts)

    def isend(self, t: torch.Tensor, dst: int):
        """Starts a send and returns its work: wait for it with `wait`."""
        return self.pg.send([t], dst, 0)

    def irecv(self, t: torch.Tensor, src: int):
        """Starts a receive and returns its work: wait for it with `wait`."""
        return self.pg.recv([t], src, 0)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.wait(self.isend(t, dst))

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.wait(self.irecv(t, src))

    def broadcast_from(self, t: torch.Tensor, src: int) -> None:
        self.wait(self.broadcast(t, src))


def serve(argv: list[str]) -> None:
    """A coordinator (args: HOST MIN_WORKERS ROUND_DEADLINE_S HEARTBEAT_TIMEOUT_S) in a process of its own (in its own network namespace for partition runs);
    prints one JSON line {"lighthouse": ..., "store_port": ...}, serves until stdin closes."""
    import json
    import sys

    host, min_workers, deadline, heartbeat = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    coord = Coordinator(min_workers, deadline, heartbeat, host)
    print(json.dumps({"lighthouse": coord.lighthouse_addr, "store_port": coord.store_port}), flush=True)
    sys.stdin.read()
    coord.shutdown()

