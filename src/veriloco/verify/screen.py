"""Screening: cheap statistical checks of a round's decoded deltas before anything is replayed.

Input: the round's deltas {worker: delta} (a delta is a tensor or {name: tensor}, flattened to
one vector in name order). Output: one `Verdict` per worker, ACCEPT or a reason code, with the
numbers that decided it as JSON-serialisable evidence. Checks, in the order that picks the reason
(evidence lists every check that failed under "flags"):

1. MALFORMED: non-finite values (decode_packet already refuses them; this is a second line).
2. NORM_OUTLIER (zero): an all-zero delta is a no-op, whatever the other workers sent.
3. DUPLICATE: the same packet hash as another worker this round, or as any packet of the previous
   round (a replay). Both ends of a same-round copy are flagged: the screen cannot tell the
   original from the copy. Where the run replays, `check.screen_checked` keeps an end against
   which the screen holds nothing else (`copied_only`) for every member to replay whole
   (`replay.judge_copy`): the original's replay reproduces its packet, the copier's batches
   cannot. So checks 5-6 also measure such an end, though it is no candidate for the centre.
4. NEAR_DUPLICATE: cosine >= `near_dup_cosine` (0.999) OR relative distance ||a-b|| / max(||a||,
   ||b||) <= `near_dup_rel_dist` (1e-3) to another delta of this round or of the previous round,
   or to the mean of the previous round's (a stale worker resubmitting last round's update);
   with `earlier_deltas`, the same against the round before's deltas and their mean:
   a copy with small noise, a rescaled copy, a replay re-encoded. Either test suffices:
   requiring both would let a rescaled copy (cosine 1, distance large) through, and honest
   workers on different batches are nowhere near cosine 0.999.
5. NORM_OUTLIER (ratio): ||x_w|| / median_w' ||x_w'|| above `norm_hi` (3.0) or below
   `norm_lo` (1/3). Honest workers run the same optimizer for the same H inner steps from the
   same G_r on equally sized shards, so their norms cluster (AdamW's per-coordinate
   normalisation makes the step size nearly data-independent); a factor of 3 either way leaves
   room for shard heterogeneity and still catches noise, big rescaling and lazy (few-step) work.
6. COSINE_OUTLIER: cosine to the robust centre below `min_cosine` (0.0). A delta that points
   away from the consensus cannot help descent to first order; sign flips and the large-epsilon
   Inner Product Manipulation of Xie, Koyejo & Gupta 2019 ("Fall of Empires", arXiv 1903.03936)
   land here. 0 rather than a positive margin because noisy honest deltas (small batches, few
   inner steps) can have small positive cosines, and we want zero false rejections.
7. NO_LOSS_GAIN / WRONG_DATA: the loss-gain test of Templar's Gauntlet (Lidin et al. 2025,
   "Incentivizing Permissionless Distributed Learning of LLMs", arXiv 2505.21684): applied to
   G_r, an honest delta lowers the loss on the batches it trained on (own gain > `min_own_gain`,
   0 nats) and lowers it more there than on random batches (own gain - random gain >
   `min_own_advantage`, 0 nats); a worker that trained on other data (or copied) does not.
   The caller measures the losses (`measure_loss_gain`) because it owns the model.

Robust centre (checks 5-6): over the workers that passed checks 1-4, the coordinate-wise median
(default; exact: the values a sort selects) or the geometric median (Weiszfeld). Both have
breakdown point 1/2: an honest majority fixes the centre and the median norm.

Few workers: a centre needs a majority to mean anything. With fewer than `min_workers` (3)
candidates, checks 5-6 are skipped and recorded as skipped: with 2 workers neither can outvote
the other, and with 1 the centre is the delta itself. Checks 1-4 and 7 do not compare workers
against each other and always run, so a lone or paired worker is still screened for no-ops,
replays, copies and loss gain; replay of sampled segments covers the rest. With 3, one bad
worker is outvoted by two honest ones; a dishonest majority defeats any centre.

What passes on purpose: ALIE (Baruch, Baruch & Goldberg 2019, "A Little Is Enough", arXiv
1902.06156) and small-epsilon IPM stay within the honest spread by construction, so no
threshold that keeps honest workers can reject them; the robust aggregator (centered clipping)
bounds what they can do in a round.

Every number is computed with deterministic float64 reductions (aggregate.det_sum), so all
workers reach the same verdicts bit for bit. The near-duplicate tests (check 4) need their dot
products only where a test could hit: float32 estimates with proven error bounds
(aggregate.bounded_dots) rule that out for honest rounds, and then those sums are skipped
(`_provably_apart`: nothing is flagged or recorded either way); a delta's square is summed once,
in the first screen that sees it (`_known_square`). The sums are batched (aggregate.RowSums: every
norm, dot product and distance of the round through one reused buffer), which changes no bit: each
sum is det_sum's, add for add. Model-sized deltas are read a chunk at a time where they are
summed (aggregate.sum_rows, median_row): no flat copy of a delta is built, nor the median centre
(the geometric centre is built as its tensors, aggregate.geometric_median_row).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import (
    ACCEPT,
    COSINE_OUTLIER,
    DUPLICATE,
    MALFORMED,
    NEAR_DUPLICATE,
    NO_LOSS_GAIN,
    NORM_OUTLIER,
    WRONG_DATA,
)
from .aggregate import (
    Delta,
    RowSums,
    bounded_dots,
    flat_parts,
    geometric_median_row,
    median_of,
    median_row,
    row_finite,
    sum_rows,
)

CENTRES = ("median", "geometric_median")


@dataclass(frozen=True)
class ScreenConfig:
    """Thresholds of the screen; the module docstring justifies each default."""

    centre: str = "median"  # robust centre: "median" (coordinate-wise) or "geometric_median"
    min_workers: int = 3  # fewest candidates for which norm/cosine-to-centre checks run
    norm_hi: float = 3.0  # reject norm > norm_hi * median norm
    norm_lo: float = 1.0 / 3.0  # reject norm < norm_lo * median norm
    min_cosine: float = 0.0  # reject cosine to the centre below this
    near_dup_cosine: float = 0.999  # near-duplicate if cosine to another delta >= this ...
    near_dup_rel_dist: float = 1e-3  # ... or relative distance to it <= this
    min_own_gain: float = 0.0  # nats: own-batch loss must drop by more than this
    min_own_advantage: float = 0.0  # nats: own gain must exceed random-batch gain by more
    weiszfeld_iterations: int = 100  # iterations of the geometric median

    def __post_init__(self) -> None:
        if self.centre not in CENTRES:
            raise ValueError(f"centre must be one of {list(CENTRES)}, got {self.centre!r}")
        if not isinstance(self.min_workers, int) or self.min_workers < 3:
            raise ValueError(
                f"min_workers must be an int >= 3 (a centre needs a majority), got {self.min_workers!r}"
            )
        if not 0 < self.norm_lo < 1 < self.norm_hi < math.inf:
            raise ValueError(
                f"need 0 < norm_lo < 1 < norm_hi < inf, got norm_lo={self.norm_lo}, norm_hi={self.norm_hi}"
            )
        if not -1 <= self.min_cosine < 1:
            raise ValueError(f"min_cosine must be in [-1, 1), got {self.min_cosine}")
        if not 0 < self.near_dup_cosine <= 1:
            raise ValueError(f"near_dup_cosine must be in (0, 1], got {self.near_dup_cosine}")
        if not 0 <= self.near_dup_rel_dist < 1:
            raise ValueError(f"near_dup_rel_dist must be in [0, 1), got {self.near_dup_rel_dist}")
        for name in ("min_own_gain", "min_own_advantage"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.weiszfeld_iterations < 1:
            raise ValueError(f"weiszfeld_iterations must be >= 1, got {self.weiszfeld_iterations}")


@dataclass(frozen=True)
class LossGain:
    """Losses of G_r and of G_r - delta on the worker's own batches and on random batches."""

    own_before: float  # loss of G_r on the batches the worker committed to
    own_after: float  # loss of G_r - delta on the same batches
    random_before: float  # loss of G_r on batches the verifier drew (seeded by the ledger)
    random_after: float  # loss of G_r - delta on those

    @classmethod
    def on_own_batches(cls, before: float, after: float) -> LossGain:
        """Losses measured on the worker's own batches only (round.py's test), which stand in
        for the random ones too: an advantage of 0, never a WRONG_DATA verdict on its own."""
        return cls(before, after, before, after)

    @property
    def own_gain(self) -> float:
        return self.own_before - self.own_after

    @property
    def random_gain(self) -> float:
        return self.random_before - self.random_after

    @property
    def advantage(self) -> float:
        """How much more the delta helps its own batches than random ones (nats)."""
        return self.own_gain - self.random_gain

    def to_dict(self) -> dict[str, float | None]:
        def f(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "own_before": f(self.own_before),
            "own_after": f(self.own_after),
            "random_before": f(self.random_before),
            "random_after": f(self.random_after),
            "own_gain": f(self.own_gain),
            "random_gain": f(self.random_gain),
            "advantage": f(self.advantage),
        }


