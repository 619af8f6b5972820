"""Robust aggregators against hand computations, outliers, and bit-for-bit determinism."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from veriloco.verify.aggregate import aggregate, det_norm, det_sum, flatten


def rows(*values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32) for v in values]


def test_hand_computations():
    xs = rows([1, 10], [2, 20], [3, 30], [4, 40], [100, -50])
    assert aggregate(xs, "mean").tolist() == [22.0, 10.0]
    assert aggregate(xs, "median").tolist() == [3.0, 20.0]
    assert aggregate(xs[:4], "median").tolist() == [2.5, 25.0]  # mean of the middle two
    # trim one from each end per coordinate: [2,3,4] and [10,20,30]
    assert aggregate(xs, "trimmed_mean", trim_count=1).tolist() == [3.0, 20.0]
    assert aggregate(xs, "trimmed_mean").tolist() == [3.0, 20.0]  # default 0.2 * 5 = 1
    assert aggregate(xs, "trimmed_mean", trim_fraction=0.0).tolist() == [22.0, 10.0]
    assert aggregate(xs, "trimmed_mean", trim_count=2).tolist() == [3.0, 20.0]


def test_centered_clip_hand_computation():
    xs = rows([0, 0], [2, 0], [0, 10])
    start = torch.zeros(2)
    # one iteration, tau=1: clip(x - 0) = [0,0], [1,0], [0,1] -> mean [1/3, 1/3]
    out = aggregate(xs, "centered_clip", tau=1.0, iterations=1, start=start)
    assert torch.allclose(out, torch.tensor([1 / 3, 1 / 3]))
    # tau large enough: centered clipping is the mean after one iteration
    out = aggregate(xs, "centered_clip", tau=100.0, iterations=1, start=start)
    assert torch.allclose(out, torch.tensor([2 / 3, 10 / 3]))


def test_dict_deltas_and_worker_order():
    a = {"w": torch.ones(2, 2), "b": torch.zeros(3)}
    b = {"w": 3 * torch.ones(2, 2), "b": torch.ones(3)}
    out = aggregate({7: b, 2: a}, "mean")
    assert set(out) == {"w", "b"} and out["w"].shape == (2, 2)
    assert torch.equal(out["w"], 2 * torch.ones(2, 2)) and torch.equal(
        out["b"], 0.5 * torch.ones(3)
    )
    assert out["w"].dtype == torch.float32


@pytest.mark.parametrize("method", ["median", "trimmed_mean", "geometric_median"])
def test_resists_one_outlier_of_1e6(method):
    g = torch.Generator().manual_seed(0)
    honest = [torch.ones(16) + 0.1 * torch.randn(16, generator=g) for _ in range(5)]
    attacked = honest[:4] + [torch.full((16,), 1e6)]
    clean = aggregate(honest[:4], "mean")
    out = aggregate(attacked, method)
    assert (out - clean).abs().max() < 0.5, (method, out)
    assert (aggregate(attacked, "mean") - clean).abs().max() > 1e5  # the mean does not resist


def test_centered_clip_bounded_influence():
    g = torch.Generator().manual_seed(1)
    honest = [torch.ones(32) + 0.1 * torch.randn(32, generator=g) for _ in range(6)]
    start = torch.ones(32)
    tau, n = 0.5, 7
    base = aggregate(honest + [torch.ones(32)], "centered_clip", tau=tau, iterations=1, start=start)
    for scale in (1e3, 1e6, 1e9):
        attacker = -scale * torch.ones(32)
        out = aggregate(honest + [attacker], "centered_clip", tau=tau, iterations=1, start=start)
        # with one iteration, replacing one delta moves the result by at most 2 tau / n
        assert det_norm(flatten(out - base)) <= 2 * tau / n + 1e-5
    for iterations in (1, 3, 10):
        out = aggregate(
            honest + [1e9 * torch.ones(32)],
            "centered_clip",
            tau=tau,
            iterations=iterations,
            start=start,
        )
        assert det_norm(flatten(out - start)) <= iterations * tau + 1e-5  # each step <= tau
    # default tau (median distance to the coordinate median) also resists a 1e6 outlier
    out = aggregate(honest + [torch.full((32,), 1e6)], "centered_clip")
    assert (out - aggregate(honest, "mean")).abs().max() < 0.5


def test_single_and_identical_deltas():
    x = torch.tensor([1.0, -2.0])
    for method in ("mean", "median", "trimmed_mean", "centered_clip", "geometric_median"):
        assert torch.equal(aggregate([x], method), x), method
        assert torch.allclose(aggregate([x, x, x], method), x), method


def test_bit_identical_across_thread_counts():
    g = torch.Generator().manual_seed(2)
    xs = {
        w: {"a": torch.randn(180, 200, generator=g), "b": torch.randn(77, generator=g)}
        for w in range(5)
    }
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                [
                    aggregate(xs, m)
                    for m in ("mean", "trimmed_mean", "centered_clip", "geometric_median")
                ]
            )
            results[-1].append(
                float(det_sum(torch.randn(100_003, generator=torch.Generator().manual_seed(3))))
            )
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[0][:-1], results[1][:-1], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert results[0][-1] == results[1][-1]


def test_det_sum_matches_fsum():
    g = torch.Generator().manual_seed(4)
    for n in (0, 1, 5, 1024, 1025, 4097, 10_000):
        x = torch.randn(n, dtype=torch.float64, generator=g)
        assert math.isclose(float(det_sum(x)), math.fsum(x.tolist()), abs_tol=1e-9)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda xs: aggregate(xs, "average"), "unknown aggregation method 'average'"),
        (lambda xs: aggregate([], "mean"), "0 deltas"),
        (lambda xs: aggregate(xs, "mean", tau=1.0), r"takes no parameters, got \['tau'\]"),
        (
            lambda xs: aggregate(xs, "trimmed_mean", trim_fraction=0.5),
            "trim_fraction must be in .* got 0.5",
        ),
        (lambda xs: aggregate(xs, "trimmed_mean", trim_count=2), "trim_count=2 .* n=3"),
        (lambda xs: aggregate(xs, "trimmed_mean", trim_count=-1), "got -1"),
        (lambda xs: aggregate(xs, "trimmed_mean", trim_count=1, trim_fraction=0.1), "not both"),
        (lambda xs: aggregate(xs, "centered_clip", tau=0.0), "tau must be .* got 0.0"),
        (lambda xs: aggregate(xs, "centered_clip", tau=math.inf), "got inf"),
        (lambda xs: aggregate(xs, "centered_clip", iterations=0), "iterations must be .* got 0"),
        (lambda xs: aggregate(xs, "centered_clip", start=torch.zeros(3)), "structure"),
        (lambda xs: aggregate([*xs, torch.zeros(3)], "mean"), r"delta 3 has structure \(3,\)"),
        (
            lambda xs: aggregate([*xs, torch.tensor([math.nan, 0.0])], "mean"),
            r"deltas \[3\] have non-finite",
        ),
        (lambda xs: aggregate([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}], "mean"), "structure"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(rows([1, 2], [3, 4], [5, 6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_mean_one_tensor_at_a_time_is_the_float64_matrix_mean_bit_for_bit(dtype):
    """aggregate(.., "mean") sums each tensor in float64 on its own instead of stacking the
    deltas into one [n, d] float64 matrix; the same adds in the same order, bit for bit."""
    from veriloco.verify.aggregate import _mean_rows, stack, unflatten

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 5):
        deltas = {w: {"b": torch.randn(7, generator=g).to(dtype) * 10 ** (w - 2),
                      "a": torch.randn(3, 4, generator=g).to(dtype) * 1e-3} for w in (4, 0, 9, 2, 7)[:n]}
        matrix, template = stack(deltas)
        want = unflatten(_mean_rows(matrix), template)
        got = aggregate(deltas, "mean")
        assert list(got) == ["a", "b"] and all(got[k].dtype == dtype for k in got)
        assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want), n
    one = aggregate([torch.ones(4, dtype=dtype), torch.zeros(4, dtype=dtype)], "mean")
    assert torch.equal(one, torch.full((4,), 0.5, dtype=dtype))


def test_all_finite_is_isfinite_all_including_sums_that_overflow():
    from veriloco.compress._common import all_finite

    big = torch.full((4,), 3e38)  # finite, but its float32 sum overflows: looked at element by element
    assert all_finite(big) and all_finite(torch.zeros(0)) and all_finite(torch.arange(3))
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.zeros(1000)
        x[617] = bad
        assert not all_finite(x) and not all_finite(x.to(torch.bfloat16))
    assert not all_finite(torch.tensor([3e38, 3e38, math.inf]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_mean_a_chunk_at_a_time_is_the_stacked_mean(dtype, monkeypatch):
    """aggregate._mean (chunks of _MEAN_CHUNK through one float64 buffer) against the definition it
    keeps: the float64 mean of the stacked rows, rounded once to the deltas' dtype, bit for bit; tensors
    shorter than a chunk, one chunk exactly, and several with a short last one."""
    agg = importlib.import_module("veriloco.verify.aggregate")  # the module (veriloco.verify.aggregate is also a function)

    monkeypatch.setattr(agg, "_MEAN_CHUNK", 64)
    g = torch.Generator().manual_seed(9)
    for workers in (1, 2, 3, 5):
        xs = [{"a": (torch.randn(7, 29, generator=g) * 10.0 ** torch.randint(-30, 30, (7, 29), generator=g)).to(dtype),
               "b": torch.randn(64, generator=g).to(dtype), "c": torch.randn(3, generator=g).to(dtype)}
              for _ in range(workers)]
        got = agg._mean(xs)
        rows, template = agg.stack(xs)
        want = agg.unflatten(agg._mean_rows(rows), template)
        assert all(got[k].dtype == dtype and torch.equal(got[k], want[k]) for k in want), workers


@pytest.mark.parametrize("method", ["mean", "median", "trimmed_mean", "centered_clip", "geometric_median"])
def test_finite_float64_deltas_too_large_for_float64_sums_are_refused(method):
    """A finite 1e200 would overflow a norm's squares (geometric median: NaN; centered clipping:
    the attacker dropped, not clipped): refused by name, like a non-finite delta."""
    f64 = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1.1, 0.9], dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"deltas \[2\] have values above .* would overflow"):
        aggregate([*f64, torch.tensor([1e200, 0.0], dtype=torch.float64)], method)
    ok = aggregate([*f64, torch.tensor([1e140, 0.0], dtype=torch.float64)], method)
    assert bool(torch.isfinite(ok).all())
    # float32's largest values are far inside the bound
    big = torch.tensor([3e38, 0.0])
    assert bool(torch.isfinite(aggregate([big, big.neg(), big], method)).all())
