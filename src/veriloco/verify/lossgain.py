"""The loss-gain screen, computed once per packet instead of once per packet per worker.

The screen's loss-gain test (screen.py: does G_r - delta lower the loss of the worker's own
batches?) costs two forward passes per batch per packet. When every worker computes it for every
packet, that is 2W forward passes per worker per round, ~W/H of the training compute: the
largest per-round cost of verification. Here each packet gets `n` *checkers* (`[verify]
loss_gain_checkers`), drawn from the round's seed among the members that are not banned and
not its sender, and only they compute its gain; the numbers are gathered by everyone.

A checker's word is not taken where it matters:
- a packet whose checkers did not report, or reported different numbers, is computed by every
  member itself;
- a packet whose reported gain *fails* the test (which makes it a suspect, then a replay, or a
  rejection) is computed by every member itself before it counts; a checker whose number does
  not reproduce (beyond `LOSS_TOLERANCE`) is convicted FALSE_REPORT, and the member's own number
  stands.
What is left is a checker that reports a passing gain for a packet that fails: the round does
not see it (a sampled replay still may), and the offline audit, which recomputes every gain,
names the checker. The reported numbers are in the round record for that purpose
(`loss_gain_reports`). Checkers cannot lower an honest worker's standing either: a failing gain
only makes it a suspect, and its replay decides (`loss_gain_action = "audit"`, which
`loss_gain_checkers > 0` requires).

Pure functions: the caller computes gains (it owns the model) and moves the reports.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .screen import LossGain, loss_gain_verdict

# Largest difference (nats, either loss) between a checker's report and a member's own number
# that still counts as the same: the same batches and params give the same float32 loss to
# ~1e-6 under another thread count or matmul order; a lie that matters moves it by far more.
LOSS_TOLERANCE = 1e-4


FLOOR_SHARE = 0.25  # [verify] loss_gain_floor's default


def gain_floor(gains: Mapping[int, LossGain], share: float = FLOOR_SHARE) -> float:
    """The least own-batch gain that passes: with 3+ deltas, `share` of the median delta's gain
    (`[verify] loss_gain_floor`, a quarter by default; an honest delta's noise gains ~0); with
    fewer, more than nothing. Not the larger of 2 gains: tried, and with no majority the attacker
    sets the bar, so a scaled delta got its honest peer refused in 26 of 60 rounds against 4
    (`python bench/two_workers.py --old 65c80e1`, checked out at 4f2ad2c; README: Two workers)."""
    if len(gains) < 3:
        return 0.0
    return max(0.0, share * sorted(g.own_gain for g in gains.values())[len(gains) // 2])


def passes(gain: LossGain, floor: float) -> bool:
    """Whether `gain` passes the round's loss-gain test (own gain above `floor`, finite)."""
    return loss_gain_verdict(gain, floor, -1e9) is None


def gain_steps(seed: str, steps: int, n: int) -> list[int]:
    """Which of its `steps` batches of the round each worker's loss-gain test uses: `n` distinct
    inner steps drawn from the round's screen seed (check.round_seed: the base, every checked
    commitment of the round and every revealed salt), ascending. Drawn after the workers committed, so a worker
    cannot train honestly on the tested batches alone (the test once took the first n, which a
    worker knew). One draw for all workers: each is tested on its own batches at the same steps,
    so the gains compare like with like (the test's floor is a share of the median gain, and an
    honest delta's gain depends on its batch's place in the round: bench/lossgain_profile.py)."""
    rank = sorted(range(steps), key=lambda s: hashlib.sha256(f"veriloco/loss-gain/{seed}/{s}".encode()).digest())
    return sorted(rank[: min(n, steps)])


def assign_checkers(seed: str, workers: list[int], eligible: list[int], n: int) -> dict[int, list[int]]:
    """For each worker in `workers`, `n` distinct checkers drawn from `eligible` minus itself
    (all of them when fewer), from `seed`; a worker with no eligible other gets []."""
    out: dict[int, list[int]] = {}
    for w in workers:
        others = [m for m in eligible if m != w]
        ranked = sorted(others, key=lambda m: hashlib.sha256(f"veriloco/loss-gain/{seed}/{w}/{m}".encode()).digest())
        out[w] = sorted(ranked[:n])
    return out


def stage_seed(seeds: list[str]) -> str:
    """The checker draw's seed of a pipelined worker's round: its stages' screen seeds (each
    stage signs its own commitment), in stage order, so that all its stages draw alike."""
    return "|".join(seeds)


def same(a: LossGain, b: LossGain) -> bool:
    """Whether two computations of one gain agree: within LOSS_TOLERANCE, or both not finite
    (a delta that breaks the model breaks it for everyone)."""

    def close(x: float, y: float) -> bool:
        if not (math.isfinite(x) and math.isfinite(y)):
            return not math.isfinite(x) and not math.isfinite(y)
        return abs(x - y) <= LOSS_TOLERANCE

    return close(a.own_before, b.own_before) and close(a.own_after, b.own_after)


@dataclass
class Settled:
    """The loss gains the screen uses, and what settling them found."""

    gains: dict[int, LossGain]
    false_reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # checker -> evidence
    record: dict | None = None  # the reports settled from, as the round record keeps them (reports_to_json)


def settle(
    workers: list[int],
    checkers: Mapping[int, list[int]],
    reports: Mapping[int, Mapping[int, LossGain | None]],
    compute: Callable[[int], LossGain],
    share: float = FLOOR_SHARE,
) -> Settled:
    """The gains of `workers`' deltas from the checkers' `reports` ({checker: {worker: gain or
    None}}), with `compute(worker)` (this member's own number) wherever a report is missing,
    the checkers disagree, or the gain fails the test (see the module docstring). Every honest
    member that sees the same reports computes the same things and settles the same way.
    `share`: the floor's share of the median gain (gain_floor)."""
    own: dict[int, LossGain] = {}
    out = Settled({})

    def recompute(j: int) -> LossGain:
        if j not in own:
            own[j] = compute(j)
        for c in checkers.get(j, []):
            said = reports.get(c, {}).get(j)
            if said is not None and not same(said, own[j]) and c not in out.false_reports:
                out.false_reports[c] = {"accused": j, "reported": said.to_dict(), "recomputed": own[j].to_dict()}
        return own[j]

    for j in workers:
        said = [reports.get(c, {}).get(j) for c in checkers.get(j, [])]
        if not said or any(s is None for s in said) or not all(same(said[0], s) for s in said[1:]):
            out.gains[j] = recompute(j)
        else:
            out.gains[j] = said[0]
    while True:  # a failing gain counts only once this member has computed it itself
        floor = gain_floor(out.gains, share)
        failing = [j for j in workers if j not in own and not passes(out.gains[j], floor)]
        if not failing:
            return out
        for j in failing:
            out.gains[j] = recompute(j)


def misreports(checkers: Mapping[int, list[int]], reports: Mapping[int, Mapping[int, LossGain | None]],
               true: Mapping[int, LossGain]) -> list[tuple[int, int]]:
    """(checker, worker) pairs whose report does not reproduce `true` (the audit's own gains)."""
    return [(c, j) for j in sorted(checkers) if j in true for c in checkers[j]
            if (g := reports.get(c, {}).get(j)) is not None and not same(g, true[j])]


def reports_to_json(checkers: Mapping[int, list[int]], reports: Mapping[int, Mapping[int, LossGain | None]]) -> dict:
    """The reports the round settled from, for its record: {worker: [[checker, own_before,
    own_after] ...]}; [checker] alone: it reported nothing; a null loss: not finite."""

    def num(x: float) -> float | None:
        return x if math.isfinite(x) else None

    out = {}
    for j in sorted(checkers):
        rows: list[list] = []
        for c in checkers[j]:
            g = reports.get(c, {}).get(j)
            rows.append([c, num(g.own_before), num(g.own_after)] if g is not None else [c])
        out[str(j)] = rows
    return out


def reports_from_json(data: Any, workers: int) -> tuple[dict[int, list[int]], dict[int, dict[int, LossGain | None]]]:
    """(checkers, reports) from a record's `loss_gain_reports`; ValueError naming the problem."""
    if not isinstance(data, dict):
        raise ValueError("loss_gain_reports must be an object")
    checkers: dict[int, list[int]] = {}
    reports: dict[int, dict[int, LossGain | None]] = {}
    for key, rows in data.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < workers):
            raise ValueError(f"loss_gain_reports: bad worker {key!r}")
        if not isinstance(rows, list):
            raise ValueError(f"loss_gain_reports[{key}] must be a list")
        j = int(key)
        checkers[j] = []
        for row in rows:
            ok = isinstance(row, list) and len(row) in (1, 3) and type(row[0]) is int and 0 <= row[0] < workers
            ok = ok and all(x is None or type(x) in (int, float) for x in row[1:])
            if not ok or row[0] in checkers[j]:
                raise ValueError(f"loss_gain_reports[{key}]: bad row {str(row)[:80]}")
            c = row[0]
            checkers[j].append(c)
            if len(row) == 1:
                reports.setdefault(c, {})[j] = None
                continue
            before, after = (math.nan if x is None else float(x) for x in row[1:])
            reports.setdefault(c, {})[j] = LossGain.on_own_batches(before, after)
    return checkers, reports
