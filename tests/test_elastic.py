"""Elastic membership: workers die, lag, come back and join, and the run goes on (issue: faults).

Every fault is declarative (faults.py): "worker 2 dies at round 1, step 2", "worker 1 is 4 s late
in round 3"; each test asserts what the survivors recorded, and that the audit (which redoes every
outer step from the accepted packets) holds: nothing was half-applied.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.faults import FaultError, parse_fault
from veriloco.run import train

ELASTIC = ("--run.membership=elastic", "--run.timeout_s=30", "--run.heartbeat_timeout_s=1.5")


def events_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


class Lighthouse:
    """A Coordinator and `workers` Memberships in this process (membership.py), for the quorum
    tests: `ask(round, {worker: delay_s})` asks for one quorum from threads."""

    def __init__(self, deadline: float, workers: int = 3, timeout_s: float = 20) -> None:
        from veriloco.membership import Coordinator, Membership

        self.coord = Coordinator(min_workers=2, round_deadline_s=deadline, heartbeat_timeout_s=1.0)
        self.ms = [Membership(w, self.coord.lighthouse_addr, self.coord.store_port, timeout_s, heartbeat_timeout_s=1.0,
                              round_deadline_s=deadline, workers=workers) for w in range(workers)]
        import time

        time.sleep(0.5)  # two heartbeats, as Membership.announce waits: a quorum asked for at once
        # could form before the Lighthouse has heard from the last member, and leave it out

    def ask(self, r: int, after: dict[int, float]) -> tuple[dict, float]:
        import threading
        import time

        views, t0 = {}, time.monotonic()

        def one(w: int) -> None:
            time.sleep(after[w])
            views[w] = self.ms[w].quorum(r)

        threads = [threading.Thread(target=one, args=(w,)) for w in after]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return views, time.monotonic() - t0

    def groups(self, views: dict) -> dict:
        """Each member's new group over its view (Membership.group), formed from threads."""
        import threading

        comms = {}
        threads = [threading.Thread(target=lambda w=w: comms.__setitem__(w, self.ms[w].group(views[w]))) for w in views]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return comms

    def close(self) -> None:
        for m in self.ms:
            m.close()
        self.coord.shutdown()


def test_elastic_without_faults_is_the_static_run(tmp_path):
    common = ("--topology.workers=3", "--train.rounds=3")
    _, static = train(tiny(*common), str(tmp_path / "static"), quiet=True)
    _, elastic = train(tiny(*common, *ELASTIC), str(tmp_path / "elastic"), quiet=True)
    a, b = rounds_of(tmp_path / "static"), rounds_of(tmp_path / "elastic")
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert elastic["eval_loss_end"] == pytest.approx(static["eval_loss_end"], rel=1e-6)
    assert audit_run(tmp_path / "elastic").ok