def measure_loss_gain(
    delta: Delta,
    own_batches: Any,
    random_batches: Any,
    loss_of: Callable[[Delta, Any], float],
) -> LossGain:
    """Call `loss_of(d, batches)` -- the loss of G_r - d on `batches`, supplied by the caller,
    who owns the model -- for d in (zero, delta) on own and random batches."""
    if isinstance(delta, torch.Tensor):
        zero: Delta = torch.zeros_like(delta)
    else:
        zero = {k: torch.zeros_like(v) for k, v in delta.items()}
    return LossGain(
        own_before=float(loss_of(zero, own_batches)),
        own_after=float(loss_of(delta, own_batches)),
        random_before=float(loss_of(zero, random_batches)),
        random_after=float(loss_of(delta, random_batches)),
    )


def loss_gain_verdict(
    gain: LossGain, min_own_gain: float = 0.0, min_own_advantage: float = 0.0
) -> str | None:
    """None if the delta passes the Gauntlet-style test, else NO_LOSS_GAIN or WRONG_DATA.

    NO_LOSS_GAIN: own gain <= `min_own_gain` (or any loss is not finite): the delta does not
    lower the loss on the very batches it claims to have trained on. WRONG_DATA: own gain -
    random gain <= `min_own_advantage`: it helps random batches as much as its own, which is
    what training on other data, or copying another worker, looks like.
    """
    values = (gain.own_before, gain.own_after, gain.random_before, gain.random_after)
    if not all(math.isfinite(v) for v in values) or gain.own_gain <= min_own_gain:
        return NO_LOSS_GAIN
    if gain.advantage <= min_own_advantage:
        return WRONG_DATA
    return None


