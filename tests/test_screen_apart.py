"""The screen skips its exact near-duplicate dots when bounded float32 estimates prove that no test
could hit (screen._provably_apart, aggregate.bounded_dots): the verdicts and the evidence must
be the exact screen's, bit for bit, in every case, near-duplicates and near-misses included."""

from __future__ import annotations

import math

import pytest
import torch

from veriloco.hashing import canonical_json
from veriloco.verify import screen as screen_mod
from veriloco.verify.aggregate import _GAMMA, bounded_dots, det_dot, flatten
from veriloco.verify.screen import screen_round


def _delta(gen: torch.Generator, n: int, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    """A two-tensor delta of n elements in all (the second long enough for several blocks)."""
    return {"a.bias": torch.randn(7, generator=gen) * scale, "b.weight": torch.randn(n - 7, generator=gen) * scale}


def _like(d: dict[str, torch.Tensor], f) -> dict[str, torch.Tensor]:
    return {k: f(v) for k, v in d.items()}


@pytest.mark.parametrize("n", [300, 200_003])
def test_every_estimate_lies_within_its_bound(n):
    gen = torch.Generator().manual_seed(n)
    base = _delta(gen, n)
    items = [
        base,
        _delta(gen, n),
        _like(base, lambda v: v * 3.0 + torch.randn(v.shape, generator=gen) * 1e-6),  # nearly parallel
        _like(base, lambda v: v * torch.where(torch.arange(v.numel()) % 2 == 0, 1.0, -1.0)),  # cancels: a.b ~ 0
        _like(base, lambda v: v * 1e-38),  # under float32's normal range
        _like(base, lambda v: v * 1e17),  # large (products near 1e30)
    ]
    norms = [math.sqrt(det_dot(flatten(d), flatten(d))) for d in items]
    pairs = [(i, j) for i in range(len(items)) for j in range(i, len(items))]
    for (i, j), (est, bound) in zip(pairs, bounded_dots(items, pairs, norms), strict=True):
        exact = det_dot(flatten(items[i]), flatten(items[j]))
        assert abs(est - exact) <= bound, (i, j, est, exact, bound)
        # the worst case (Higham's gamma_m for a float32 block of _EST_BLOCK) is what is proven; the
        # errors measured here sit far inside it, so a smaller bound would pass the line above
        assert _GAMMA * norms[i] * norms[j] <= bound <= 0.0040 * norms[i] * norms[j] + n * 2.0**-148


def test_no_estimate_for_other_dtypes_or_non_finite_sums():
    gen = torch.Generator().manual_seed(0)
    a = _delta(gen, 100)
    assert bounded_dots([a, _like(a, torch.Tensor.double)], [(0, 1)], [1.0, 1.0]) is None
    huge = _like(a, lambda v: torch.full_like(v, 3e38))
    assert bounded_dots([huge, huge], [(0, 1)], [math.inf, math.inf]) is None


def _rounds(n: int):
    """(name, this round's deltas, previous round's, earlier round's) covering every test of check 4."""
    gen = torch.Generator().manual_seed(7)
    honest = {w: _delta(gen, n) for w in range(4)}
    prev = {w: _delta(gen, n) for w in range(4)}
    earlier = {w: _delta(gen, n) for w in range(4)}
    noise = lambda s: (lambda v: v + torch.randn(v.shape, generator=gen) * s)  # noqa: E731
    prev_mean = {k: sum(prev[w][k] for w in prev) / 4 for k in prev[0]}
    yield "honest", honest, prev, earlier
    yield "honest, no earlier round", honest, prev, {}
    yield "first round", honest, {}, {}
    yield "copy with noise", {**honest, 3: _like(honest[1], noise(1e-6))}, prev, earlier
    yield "rescaled copy", {**honest, 3: _like(honest[1], lambda v: v * 5.0)}, prev, earlier
    yield "replay of its previous delta, re-encoded", {**honest, 2: _like(prev[2], lambda v: v.half().float())}, prev, earlier
    yield "copy of an earlier delta", {**honest, 0: _like(earlier[3], noise(1e-7))}, prev, earlier
    yield "stale: the previous mean", {**honest, 1: _like(prev_mean, noise(1e-7))}, prev, earlier
    # near the cosine threshold (0.999) from both sides, and just past it
    for cos in (0.99, 0.9985, 0.9991):
        ortho = _like(honest[1], lambda v: torch.randn(v.shape, generator=gen))
        mixed = {k: cos * honest[1][k] / flatten(honest[1]).norm().item()
                 + math.sqrt(1 - cos**2) * ortho[k] / flatten(ortho).norm().item() for k in honest[1]}
        yield f"cosine {cos}", {**honest, 3: mixed}, prev, earlier
    yield "a zero delta and a zero previous one", {**honest, 2: _like(honest[2], torch.zeros_like)}, \
        {**prev, 0: _like(prev[0], torch.zeros_like)}, earlier
    # its mean is exactly zero (no mean test), which estimates cannot prove: the exact tests run
    yield "a previous round that cancels to zero", honest, {0: prev[0], 1: _like(prev[0], torch.neg)}, earlier
    yield "every delta the same direction", {w: _like(honest[0], lambda v, w=w: v * (1 + w)) for w in range(4)}, prev, earlier
    yield "non-finite", {**honest, 0: _like(honest[0], lambda v: v.index_fill(0, torch.tensor([0]), math.inf))}, prev, earlier
    yield "float64 deltas", {w: _like(d, torch.Tensor.double) for w, d in honest.items()}, prev, earlier


@pytest.mark.parametrize("n", [300, 200_003])
def test_the_screen_reaches_the_exact_screens_verdicts_and_evidence(n, monkeypatch):
    took = []
    real = screen_mod._provably_apart

    def spy(*args):
        took.append(real(*args))
        return took[-1]

    monkeypatch.setattr(screen_mod, "_provably_apart", spy)
    for name, deltas, prev, earlier in _rounds(n):
        hashes = {w: f"{w:064x}" for w in deltas}
        kwargs = dict(packet_hashes=hashes, previous_packet_hashes={w: f"{w + 9:064x}" for w in prev},
                      previous_deltas=prev, earlier_deltas=earlier)
        took.clear()
        fast = screen_round(deltas, **kwargs)
        spared = took[0] if took else None  # None: no near-duplicate test to run
        monkeypatch.setattr(screen_mod, "ESTIMATE", False)
        exact = screen_round(deltas, **kwargs)
        monkeypatch.setattr(screen_mod, "ESTIMATE", True)
        assert [(v.worker, v.reason) for v in fast.values()] == [(v.worker, v.reason) for v in exact.values()], name
        assert canonical_json({w: v.evidence for w, v in fast.items()}) == \
            canonical_json({w: v.evidence for w, v in exact.items()}), name
        near = any("near_duplicate" in k for v in exact.values() for k in v.evidence)
        # the estimates spared the exact dots exactly where nothing was near (and the deltas are float32)
        if name in ("honest", "honest, no earlier round", "first round", "cosine 0.99", "non-finite",
                    "a zero delta and a zero previous one"):
            assert spared is True and not near, name
        if near or name == "float64 deltas":
            assert spared is False, name


def test_a_delta_screened_before_is_not_summed_again_unless_it_changed(monkeypatch):
    """The previous round's deltas were this round's in their screen: their squares are reused (the
    same floats), unless a tensor changed in place since or is another object."""
    from veriloco.verify.aggregate import RowSums

    computed = []
    real = RowSums.dots

    def spy(self, a, b, pairs):
        if a is b and all(i == j for i, j in pairs):  # the squares (not the centre's, summed with its dots)
            computed.extend(i for i, _ in pairs)
        return real(self, a, b, pairs)

    monkeypatch.setattr(RowSums, "dots", spy)
    gen = torch.Generator().manual_seed(3)
    first = {w: _delta(gen, 5000) for w in range(3)}
    second = {w: _delta(gen, 5000) for w in range(3)}
    one = screen_round(first)
    assert sorted(computed) == [0, 1, 2]
    computed.clear()
    two = screen_round(second, previous_deltas=first)
    assert sorted(computed) == [0, 1, 2]  # this round's three; the previous round's three were known
    assert [v.evidence["norm"] for v in one.values()] == [math.sqrt(det_dot(flatten(d), flatten(d))) for d in first.values()]
    screen_mod._SQUARES.clear()
    computed.clear()
    assert canonical_json({w: v.evidence for w, v in screen_round(second, previous_deltas=first).items()}) == \
        canonical_json({w: v.evidence for w, v in two.items()})
    assert sorted(computed) == [0, 1, 2, 3, 4, 5]
    first[1]["b.weight"].mul_(2.0)  # changed in place: summed again
    copy = {k: v.clone() for k, v in first[2].items()}  # the same values, another object: summed again
    computed.clear()
    screen_round(second, previous_deltas={1: first[1], 2: copy})
    assert sorted(computed) == [3, 4]