@pytest.mark.parametrize("delay", [0, 1])
def test_dead_worker_survivors_go_on_it_rejoins_and_a_death_mid_exchange_is_retried(tmp_path, delay):
    run_dir = tmp_path / "run"
    # with delay 1, the default outer momentum (Nesterov 0.9) is unstable on this config even
    # without faults (eval rises from round 4: 3.53 -> 7.47 by round 8); 0.5 trains smoothly
    momentum = ("--outer.momentum=0.5",) if delay else ()
    cfg = tiny("--topology.workers=3", "--train.rounds=8", f"--outer.delay={delay}", *momentum, *ELASTIC)
    _, summary = train(cfg, str(run_dir), quiet=True,
                       # 2 is restarted 3 s after its death (a worker starts in ~0.1 s from the
                       # forkserver, procs.py): the survivors commit rounds without it meanwhile
                       faults=["die:2@1.2", "restart:2+3", "die:1@4"])  # 1 dies inside round 4's exchange
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(8))
    # 2 dies at step 2 of round 1; with delay 1, round 0's exchange runs under round 1's steps, so
    # whether round 0 still has its packet depends on that thread's timing
    # (under load, with delay 1 its restart can even heal before any round commits without it)
    gone = next((r["round"] for r in recs if r["verdicts"][2] == "absent"), None)
    assert gone in ((1,) if delay == 0 else (0, 1, None)), gone
    if gone is not None:
        assert all(r["verdicts"] == ["accept"] * 3 for r in recs[:gone])
        assert recs[gone]["members"] == [0, 1]
        assert recs[gone]["train_loss"][2] is None and recs[gone]["bytes_sent"][2] == 0
    rejoined = [r["round"] for r in recs[2:] if r["verdicts"][2] == "accept"]
    assert rejoined, "worker 2 never took part again after its restart"
    # 1 dies in round 4's exchange; with delay 1 that exchange runs in a thread under round 5's
    # inner steps, and whether round 4 still counts its packet depends on that thread's timing.
    # Under load it can be left out of an earlier round as late and heal past round 4: it then
    # dies in the first exchange it reaches after it (faults.py). (Before the quorum judge of
    # membership.py, a worker left out once could stay out for the rest of the run, never reach an
    # exchange and never die: 2 runs in about 30 here.)
    absent1 = [r["verdicts"][1] == "absent" for r in recs]
    gone1 = next((i for i in range(len(recs)) if all(absent1[i:])), None)  # 1 was not restarted: absent to the end
    kinds = [(e["event"], e["worker"]) for e in events_of(run_dir)]
    assert kinds.count(("started", 2)) == 2 and ("died", 2) in kinds
    assert gone1 is not None, [r["verdicts"] for r in recs]
    left_out = [(r["round"], r["verdicts"][1]) for r in recs[:gone1] if r["verdicts"][1] != "accept"]
    assert gone1 in ((4,) if delay == 0 else (4, 5)) or (left_out and 4 < gone1 < len(recs)), (gone1, left_out)
    assert 1 not in recs[gone1]["members"]  # committed without 1
    assert ("died", 1) in kinds
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_straggler_is_left_out_as_late_and_a_new_worker_joins(tmp_path):
    run_dir = tmp_path / "run"
    # a 0.4 s link latency makes a round last long enough (without using CPU) for a process to
    # start and join while the run is still going (from the forkserver: it took part from round 4
    # on a loaded machine). 16 rounds (24 before): worker 1, 4 s late in round 3, was back in the
    # round after its 4 s were over (round 7 or 8 in two runs); at the link's floor (~0.6 s a round)
    # that is ~7 rounds, back by ~11: 4 rounds to spare
    cfg = tiny("--topology.workers=4", "--train.rounds=16", "--run.min_workers=2", "--run.round_deadline=1",
               "--link.latency=400ms", *ELASTIC)
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["join:3@2", "late:1@3+4"])
    recs = rounds_of(run_dir)
    assert summary["complete"]
    assert recs[0]["verdicts"][3] == "absent" and recs[1]["verdicts"][3] == "absent"  # not started yet
    assert any(r["verdicts"][3] == "accept" for r in recs[2:]), "the new worker never took part"
    assert recs[3]["verdicts"][1] == "late" and 1 not in recs[3]["members"]
    assert recs[3]["round_s"] < 4.0  # the others did not wait out the straggler's 4 s
    assert recs[-1]["verdicts"][1] == "accept"  # it healed and came back
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_a_file_system_without_locks_is_refused_before_an_elastic_run_starts(tmp_path, monkeypatch, capsys):
    """An elastic round is recorded by whichever member takes RUN/.commit.lock first; on a file
    system without locks (an NFS mount without its lock manager: ENOLCK) that flock raises in a
    worker at its first commit, after the run directory was made. `veriloco train` and `veriloco
    join` now refuse it in one line, exit 2, with nothing written."""
    import errno
    import fcntl

    from conftest import TINY, cli

    from veriloco.elastic import check_commit_lock
    from veriloco.records import RunDirError

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    code, lines, _ = cli(monkeypatch, capsys, "train", str(TINY), *ELASTIC, "--out", str(tmp_path / "r"))
    assert code == 2 and len(lines) == 1 and "is on a file system without locks (No locks available)" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(RunDirError, match="on NFS, mount it with its lock manager"):  # join's check, on its run directory
        check_commit_lock(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_workers_stamp_in_the_coordinators_clock_whatever_their_machines_say(monkeypatch):
    """Heartbeats, quorum requests and late marks are times that one worker writes and another
    reads against its own now. In each machine's wall clock, a worker 5 s behind looked silent to
    the others (and saw a dead one alive for 5 s more), and one 3 s ahead found the others' stamps
    3 s old, past the 1 s timeout: everyone silent. Each worker now reads the
    clock the coordinator publishes when it starts (`offset_to`) and stamps and reads in it."""
    import time

    import veriloco.membership as membership
    from veriloco.membership import Coordinator, Membership, QuorumView

    monkeypatch.setattr(membership, "CLOCK_REREAD_S", 3.0)  # (10 s in a run; after the checks at about 1 s)
    coord = Coordinator(min_workers=2, round_deadline_s=0, heartbeat_timeout_s=1.0)
    skews = [0.0, 3.0, -5.0]
    ms = [Membership(w, coord.lighthouse_addr, coord.store_port, 20, heartbeat_timeout_s=1.0, workers=3,
                     clock=lambda s=s: time.time() + s) for w, s in enumerate(skews)]
    try:
        assert all(abs(m.offset + s) < 0.05 for m, s in zip(ms, skews, strict=True)), [m.offset for m in ms]
        time.sleep(0.5)  # two heartbeats
        view = QuorumView("k", {0: 0, 1: 0, 2: 0}, 0, [0, 1, 2])
        assert [m._silent(view) for m in ms] == [None, None, None]
        ages = [m.now() - t for m in ms for t in m.alive_times([0, 1, 2]).values()]
        assert all(-0.1 < a < 1.0 for a in ages), ages  # a beat every 0.2 s; the skews are 3 and 5 s
        for m in ms:  # as before: each its own wall clock
            m.offset = 0.0
        time.sleep(0.4)  # worker 2's next heartbeats, stamped 5 s behind
        assert ms[0]._silent(view) == "worker 2 of the quorum went silent"
        # read again every CLOCK_REREAD_S (clocks drift, NTP may step one): worker 1's offset comes back
        deadline = time.monotonic() + 8
        while abs(ms[1].offset + 3.0) > 0.05 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert abs(ms[1].offset + 3.0) < 0.05, ms[1].offset
    finally:
        for m in ms:
            m.close()
        coord.shutdown()


def test_the_clock_offset_is_the_median_of_its_reads_so_a_few_bad_values_do_not_move_it():
    """The TCPStore takes anyone's keys: a value that is not a time, or a time another process wrote
    there, is outvoted (`offset_to`: the median of 8 reads), and a clock key that never holds a time
    is a MembershipError, not a number."""
    import time

    from veriloco.membership import MembershipError, offset_to

    class Store:  # what offset_to asks of a TCPStore, answering with the coordinator's clock 7 s ahead
        def __init__(self, bad: dict[int, bytes]) -> None:
            self.bad, self.reads = bad, 0

        def wait(self, keys) -> None:
            pass

        def get(self, key) -> bytes:
            self.reads += 1
            return self.bad.get(self.reads, repr(time.time() + 7.0).encode())

    assert abs(offset_to(Store({})) - 7.0) < 0.05
    assert abs(offset_to(Store({2: b"garbage", 3: b"1e300", 5: b"nan", 6: repr(time.time() - 50).encode()})) - 7.0) < 0.05
    with pytest.raises(MembershipError, match="is not a time"):
        offset_to(Store(dict.fromkeys(range(1, 9), b"garbage")))


def test_a_worker_whose_clock_is_5_s_behind_takes_part_in_every_round_over_a_slow_link(tmp_path):
    """`--fault skew:1-5` (worker 1's wall clock 5 s behind worker 0's) on a kernel-shaped 2 Mbit/s
    link, where the exchange's collectives wait long enough for the members' watch to read each
    other's heartbeats: before, the run committed no round in 90 s and stopped ("elastic run stalled
    at round 0"), by hand; the same run without the skew took 12 s. Now every worker is accepted in
    every round."""
    from veriloco import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    # 2 workers (worker 1 skewed): the one punctual member reads the skewed one's heartbeats as the
    # others did (with every offset forced to 0 this run stalls at round 0 as the 3-worker one did);
    # a third member only added a worker's start (a fresh interpreter in its namespace)
    base = ("--topology.workers=2", "--train.rounds=2", "--link.bandwidth=2mbit", "--link.shaping=kernel", *ELASTIC)
    _, summary = train(tiny(*base), str(tmp_path / "run"), quiet=True, faults=["skew:1-5"])
    recs = rounds_of(tmp_path / "run")
    assert summary["complete"] and [r["verdicts"] for r in recs] == [["accept"] * 2] * 2, [r["verdicts"] for r in recs]


@pytest.mark.parametrize(
    ("spec", "message"),
    [("die:9@1", "names worker 9"), ("skew:1+", "is not one of"), ("skew:7-2", "names worker 7"), ("explode:1@2", "is not one of"), ("late:1@2", "is not one of"),
     ("stop:1@2", "is not one of"), ("sever:1@2+3", "is not one of"), ("sever:1-3@2+3", "names worker 3"),
     ("sever:1-1@2+3", "severs worker 1 from itself")],
)
def test_bad_fault_specs_are_rejected(spec, message):
    with pytest.raises(FaultError, match=message):
        parse_fault(spec, workers=3)


def test_a_sever_fault_names_both_workers():
    f = parse_fault("sever:2-0@3+4.5", workers=3)
    assert (f.kind, f.worker, f.peer, f.round, f.seconds) == ("sever", 2, 0, 3, 4.5)


def test_a_worker_that_healed_past_its_fault_dies_at_the_next_point_it_reaches(monkeypatch):
    from veriloco import faults

    fired = []
    monkeypatch.setattr(faults, "die", lambda: fired.append(True))
    specs = [parse_fault(s, workers=3) for s in ("die:1@4", "die:1@2.5", "late:1@3+1", "die:2@1")]
    inj = faults.Injector(specs, worker=1)
    inj.at_step(2, 4)
    inj.in_exchange(3)
    assert not fired
    inj.at_step(3, 0)  # it skipped round 2 (healed from 1 to 3): the step fault fires at its next step
    assert len(fired) == 1
    assert faults.first_death(inj.faults) == specs[1]  # the launcher drops the one that fired
    inj = faults.Injector([specs[0]], worker=1)
    inj.in_exchange(5)  # left out of round 4 as late, healed to 5: dies in round 5's exchange
    assert len(fired) == 2


def test_a_death_once_the_packet_is_out_comes_after_the_exchange_of_its_round(monkeypatch):
    """die:W@R.sent fires at after_sent (having waited for the exchange), never in_exchange, and
    the launcher counts it after die:W@R of the same round."""
    from veriloco import faults

    waited, fired = [], []
    monkeypatch.setattr(faults, "die", lambda: fired.append(True))
    sent, mid = parse_fault("die:1@2.sent", workers=3), parse_fault("die:1@2", workers=3)
    assert (sent.kind, sent.round, sent.step, sent.sent) == ("die", 2, None, True)
    inj = faults.Injector([sent], worker=1)
    inj.in_exchange(2)
    inj.after_sent(1, lambda: waited.append(1))
    assert not fired and not waited
    inj.after_sent(2, lambda: waited.append(2))
    assert fired == [True] and waited == [2]
    assert faults.first_death([sent, mid]) == mid
    with pytest.raises(FaultError, match="is not one of"):
        parse_fault("die:1@2.later", workers=3)


def test_cli_fault_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    # `veriloco train` in this process: the one-line error is the point, not an interpreter's start
    from conftest import cli

    def run(*args: str) -> tuple[int, list[str], str]:
        return cli(monkeypatch, capsys, "train", str(ROOT / "configs" / "tiny.toml"), "--out", str(tmp_path / "r"), *args)

    code, lines, _ = run("--fault", "die:7@1", "--run.membership=elastic")
    assert code == 2 and len(lines) == 1 and "names worker 7" in lines[0], lines
    code, lines, _ = run("--fault", "die:1@1")
    assert code == 2 and "needs run.membership = 'elastic'" in "\n".join(lines), lines
    assert not (tmp_path / "r" / "rounds.jsonl").exists()


def test_partition_minority_commits_nothing_then_rejoins_with_the_same_params(tmp_path):
    from veriloco import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    cfg = tiny("--topology.workers=3", "--train.rounds=14", "--link.latency=400ms", *ELASTIC)
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["partition:2@3+5"])  # cut worker 2's veth for 5 s
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(14))  # one record per round
    events = events_of(run_dir)
    cut = next(e for e in events if e["event"] == "cut")
    back = next(e for e in events if e["event"] == "reconnected")
    during = recs[cut["round"]:back["round"]]
    assert during and all(r["members"] == [0, 1] and r["verdicts"][2] == "absent" for r in during)
    assert recs[-1]["verdicts"] == ["accept"] * 3  # back in, from the same params (hashes agree each round)
    assert not any(e["event"] == "died" for e in events)  # it waited out the cut, it did not crash
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_two_workers_that_cannot_reach_each_other_cost_the_run_one_of_them_not_its_progress(tmp_path):
    """A partial partition: workers 1 and 2 lose each other for 9 s, both still reach the coordinator
    and worker 0. Before each round's group forms its members probe each other and drop one of the
    pair (the higher id); without that, every try of the round waited gloo's timeout (30 s here):
    nothing was committed until the cut ended (a 90 s cut stopped the run as stalled)."""
    from veriloco import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    # delay 1: the quorum, the probes and the exchange run under the next round's steps, and the
    # dropped worker pauses its heartbeats while it heals (delay 0 takes the same path in the
    # foreground: checked by hand, see the README)
    cfg = tiny("--topology.workers=3", "--train.rounds=12", "--link.latency=400ms", "--outer.delay=1", *ELASTIC)
    # 9 s: finding the cut costs the round it lands in up to ~2 heartbeat timeouts (a stalled try,
    # then the probes); a 5 s cut once ended within that round, leaving no round inside it to check
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["sever:1-2@2+9"])
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(12))
    events = events_of(run_dir)
    cut = next(e for e in events if e["event"] == "cut")
    back = next(e for e in events if e["event"] == "reconnected")
    assert cut["worker"] == 1 and cut["peer"] == 2
    during = recs[cut["round"] + 1:back["round"]]  # the round after the cut began (delay 1: in flight) to the end
    # one of the pair is out of each round: the higher id when the probes before the group find the
    # cut; either, when the cut lands after them and a waiting worker's probe finds it first
    assert during and all(r.get("members") in ([0, 1], [0, 2]) and r["verdicts"][3 - r["members"][1]] == "absent"
                          for r in during), [(r["round"], r.get("members")) for r in recs]
    assert max(r["round_s"] for r in recs) < 10, [r["round_s"] for r in recs]  # never a gloo timeout
    assert recs[-1]["verdicts"] == ["accept"] * 3  # back in after the cut
    assert not any(e["event"] == "died" for e in events)
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_with_delay_1_a_straggler_has_a_round_of_slack(tmp_path):
    """The same late packet (worker 1's, 1.0 s late in round 1) side by side: with delay 0 the others
    wait for it; with delay 1 the wait runs under their next round's inner steps."""
    # 200 tiny steps (~0.3-1 s, by the machine's load) to hide most of the 1.0 s under. Only the
    # rounds read below are trained: round 1 with delay 0; round 2 too with delay 1, whose steps
    # hide round 1's exchange (each round is 200 steps: the slowest part of the file)
    common = ("--topology.workers=3", "--train.inner_steps=200", "--run.round_deadline=3", *ELASTIC)
    waits, hidden = {}, 0.0
    for delay in (0, 1):
        run_dir = tmp_path / f"d{delay}"
        train(tiny(*common, f"--train.rounds={2 + delay}", f"--outer.delay={delay}"), str(run_dir), quiet=True,
              faults=["late:1@1+1.0"])
        recs = rounds_of(run_dir)
        assert recs[1]["verdicts"] == ["accept"] * 3  # within the deadline: not late
        # the idle time of the punctual worker that waited longer for round 1's packets (under
        # load either one's own steps may run late by a good part of the straggler's 1.0 s)
        j = max((0, 2), key=lambda k: recs[1]["wait_s"][k])
        waits[delay] = recs[1]["wait_s"][j]
        if delay:
            hidden = recs[2]["inner_s"][j]  # round 1's exchange runs under round 2's steps
        report = audit_run(run_dir)
        assert report.ok, report.first_failure
    # the others wait for most of the 1.0 s (less if they were slower: with 0.7 s late and a bound
    # of 0.4 this failed once under load, at 0.36)
    assert waits[0] > 0.5, waits
    # with delay 1 only what round 2's steps did not cover is left to wait (how long they take
    # depends on the machine and its load: measured, not assumed)
    assert waits[1] <= max(0.0, waits[0] - hidden) + 0.25, (waits, hidden)
    assert waits[1] < waits[0] - 0.5 * min(hidden, waits[0]), (waits, hidden)