@dataclass(frozen=True)
class Verdict:
    """The screen's decision about one worker's delta, with the numbers behind it."""

    worker: int
    reason: str  # ACCEPT or the first failed check's reason code
    evidence: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable

    @property
    def accepted(self) -> bool:
        return self.reason == ACCEPT

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "reason": self.reason, "evidence": self.evidence}


def _cosine(dot: float, na: float, nb: float) -> float | None:
    if na == 0.0 or nb == 0.0:
        return None
    return max(-1.0, min(1.0, dot / (na * nb)))


def near_distance(sq_a: float, sq_b: float, dot: float) -> float:
    """||a - b|| from the float64 sums |a|^2, |b|^2 and a.b. For the near-duplicate test only:
    the cancellation error is ~1e-16 of the squares, so a relative distance is exact to ~1e-8,
    far below the threshold (1e-3); an exact copy (the same bits: a.b is |a|^2, summed in the
    same order) comes out 0."""
    return math.sqrt(max(sq_a + sq_b - 2.0 * dot, 0.0))


def mean_square(members: list[int], squares: list[float], dots: Mapping[tuple[int, int], float]) -> float:
    """|m|^2 for m the mean of rows `members`, from their squares and pairwise dots:
    (sum_i |x_i|^2 + 2 sum_{i<j} x_i.x_j) / n^2, summed in `members` order (the same bits on
    every worker). The dot of a row a with m is sum_i a.x_i / n, summed in the same order."""
    total = 0.0
    for i, x in enumerate(members):
        total += squares[x]
        for y in members[i + 1 :]:
            total += 2.0 * dots[x, y]
    return max(total, 0.0) / len(members) ** 2


# |delta|^2 of the deltas screened so far (det_dot's, bit for bit), by the id of their first tensor:
# a delta is screened in its round and again as the next round's previous (and, delay 1, the round
# after's earlier). Entries hold weak references only; those of freed deltas go as new ones come
_SQUARES: dict[int, tuple[list[tuple[weakref.ref, int]], float]] = {}


