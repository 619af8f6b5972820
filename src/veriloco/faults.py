"""Declarative fault injection: "worker 2 dies at round 3, step 5", "worker 1 is 2 s late in round 4".

A fault is a short spec, given to `veriloco train --fault SPEC` (repeatable) or `launch(faults=...)`:

    die:W@R.S      worker W kills itself with SIGKILL (kill -9) at inner step S of round R
    die:W@R        ... in the middle of round R's exchange (after the quorum, before its packet is out)
                   (a worker that healed past that point, left out of an earlier round as late,
                   dies at the first step or exchange it reaches after it instead)
    die:W@R.sent   ... once its round-R packet and reveal are out (the others hold its commitment),
                   before the round's checks and commit: restarted, it must send that packet again
    stop:W@R+T     worker W freezes (SIGSTOP; a helper process sends SIGCONT after T seconds) in the
                   middle of round R's exchange, after the round's group formed: its sockets stay
                   open and its heartbeats stop, as in a paused VM or a partition
    late:W@R+T     worker W's round-R packet is T seconds late: it joins the round's quorum T seconds
                   after its inner steps end (with delay 1 that wait overlaps its next round's steps,
                   as a packet late on the wire would)
    restart:W+T    the launcher starts worker W again T seconds after it died (it rejoins)
    join:W@R       worker W (admitted in the manifest) is started only once round R is recorded
    partition:W@R+T   once round R is recorded, worker W's network link is cut for T seconds: the
                   run moves to network namespaces (one per worker, veth pairs to a bridge, the
                   coordinator in its own; netns.py; needs root) and the launcher downs W's veth
    skew:W+T, skew:W-T   worker W's wall clock runs T seconds ahead (+) or behind (-) the others'
                   (machines whose clocks NTP does not keep together): what it stamps its heartbeats
                   and quorum requests with, and what it reads the others' stamps against
    sever:A-B@R+T  once round R is recorded, workers A and B cannot reach each other for T seconds,
                   while both still reach the coordinator and every other worker (a partial
                   partition: network namespaces as above; the launcher points each one's
                   neighbour entry for the other at a MAC address nobody has, so their packets
                   to each other vanish without an error, as on a broken route)

Faults are for tests and the chaos benchmark; they need `[run] membership = "elastic"` (with a
fixed world a dead worker ends the run, which is what static mode promises). They are not part of
the run's manifest: they describe what happened to the run, not what the run is.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

_SPEC = re.compile(
    r"^(?:(?P<die>die):(?P<dw>\d+)@(?P<dr>\d+)(?:\.(?P<ds>\d+|sent))?"
    r"|(?P<stop>stop):(?P<sw>\d+)@(?P<sr>\d+)\+(?P<st>\d+(?:\.\d+)?)"
    r"|(?P<late>late):(?P<lw>\d+)@(?P<lr>\d+)\+(?P<lt>\d+(?:\.\d+)?)"
    r"|(?P<restart>restart):(?P<rw>\d+)\+(?P<rt>\d+(?:\.\d+)?)"
    r"|(?P<join>join):(?P<jw>\d+)@(?P<jr>\d+)"
    r"|(?P<partition>partition):(?P<pw>\d+)@(?P<pr>\d+)\+(?P<pt>\d+(?:\.\d+)?)"
    r"|(?P<sever>sever):(?P<xa>\d+)-(?P<xb>\d+)@(?P<xr>\d+)\+(?P<xt>\d+(?:\.\d+)?)"
    r"|(?P<skew>skew):(?P<kw>\d+)(?P<kt>[+-]\d+(?:\.\d+)?))$"
)


class FaultError(ValueError):
    """A fault spec that does not parse or names a worker the run does not have."""


@dataclass(frozen=True)
class Fault:
    kind: str  # "die" | "stop" | "late" | "restart" | "join" | "partition" | "sever" | "skew"
    worker: int
    round: int = 0
    step: int | None = None  # die: the inner step; None = during the exchange
    sent: bool = False  # die: once the round's packet is out (die:W@R.sent)
    seconds: float = 0.0  # late: how late; stop: how long frozen; restart: how long after the death; partition, sever: how long cut; skew: how far ahead (< 0: behind)
    peer: int | None = None  # sever: the other worker


def parse_fault(text: str, workers: int) -> Fault:
    """One spec (see the module docstring) -> Fault; FaultError names what is wrong."""
    m = _SPEC.match(text.strip())
    if m is None:
        raise FaultError(f"fault {text!r} is not one of die:W@R[.S], die:W@R.sent, stop:W@R+SECONDS, late:W@R+SECONDS, restart:W+SECONDS, "
                         "join:W@R, partition:W@R+SECONDS, sever:A-B@R+SECONDS, skew:W+SECONDS, skew:W-SECONDS")
    g = m.groupdict()
    if g["die"]:
        ds = g["ds"]
        f = Fault("die", int(g["dw"]), int(g["dr"]), int(ds) if ds not in (None, "sent") else None, sent=ds == "sent")
    elif g["stop"]:
        f = Fault("stop", int(g["sw"]), int(g["sr"]), seconds=float(g["st"]))
    elif g["late"]:
        f = Fault("late", int(g["lw"]), int(g["lr"]), seconds=float(g["lt"]))
    elif g["restart"]:
        f = Fault("restart", int(g["rw"]), seconds=float(g["rt"]))
    elif g["join"]:
        f = Fault("join", int(g["jw"]), int(g["jr"]))
    elif g["partition"]:
        f = Fault("partition", int(g["pw"]), int(g["pr"]), seconds=float(g["pt"]))
    elif g["sever"]:
        f = Fault("sever", int(g["xa"]), int(g["xr"]), seconds=float(g["xt"]), peer=int(g["xb"]))
    else:
        f = Fault("skew", int(g["kw"]), seconds=float(g["kt"]))
    for j in (f.worker, f.peer):
        if j is not None and not 0 <= j < workers:
            raise FaultError(f"fault {text!r} names worker {j}, but the run has workers 0..{workers - 1}")
    if f.peer == f.worker:
        raise FaultError(f"fault {text!r} severs worker {f.worker} from itself")
    return f


def parse_faults(texts: list[str], workers: int) -> list[Fault]:
    faults = [parse_fault(t, workers) for t in texts]
    joins = [f.worker for f in faults if f.kind == "join"]
    if len(joins) >= workers:
        raise FaultError("every worker has a join fault: nobody would start the run")
    return faults


class Injector:
    """A worker's own faults, asked at the points where they fire."""

    def __init__(self, faults: list[Fault], worker: int) -> None:
        self.faults = [f for f in faults if f.worker == worker]
        self._stopped: list[Fault] = []

    def at_step(self, round: int, step: int) -> None:
        if any(f.kind == "die" and f.step is not None and (f.round, f.step) <= (round, step) for f in self.faults):
            die()

    def in_exchange(self, round: int) -> None:
        if any(f.kind == "die" and f.step is None and not f.sent and f.round <= round for f in self.faults):
            die()
        for f in self.faults:
            if f.kind == "stop" and f.round == round and f not in self._stopped:
                self._stopped.append(f)  # once: the round is retried after the others gave it up
                freeze(f.seconds)

    def after_sent(self, round: int, wait: Callable[[], object]) -> None:
        """A `die:W@R.sent` fault: wait() for the round's exchange (every packet and reveal
        through), then die."""
        if any(f.kind == "die" and f.sent and f.round <= round for f in self.faults):
            wait()
            die()

    def late_s(self, round: int) -> float:
        return sum(f.seconds for f in self.faults if f.kind == "late" and f.round == round)

    def clock(self) -> Callable[[], float]:
        """This worker's wall clock: time.time, or that many seconds off it (a `skew` fault)."""
        skew = sum(f.seconds for f in self.faults if f.kind == "skew")
        return (lambda: time.time() + skew) if skew else time.time


def first_death(faults: list[Fault]) -> Fault | None:
    """The die fault that fires first of `faults` (one worker's): a step of round R comes before its
    exchange, and its exchange before the moment its packet is out."""
    dies = [f for f in faults if f.kind == "die"]
    return min(dies, key=lambda f: (f.round, f.step is None, f.sent, f.step or 0)) if dies else None


def die() -> None:
    """kill -9 of this process: no cleanup, no flush, no goodbye to the peers."""
    os.kill(os.getpid(), signal.SIGKILL)


def freeze(seconds: float) -> None:
    """SIGSTOP of this process for `seconds`: every thread stops (heartbeats too), every socket
    stays open. A helper process of its own session sends the SIGCONT."""
    pid = os.getpid()
    subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds:g}; kill -CONT {pid}"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.kill(pid, signal.SIGSTOP)