def test_a_healer_whose_round_is_never_recorded_heals_to_the_round_the_others_retry(monkeypatch):
    """With delay 1 a healing worker stops heartbeating and waits for the record of the round
    before the one it heals to. If a member of that round's quorum died mid-exchange and the rest
    are fewer than min_workers, it is never recorded without the healer: after run.timeout_s the
    healer heals to the first unrecorded round instead and joins the retry (else the run stalls)."""
    from types import SimpleNamespace

    from veriloco import elastic
    from veriloco.membership import MembershipError

    records = [{"round": i} for i in range(4)]  # rounds 0-3 recorded; 4 is being retried
    healed, resumed = [], []

    def heal(w, to_round):
        if to_round - 1 - 1 >= len(records):  # delay 1: waits for the record of to_round - 2
            raise MembershipError(f"worker 2: round {to_round - 2} was not recorded within 30 s")
        healed.append(to_round)
        return to_round

    monkeypatch.setattr(elastic, "heal", heal)
    w = SimpleNamespace(worker=2, run=SimpleNamespace(rounds=lambda: records))
    members = SimpleNamespace(resume=lambda: resumed.append(True))
    assert elastic.heal_toward(w, members, 6, quiet=True) == 4  # wanted 6 (waits for round 4)
    assert healed == [4] and resumed == [True]  # heartbeating again, for the quorum of round 4
    assert elastic.heal_toward(w, members, 5, quiet=True) == 5 and healed == [4, 5] and len(resumed) == 1


def _sleeper(run_dir: str) -> None:
    from veriloco.elastic import _stacks_on_signal

    _stacks_on_signal(run_dir, 0)
    import time

    time.sleep(60)


def test_a_stalled_run_reports_what_each_worker_was_waiting_on(tmp_path, capsys):
    import time

    from veriloco.elastic import _dump_stacks, _Spawned
    from veriloco.procs import context

    p = context().Process(target=_sleeper, args=(str(tmp_path),))
    p.start()
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "stacks-0.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # registered (the file is opened at registration)
        assert _dump_stacks({0: _Spawned(p)}, tmp_path)
    finally:
        p.kill()
        p.join()
    stacks = (tmp_path / "stacks-0.txt").read_text()
    assert "_sleeper" in stacks and "test_elastic.py" in stacks
    assert "worker 0's threads at the stall" in capsys.readouterr().err