def _known_square(delta: Delta) -> float | None:
    """|delta|^2 as a screen summed it, if these very tensors (the same objects, alive, unchanged
    since: torch's version counters) were screened before."""
    parts = flat_parts(delta)
    seen = _SQUARES.get(id(parts[0]))
    if seen is None:
        return None
    refs, square = seen
    if len(refs) != len(parts) or any(ref() is not t or v != _version(t) for (ref, v), t in zip(refs, parts, strict=False)):
        return None
    return square


def _remember_square(delta: Delta, square: float) -> None:
    for key in [k for k, (refs, _) in _SQUARES.items() if refs[0][0]() is None]:
        del _SQUARES[key]
    parts = flat_parts(delta)
    versions = [_version(t) for t in parts]
    if None not in versions:
        _SQUARES[id(parts[0])] = ([(weakref.ref(t), v) for t, v in zip(parts, versions, strict=True)], square)


def _version(t: torch.Tensor) -> int | None:
    """t's version counter (bumped by every in-place change); None for a tensor without one (made
    under torch.inference_mode), whose square is not remembered."""
    try:
        return t._version
    except RuntimeError:
        return None


COPY_FLAGS = (DUPLICATE, NEAR_DUPLICATE)


def copy_partners(evidence: dict[str, Any]) -> list[int]:
    """The workers of this round whose packet a screened one's copies or is copied by (exactly or
    nearly): it is an end of a same-round copy, and the screen cannot tell which end is the
    original (check.screen_checked may have every end replayed). [] if none."""
    return sorted(set(evidence.get("duplicate_of", [])) | {x["worker"] for x in evidence.get("near_duplicate_of", [])})


def copied_only(evidence: dict[str, Any]) -> list[int] | None:
    """`copy_partners`, where that copy is all the screen holds against the worker: no other flag,
    no copy of an earlier round (such an end may be the original: check.screen_checked keeps it
    in until its replay tells). None otherwise."""
    flags = evidence.get("flags") or []
    keys = {k for k in evidence if k.startswith(("duplicate_of", "near_duplicate_of"))}
    if not flags or not set(flags) <= set(COPY_FLAGS) or not keys <= {"duplicate_of", "near_duplicate_of"}:
        return None
    return copy_partners(evidence) or None


ESTIMATE = True  # _provably_apart may spare the exact near-duplicate dots (tests turn it off to compare)
_MARGIN = 1e-9  # relative slack for the float64 arithmetic of the exact tests


