"""The batched screen and the min/max-network aggregators against the algorithms they replaced.

Every worker and the offline audit recompute the screen's verdicts and evidence and the
aggregate; they must agree bit for bit with what the one-pair-at-a-time det_norm/det_dot and
the sort-based median gave. The reference copies below are those algorithms, as they were.
Inputs include odd lengths, ties, zeros of both signs, 1 to 17 rows, float32 and float64, and
run with 1 and 2 torch threads.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import random
from typing import Any

import pytest
import torch

from veriloco.verify import (
    ACCEPT,
    COSINE_OUTLIER,
    DUPLICATE,
    MALFORMED,
    NEAR_DUPLICATE,
    NORM_OUTLIER,
)
from veriloco.verify.aggregate import (
    FlatRow,
    MedianRow,
    RowSums,
    aggregate,
    centered_clip,
    coordinate_median,
    det_sum,
    flatten,
    geometric_median,
    median_of,
    trimmed_mean,
    unflatten,
)
from veriloco.verify.screen import ScreenConfig, Verdict, screen_round

# the module, not the function of the same name that veriloco.verify exports
aggregate_module = importlib.import_module("veriloco.verify.aggregate")

# ---- the reference: the algorithms as they were before RowSums and the min/max network ----


def ref_det_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1)
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    pad = (-n) % 1024
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    x = x.view(-1, 1024)
    while x.shape[0] > 1:
        rows = x.shape[0]
        half = rows // 2
        folded = x[:half] + x[half : 2 * half]
        if rows % 2:
            folded[0] += x[2 * half]
        x = folded
    v = x[0]
    while v.numel() > 1:
        half = v.numel() // 2
        v = v[:half] + v[half:]
    return v[0]


def ref_det_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(ref_det_sum(a.double() * b.double()))


def ref_det_norm(a: torch.Tensor) -> float:
    return math.sqrt(ref_det_dot(a, a))


def ref_median(matrix: torch.Tensor) -> torch.Tensor:
    n = matrix.shape[0]
    s = torch.sort(matrix, dim=0).values
    return s[n // 2].clone() if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def ref_trimmed_mean(matrix: torch.Tensor, k: int) -> torch.Tensor:
    s = torch.sort(matrix, dim=0).values[k : matrix.shape[0] - k]
    acc = s[0].clone()
    for i in range(1, s.shape[0]):
        acc += s[i]
    return acc / s.shape[0]


def ref_centered_clip(
    matrix: torch.Tensor, start: torch.Tensor, tau: float | None, iterations: int
):
    v = start.clone()
    if tau is None:
        tau = median_of([ref_det_norm(row - v) for row in matrix])
        if tau == 0.0:
            return v
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for row in matrix:
            diff = row - v
            dist = ref_det_norm(diff)
            step += diff * (1.0 if dist <= tau else tau / dist)
        v = v + step / matrix.shape[0]
    return v


def ref_geometric_median(matrix: torch.Tensor, iterations: int, eps=1e-12, tol=1e-10):
    z = ref_median(matrix)
    scale = max(ref_det_norm(row) for row in matrix) or 1.0
    for _ in range(iterations):
        weights = [1.0 / max(ref_det_norm(row - z), eps * scale) for row in matrix]
        total, acc = 0.0, torch.zeros_like(z)
        for w, row in zip(weights, matrix, strict=True):
            acc += row * w
            total += w
        new = acc / total
        moved = ref_det_norm(new - z)
        z = new
        if moved <= tol * scale:
            break
    return z


def ref_screen(deltas, packet_hashes=None, previous_deltas=None, config=None) -> dict[int, Verdict]:
    """screen_round's checks 1-6 as they were (loss gain and previous packet hashes are plain
    bookkeeping, unchanged, and left out here)."""
    cfg = config or ScreenConfig()
    workers = sorted(deltas)
    vecs = {w: flatten(deltas[w]) for w in workers}
    prev = {w: flatten(d) for w, d in sorted((previous_deltas or {}).items())}
    flags: dict[int, list[str]] = {w: [] for w in workers}
    ev: dict[int, dict[str, Any]] = {w: {} for w in workers}

    def flag(w, reason):
        if reason not in flags[w]:
            flags[w].append(reason)

    def cosine(a, b, na, nb):
        if na == 0.0 or nb == 0.0:
            return None
        return max(-1.0, min(1.0, ref_det_dot(a, b) / (na * nb)))

    norms, finite = {}, set()
    for w in workers:
        if bool(torch.isfinite(vecs[w]).all()):
            finite.add(w)
            norms[w] = ref_det_norm(vecs[w])
        else:
            flag(w, MALFORMED)
        ev[w]["norm"] = norms.get(w)
        if norms.get(w) == 0.0:
            flag(w, NORM_OUTLIER)
            ev[w]["zero"] = True
    prev_norms = {w: ref_det_norm(v) for w, v in prev.items() if bool(torch.isfinite(v).all())}
    hashes = dict(packet_hashes or {})
    for w in workers:
        same = [
            o
            for o in workers
            if o != w and hashes.get(w) is not None and hashes.get(o) == hashes[w]
        ]
        if same:
            ev[w]["duplicate_of"] = same
            flag(w, DUPLICATE)

    def near(a, b, na, nb, sq_a=None, sq_b=None, dot=None):
        # the distance from the sums, as the screen takes it (screen.near_distance)
        dot = ref_det_dot(a, b) if dot is None else dot
        if na == 0.0 or nb == 0.0:
            return None
        cos = max(-1.0, min(1.0, dot / (na * nb)))
        sq_a = ref_det_dot(a, a) if sq_a is None else sq_a
        sq_b = ref_det_dot(b, b) if sq_b is None else sq_b
        rel = math.sqrt(max(sq_a + sq_b - 2.0 * dot, 0.0)) / max(na, nb)
        if cos >= cfg.near_dup_cosine or rel <= cfg.near_dup_rel_dist:
            return {"cosine": cos, "rel_dist": rel}
        return None

    live = [w for w in workers if w in finite and norms[w] > 0.0]
    for i, w in enumerate(live):
        for o in live[i + 1 :]:
            hit = near(vecs[w], vecs[o], norms[w], norms[o])
            if hit is not None:
                for a, b in ((w, o), (o, w)):
                    ev[a].setdefault("near_duplicate_of", []).append({"worker": b, **hit})
                    flag(a, NEAR_DUPLICATE)
        for pw, pn in prev_norms.items():
            hit = near(vecs[w], prev[pw], norms[w], pn)
            if hit is not None:
                ev[w].setdefault("near_duplicate_of_previous", []).append({"worker": pw, **hit})
                flag(w, NEAR_DUPLICATE)
        if len(prev_norms) >= 2:  # the previous round's mean (a stale resubmission), from the sums
            members = list(prev_norms)
            mean_sq = 0.0
            for i_, x in enumerate(members):
                mean_sq += ref_det_dot(prev[x], prev[x])
                for y in members[i_ + 1 :]:
                    mean_sq += 2.0 * ref_det_dot(prev[x], prev[y])
            mean_sq = max(mean_sq, 0.0) / len(members) ** 2
            mean_dot = 0.0
            for x in members:
                mean_dot += ref_det_dot(vecs[w], prev[x])
            mean_dot /= len(members)
            hit = None
            if mean_sq > 0.0:
                hit = near(vecs[w], None, norms[w], math.sqrt(mean_sq), sq_b=mean_sq, dot=mean_dot)
            if hit is not None:
                ev[w]["near_duplicate_of_previous_mean"] = hit
                flag(w, NEAR_DUPLICATE)
    candidates = [w for w in workers if not flags[w]]
    common: dict[str, Any] = {"centre": cfg.centre, "consensus_workers": candidates}
    if len(candidates) >= cfg.min_workers:
        matrix = torch.stack([vecs[w] for w in candidates])
        centre = (
            ref_median(matrix)
            if cfg.centre == "median"
            else ref_geometric_median(matrix, cfg.weiszfeld_iterations)
        )
        centre_norm = ref_det_norm(centre)
        median_norm = median_of([norms[w] for w in candidates])
        common["median_norm"], common["centre_norm"] = median_norm, centre_norm
        for w in workers:
            if w not in finite:
                continue
            ratio = norms[w] / median_norm
            cos = cosine(vecs[w], centre, norms[w], centre_norm)
            ev[w]["norm_ratio"], ev[w]["cosine_to_centre"] = ratio, cos
            if w not in candidates and not set(flags[w]) <= {DUPLICATE, NEAR_DUPLICATE}:
                continue  # (an end of a same-round copy is measured too: the forty-third session)
            if not cfg.norm_lo <= ratio <= cfg.norm_hi:
                flag(w, NORM_OUTLIER)
            if cos is not None and cos < cfg.min_cosine:
                flag(w, COSINE_OUTLIER)
    else:
        common["skipped"] = (
            f"{len(candidates)} candidate(s) < min_workers={cfg.min_workers}: "
            "no norm/cosine-to-centre checks"
        )
    out = {}
    for w in workers:
        evidence = {**common, **ev[w], "flags": list(flags[w])}
        evidence.setdefault("norm_ratio", None)
        evidence.setdefault("cosine_to_centre", None)
        out[w] = Verdict(w, flags[w][0] if flags[w] else ACCEPT, evidence)
    return out


# ---- inputs and comparison ----


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float64: torch.int64, torch.float32: torch.int32}[a.dtype]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def matrix(rows: int, d: int, dtype: torch.dtype, kind: str, g: torch.Generator) -> torch.Tensor:
    m = torch.randn(rows, d, generator=g, dtype=torch.float64)
    if kind == "ties":  # few distinct values: many equal keys per column
        m = torch.randint(-2, 3, (rows, d), generator=g).double()
    elif kind == "zeros":  # +0.0 and -0.0 mixed in: which one a sort picks depends on row order
        u = torch.rand(rows, d, generator=g)
        m = torch.where(u < 0.35, torch.zeros_like(m), m)
        m = torch.where(u > 0.7, torch.full_like(m, -0.0), m)
    elif kind == "copies":
        m[1:] = m[0]
    return m.to(dtype)


CASES = [
    (rows, d, dtype, kind)
    for rows in (*range(1, 10), 16, 17)
    for d, kind in (
        (1, "normal"),
        (7, "ties"),
        (1023, "zeros"),
        (1025, "copies"),
        (3001, "normal"),
        (3001, "zeros"),
    )
    for dtype in (torch.float32, torch.float64)
]


def test_det_sum_and_row_sums_match_the_reference(threads):
    g = torch.Generator().manual_seed(threads)
    sums = {}
    for d in (1, 2, 1023, 1024, 1025, 5 * 1024 + 3):
        for dtype in (torch.float32, torch.float64):
            m = matrix(4, d, dtype, "normal", g) * 10
            assert same_bits(det_sum(m[0]), ref_det_sum(m[0]))
            pairs = [(i, j) for i in range(4) for j in range(4)]
            sums[d, dtype] = RowSums()
            assert sums[d, dtype].dots(m, m, pairs) == [ref_det_dot(m[i], m[j]) for i, j in pairs]
            rows = list(m)  # as the screen passes them: a square (i, i) is one row, converted once
            assert RowSums().dots(rows, rows, pairs) == [ref_det_dot(m[i], m[j]) for i, j in pairs]
            assert sums[d, dtype].norms(m) == [ref_det_norm(r) for r in m]
            # rows of different dtypes, and as a list: each stands for its float64 values
            other = list(m.double().flip(0))
            want = [ref_det_norm(m[i].double() - other[j]) for i, j in pairs]
            assert sums[d, dtype].distances(m, other, pairs) == want
            assert sums[d, dtype].distances(m, m, pairs[:3]) == [
                ref_det_norm(m[i].double() - m[j].double()) for i, j in pairs[:3]
            ]
    assert RowSums().dots([torch.zeros(0)], [torch.zeros(0)], [(0, 0)]) == [0.0]
    with pytest.raises(ValueError, match="different sizes"):
        RowSums().dots([torch.zeros(3)], [torch.zeros(4)], [(0, 0)])


def test_median_and_trimmed_mean_match_sort(threads):
    g = torch.Generator().manual_seed(10 + threads)
    for rows, d, dtype, kind in CASES:
        m = matrix(rows, d, dtype, kind, g)
        assert same_bits(coordinate_median(m), ref_median(m)), (rows, d, dtype, kind)
        assert same_bits(coordinate_median(list(m)), ref_median(m))
        if dtype == torch.float32:  # computed in float64 from float32 rows
            assert same_bits(coordinate_median(list(m), torch.float64), ref_median(m.double()))
        for k in range((rows + 1) // 2):
            assert same_bits(trimmed_mean(m, k), ref_trimmed_mean(m, k)), (rows, d, kind, k)


def test_median_of_every_zero_one_column():
    """The 0-1 principle: a comparator network that selects the right order statistic for
    every column of 0s and 1s selects it for every input."""
    for rows in range(1, 11):
        columns = torch.tensor(list(itertools.product([0.0, 1.0], repeat=rows))).T.contiguous()
        assert same_bits(coordinate_median(columns), ref_median(columns)), rows
        for k in range((rows + 1) // 2):
            assert same_bits(trimmed_mean(columns, k), ref_trimmed_mean(columns, k)), (rows, k)


def test_nan_columns_fall_back_to_sort():
    """Sort puts NaN last, so a trimmed or median result can be a number; min/max would
    spread the NaN. Not a screen input (it rejects non-finite deltas first), but the same."""
    m = torch.randn(5, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    m[4, 3] = m[1, 7] = float("nan")
    m[:, 9] = float("nan")
    for rows in range(1, 6):
        assert same_bits(coordinate_median(m[:rows]), ref_median(m[:rows]))
        for k in range((rows + 1) // 2):
            assert same_bits(trimmed_mean(m[:rows], k), ref_trimmed_mean(m[:rows], k))


def test_centered_clip_and_geometric_median_match_the_reference(threads):
    g = torch.Generator().manual_seed(20 + threads)
    for rows, d, dtype, kind in CASES[::3]:
        m = matrix(rows, d, dtype, kind, g).double()
        start = ref_median(m)
        for tau in (None, 0.5):
            assert same_bits(centered_clip(m, start, tau, 3), ref_centered_clip(m, start, tau, 3))
        assert same_bits(geometric_median(m, 8), ref_geometric_median(m, 8))
        f32 = m.float()  # the functions as called directly, on float32
        assert same_bits(
            centered_clip(f32, f32[0], None, 2), ref_centered_clip(f32, f32[0], None, 2)
        )
        # aggregate() end to end: float32 deltas, float64 arithmetic, float32 result
        stacked = f32.double()
        want = ref_trimmed_mean(stacked, math.floor(0.2 * rows)).float()
        assert same_bits(aggregate(dict(enumerate(f32)), "trimmed_mean"), want)
        assert same_bits(aggregate(list(f32), "median"), ref_median(stacked).float())


def test_every_aggregate_of_dict_deltas_goes_tensor_by_tensor(threads):
    """aggregate() takes dict deltas a tensor at a time (no [n, d] float64 matrix; centered
    clipping and the geometric median one row's difference at a time): the same bits as on the
    whole flattened matrix, tensors of mixed dtypes and shapes, ties and zeros included."""
    g = torch.Generator().manual_seed(60 + threads)
    for n in (1, 2, 3, 5, 8, 17):
        deltas = {
            w: {"w": matrix(33, 7, torch.float32, "zeros", g).view(33, 7),
                "b": matrix(1, 5, torch.float64, "ties", g)[0], "a": torch.randn(3, generator=g)}
            for w in range(n)
        }
        stacked = torch.stack([flatten(deltas[w]) for w in range(n)])
        cases = [("median", {}, ref_median(stacked))]
        cases += [("trimmed_mean", {"trim_count": k}, ref_trimmed_mean(stacked, k)) for k in range((n + 1) // 2)]
        for method, params, ref in cases:
            got, want = aggregate(deltas, method, **params), unflatten(ref, deltas[0])
            assert all(same_bits(got[k], want[k]) for k in want), (n, method, params)
        for tau in (None, 0.5):  # the norm-taking methods: each delta as its tensors, never stacked
            got = aggregate(deltas, "centered_clip", tau=tau, iterations=2)
            want = unflatten(ref_centered_clip(stacked, ref_median(stacked), tau, 2), deltas[0])
            assert all(same_bits(got[k], want[k]) for k in want), (n, tau)
        start = {k: v * 0.5 for k, v in deltas[0].items()}
        got = aggregate(deltas, "centered_clip", start=start, iterations=2)
        want = unflatten(ref_centered_clip(stacked, flatten(start), None, 2), deltas[0])
        assert all(same_bits(got[k], want[k]) for k in want), n
        got = aggregate(deltas, "geometric_median", iterations=6)
        want = unflatten(ref_geometric_median(stacked, 6), deltas[0])
        assert all(same_bits(got[k], want[k]) for k in want), n
    for method in ("median", "centered_clip", "geometric_median"):
        with pytest.raises(ValueError, match="non-finite"):
            aggregate([{"a": torch.tensor([float("nan")])}, {"a": torch.zeros(1)}], method)
    with pytest.raises(ValueError, match="structure"):
        aggregate([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}], "trimmed_mean")


def random_round(rng: random.Random, g: torch.Generator) -> tuple[dict, dict, dict | None]:
    shapes = rng.choice(
        [{"a": (5,)}, {"w": (33, 31), "b": (31,)}, {"w": (40, 40), "b": (7,), "c": (3,)}]
    )
    base = {k: torch.randn(s, generator=g) for k, s in shapes.items()}

    def one() -> dict[str, torch.Tensor]:
        kind = rng.choice(["honest"] * 5 + ["zero", "nan", "flip", "big", "negzero"])
        d = {
            k: base[k] + torch.randn(s, generator=g) * rng.choice([0.3, 1.0])
            for k, s in shapes.items()
        }
        if kind == "zero":
            d = {k: torch.zeros(s) for k, s in shapes.items()}
        elif kind == "nan":
            next(iter(d.values())).view(-1)[0] = float("nan")
        elif kind == "flip":
            d = {k: -v for k, v in d.items()}
        elif kind == "big":
            d = {k: 10 * v for k, v in d.items()}
        elif kind == "negzero":
            d = {
                k: torch.where(torch.rand(v.shape, generator=g) < 0.5, -0.0, v)
                for k, v in d.items()
            }
        return d

    deltas: dict[int, dict[str, torch.Tensor]] = {}
    for w in rng.sample(range(12), rng.randint(1, 9)):
        d = one()
        if deltas and rng.random() < 0.25:  # a copy, a noisy copy, or a rescaled copy
            src = deltas[rng.choice(list(deltas))]
            how = rng.choice(["copy", "near", "scale"])
            scale = {"copy": 1.0, "near": 1.0, "scale": 2.5}[how]
            noise = 1e-5 if how == "near" else 0.0
            d = {
                k: v * scale * (1 + noise * torch.randn(v.shape, generator=g))
                for k, v in src.items()
            }
        deltas[w] = d
    previous = {w: one() for w in range(rng.randint(0, 4))}
    if previous and rng.random() < 0.5:  # a replay of the previous round
        previous[0] = {k: v.clone() for k, v in deltas[rng.choice(list(deltas))].items()}
    hashes = {w: str(rng.randint(0, 3)) for w in deltas} if rng.random() < 0.3 else None
    return deltas, previous, hashes


def as_json(verdicts: dict[int, Verdict]) -> str:
    return json.dumps([v.to_dict() for v in verdicts.values()])  # repr of floats: every bit


def test_screen_matches_the_reference(threads):
    rng, g = random.Random(threads), torch.Generator().manual_seed(30 + threads)
    for _ in range(40):
        deltas, previous, hashes = random_round(rng, g)
        for centre in ("median", "geometric_median"):
            cfg = ScreenConfig(centre=centre, weiszfeld_iterations=5)
            got = screen_round(deltas, packet_hashes=hashes, previous_deltas=previous, config=cfg)
            want = ref_screen(deltas, packet_hashes=hashes, previous_deltas=previous, config=cfg)
            assert as_json(got) == as_json(want)


def test_screen_of_float64_and_plain_tensor_deltas():
    """Float64 deltas (and tensors rather than dicts) are screened in float64 throughout."""
    g = torch.Generator().manual_seed(5)
    common = torch.randn(2049, generator=g, dtype=torch.float64)
    deltas = {w: common + torch.randn(2049, generator=g, dtype=torch.float64) for w in range(5)}
    deltas[4] = deltas[0] * (1 + 1e-7)
    previous = {0: deltas[1].float()}  # a float32 replay of a float64 delta
    assert as_json(screen_round(deltas, previous_deltas=previous)) == as_json(
        ref_screen(deltas, previous_deltas=previous)
    )


@pytest.fixture
def long_rows(monkeypatch):
    """Rows count as long (summed a chunk at a time, read from their tensors) from 2 blocks on,
    in chunks of `chunk` blocks: every level of the fold and every odd block out is reached
    with small inputs."""

    def set_chunk(chunk: int) -> None:
        monkeypatch.setattr(aggregate_module, "_WORK", 2 * 1024)
        monkeypatch.setattr(aggregate_module, "_CHUNK", chunk)
        monkeypatch.setattr(aggregate_module, "_GROUP", 3)

    set_chunk(1)
    return set_chunk


def test_long_rows_are_summed_a_chunk_at_a_time_bit_for_bit(long_rows, threads):
    g = torch.Generator().manual_seed(40 + threads)
    rng = random.Random(threads)
    for chunk in (1, 2, 3, 5):
        long_rows(chunk)
        # block counts with odd counts at different levels, and rows that do not fill their last block
        for n in (2049, 3 * 1024, 5 * 1024 - 1, 7 * 1024 + 5, 13 * 1024, 29 * 1024 + 17, 45 * 1024 + 1):
            m = matrix(5, n, torch.float32, "zeros" if n % 2 else "normal", g) * 10 ** rng.uniform(-3, 3)
            cuts = [sorted(rng.sample(range(1, n), 3)) for _ in m]
            flat = [FlatRow(list(torch.tensor_split(r, c))) for r, c in zip(m, cuts, strict=True)]
            flat[4] = FlatRow(list(torch.tensor_split(m[4].double(), cuts[4])))  # a float64 row
            rows = [*m[:4], m[4].double()]
            pairs = [(i, j) for i in range(5) for j in range(5)]
            want = [ref_det_dot(rows[i], rows[j]) for i, j in pairs]
            assert RowSums().dots(flat, flat, pairs) == want, (chunk, n)
            assert RowSums().dots(rows, flat, pairs) == want  # plain tensors take the same path
            assert RowSums().norms(m) == [ref_det_norm(r) for r in m]  # a [rows, n] tensor's rows
            want = [ref_det_norm(rows[i].double() - rows[j].double()) for i, j in pairs]
            assert RowSums().distances(flat, rows, pairs) == want
            centre = ref_median(torch.stack(rows[:3]).double())
            lazy = MedianRow(flat[:3])
            assert same_bits(lazy.tensor(), centre)
            got = RowSums().dots([*flat, lazy], [*flat, lazy], [(5, 5), *[(i, 5) for i in range(5)]])
            assert got == [ref_det_dot(centre, centre), *[ref_det_dot(r, centre) for r in rows]]


def test_flat_row_reads_across_its_tensors():
    parts = [torch.arange(3.0), torch.arange(3.0, 4.0), torch.arange(4.0, 10.0)]
    row = FlatRow([p.reshape(-1, 1) if p.numel() == 3 else p for p in parts])
    assert row.numel() == 10 and row.dtype == torch.float32
    assert row.chunk(2, 7).tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert row.chunk(5, 8).data_ptr() == parts[2][1:].data_ptr()  # within one tensor: a view
    assert row.chunk(4, 4).numel() == 0 and same_bits(row.tensor(), torch.arange(10.0))
    assert FlatRow([torch.ones(2), torch.ones(2, dtype=torch.float64)]).tensor().dtype == torch.float64
    assert row.all_finite()
    parts[2][3] = float("inf")
    assert not row.all_finite()


def test_screen_of_long_deltas_builds_no_flat_copy(long_rows, threads):
    """Deltas longer than one fold are screened from their own tensors (FlatRow, MedianRow)
    with the same verdicts and evidence, every bit, as the reference."""
    rng, g = random.Random(50 + threads), torch.Generator().manual_seed(50 + threads)
    for chunk in (1, 3):
        long_rows(chunk)
        for _ in range(6):
            shapes = {"w": (70, 60), "b": (1100,), "c": (3,)}
            base = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
            deltas = {w: {k: v + torch.randn(v.shape, generator=g) for k, v in base.items()}
                      for w in rng.sample(range(9), rng.randint(3, 7))}
            first = min(deltas)
            deltas[first]["w"][0, 0] = float("nan") if rng.random() < 0.5 else deltas[first]["w"][0, 0]
            previous = {0: {k: v.clone() for k, v in deltas[max(deltas)].items()}, 1: base}
            for centre in ("median", "geometric_median"):
                cfg = ScreenConfig(centre=centre, weiszfeld_iterations=3)
                got = screen_round(deltas, previous_deltas=previous, config=cfg)
                want = ref_screen(deltas, previous_deltas=previous, config=cfg)
                assert as_json(got) == as_json(want)
    assert all(isinstance(r, FlatRow) for r in aggregate_module.sum_rows([base, base]))