def test_max_restarts_starts_a_dead_worker_again_as_often_as_it_allows(tmp_path):
    """No restart fault: the launcher's own policy. Worker 2 dies (kill -9) in round 1 and is
    started again; it dies again in round 6 and, its one restart spent, stays out."""
    run_dir = tmp_path / "run"
    cfg = tiny("--topology.workers=3", "--train.rounds=12", "--link.latency=400ms", "--run.max_restarts=1", *ELASTIC)
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["die:2@1.2", "die:2@6.1"])
    assert summary["complete"]
    events = events_of(run_dir)
    mine = [(e["event"], e.get("restarts_left")) for e in events if e["worker"] == 2]
    assert mine == [("started", None), ("died", None), ("restarting", 0), ("started", None), ("died", None)], mine
    recs = rounds_of(run_dir)
    back = [r["round"] for r in recs[2:] if r["verdicts"][2] == "accept"]
    assert back and max(back) <= 6, [r["verdicts"][2] for r in recs]  # in again between its deaths
    assert all(r["verdicts"][2] == "absent" for r in recs[7:])
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_workers_started_by_join_on_another_machine_take_part_as_local_ones(tmp_path):
    """The launcher starts workers 0 and 1 (`--workers 0,1`); `veriloco join` starts worker 2 from
    RUN/coordinator.json, as on a second machine sharing the run directory (here: the same one).
    Each machine prints the progress line of every round, in order (the worker that committed a
    round printed it, so each machine showed only the rounds its own workers committed first)."""
    import time

    from typer.testing import CliRunner

    from veriloco.cli import app

    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "veriloco.cli"]
    launcher = subprocess.Popen([*cli, "train", str(ROOT / "configs" / "tiny.toml"), "--topology.workers=3",
                                 "--train.rounds=2", *ELASTIC, "--workers", "0,1", "--out", str(run_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = run_dir / "workers" / "1.lock"
    try:
        while not (lock.exists() and lock.read_text().strip()) and launcher.poll() is None:
            time.sleep(0.1)
        # worker 1 runs already (the launcher's, waiting for worker 2 in round 0): a join of it is
        # refused before it starts anything; it ran a second worker 1 beside the first
        # (in this process: refused at once, it needs no interpreter of its own)
        again = CliRunner().invoke(app, ["join", str(run_dir), "--workers", "1", "--quiet"])
        joined = subprocess.run([*cli, "join", str(run_dir), "--workers", "2"], capture_output=True,
                                text=True, timeout=300)
        out, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert again.exit_code == 2 and again.stderr.splitlines() == [
        f"veriloco: error: worker 1 of {run_dir} is running already (pid {lock.read_text().split()[0]}): a worker id runs "
        "once (on this machine or one sharing the run directory)"], again.output
    assert joined.returncode == 0 and "workers 2 done" in joined.stdout, joined.stderr
    assert launcher.returncode == 0, err
    for printed in (out, joined.stdout):
        assert [ln.split("|")[0].split()[1] for ln in printed.splitlines() if ln.startswith("round ")] == \
            ["1/2", "2/2"], printed  # (each round was printed once, by the machine that committed it)
    recs = rounds_of(run_dir)
    assert [r["verdicts"] for r in recs] == [["accept"] * 3] * 2  # worker 2 in every round, from round 0
    assert not (run_dir / "coordinator.json").exists()  # the launcher removes it when it ends
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_join_refuses_what_it_cannot_use_in_one_line(tmp_path):
    import socket

    from typer.testing import CliRunner

    from veriloco.cli import app
    from veriloco.run import prepare_run

    prepare_run(tiny(), str(tmp_path / "static"))  # a static run's directory: its manifest, no training
    run, _ = prepare_run(tiny("--run.membership=elastic"), str(tmp_path / "elastic"))
    with socket.socket() as s:  # a port nobody listens on: the launcher that wrote the file is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run.root / "coordinator.json").write_text(json.dumps({
        "lighthouse": f"http://127.0.0.1:{port}", "store_host": "127.0.0.1", "store_port": port, "eval_start": 5.0,
        "first": [0, 1], "stop_after": None, "launcher_pid": 1}))
    for args, needle in [
        (["join", str(tmp_path / "static"), "--workers", "1"], "is not an elastic run"),
        (["join", str(tmp_path / "static"), "--workers", "1,x"], "--workers takes distinct worker ids"),
        (["join", str(tmp_path / "nothing"), "--workers", "1"], "not a run directory"),
        (["join", str(tmp_path / "elastic"), "--workers", "1"], "does not answer"),  # a stale coordinator.json
        (["train", str(ROOT / "configs" / "tiny.toml"), "--workers", "0", "--out", str(tmp_path / "r")],
         "--host and --workers need run.membership = 'elastic'"),
        (["train", str(ROOT / "configs" / "tiny.toml"), "--run.membership=elastic", "--workers", "0,7",
          "--out", str(tmp_path / "r")], "--workers must name workers of 0..1"),
        # an address the coordinator cannot listen on: it failed with exit 1 after making the run's
        # directory (999.1.1.1)
        *((["train", str(ROOT / "configs" / "tiny.toml"), "--run.membership=elastic", "--host", host,
            "--out", str(tmp_path / "r")], f"--host {host}: not an address of this machine")
          for host in ("999.1.1.1", "192.0.2.1", "2001:db8::1")),
    ]:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1 and needle in res.stderr, (args, res.output)
    assert not (tmp_path / "r").exists()


def test_kernel_shaping_moves_the_exchange_over_a_real_rate_limited_link(tmp_path):
    """`[link] shaping = "kernel"`: the workers in network namespaces, each veth shaped to 10 Mbit/s by
    tc tbf and every path 20 ms long (netns.py's delay line), nothing paced in software. Each
    exchange then takes at least the latency and what its bytes need at that rate; over loopback
    it would take milliseconds."""
    from veriloco import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    cfg = tiny("--topology.workers=3", "--train.rounds=3", "--link.bandwidth=10mbit", "--link.latency=20ms",
               "--link.shaping=kernel", "--compress.codec=fp32", *ELASTIC)
    from veriloco.elastic import _paced
    from veriloco.link import Link

    assert _paced(cfg, Link(10e6, 0.02)) is None  # the kernel link alone: no software pacing on top
    _, summary = train(cfg, str(run_dir), quiet=True)
    recs = rounds_of(run_dir)
    assert summary["complete"] and all(r["verdicts"] == ["accept"] * 3 for r in recs)
    for r in recs:
        need = 0.02 + max(r["bytes_sent"]) * 8 / 10e6  # the latency and the most any worker sent, at 10 Mbit/s
        assert min(r["exchange_s"]) > 0.9 * need, (r["exchange_s"], need)
    # and the protocol's round trips stay few: rounds after the first run on the first's group, and
    # no collective waits on its watch's reads (bench/elastic_latency.py: 9.4 s a round at 50 ms
    # before, about 0.9 s after; at 20 ms, with these bytes, about 3.7 s before, 0.7 s after)
    protocol = [r["round_s"] - max(r["inner_s"]) for r in recs[1:]]
    assert max(protocol) < 2.0, protocol
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_workers_that_crash_are_named_with_their_error(tmp_path):
    # not a planned fault: a bug in every worker. The launcher stops at once and says what each died of.
    crash = "red_team:Crashes:at=1"  # after round 0, which both start and commit together
    with pytest.raises(RuntimeError, match="stopped at round 1 of 3: every worker is gone") as err:
        train(tiny(*ELASTIC, f"--adversary.0={crash}", f"--adversary.1={crash}"), str(tmp_path / "run"), quiet=True)
    assert "worker 0 died of ValueError: worker 0 crashes in round 1 (red_team.Crashes)" in str(err.value)
    assert "worker 1 died of ValueError: worker 1 crashes in round 1" in str(err.value)
    died = [e for e in events_of(tmp_path / "run") if e["event"] == "died"]
    assert sorted(e["worker"] for e in died) == [0, 1] and all("crashes in round 1" in e["error"] for e in died)
    assert "Traceback" in (tmp_path / "run" / "error-0.txt").read_text()