def _provably_apart(items: list[Delta], pairs: list[tuple[int, int]], squares: list[float], live: list[int],
                    back: list[tuple[str, dict[int, tuple[int, float]], list[int]]], cfg: ScreenConfig) -> bool:
    """True when no near-duplicate test of check 4 can hit: every pair of rows (this round's
    `live` rows with each other and with each earlier round's, and with that round's mean) has,
    by `aggregate.bounded_dots`' estimates and their error bounds, a cosine below
    `near_dup_cosine` and a relative distance above `near_dup_rel_dist`, with a margin for the
    float64 arithmetic of the exact tests. Then the exact tests would flag nothing and record
    nothing, so the verdicts and the evidence are theirs, bit for bit. False when that cannot be
    proven (a copy, a delta near a threshold, deltas that are not float32): the caller runs the
    exact tests."""
    if not ESTIMATE or not pairs:
        return not pairs
    norms = [math.sqrt(q) if math.isfinite(q) else math.inf for q in squares]
    bounded = bounded_dots(items, pairs, norms)
    if bounded is None:
        return False
    est = dict(zip(pairs, bounded, strict=True))
    c, r = cfg.near_dup_cosine, cfg.near_dup_rel_dist

    def far(sq_a: float, sq_b: float, dot_hi: float) -> bool:
        """No hit for any a.b <= dot_hi, given |a|^2 and |b|^2."""
        if sq_a <= 0.0 or sq_b <= 0.0:
            return True  # no cosine: near() records nothing
        na, nb = math.sqrt(sq_a), math.sqrt(sq_b)
        cosine_below = dot_hi <= 0.0 or dot_hi < (c - _MARGIN) * na * nb
        return cosine_below and sq_a + sq_b - 2.0 * dot_hi > (r * max(na, nb)) ** 2 * (1 + _MARGIN) + _MARGIN * (sq_a + sq_b)

    def pair_far(a: int, b: int) -> bool:
        d, e = est[(a, b)]
        return far(squares[a], squares[b], d + e)

    if not all(pair_far(a, b) for i, a in enumerate(live) for b in live[i + 1 :]):
        return False
    for _, earlier_rows, members in back:
        if not all(pair_far(a, r_pw) for a in live for r_pw, _ in earlier_rows.values()):
            return False
        if len(members) < 2:
            continue
        k = len(members)
        total, slack = 0.0, 0.0
        for i, x in enumerate(members):
            total += squares[x]
            for y in members[i + 1 :]:
                d, e = est[(x, y)]
                total, slack = total + 2.0 * d, slack + 2.0 * e
        lo, hi = max(total - slack, 0.0) / k**2, max(total + slack, 0.0) / k**2  # |mean|^2
        if hi == 0.0:
            continue  # the mean is zero: no test
        if lo == 0.0:
            return False
        for a in live:
            d = sum(est[(a, m)][0] for m in members) / k
            e = sum(est[(a, m)][1] for m in members) / k + _MARGIN * abs(d)
            # the cosine's denominator at |mean| >= sqrt(lo), the distance's at |mean|^2 >= lo, its max at <= hi
            na = math.sqrt(squares[a])
            if not (d + e <= 0.0 or d + e < (c - _MARGIN) * na * math.sqrt(lo)):
                return False
            if not squares[a] + lo - 2.0 * (d + e) > r**2 * max(squares[a], hi) * (1 + _MARGIN) + _MARGIN * (squares[a] + hi):
                return False
    return True


def _flat_size(delta: Delta) -> int:
    """numel of `flatten(delta)`, without building it."""
    return sum(t.numel() for t in flat_parts(delta))