def test_a_worker_left_out_once_is_waited_for_again_until_the_deadline():
    """torchft's Lighthouse forms a "fast quorum" as soon as the previous quorum's members are all
    back, so on its own a worker left out once stays out whenever it asks last (membership.py):
    with Memberships built with `workers=0`, which turns the judge off, round 1 comes out [0, 2]
    (torchft 0.2.0)."""
    import time

    deadline = 2.0
    lh = Lighthouse(deadline)
    ms, ask = lh.ms, lh.ask
    try:
        ms[1].pause()  # round 0 forms without 1: its heartbeats stopped (starved, or healing)
        time.sleep(2.0)  # stale to the Lighthouse (1 s), even under load
        views, _ = ask(0, {0: 0.0, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 2]] * 2
        ms[1].resume()
        time.sleep(0.4)
        # round 1: 1 is alive and asks 0.5 s after the others, well inside the deadline: it is in
        views, _ = ask(1, {0: 0.0, 1: 0.5, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 1, 2]] * 3
        assert len({v.key for v in views.values()}) == 1
        # round 2: 1 is alive but never asks: the others go on without it, after the deadline
        views, waited = ask(2, {0: 0.0, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 2]] * 2
        assert waited >= deadline - 0.1, waited
        # round 3: it still has not asked since it missed the deadline (stuck): not waited for again
        views, waited = ask(3, {0: 0.0, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 2]] * 2
        assert waited < deadline / 2, waited
        # round 4: it asks again (first, so it is in); round 5: 0.5 s after the others, waited for again
        views, _ = ask(4, {0: 0.3, 1: 0.0, 2: 0.3})
        assert [v.active for v in views.values()] == [[0, 1, 2]] * 3
        views, _ = ask(5, {0: 0.0, 1: 0.5, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 1, 2]] * 3
    finally:
        lh.close()


def test_a_member_that_dies_before_the_group_forms_costs_a_heartbeat_timeout_not_the_run_timeout():
    import time

    from veriloco.membership import MembershipError

    lh = Lighthouse(5.0, workers=2, timeout_s=60)
    ms = lh.ms
    try:
        views, _ = lh.ask(0, {0: 0.0, 1: 0.0})
        assert views[0].active == [0, 1]
        ms[1].pause()  # 1 goes silent (as if killed) and never connects
        t0 = time.monotonic()
        with pytest.raises(MembershipError, match="worker 1 of the quorum went silent"):
            ms[0].group(views[0])
        assert time.monotonic() - t0 < 10  # the collective timeout is 60 s
    finally:
        lh.close()


def test_overlap_steps_elastic_is_the_static_run_and_survives_a_death(tmp_path):
    """`[outer] overlap_steps` under elastic membership: round r-1 lands before step tau of round r
    (elastic._lander). Without faults the run is bit for bit the static one; with a worker killed
    and restarted, it heals from round r-2's params and lands round r-1 from its record, and the
    replays, the agreement check and the audit (which replays every landing) hold."""
    common = ("--topology.workers=3", "--outer.delay=1", "--outer.overlap_steps=1", "--outer.momentum=0.5")
    _, static = train(tiny(*common, "--train.rounds=3"), str(tmp_path / "static"), quiet=True)
    _, elastic = train(tiny(*common, "--train.rounds=3", *ELASTIC), str(tmp_path / "elastic"), quiet=True)
    a, b = rounds_of(tmp_path / "static"), rounds_of(tmp_path / "elastic")
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert elastic["eval_loss_end"] == pytest.approx(static["eval_loss_end"], rel=1e-6)

    # worker 2 is killed in round 1 and back 1 s later, before the others count it dead: it heals
    # into round 1, whose start point (eager correction) is its dead process's round-0 delta, and
    # every worker-round is replayed, its own and those it audits, from the others' views
    run_dir = tmp_path / "faults"
    _, summary = train(tiny(*common, "--train.rounds=6", "--verify.replay_probability=1", "--train.inner_state=reset",
                            "--verify.trace_every=5", "--link.latency=300ms", *ELASTIC),
                       str(run_dir), quiet=True, faults=["die:2@1.2", "restart:2+1"])
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(6))
    kinds = [(e["event"], e["worker"]) for e in events_of(run_dir)]
    assert kinds.count(("started", 2)) == 2 and ("died", 2) in kinds
    # no worker is ever refused; the restarted one is absent, or late where its start outlasts the
    # round deadline on a loaded machine (seen once with the suite on 2 processes beside a 43M-param run)
    assert all(v in ("accept", "absent", "late") for r in recs for v in r["verdicts"]), [r["verdicts"] for r in recs]
    assert recs[-1]["verdicts"] == ["accept"] * 3
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_overlap_steps_elastic_a_straggler_learns_at_the_landing_that_it_was_left_out(tmp_path):
    """With `overlap_steps`, the round in flight settles inside the next round's inner steps: a
    worker whose packet missed the deadline learns there that the round was committed without it
    (elastic._Behind), drops the round's work, heals, and takes part again."""
    run_dir = tmp_path / "run"
    cfg = tiny("--topology.workers=3", "--outer.delay=1", "--outer.overlap_steps=1", "--outer.momentum=0.5",
               "--train.rounds=14", "--run.round_deadline=1", "--link.latency=300ms", *ELASTIC)
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["late:1@3+2"])
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(14))
    assert recs[3]["verdicts"][1] == "late" and 1 not in recs[3]["members"], [r["verdicts"] for r in recs]
    assert recs[-1]["verdicts"] == ["accept"] * 3, [r["verdicts"] for r in recs]  # it healed and came back
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_a_healer_is_waited_for_in_the_round_it_heads_for_and_not_before():
    import time

    deadline = 4.0
    lh = Lighthouse(deadline)
    ms, ask = lh.ms, lh.ask
    try:
        time.sleep(0.6)  # every heartbeat has reached the Lighthouse and the store (Membership.announce)
        views, _ = ask(1, {0: 0.0, 1: 0.0, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 1, 2]] * 3
        ms[1].pause()  # 1 heals (its heartbeats paused), skipping round 2, heading for round 3
        ms[1].heading(3)
        time.sleep(2.0)  # its heartbeat is stale to the Lighthouse (1 s), even under load
        views, waited = ask(2, {0: 0.0, 2: 0.0})
        assert [v.active for v in views.values()] == [[0, 2]] * 2 and waited < deadline / 2, waited
        views, _ = ask(3, {0: 0.0, 1: 0.5, 2: 0.0})  # round 3: waited for, 0.5 s after the others
        assert [v.active for v in views.values()] == [[0, 1, 2]] * 3
    finally:
        lh.close()


def test_a_member_frozen_mid_collective_is_given_up_after_a_heartbeat_timeout_and_told_so_when_it_thaws():
    """gloo notices a killed peer (its sockets close), not a frozen or cut-off one: without the
    watch, a collective waits the whole timeout_s (60 s here) for it."""
    import threading
    import time

    import torch

    from veriloco.membership import MembershipError

    lh = Lighthouse(5.0, workers=2, timeout_s=60)
    ms = lh.ms
    try:
        views, _ = lh.ask(0, {0: 0.0, 1: 0.0})
        comms = {}
        threads = [threading.Thread(target=lambda w=w: comms.__setitem__(w, ms[w].group(views[w]))) for w in (0, 1)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        got = torch.zeros(2)  # gloo's send/recv have no future: they are waited for in a thread
        sender = threading.Thread(target=lambda: comms[0].send(torch.full((2,), 7.0), 1 - comms[0].rank))
        sender.start()
        comms[1].recv(got, 1 - comms[1].rank)
        sender.join()
        assert got.tolist() == [7.0, 7.0]
        out = [torch.zeros(2), torch.zeros(2)]
        ms[1].pause()  # 1 freezes: it holds its sockets open, its heartbeats stop, it issues nothing
        t0 = time.monotonic()
        with pytest.raises(MembershipError, match="worker 1 of the quorum went silent"):
            comms[0].all_gather(out, torch.ones(2))
        assert time.monotonic() - t0 < 10
        with pytest.raises(MembershipError):  # given up: the group is not used again
            comms[0].all_gather(out, torch.ones(2))
        ms[1].resume()  # 1 thaws; its peer is alive, but left the group: it finds out at once
        t0 = time.monotonic()
        with pytest.raises(MembershipError, match="worker 0 gave the round's group up"):
            comms[1].broadcast_from(torch.ones(2), 1 - comms[1].rank)
        assert time.monotonic() - t0 < 5
    finally:
        lh.close()


def test_members_that_cannot_reach_each_other_are_dropped_the_same_way_by_everyone():
    from veriloco.membership import reachable_part

    assert reachable_part([0, 1, 2], {0: set(), 1: set(), 2: set()}) == [0, 1, 2]
    assert reachable_part([0, 1, 2], {0: set(), 1: {2}, 2: {1}}) == [0, 1]  # a cut pair: the higher id goes
    assert reachable_part([0, 1, 2], {0: set(), 1: {2}, 2: set()}) == [0, 2]  # one-sided: its reporter goes
    assert reachable_part([0, 1, 2, 3], {0: {1, 2, 3}, 1: set(), 2: set(), 3: set()}) == [1, 2, 3]  # a liar about all
    assert reachable_part([0, 1, 2, 3], {0: {3}, 1: {3}, 2: {3}, 3: {0, 1, 2}}) == [0, 1, 2]  # 3 reaches nobody
    assert reachable_part([0, 2], {0: {1}, 2: set()}) == [0, 2]  # a report about a non-member counts for nothing


def test_a_path_cut_between_members_is_found_before_the_group_forms_and_while_a_collective_waits():
    """Members that still reach the coordinator (fresh heartbeats) but not each other: gloo would
    wait its whole timeout (60 s here) in the group's connect or in a collective."""
    import threading
    import time

    import torch

    from veriloco.membership import MembershipError

    lh = Lighthouse(5.0, workers=3, timeout_s=60)
    ms = lh.ms
    try:
        views, _ = lh.ask(0, {0: 0.0, 1: 0.0, 2: 0.0})
        comms, errors = {}, {}

        def group(w: int) -> None:
            try:
                comms[w] = ms[w].group(ms[w].connected(views[w]))
            except MembershipError as e:
                errors[w] = str(e)

        ms[2]._unlisten()  # 2 answers no probe: as if the paths to it were cut (it still heartbeats)
        t0 = time.monotonic()
        threads = [threading.Thread(target=group, args=(w,)) for w in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert time.monotonic() - t0 < 10  # probes time out after heartbeat_timeout_s (1 s)
        assert set(comms) == {0, 1} and "the round goes on among [0, 1]" in errors[2], errors
        out = [torch.zeros(2), torch.zeros(2)]
        ms[1]._unlisten()  # now 0 and 1 lose each other too, after their group formed
        t0 = time.monotonic()
        with pytest.raises(MembershipError, match="worker 1 of the quorum cannot be reached"):
            comms[0].all_gather(out, torch.ones(2))  # 1 issues nothing; its heartbeats stay fresh
        assert time.monotonic() - t0 < 10
    finally:
        lh.close()


def test_a_worker_frozen_in_the_exchange_costs_the_round_a_heartbeat_timeout_then_it_heals(tmp_path):
    run_dir = tmp_path / "run"
    # a 0.4 s link latency makes the rounds long enough for the frozen worker to come back
    cfg = tiny("--topology.workers=3", "--train.rounds=16", "--link.latency=400ms", *ELASTIC)
    # worker 1 stops for 6 s inside round 2's exchange, after the round's group formed
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["stop:1@2+6"])
    recs = rounds_of(run_dir)
    assert summary["complete"] and [r["round"] for r in recs] == list(range(16))
    assert recs[2].get("members") == [0, 2] and recs[2]["verdicts"][1] == "absent", (recs[2]["round_s"], recs[2]["verdicts"])
    # the others gave the group up after heartbeat_timeout_s (1.5 s) and retried without it; gloo
    # alone would have held them until the freeze ended (6 s) and then gone on with it
    assert recs[2]["round_s"] < 5.0, recs[2]["round_s"]
    assert not any(e["event"] == "died" for e in events_of(run_dir))
    assert recs[-1]["verdicts"] == ["accept"] * 3, [r["verdicts"] for r in recs]  # it thawed, healed, came back
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


@pytest.mark.parametrize("delay", [0, 1])
def test_an_elastic_run_stopped_after_n_rounds_resumes_to_the_uninterrupted_run(tmp_path, delay, capsys):
    from veriloco.cli import _print_summary
    from veriloco.run import resume

    momentum = ("--outer.momentum=0.5",) if delay else ()
    cfg = tiny("--topology.workers=3", "--train.rounds=4", f"--outer.delay={delay}", *momentum, *ELASTIC)
    train(cfg, str(tmp_path / "a"), quiet=True)
    _, stopped = train(cfg, str(tmp_path / "b"), quiet=True, stop_after=2)
    assert not stopped["complete"] and len(rounds_of(tmp_path / "b")) == 2
    _print_summary(tmp_path / "b", stopped)  # what `veriloco train --stop-after 2` prints at the end
    assert f"continue with `veriloco train --resume {tmp_path / 'b'}`" in capsys.readouterr().out
    _, summary = resume(str(tmp_path / "b"), quiet=True)
    a, b = rounds_of(tmp_path / "a"), rounds_of(tmp_path / "b")
    assert summary["complete"] and len(b) == 4
    # (seen once in a fresh clone's `make test`, not since: round 2's params differed; what each
    # run's rounds were, so a next failure names its cause)
    seen = [[(r["round"], r["verdicts"], r.get("members"), r.get("inner_steps")) for r in run] for run in (a, b)]
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b], seen
    assert [r["verdicts"] for r in b] == [["accept"] * 3] * 4
    report = audit_run(tmp_path / "b")
    assert report.ok, report.first_failure