def screen_round(
    deltas: Mapping[int, Delta],
    *,
    packet_hashes: Mapping[int, str] | None = None,
    previous_packet_hashes: Mapping[int, str] | None = None,
    previous_deltas: Mapping[int, Delta] | None = None,
    loss_gains: Mapping[int, LossGain] | None = None,
    config: ScreenConfig | None = None,
    earlier_deltas: Mapping[int, Delta] | None = None,
) -> dict[int, Verdict]:
    """Screen one round's deltas; see the module docstring for the checks and thresholds.

    deltas: {worker: decoded delta} of this round. packet_hashes: {worker: sha256 of its packet}
    (enables exact-duplicate detection). previous_packet_hashes / previous_deltas: the previous
    round's packets and decoded deltas (replay detection). earlier_deltas: the round before's
    accepted deltas, near-duplicate checked like the previous round's (evidence keys
    "..._of_earlier"): with the exchange a round late, those are the newest deltas a worker holds
    when it sends, so a stale or copying worker resubmits them. loss_gains: {worker: LossGain} for the
    workers whose losses the caller measured (others skip the loss check). Returns {worker:
    Verdict} in ascending worker order.
    """
    cfg = config or ScreenConfig()
    workers = sorted(deltas)
    previous = dict(previous_deltas or {})
    prev_workers = sorted(previous)
    earlier = dict(earlier_deltas or {})
    early_workers = sorted(earlier)
    items = [deltas[w] for w in workers] + [previous[w] for w in prev_workers] + [earlier[w] for w in early_workers]
    sizes = {_flat_size(d) for d in items}
    if len(sizes) > 1:
        raise ValueError(f"deltas have different sizes {sorted(sizes)[:6]}; decode checks shapes")
    if not workers:
        return {}
    # this round's deltas, then the previous round's, as rows (row numbers below)
    rows = sum_rows(items)
    row = {w: i for i, w in enumerate(workers)}
    prev_row = {w: len(workers) + i for i, w in enumerate(prev_workers)}
    early_row = {w: len(workers) + len(prev_workers) + i for i, w in enumerate(early_workers)}
    sums = RowSums()  # one scratch buffer for every sum below
    # a finite sum of squares proves every element finite (a NaN or inf would reach the sum);
    # only a row whose sum overflowed or is not finite is looked at element by element.
    # The previous rounds' deltas were this round's in their screen: their squares are known
    squares = [_known_square(d) for d in items]
    missing = [i for i, q in enumerate(squares) if q is None]
    for i, q in zip(missing, sums.dots(rows, rows, [(i, i) for i in missing]), strict=True):
        squares[i] = q
        _remember_square(items[i], q)
    finite_rows = [
        math.isfinite(sq) or row_finite(r)
        for sq, r in zip(squares, rows, strict=True)
    ]
    flags: dict[int, list[str]] = {w: [] for w in workers}
    ev: dict[int, dict[str, Any]] = {w: {} for w in workers}

    def flag(w: int, reason: str) -> None:
        if reason not in flags[w]:
            flags[w].append(reason)

    # 1-2: absolute checks
    finite = {w for w in workers if finite_rows[row[w]]}
    finite_prev = [w for w in prev_workers if finite_rows[prev_row[w]]]
    norms: dict[int, float] = {}
    for w in workers:
        if w in finite:
            norms[w] = math.sqrt(squares[row[w]])  # det_norm
        else:
            flag(w, MALFORMED)
        ev[w]["norm"] = norms.get(w)
        if norms.get(w) == 0.0:
            flag(w, NORM_OUTLIER)
            ev[w]["zero"] = True
    prev_norms = {w: math.sqrt(squares[prev_row[w]]) for w in finite_prev}
    early_norms = {w: math.sqrt(squares[early_row[w]]) for w in early_workers if finite_rows[early_row[w]]}

    # 3: exact duplicates by packet hash
    hashes = dict(packet_hashes or {})
    prev_by_hash: dict[str, list[int]] = {}
    for pw, h in sorted((previous_packet_hashes or {}).items()):
        prev_by_hash.setdefault(h, []).append(pw)
    for w in workers:
        h = hashes.get(w)
        if h is None:
            continue
        same = [o for o in workers if o != w and hashes.get(o) == h]
        if same:
            ev[w]["duplicate_of"] = same
            flag(w, DUPLICATE)
        if h in prev_by_hash:
            ev[w]["duplicate_of_previous"] = prev_by_hash[h]
            flag(w, DUPLICATE)

    # 4: near duplicates, this round (each pair once) and against the previous round.
    # Everything comes from the deterministic sums of squares and dot products: a distance is
    # sqrt(|a|^2 + |b|^2 - 2 a.b) (near_distance), and an earlier round's mean enters through its
    # members' dots (mean_square), so no difference vector and no mean vector is ever built
    live = [w for w in workers if w in finite and norms[w] > 0.0]
    pairs = [(row[w], row[o]) for i, w in enumerate(live) for o in live[i + 1 :]]
    back = []  # (evidence suffix, {worker: (row, norm)}, that round's rows in worker order)
    for suffix, at, nrm in (("previous", prev_row, prev_norms), ("earlier", early_row, early_norms)):
        members = [at[pw] for pw in nrm]  # worker order
        pairs += [(row[w], m) for w in live for m in members]
        if len(members) >= 2:  # the mean's square needs the members' own dots
            pairs += [(a, b) for i, a in enumerate(members) for b in members[i + 1 :]]
        back.append((suffix, {pw: (at[pw], pn) for pw, pn in nrm.items()}, members))
    # honest deltas are far from every threshold: when bounded estimates prove that no test below
    # can hit, the exact dots (two thirds of a screen's sums) are not needed, and nothing is recorded;
    # else the exact tests
    if not _provably_apart(items, pairs, squares, [row[w] for w in live], back, cfg):
        dots = dict(zip(pairs, sums.dots(rows, rows, pairs), strict=True))
        # with one delta, the mean is that delta (checked on its own)
        mean_squares = [mean_square(m, squares, dots) if len(m) >= 2 else 0.0 for _, _, m in back]

        def near(sq_a: float, sq_b: float, dot: float, na: float, nb: float) -> dict[str, float] | None:
            cos = _cosine(dot, na, nb)
            if cos is None:
                return None
            rel = near_distance(sq_a, sq_b, dot) / max(na, nb)
            if cos >= cfg.near_dup_cosine or rel <= cfg.near_dup_rel_dist:
                return {"cosine": cos, "rel_dist": rel}
            return None

        for i, w in enumerate(live):
            a = row[w]
            for o in live[i + 1 :]:
                hit = near(squares[a], squares[row[o]], dots[a, row[o]], norms[w], norms[o])
                if hit is not None:
                    for x, y in ((w, o), (o, w)):
                        ev[x].setdefault("near_duplicate_of", []).append({"worker": y, **hit})
                        flag(x, NEAR_DUPLICATE)
            for (suffix, earlier_rows, members), mean_sq in zip(back, mean_squares, strict=True):
                for pw, (r_pw, pn) in earlier_rows.items():
                    hit = near(squares[a], squares[r_pw], dots[a, r_pw], norms[w], pn)  # None for pn = 0
                    if hit is not None:
                        ev[w].setdefault(f"near_duplicate_of_{suffix}", []).append({"worker": pw, **hit})
                        flag(w, NEAR_DUPLICATE)
                if mean_sq > 0.0:
                    mean_dot = 0.0
                    for m in members:  # in members order, as mean_square sums
                        mean_dot += dots[a, m]
                    hit = near(squares[a], mean_sq, mean_dot / len(members), norms[w], math.sqrt(mean_sq))
                    if hit is not None:
                        ev[w][f"near_duplicate_of_{suffix}_mean"] = hit
                        flag(w, NEAR_DUPLICATE)

    # 5-6: against the robust centre of the workers that are still candidates
    # the previous rounds' rows are done with (a short row is a flat copy, freed here for the median's scratch)
    del rows[len(workers) :]
    candidates = [w for w in workers if not flags[w]]
    ev_common: dict[str, Any] = {"centre": cfg.centre, "consensus_workers": candidates}
    if len(candidates) >= cfg.min_workers:
        if cfg.centre == "median":
            centre = median_row([rows[row[w]] for w in candidates])
        else:
            centre = geometric_median_row([items[row[w]] for w in candidates], cfg.weiszfeld_iterations)
        measured = [w for w in workers if w in finite]
        # |centre|^2 and each delta's dot with the centre in one call: a median centre is computed a
        # chunk at a time where it is read, so it is read (and its medians taken) once, not twice
        c, both = len(rows), [*rows, centre]
        sums_c = sums.dots(both, both, [(row[w], c) for w in measured] + [(c, c)])
        centre_norm, centre_dots = math.sqrt(sums_c[-1]), sums_c[:-1]
        median_norm = median_of([norms[w] for w in candidates])
        ev_common["median_norm"] = median_norm
        ev_common["centre_norm"] = centre_norm
        for w, dot in zip(measured, centre_dots, strict=True):
            ratio = norms[w] / median_norm
            cos = _cosine(dot, norms[w], centre_norm)
            ev[w]["norm_ratio"] = ratio
            ev[w]["cosine_to_centre"] = cos
            if w not in candidates and not set(flags[w]) <= set(COPY_FLAGS):
                continue  # measured for the record; already rejected (an end of a copy may be replayed)
            if not cfg.norm_lo <= ratio <= cfg.norm_hi:
                flag(w, NORM_OUTLIER)
            # a zero centre (the candidates cancel out) defines no direction: no cosine check
            if cos is not None and cos < cfg.min_cosine:
                flag(w, COSINE_OUTLIER)
    else:
        ev_common["skipped"] = (
            f"{len(candidates)} candidate(s) < min_workers={cfg.min_workers}: "
            "no norm/cosine-to-centre checks"
        )

    # 7: loss gain, where the caller measured it
    for w in workers:
        g = (loss_gains or {}).get(w)
        if g is None:
            continue
        ev[w]["loss_gain"] = g.to_dict()
        reason = loss_gain_verdict(g, cfg.min_own_gain, cfg.min_own_advantage)
        if reason is not None:
            flag(w, reason)

    verdicts: dict[int, Verdict] = {}
    for w in workers:
        evidence = {**ev_common, **ev[w], "flags": list(flags[w])}
        evidence.setdefault("norm_ratio", None)
        evidence.setdefault("cosine_to_centre", None)
        verdicts[w] = Verdict(w, flags[w][0] if flags[w] else ACCEPT, evidence)
    return verdicts