def test_elastic_workers_on_replicas_are_the_static_run_through_a_killed_worker_and_a_crashed_replica(tmp_path):
    """`[topology] replicas` under elastic membership: each worker starts its other replica as its
    own child (elastic.WorkerReplicas). Worker 1 is killed (kill -9) in round 2: its replica exits
    with it. Worker 0's replica raises in round 3: worker 0 fails with it, and the launcher names
    the replica's error. With 2 of 2 workers needed nothing commits without either; the launcher
    starts each again with a fresh replica, which takes the inner state the worker healed from.
    Every round is the static run's without replicas, bit for bit, and the audit holds."""
    common = ("--topology.workers=2", "--train.rounds=5", "--train.grad_accum=2")
    train(tiny(*common), str(tmp_path / "static"), quiet=True)
    crash = f"--adversary.0=red_team:ReplicaCrashes:at=3,once={tmp_path / 'crashed'}"
    _, summary = train(tiny(*common, *ELASTIC, "--topology.replicas=2", "--run.max_restarts=1", crash),
                       str(tmp_path / "elastic"), quiet=True, faults=["die:1@2.2"])
    a, b = rounds_of(tmp_path / "static"), rounds_of(tmp_path / "elastic")
    assert [r["params_hash"] for r in a] == [r["params_hash"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    events = events_of(tmp_path / "elastic")
    kinds = [(e["event"], e["worker"]) for e in events]
    assert kinds.count(("started", 0)) == kinds.count(("started", 1)) == 2, kinds
    died = {e["worker"]: e.get("error") for e in events if e["event"] == "died"}
    assert died[1] is None  # killed: no error of its own, nor of its replica, which exited with it
    assert died[0].startswith("its replica 1: RuntimeError: replica 1 of worker 0 crashes in round 3"), died[0]
    assert summary["replicas"] == 2
    assert audit_run(tmp_path / "elastic").ok


def test_a_quorum_of_the_same_members_runs_on_the_last_rounds_group_and_a_changed_one_forms_anew():
    """Membership.reuse: forming a group costs a rendezvous and new connections (about 13 round
    trips, 1.3 s of a round on a 50 ms link); a round whose active members are the last committed
    round's runs on its group again. Every member must take the same group."""
    import threading

    import torch

    from veriloco.membership import MembershipError

    lh = Lighthouse(5.0, workers=3, timeout_s=60)
    ms = lh.ms

    def on_groups(views: dict) -> tuple[dict, dict]:
        """Each member's reuse(view), else a new group; then an all_gather on it; (comms, errors)."""
        comms, errors = {}, {}

        def one(w: int) -> None:
            try:
                comm = ms[w].reuse(views[w])
                comms[w] = comm if comm is not None else ms[w].group(views[w])
                out = [torch.zeros(1) for _ in range(comms[w].size)]
                comms[w].all_gather(out, torch.full((1,), float(w)))
                assert [int(t) for t in out] == views[w].active
            except MembershipError as e:
                errors[w] = str(e)

        threads = [threading.Thread(target=one, args=(w,)) for w in views]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return comms, errors

    try:
        views, _ = lh.ask(0, {0: 0.0, 1: 0.0, 2: 0.0})
        assert {v.group for v in views.values()} == {"-"}  # nothing kept yet: a new group
        first, errors = on_groups(views)
        assert not errors and len({c.key for c in first.values()}) == 1
        for w in range(3):
            ms[w].keep(0, first[w])
        views, _ = lh.ask(1, {0: 0.0, 1: 0.0, 2: 0.0})
        assert {v.group for v in views.values()} == {first[0].key}  # the judge proposed it, all take it
        again, errors = on_groups(views)
        assert not errors and all(again[w] is first[w] for w in range(3))

        # round 2 without worker 2 (it was not asked): other members, so a new group
        for w in range(3):
            ms[w].keep(1, again[w])
        views, _ = lh.ask(2, {0: 0.0, 1: 0.0})
        assert {v.group for v in views.values()} == {"-"}
        pair, errors = on_groups(views)
        assert not errors and all(pair[w] is not first[w] for w in (0, 1)) and pair[0].size == 2

        # a stale keep (not the round before) is not proposed either
        for w in (0, 1):
            ms[w].keep(1, pair[w])
        views, _ = lh.ask(4, {0: 0.0, 1: 0.0})
        assert {v.group for v in views.values()} == {"-"}
    finally:
        lh.close()


def test_a_member_that_does_not_hold_the_group_the_others_take_stops_them_at_once():
    """If the quorum's judge proposes a group that a member does not hold (it failed the last round
    after the others finished it), that member says so and the others' first collective on the
    group stops within a watch: the round is retried with a new quorum, never run on a group
    whose members are not all there."""
    import time

    import torch

    from veriloco.membership import MembershipError

    lh = Lighthouse(5.0, workers=3, timeout_s=60)
    ms = lh.ms
    try:
        views, _ = lh.ask(0, {0: 0.0, 1: 0.0, 2: 0.0})
        comms = lh.groups(views)
        for w in (0, 1):
            ms[w].keep(0, comms[w])  # worker 2 did not commit round 0 on it
        views, _ = lh.ask(1, {0: 0.0, 1: 0.0, 2: 0.0})
        for v in views.values():
            v.group = comms[0].key  # as a judge among 0 and 1 proposes (the judge is whoever asks first)
        with pytest.raises(MembershipError, match="hold different groups"):
            ms[2].reuse(views[2])
        comm = ms[0].reuse(views[0])
        assert comm is comms[0]
        t0 = time.monotonic()
        with pytest.raises(MembershipError, match="worker 2 gave the round's group up"):
            comm.all_gather([torch.zeros(1) for _ in range(3)], torch.zeros(1))
        assert time.monotonic() - t0 < 5  # not gloo's 60 s
    finally:
        lh.close()


def test_a_collective_is_noticed_done_at_once_however_long_its_watch_takes():
    """membership.wait_watching: the watch's reads cross the link to the coordinator, several round
    trips on a long link; run between slices of the wait, it held each collective until they were
    back (0.9 s a collective at 50 ms). It runs beside the wait now."""
    import time

    from veriloco.membership import WATCH_S, wait_watching

    def slow_watch() -> None:
        time.sleep(2.0)  # a watch over a slow link

    t0 = time.monotonic()
    assert wait_watching(lambda: time.sleep(WATCH_S * 1.5), slow_watch) == (None, None)
    assert time.monotonic() - t0 < WATCH_S * 1.5 + 0.5  # not held until the watch's 2 s are over

    def boom() -> None:
        raise ValueError("gloo says no")

    why, error = wait_watching(boom, lambda: None)
    assert why is None and isinstance(error, ValueError)
    t0 = time.monotonic()
    why, error = wait_watching(lambda: time.sleep(30), lambda: "worker 1 of the quorum went silent")
    assert why == "worker 1 of the quorum went silent" and error is None
    assert time.monotonic() - t0 < WATCH_S + 1  # the blocked run is abandoned

    def broken_watch() -> None:
        raise OSError("no route")

    why, error = wait_watching(lambda: time.sleep(30), broken_watch)  # a watch that fails stops the wait
    assert why == "the members' watch failed: OSError: no route" and error is None


def test_a_member_a_watch_found_cut_off_is_not_probed_again_by_the_retrys_connected():
    """A reused group has no probes before its first collective: a path cut since the last round
    stalls it, and the watch's probe finds the cut (heartbeat_timeout_s). The retry's `connected`
    reports that member at once instead of waiting out a second probe of the same cut path."""
    import threading

    import torch

    from veriloco.membership import MembershipError

    lh = Lighthouse(5.0, workers=3, timeout_s=60)
    ms = lh.ms
    try:
        views, _ = lh.ask(0, {0: 0.0, 1: 0.0, 2: 0.0})
        comms = lh.groups(views)
        ms[1]._unlisten()  # the path to 1 is cut (it still heartbeats); 1 issues nothing
        with pytest.raises(MembershipError, match="worker 1 of the quorum cannot be reached"):
            comms[0].all_gather([torch.zeros(1) for _ in range(3)], torch.zeros(1))
        probed = []
        real = ms[0].unreachable
        ms[0].unreachable = lambda workers, store=None: probed.append(list(workers)) or real(workers, store)
        views, _ = lh.ask(1, {0: 0.0, 1: 0.0, 2: 0.0})
        out = {}
        threads = [threading.Thread(target=lambda w=w: out.__setitem__(w, _connected_or_error(ms[w], views[w])))
                   for w in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert probed == [[2]], probed  # 1 was reported from the watch's finding, 2 probed
        assert out[0] == [0, 2] and out[2] == [0, 2] and "cannot reach this one" in out[1], out
        assert ms[0]._found_cut == {}  # used once: the next `connected` probes everyone again
    finally:
        lh.close()


def _connected_or_error(m, view):
    from veriloco.membership import MembershipError

    try:
        return m.connected(view).active
    except MembershipError as e:
        return str(e)


def test_an_ipv6_coordinator_runs_the_elastic_run(tmp_path):
    """`--host ::1`: the Lighthouse and the TCPStore listen on an IPv6 address, and the workers
    reach them at [::1]:port. The run hung (its host:port strings were built the IPv4 way), and
    from the thirty-fourth session an IPv6 --host was refused."""
    import socket

    from typer.testing import CliRunner

    from veriloco.cli import app

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    res = CliRunner().invoke(app, ["train", str(ROOT / "configs" / "tiny.toml"), "--run.membership=elastic",
                                   "--host", "::1", "--quiet", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["complete"]
    assert audit_run(tmp_path / "r").ok


_TASK_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[3])
import custom_model as cm
from veriloco import Task, join_task, load_config, train_task

task = Task(cm.make_model, cm.loss, cm.batch, cm.eval_batches)
if __name__ == "__main__":
    if sys.argv[1] == "launch":
        cfg = load_config(overrides=sys.argv[4:])
        print("launched", train_task(task, cfg, sys.argv[2], quiet=True, workers=[0])["complete"])
    else:
        print("joined", join_task(task, sys.argv[2], [1], quiet=True))
"""


def test_a_users_task_trains_across_machines_with_join_task(tmp_path):
    """A user's own model could train on one machine only: `veriloco join` rebuilds the built-in
    task, and `train_task` took no placement (torchrun runs the built-in task too). Now
    `train_task(..., workers=[0])` launches an elastic run and `join_task(task, RUN, [1])` starts
    the other worker, as on a second machine sharing the run directory; `audit_task` checks it.
    `veriloco join` of it names `join_task` in one line."""
    import time

    from typer.testing import CliRunner

    from veriloco import Task
    from veriloco.audit import audit_task
    from veriloco.cli import app

    run_dir = tmp_path / "run"
    examples = str(ROOT / "examples")
    overrides = ["--topology.workers=2", "--train.rounds=3", "--train.inner_steps=5", "--train.warmup_steps=5",
                 "--train.lr=0.01", "--train.eval_batches=2", *ELASTIC]
    launcher = subprocess.Popen([sys.executable, "-c", _TASK_SCRIPT, "launch", str(run_dir), examples, *overrides],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (run_dir / "coordinator.json").exists() and launcher.poll() is None:
            time.sleep(0.1)
        res = CliRunner().invoke(app, ["join", str(run_dir), "--workers", "1"])
        assert res.exit_code == 2 and res.stderr.splitlines() == [
            f"veriloco: error: {run_dir} trains a user's Task (make_model): join it with veriloco.join_task(task, RUN, "
            "workers) and that Task"], res.output
        joined = subprocess.run([sys.executable, "-c", _TASK_SCRIPT, "join", str(run_dir), examples],
                                capture_output=True, text=True, timeout=300)
        out, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert joined.returncode == 0 and "joined {1: 0}" in joined.stdout, joined.stderr[-2000:]
    assert launcher.returncode == 0 and "launched True" in out, err[-2000:]
    assert [r["verdicts"] for r in rounds_of(run_dir)] == [["accept"] * 2] * 3
    sys.path.insert(0, examples)
    try:
        import custom_model as cm
    finally:
        sys.path.remove(examples)
    report = audit_task(Task(cm.make_model, cm.loss, cm.batch, cm.eval_batches), run_dir)
    assert report.ok, report.first_failure


@pytest.mark.parametrize("delay", [0, 1])
def test_a_worker_restarted_after_its_packet_went_out_sends_that_packet_again(tmp_path, delay):
    """Killed once its round's bundle was out (the others hold its commitment) and started again,
    a worker redoes the round from its saved state. Its redo must make the same bundle, or the
    others convict it of equivocation (and, as it does not know that, disagree with it on the
    params: until the fortieth session the whole run died). Worker 2 is honest under the
    adaptive codec, whose budget followed the redo's own timing: the noted budget window makes
    the redo reproduce. Worker 1's delta does not reproduce (red_team.Jitter, as a GPU's might):
    it sends the noted bundle again. min_workers = 3: no round commits without the dead one. With
    delay 1 the round's exchange ran under the next round's steps, whose bundle (held, not sent)
    the restarted worker makes again too."""
    run_dir = tmp_path / "run"
    cfg = tiny("--topology.workers=3", "--train.rounds=5", "--run.min_workers=3", "--compress.codec=adaptive",
               "--link.bandwidth=20mbit", "--link.latency=1ms", "--adversary.1=red_team:Jitter", f"--outer.delay={delay}",
               *ELASTIC)
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["die:2@3.sent", "die:1@4.sent", "restart:1+1",
                                                                "restart:2+1"])
    assert summary["complete"]
    died = [(e["worker"], e.get("round")) for e in events_of(run_dir) if e["event"] == "died"]
    assert sorted(w for w, _ in died) == [1, 2], died
    recs = rounds_of(run_dir)
    assert all(v == "accept" for r in recs for v in r["verdicts"]), [r["verdicts"] for r in recs]
    notes = {(j, r): json.loads((run_dir / "workers" / str(j) / f"sent-{r}.json").read_text()) for j in (1, 2) for r in (3, 4)}
    assert all(n["bundle"] == recs[r]["bundles"][j] for (j, r), n in notes.items())  # what went out first is in
    assert [k for k, n in notes.items() if n["resent"]] == [(1, 4)]  # worker 2's redo made the same bytes
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_a_noted_bundle_of_other_work_is_not_sent_again(tmp_path):
    """With delay 1 a round's bundle is noted while it is held for the round before it. Worker 2,
    late for round 2, is left out of it and heals into round 3 from another start (no eager delta
    of its own): its redo is other work, and the note is stale. Sending the noted bundle again
    (the review's reproduction, fortieth session) got the honest worker convicted of
    replay_mismatch and banned; a note binds a redo only once its bundle went out (`out`, set
    as the quorum forms). Worker 1 dies in round 3, so the others heal and retry around it."""
    run_dir = tmp_path / "run"
    cfg = tiny("--topology.workers=3", "--train.rounds=6", "--outer.delay=1", "--run.min_workers=2",
               "--run.round_deadline=1", "--verify.replay_probability=1.0", "--train.inner_state=reset",
               "--verify.trace_every=5", "--run.membership=elastic", "--run.timeout_s=6", "--run.heartbeat_timeout_s=1.5")
    _, summary = train(cfg, str(run_dir), quiet=True, faults=["late:2@2+3", "die:1@3"])
    assert summary["complete"]
    verdicts = [r["verdicts"][2] for r in rounds_of(run_dir)]
    assert not {"replay_mismatch", "banned", "equivocation"} & set(verdicts), verdicts
    report = audit_run(run_dir)
    assert report.ok, report.first_failure


def test_a_sent_note_is_checked_before_it_is_trusted(tmp_path):
    """A note the worker cannot read, or one that is not of the round, is a one-line error naming
    the file, never a silent guess (a bool is not a round number)."""
    from types import SimpleNamespace

    from veriloco.records import RunDir
    from veriloco.round import sent_note

    w = SimpleNamespace(run=RunDir(tmp_path), rank=0)
    d = tmp_path / "workers" / "0"
    d.mkdir(parents=True)
    assert sent_note(w, 1) is None
    good = {"round": 1, "window_s": 0.5, "bundle": "ab" * 32, "codec_log": {}, "out": True, "resent": False}
    (d / "sent-1.json").write_text(json.dumps(good))
    assert sent_note(w, 1) == good
    for bad in ({**good, "round": True}, {**good, "round": 2}, {**good, "window_s": float("nan")},
                {**good, "window_s": -1}, {**good, "bundle": "xy" * 32}, {**good, "codec_log": []}, {**good, "out": 1},
                [good]):
        (d / "sent-1.json").write_text(json.dumps(bad))
        with pytest.raises(RuntimeError, match="not a note of round 1's bundle"):
            sent_note(w, 1)
    (d / "sent-1.json").write_text("{")
    with pytest.raises(RuntimeError, match="sent-1.json: unreadable"):
        sent_note(w, 1)
