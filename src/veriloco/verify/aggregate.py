"""Robust aggregation of the accepted deltas of a round, bit-identical on every worker.

Every worker aggregates the same accepted deltas itself (there is no coordinator), so the result
must not depend on the machine: not on the thread count, not on the SIMD width. Library
reductions (`sum`, `norm`, `mean`) split work by thread and vector lane, so their rounding can
differ between machines. Here every reduction is built from elementwise IEEE operations in a
fixed order (`det_sum`: fixed-size blocks folded pairwise; worker sums in ascending worker
order), and order statistics are exact (a sort, or for up to 16 workers a min/max network that
selects the same values), so equal inputs in equal order give equal bits everywhere.
Arithmetic is float64; the result is cast back to the dtype of the inputs.

Methods (`aggregate(deltas, method, **params)`):
- "mean": plain average; no robustness, one worker can move it arbitrarily far.
- "median": coordinate-wise median (mean of the two middle values for an even count);
  Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates".
- "trimmed_mean": per coordinate, drop the `trim_count` (or floor(`trim_fraction` * n)) largest
  and smallest values and average the rest (Yin et al. 2018). Default trim_fraction 0.2, i.e.
  one of 5 workers per side: tolerates one attacker from n=5 on, plain mean below that.
- "centered_clip": Karimireddy, He & Jaggi 2021, "Learning from History for Byzantine Robust
  Optimization" (ICML, arXiv 2012.10333). Paper symbols -> arguments: v_0 -> `start` (the
  previous round's aggregate; default the coordinate-wise median), tau -> `tau`, l -> `iterations`.
  Each iteration v <- v + (1/n) sum_i (x_i - v) * min(1, tau / ||x_i - v||), so one worker moves
  the result by at most tau/n per iteration, however large its delta. Default tau is the median
  of ||x_i - v_0||, which honest workers set as long as they are a majority.
- "geometric_median": Weiszfeld iterations (Pillutla, Kakade & Harchaoui 2022, "Robust
  Aggregation for Federated Learning", arXiv 1912.13445), started from the coordinate median.

None of these removes attacks designed to hide inside the honest spread: ALIE (Baruch, Baruch &
Goldberg 2019, "A Little Is Enough", arXiv 1902.06156) and IPM (Xie, Koyejo & Gupta 2019, "Fall of
Empires", arXiv 1903.03936) were built to pass median and trimmed mean. Centered clipping bounds
how far they can move one round; screening, replay and the ledger handle the rest.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..compress._common import all_finite

Delta = torch.Tensor | dict[str, torch.Tensor]
METHODS: tuple[str, ...] = ("mean", "median", "trimmed_mean", "centered_clip", "geometric_median")
_BLOCK = 1024  # det_sum block length; a power of two so the last fold halves evenly
# float64 elements per RowSums fold (8 MB): a larger buffer costs more in page faults and cache
# misses than the Python calls it saves
_WORK = 1 << 20
# blocks per chunk where a row is longer than _WORK and is summed a chunk at a time
# (RowSums._chunked_sums): one level's scratch is _GROUP pairs x _CHUNK blocks of float64 (4 MB)
_CHUNK = 64
_GROUP = 8


def _fold_(x: torch.Tensor) -> torch.Tensor:
    """Row sums of `x` ([rows, blocks * 1024], zero-padded), in the order `det_sum` defines,
    computed in place: adding row i + half onto row i writes only where nothing is read later,
    so every add has the operands it has in `det_sum`. Destroys `x`."""
    x = x.view(x.shape[0], -1, _BLOCK)
    rows = x.shape[1]
    while rows > 1:
        half = rows // 2
        x[:, :half] += x[:, half : 2 * half]
        if rows % 2:
            x[:, 0] += x[:, 2 * half]
        rows = half
    v = x[:, 0]
    width = _BLOCK
    while width > 1:
        half = width // 2
        v[:, :half] += v[:, half:width]
        width = half
    return v[:, 0].clone()


def _padded_width(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def det_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of all elements of `x` (0-d tensor, same dtype), in an order fixed by its length
    alone: pad to blocks of 1024, add the second half of the blocks onto the first until one
    block is left (an odd block out goes onto block 0), then halve that block the same way.
    Only elementwise adds, so the bits do not depend on threads or vector width."""
    x = x.reshape(-1)
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    buf = x.new_zeros(1, _padded_width(n))
    buf[0, :n] = x
    return _fold_(buf)[0]


class FlatRow:
    """A delta's tensors as one row, in `flatten`'s order, without concatenating them: RowSums
    reads a long row a chunk at a time, so a screen of model-sized deltas never holds a flat
    copy of each (`sum_rows`)."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = [p.detach().reshape(-1) for p in parts]
        if not self.parts:
            raise ValueError("a row needs at least one tensor")
        dtypes = {p.dtype for p in self.parts}
        self.dtype = self.parts[0].dtype if len(dtypes) == 1 else torch.float64
        self.device = self.parts[0].device
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.numel())

    def numel(self) -> int:
        return self.starts[-1]

    def chunk(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the row: a view where one tensor holds them all."""
        pieces = []
        k = max(bisect.bisect_right(self.starts, start) - 1, 0)  # the first tensor that may hold element `start`
        while k < len(self.parts) and self.starts[k] < stop:
            lo, hi = max(start, self.starts[k]), min(stop, self.starts[k + 1])
            if lo < hi:
                pieces.append(self.parts[k][lo - self.starts[k] : hi - self.starts[k]])
            k += 1
        if not pieces:
            return self.parts[0].new_empty(0, dtype=self.dtype)
        if len(pieces) == 1 and pieces[0].dtype == self.dtype:
            return pieces[0]
        return torch.cat([x.to(self.dtype) for x in pieces])

    def all_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.parts)

    def tensor(self) -> torch.Tensor:
        return self.chunk(0, self.numel())


class MedianRow:
    """The coordinate median (float64) of rows, computed a chunk at a time where RowSums reads
    it: bit for bit `coordinate_median(rows, torch.float64)`, whose every element depends on its
    own column only."""

    def __init__(self, rows: Sequence[torch.Tensor | FlatRow]) -> None:
        self.rows = list(rows)
        self.dtype = torch.float64
        self.device = self.rows[0].device

    def numel(self) -> int:
        return self.rows[0].numel()

    def chunk(self, start: int, stop: int) -> torch.Tensor:
        return coordinate_median([_row_chunk(r, start, stop) for r in self.rows], torch.float64)

    def tensor(self) -> torch.Tensor:
        return self.chunk(0, self.numel())


Row = torch.Tensor | FlatRow | MedianRow
Rows = torch.Tensor | Sequence[Row]  # a [rows, n] tensor, or a list of rows


def _row_chunk(row: Row, start: int, stop: int) -> torch.Tensor:
    if isinstance(row, torch.Tensor):
        return row.detach().reshape(-1)[start:stop]
    return row.chunk(start, stop)


def _row_tensor(row: Row) -> torch.Tensor:
    return row if isinstance(row, torch.Tensor) else row.tensor()


def row_finite(row: Row) -> bool:
    """Every element of the row is finite."""
    if isinstance(row, FlatRow):
        return row.all_finite()
    return bool(torch.isfinite(_row_tensor(row)).all())


def sum_rows(items: Sequence[Delta]) -> list[Row]:
    """Rows for RowSums, one per delta (`flatten`'s order): a flat tensor each where a row is
    short enough for several pairs to share a fold (float32 deltas stay float32: RowSums
    converts exactly where it computes), else a `FlatRow`, read a chunk at a time."""
    parts = [flat_parts(d) for d in items]
    if not parts:
        return []
    n = sum(t.numel() for t in parts[0])
    if _padded_width(n) > _WORK:
        return [FlatRow(p) for p in parts]
    compact = all(t.dtype == torch.float32 for p in parts for t in p)
    dtype = torch.float32 if compact else torch.float64
    return [torch.cat([t.detach().reshape(-1).to(dtype) for t in p]) for p in parts]


def median_row(rows: Sequence[Row]) -> Row:
    """`coordinate_median(rows, torch.float64)`, as a tensor for short rows and as a `MedianRow`
    (never built whole) for the long rows `sum_rows` leaves as `FlatRow`s."""
    if all(isinstance(r, torch.Tensor) for r in rows):
        return coordinate_median(list(rows), torch.float64)
    return MedianRow(rows)


class RowSums:
    """`det_dot` and `det_norm` over many pairs of rows, bit for bit, a few pairs per fold.

    Rows (1-D tensors, or the rows of a 2-D tensor) may have any real dtype and stand for their
    float64 values: each is converted exactly, as `det_dot`'s `.double()`, and products and
    differences are taken in float64. They are written into one scratch buffer that every call
    reuses, and the rows of the buffer are summed together by one in-place fold. That is the
    point: a fresh tensor per pair costs more in page faults than its arithmetic, and one
    Python call per pair more than the fold.

    A row longer than one fold's work (`_WORK` elements) is summed a chunk at a time instead
    (`_chunked_sums`), so that no scratch of the row's length is ever allocated: such rows may be
    `FlatRow`s and `MedianRow`s, which are never built whole.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None  # [rows per fold, n padded]: products, then sums
        self._converted: torch.Tensor | None = None  # one row converted to float64
        self._n = -1

    def dots(self, a: Rows, b: Rows, pairs: Sequence[tuple[int, int]]) -> list[float]:
        """[det_dot(a[i], b[j]) for i, j in pairs]."""
        return self._sums(a, b, pairs, difference=False)

    def norms(self, a: Rows, rows: Sequence[int] | None = None) -> list[float]:
        """[det_norm(a[i]) for i in rows] (default: every row)."""
        pairs = [(i, i) for i in (range(len(a)) if rows is None else rows)]
        return [math.sqrt(s) for s in self._sums(a, a, pairs, difference=False)]

    def distances(self, a: Rows, b: Rows, pairs: Sequence[tuple[int, int]]) -> list[float]:
        """[det_norm(a[i].double() - b[j].double()) for i, j in pairs]."""
        return [math.sqrt(s) for s in self._sums(a, b, pairs, difference=True)]

    def _buffer(self, n: int, rows: int, device: torch.device) -> torch.Tensor:
        if n != self._n and self._n >= 0:
            raise ValueError(f"rows of {n} elements after rows of {self._n}")
        self._n = n
        buf = self._buf
        if buf is None or buf.shape[0] < rows or buf.device != device:
            buf = self._buf = torch.empty(
                rows, _padded_width(n), dtype=torch.float64, device=device
            )
        return buf

    def _as_float64(self, y: torch.Tensor) -> torch.Tensor:
        """`y` converted (exactly) into a reused buffer; an op with operands of two dtypes
        would convert into a fresh tensor every time."""
        if y.dtype == torch.float64:
            return y
        if self._converted is None or self._converted.device != y.device:
            self._converted = torch.empty(self._n, dtype=torch.float64, device=y.device)
        return self._converted.copy_(y)

    def _sums(
        self, a: Rows, b: Rows, pairs: Sequence[tuple[int, int]], difference: bool
    ) -> list[float]:
        if not pairs:
            return []
        first = a[pairs[0][0]]
        n = first.numel()
        sizes = {x.numel() for i, j in pairs for x in (a[i], b[j])}
        if sizes != {n}:
            raise ValueError(f"rows of different sizes {sorted(sizes)[:6]}")
        if n == 0:
            return [0.0] * len(pairs)
        if _padded_width(n) > _WORK:
            return _chunked_sums(a, b, pairs, difference, n)
        if not all(isinstance(x, torch.Tensor) for i, j in pairs for x in (a[i], b[j])):
            a, b = _tensors(a), _tensors(b)  # short rows: built whole, as the fold below reads them
            first = a[pairs[0][0]]
        per_fold = min(len(pairs), max(1, _WORK // _padded_width(n)))
        buf = self._buffer(n, per_fold, first.device)
        sums: list[float] = [0.0] * len(pairs)
        # each pair's sum is its own row of the fold, so the pairs may be taken in any order: those
        # with the same second row one after another, which is then converted once for all of them
        order = sorted(range(len(pairs)), key=lambda k: pairs[k][1])
        held = None  # the row whose float64 values self._converted holds, in this call
        for start in range(0, len(order), per_fold):
            chunk = order[start : start + per_fold]
            buf[: len(chunk), n:].zero_()  # det_sum's padding
            for k, (i, j) in enumerate(pairs[p] for p in chunk):
                x, out = a[i].detach().reshape(-1), buf[k, :n]
                if b[j] is a[i] and not difference:  # a square: the row is converted once, not twice
                    if x.dtype != torch.float64:
                        x = out.copy_(x)
                    torch.mul(x, x, out=out)
                    continue
                if b[j] is held:
                    y = self._converted
                else:
                    y = self._as_float64(b[j].detach().reshape(-1))
                    held = b[j] if y is self._converted else None
                if x.dtype != torch.float64:
                    x = out.copy_(x)  # exact, as .double()
                (torch.sub if difference else torch.mul)(x, y, out=out)
                if difference:
                    out.mul_(out)
            for p, total in zip(chunk, _fold_(buf[: len(chunk)]).tolist(), strict=True):
                sums[p] = total
        return sums


def _tensors(rows: Rows) -> Rows:
    if isinstance(rows, torch.Tensor):
        return rows
    return [_row_tensor(r) for r in rows]


def _chunked_sums(
    a: Rows, b: Rows, pairs: Sequence[tuple[int, int]], difference: bool, n: int
) -> list[float]:
    """RowSums._sums for rows of n > _WORK elements, without a scratch of their length.

    det_sum's fold first halves the row's blocks level by level (level l + 1's block i is
    level l's i plus its i + half, and an odd block out goes onto block 0) until one block is
    left. A block of a level deep enough to have at most `_CHUNK` blocks is a fixed sum of
    blocks of the row, two contiguous runs per level down: so that level is computed by
    recursion from `_CHUNK`-block pieces of the row, each read, converted and multiplied where
    it is needed, with the same adds on the same operands as the whole fold. `_fold_` then
    finishes from that level. Pairs go `_GROUP` at a time, each row's piece converted once for
    all the pairs of the group that read it."""
    # lists hold each row as one object (a [rows, n] tensor makes a new one per index): a piece is
    # converted once per row object, found by id
    same = b is a
    a = list(a)
    b = a if same else list(b)
    fold = _ChunkedFold(n, min(len(pairs), _GROUP), difference, a[pairs[0][0]].device)
    sums: list[float] = [0.0] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda k: (pairs[k][1], pairs[k][0]))
    for start in range(0, len(order), _GROUP):
        group = order[start : start + _GROUP]
        totals = fold.sums([(a[pairs[p][0]], b[pairs[p][1]]) for p in group])
        for p, total in zip(group, totals, strict=True):
            sums[p] = total
    return sums


class _ChunkedFold:
    """det_sum of the products (or squared differences) of up to `group` pairs of rows of n
    elements, from `_CHUNK`-block pieces (`_chunked_sums`): one float64 buffer per level of the
    recursion and one per row a group reads, reused for every group."""

    def __init__(self, n: int, group: int, difference: bool, device: torch.device) -> None:
        self.n, self.difference = n, difference
        self.counts = [_padded_width(n) // _BLOCK]  # blocks at each level, down to one of <= _CHUNK
        while self.counts[-1] > _CHUNK:
            self.counts.append(self.counts[-1] // 2)
        width = self.counts[-1] * _BLOCK
        # level l's scratch: what the second run of its blocks sums to; level 0's is the result
        self.levels = [torch.empty(group, width, dtype=torch.float64, device=device) for _ in self.counts]
        self.pieces = torch.empty(2 * group, width, dtype=torch.float64, device=device)  # rows' converted pieces
        self.pairs: list[tuple[Row, Row]] = []

    def sums(self, pairs: list[tuple[Row, Row]]) -> list[float]:
        self.pairs = pairs
        out = self.levels[0][: len(pairs)]
        top = len(self.counts) - 1
        self._level(top, 0, self.counts[top], out)
        return _fold_(out).tolist()

    def _level(self, lv: int, first: int, stop: int, out: torch.Tensor) -> None:
        """Blocks [first, stop) of level lv of every pair, into out [pairs, (stop - first) * 1024]."""
        if lv == 0:
            self._leaf(first, stop, out)
            return
        half = self.counts[lv - 1] // 2
        self._level(lv - 1, first, stop, out)
        second = self.levels[lv][: out.shape[0], : out.shape[1]]
        self._level(lv - 1, first + half, stop + half, second)
        out += second
        if first == 0 and self.counts[lv - 1] % 2:
            odd = self.levels[lv][: out.shape[0], :_BLOCK]
            self._level(lv - 1, 2 * half, 2 * half + 1, odd)
            out[:, :_BLOCK] += odd

    def _leaf(self, first: int, stop: int, out: torch.Tensor) -> None:
        """The products of blocks [first, stop) of the rows of every pair, into out."""
        lo, hi = first * _BLOCK, min(stop * _BLOCK, self.n)
        length = hi - lo
        if length < out.shape[1]:
            out[:, max(length, 0) :].zero_()  # det_sum's padding
        if length <= 0:
            return
        held: dict[int, torch.Tensor] = {}

        def piece(row: Row) -> torch.Tensor:
            if id(row) not in held:
                x = _row_chunk(row, lo, hi)
                if x.dtype != torch.float64:
                    x = self.pieces[len(held), :length].copy_(x)  # exact, as .double()
                held[id(row)] = x
            return held[id(row)]

        for k, (ra, rb) in enumerate(self.pairs):
            dst, x, y = out[k, :length], piece(ra), piece(rb)
            if self.difference:
                torch.sub(x, y, out=dst)
                dst.mul_(dst)
            else:
                torch.mul(x, y, out=dst)


def det_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Deterministic float64 dot product of two flat tensors."""
    return float(det_sum(a.double() * b.double()))


def det_norm(a: torch.Tensor) -> float:
    """Deterministic float64 Euclidean norm of a flat tensor."""
    return math.sqrt(det_dot(a, a))


_EST_BLOCK = 1 << 16  # elements per float32 dot of `bounded_dots`
_GAMMA = _EST_BLOCK * 2.0**-24 / (1 - _EST_BLOCK * 2.0**-24)  # gamma_m for m = _EST_BLOCK, u = 2^-24


def bounded_dots(items: Sequence[Delta], pairs: Sequence[tuple[int, int]],
                 norms: Sequence[float]) -> list[tuple[float, float]] | None:
    """For each pair (i, j) of float32 deltas: (e, b) with |e - d| <= b, both for d the exact dot
    product a_i.a_j and for `det_dot`'s (float64 pairwise sums of products that are exact in
    float64: within log2(n) 2^-53 |a_i| |a_j| of it, inside the slack below), from `norms` (the
    rows' norms, or upper bounds). Cheap where `det_dot` is exact: float32 dots of blocks of
    m = _EST_BLOCK elements, summed in float64. The bound holds whatever order a dot sums a
    block in: a block's error is at most gamma_m sum_k |x_k y_k| (Higham, Accuracy and Stability
    of Numerical Algorithms, eq. 3.5: any order of evaluation, with or without fused
    multiply-adds), gamma_m = m u / (1 - m u) with u = 2^-24, and over the blocks
    sum |x_k y_k| <= |a_i| |a_j| (Cauchy-Schwarz); summing the blocks' results in float64 adds at
    most 2^-52 of that per block, underflow below float32's normal range at most 2^-148 per
    element, and 1e-9 of it covers norms a few ulps short. On the CPU a block's dots are one float32
    matrix product, [the pairs' first rows] x [every row]^T, so each row's block is read once for
    all its pairs, not once per pair (elsewhere `torch.dot` per pair: a GPU's matrix product may
    round its inputs to TF32). For a screen that only needs to know that no dot comes near a
    threshold (screen.py: the near-duplicate tests). None if a tensor is not float32, the rows'
    tensors differ in size, or a pair's sum is not finite: the caller computes the dots exactly."""
    if not pairs:
        return []
    parts = [[t.detach().reshape(-1) for t in flat_parts(d)] for d in items]
    if any(t.dtype != torch.float32 for row in parts for t in row):
        return None
    firsts = sorted({i for i, _ in pairs})
    rows = firsts + sorted({r for pair in pairs for r in pair} - set(firsts))
    sizes = [x.numel() for x in parts[rows[0]]]
    if any([x.numel() for x in parts[r]] != sizes for r in rows):
        return None
    at = {r: k for k, r in enumerate(rows)}
    where = [(at[i], at[j]) for i, j in pairs]
    gemm = all(t.device.type == "cpu" for r in rows for t in parts[r])
    totals = [0.0] * len(pairs)
    blocks = 0
    for t, size in enumerate(sizes):
        for lo in range(0, size, _EST_BLOCK):
            hi = lo + _EST_BLOCK
            if gemm:
                x = torch.stack([parts[r][t][lo:hi] for r in rows])
                g = torch.mm(x[: len(firsts)], x.T).tolist()
                for p, (a, b) in enumerate(where):
                    totals[p] += g[a][b]
            else:
                for p, (i, j) in enumerate(pairs):
                    totals[p] += float(torch.dot(parts[i][t][lo:hi], parts[j][t][lo:hi]))
            blocks += 1
    if not all(math.isfinite(total) for total in totals):
        return None
    n = sum(sizes)
    return [(total, (_GAMMA * (1 + 1e-9) + (blocks + 1) * 2.0**-52) * norms[i] * norms[j] + n * 2.0**-148)
            for total, (i, j) in zip(totals, pairs, strict=True)]


def flat_parts(delta: Delta) -> list[torch.Tensor]:
    """The tensors of `delta` in the order `flatten` concatenates them: the tensor itself, or a
    dict's tensors in name order."""
    if isinstance(delta, torch.Tensor):
        return [delta]
    if not delta:
        raise ValueError("a delta dict must have at least one tensor")
    return [delta[k] for k in sorted(delta)]


def flatten(delta: Delta) -> torch.Tensor:
    """One float64 vector: a tensor flattened, or a dict's tensors concatenated in name order."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in flat_parts(delta)])


def unflatten(vec: torch.Tensor, template: Delta) -> Delta:
    """Inverse of `flatten`, with the shapes and dtypes of `template`."""
    if isinstance(template, torch.Tensor):
        return vec.reshape(template.shape).to(template.dtype)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k in sorted(template):
        t = template[k]
        out[k] = vec[offset : offset + t.numel()].reshape(t.shape).to(t.dtype).clone()
        offset += t.numel()
    return out


def _signature(delta: Delta) -> Any:
    if isinstance(delta, torch.Tensor):
        return tuple(delta.shape)
    if not isinstance(delta, Mapping):
        raise ValueError(
            f"a delta must be a tensor or a dict of tensors, got {type(delta).__name__}"
        )
    return {k: tuple(v.shape) for k, v in delta.items()}


def _ordered(deltas: Sequence[Delta] | Mapping[int, Delta]) -> list[Delta]:
    if isinstance(deltas, Mapping):
        return [deltas[w] for w in sorted(deltas)]  # ascending worker id: the agreed order
    return list(deltas)


def _structured(items: list[Delta]) -> list[Delta]:
    """`items`, after checking there is one at least and that all share one structure."""
    if not items:
        raise ValueError("cannot aggregate 0 deltas")
    want = _signature(items[0])
    for i, d in enumerate(items[1:], start=1):
        got = _signature(d)
        if got != want:
            raise ValueError(
                f"delta {i} has structure {str(got)[:120]}, delta 0 has {str(want)[:120]}"
            )
    return items


def stack(deltas: Sequence[Delta] | Mapping[int, Delta]) -> tuple[torch.Tensor, Delta]:
    """Check that all deltas share one structure and are finite; return the [n, d] float64
    matrix (rows in order; a Mapping is ordered by worker id) and the first delta as template."""
    items = _structured(_ordered(deltas))
    parts = [flat_parts(d) for d in items]
    matrix = torch.empty(len(items), sum(t.numel() for t in parts[0]), dtype=torch.float64)
    for i, p in enumerate(parts):  # flatten(d) of each, written in place (one copy, not two)
        offset = 0
        for t in p:
            matrix[i, offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
    bad = [i for i in range(len(items)) if not all_finite(matrix[i])]
    if bad:
        raise ValueError(f"deltas {bad[:8]} have non-finite values")
    return matrix, items[0]


def _mean_rows(rows: torch.Tensor) -> torch.Tensor:
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        acc += rows[i]  # left to right, one worker at a time: a fixed order
    return acc / rows.shape[0]


_MEAN_CHUNK = 1 << 16  # float64 elements the mean adds at a time (512 KB, which stays in the cache)


def _mean(items: list[Delta]) -> Delta:
    """unflatten(_mean_rows(stack(items)), items[0]), bit for bit (the same float64 adds in
    the same order, the same division and rounding, element by element), one tensor at a time:
    no [n, d] float64 matrix and no flat copy (bench/round_cost.py). Each tensor `_MEAN_CHUNK`
    elements at a time, through one reused float64 buffer, rounded straight into the result's
    dtype: no float64 copy of a tensor, nor of its mean."""
    buf: torch.Tensor | None = None

    def mean(ts: list[torch.Tensor]) -> torch.Tensor:
        nonlocal buf
        first, rest = ts[0].detach(), [t.detach() for t in ts[1:]]
        n = first.numel()
        out = torch.empty(n, dtype=first.dtype, device=first.device)  # _assemble's dtype: no conversion there
        if buf is None or buf.device != first.device:
            buf = torch.empty(_MEAN_CHUNK, dtype=torch.float64, device=first.device)
        for lo in range(0, n, _MEAN_CHUNK):
            hi = min(lo + _MEAN_CHUNK, n)
            acc = buf[: hi - lo].copy_(first[lo:hi])  # exact, as .to(float64)
            for t in rest:
                acc += t[lo:hi]  # left to right, one worker at a time, in float64
            acc /= len(ts)
            out[lo:hi] = acc  # rounded once, as .to(dtype)
        return out

    return _by_tensor(items, mean)


def _by_tensor(items: list[Delta], combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> Delta:
    """`combine` for each tensor (given that tensor of every item, flat, in item order; it computes
    in float64), as one delta of the items' structure and dtype. For element-by-element methods
    (mean, trimmed mean) that is unflatten(combine(stack(items)), items[0]), bit for bit, without
    the [n, d] float64 matrix: the largest tensor's n rows at a time. The same checks as `stack`."""
    parts = _checked_parts(items)
    return _assemble(items, [combine([p[k] for p in parts]) for k in range(len(parts[0]))])


def _checked_parts(items: list[Delta]) -> list[list[torch.Tensor]]:
    """Each item's tensors in `flatten`'s order, flat, after `stack`'s checks (one structure,
    every value finite)."""
    parts = [[t.detach().reshape(-1) for t in flat_parts(d)] for d in _structured(items)]
    bad = [i for i, p in enumerate(parts) if not all(all_finite(t) for t in p)]
    if bad:
        raise ValueError(f"deltas {bad[:8]} have non-finite values")
    # float64 values can be finite and still overflow the float64 sums (a norm's squares, a mean's adds):
    # below _MAGNITUDE / sqrt(d) a norm and a difference stay far from it. float32 and narrower never get near
    limit = _MAGNITUDE / math.sqrt(max(1, sum(t.numel() for t in parts[0])))
    huge = [i for i, p in enumerate(parts)
            if any(t.numel() and t.dtype == torch.float64 and float(t.abs().max()) > limit for t in p)]
    if huge:
        raise ValueError(f"deltas {huge[:8]} have values above {limit:.3g}, whose float64 sums would overflow")
    return parts


_MAGNITUDE = 1e150  # the largest float64 norm the aggregators take (sqrt of float64's max is 1.3e154)


def _assemble(items: list[Delta], out: list[torch.Tensor]) -> Delta:
    """One delta of the items' structure and dtypes from its tensors' values in `flatten`'s order."""
    tensors = [x.reshape(t.shape).to(t.dtype) for x, t in zip(out, flat_parts(items[0]), strict=True)]
    if isinstance(items[0], torch.Tensor):
        return tensors[0]
    return dict(zip(sorted(items[0]), tensors, strict=True))


def _rows64(ts: list[torch.Tensor]) -> torch.Tensor:
    """The [n, numel] float64 matrix of same-shaped tensors (stack's rows for one tensor)."""
    return torch.stack([t.detach().reshape(-1).to(torch.float64) for t in ts])


def _sorting_network(count: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for `count` inputs as comparators (i, j), i < j: min to i,
    max to j. Built for the next power of two; comparators that reach past `count` are dropped,
    which is exact: padding with +inf, those positions only ever hold the padding."""
    size = 1 << max(0, (count - 1).bit_length())
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple((i, j) for i, j in pairs if j < count)


@functools.lru_cache(maxsize=256)
def _selection_plan(count: int, wanted: tuple[int, ...]) -> tuple[tuple[int, int, bool, bool], ...]:
    """The comparators of the sorting network that the sorted positions `wanted` depend on,
    each with which of its outputs (min, max) is needed later."""
    needed = set(wanted)
    steps = []
    for i, j in reversed(_sorting_network(count)):
        lo, hi = i in needed, j in needed
        if lo or hi:
            steps.append((i, j, lo, hi))
            needed |= {i, j}
    return tuple(reversed(steps))


def _sorted_positions(rows: Sequence[torch.Tensor], wanted: Sequence[int]) -> list[torch.Tensor]:
    """Rows `wanted` of torch.sort(torch.stack(rows), dim=0).values, by elementwise min/max.

    The values equal sort's; the bits too, except that sort keeps equal keys in row order, so
    which of -0.0 and +0.0 lands where can differ, and a NaN spreads through min/max where
    sort moves it to the end. Callers patch those columns (`_patch_with_sort`). Outputs are
    written over inputs that are no longer needed: few fresh tensors, few page faults."""
    wires: list[torch.Tensor | None] = list(rows)
    owned = [False] * len(wires)  # wires holding a tensor of ours, not an input row
    spare: list[torch.Tensor] = []

    def scratch(*candidates: int) -> torch.Tensor | None:
        for pos in candidates:  # an input of this comparator that is ours and read in place
            if owned[pos]:
                owned[pos] = False
                return wires[pos]
        return spare.pop() if spare else None

    for i, j, lo, hi in _selection_plan(len(wires), tuple(wanted)):
        a, b = wires[i], wires[j]
        # the min may not overwrite an input the max still reads; the max, computed last, may
        new_lo = torch.minimum(a, b, out=scratch() if hi else scratch(i, j)) if lo else None
        new_hi = torch.maximum(a, b, out=scratch(j, i)) if hi else None
        for pos, new in ((i, new_lo), (j, new_hi)):
            if owned[pos]:  # still ours and not reused: free for a later comparator
                spare.append(wires[pos])
            wires[pos], owned[pos] = new, new is not None
    return [wires[p] for p in wanted]


_NETWORK_MAX = 16  # more rows than this: torch.sort; the network grows as count * log^2(count)
_NETWORK_DTYPES = {torch.float64: torch.int64, torch.float32: torch.int32}


def _use_network(rows: Sequence[torch.Tensor]) -> bool:
    dtypes = {r.dtype for r in rows}
    return 1 <= len(rows) <= _NETWORK_MAX and len(dtypes) == 1 and dtypes <= set(_NETWORK_DTYPES)


def _patch_with_sort(
    out: torch.Tensor,
    rows: Sequence[torch.Tensor],
    from_sorted: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Recompute with torch.sort the columns of `out` where the network may differ from it: a
    NaN result, or a zero result in a column holding a -0.0 (its sign depends on row order).
    A nonzero result cannot depend on the sign of a zero input."""
    bad = torch.isnan(out)
    zero = out == 0
    if bool(zero.any()):
        bits = _NETWORK_DTYPES[rows[0].dtype]
        negative_zero = torch.zeros_like(zero)
        for r in rows:
            negative_zero |= r.view(bits) == torch.iinfo(bits).min  # the bits of -0.0
        bad |= zero & negative_zero
    if bool(bad.any()):
        columns = torch.stack([r[bad] for r in rows])
        out[bad] = from_sorted(torch.sort(columns, dim=0).values)
    return out


def _median_of_sorted(s: torch.Tensor) -> torch.Tensor:
    n = s.shape[0]
    if n % 2:
        return s[n // 2].clone()
    return (s[n // 2 - 1] + s[n // 2]) / 2


def coordinate_median(
    matrix: torch.Tensor | Sequence[torch.Tensor], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Per-coordinate median of the rows; for an even count, the mean of the two middle values.

    `matrix`: [n, d], or a list of n d-vectors. `dtype`: compute in this dtype, at least as
    wide as the rows' (default theirs): bit for bit `coordinate_median(matrix.to(dtype))`.
    Bit for bit what sorting the rows gives; up to 16 float rows go through a min/max network
    (a few elementwise passes, where a sort over dim 0 is a strided sort per column)."""
    if isinstance(matrix, torch.Tensor):
        rows = list(matrix.unbind(0)) if matrix.dim() >= 2 else []
    else:
        rows = list(matrix)
    dtype = dtype or (matrix.dtype if isinstance(matrix, torch.Tensor) else rows[0].dtype)
    if not _use_network(rows):
        stacked = matrix if isinstance(matrix, torch.Tensor) else torch.stack(rows)
        return _median_of_sorted(torch.sort(stacked.to(dtype), dim=0).values)
    if torch.promote_types(rows[0].dtype, dtype) != dtype:
        raise ValueError(f"dtype {dtype} is narrower than the rows' {rows[0].dtype}")
    n = len(rows)
    out = torch.empty(rows[0].shape, dtype=dtype, device=rows[0].device)
    if n % 2:
        out.copy_(_sorted_positions(rows, [n // 2])[0])
    else:  # (lower + upper) / 2 in `dtype`; the in-place add converts `upper` exactly
        lower, upper = _sorted_positions(rows, [n // 2 - 1, n // 2])
        out.copy_(lower).add_(upper).div_(2)
    return _patch_with_sort(out, rows, lambda s: _median_of_sorted(s.to(dtype)))


def median_of(values: Sequence[float]) -> float:
    """Median of a list of floats (mean of the middle two for an even count)."""
    v = sorted(values)
    if not v:
        raise ValueError("median of an empty list")
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def trimmed_mean(matrix: torch.Tensor, trim_count: int) -> torch.Tensor:
    """Per coordinate, the mean of the rows left after dropping `trim_count` from each end."""
    n = matrix.shape[0]
    if not 0 <= 2 * trim_count < n:
        raise ValueError(f"trim_count={trim_count} from each end leaves nothing of n={n} deltas")

    def from_sorted(s: torch.Tensor) -> torch.Tensor:
        return _mean_rows(s[trim_count : n - trim_count])

    rows = list(matrix.unbind(0)) if matrix.dim() >= 2 else []
    if not _use_network(rows):
        return from_sorted(torch.sort(matrix, dim=0).values)
    kept = _sorted_positions(rows, range(trim_count, n - trim_count))
    acc = kept[0].clone()
    for row in kept[1:]:
        acc += row  # ascending order, as _mean_rows adds the sorted rows
    return _patch_with_sort(acc / len(kept), rows, from_sorted)


def centered_clip(
    matrix: torch.Tensor, start: torch.Tensor, tau: float | None, iterations: int
) -> torch.Tensor:
    """Karimireddy et al. 2021 centered clipping from `start` (v_0); see the module docstring."""
    return _clip_parts([[row] for row in matrix], [start], tau, iterations)[0]


def _difference_norm(sums: RowSums, row: list[torch.Tensor], v: list[torch.Tensor]) -> float:
    """||row - v|| of vectors given as parts, the difference taken as the subtraction of the whole
    vectors would (the same dtype promotion). In float64 (aggregate's case) that is RowSums'
    distance, a piece at a time; in a narrower dtype the difference is built, one row at a time."""
    if all(torch.promote_types(x.dtype, y.dtype) == torch.float64 for x, y in zip(row, v, strict=True)):
        return sums.distances([FlatRow(row)], [FlatRow(v)], [(0, 0)])[0]
    return sums.norms([FlatRow([x - y for x, y in zip(row, v, strict=True)])])[0]


def _clip_parts(
    rows: list[list[torch.Tensor]], start: list[torch.Tensor], tau: float | None, iterations: int
) -> list[torch.Tensor]:
    """centered_clip on vectors given as parts (a delta's flat tensors): element for element the
    operations it does on the matrix of the whole vectors, and each norm the same det_sum, with
    one row's difference at a time instead of every row's (taken twice: for its norm, then for
    the step)."""
    v = [t.clone() for t in start]
    sums = RowSums()
    if tau is None:
        tau = median_of([_difference_norm(sums, row, v) for row in rows])
        if tau == 0.0:  # a majority sits exactly on the start point: it is the answer
            return v
    n = len(rows)
    for _ in range(iterations):
        scales = [1.0 if d <= tau else tau / d for d in [_difference_norm(sums, row, v) for row in rows]]
        for k, y in enumerate(v):  # a tensor's step at a time: the same adds, in row order
            step = torch.zeros_like(y)
            for row, scale in zip(rows, scales, strict=True):
                step += (row[k] - y) * scale
            y += step / n  # (v + step / n, in place: v is this function's own)
    return v


def geometric_median(
    matrix: torch.Tensor, iterations: int = 100, eps: float = 1e-12, tol: float = 1e-10
) -> torch.Tensor:
    """Weiszfeld's algorithm for argmin_z sum_i ||x_i - z||, from the coordinate median.

    Distances are floored at `eps` (relative to the largest row norm) so a point that coincides
    with a row stays finite; stops when a step moves less than `tol` times that scale.
    """
    return _weiszfeld_parts([[row] for row in matrix], [coordinate_median(matrix)], iterations, eps, tol)[0]


def geometric_median_row(items: Sequence[Delta], iterations: int) -> FlatRow:
    """geometric_median(torch.stack([flatten(d) for d in items]), iterations) as a FlatRow of its
    tensors, bit for bit, without that [n, d] float64 matrix (the screen's centre)."""
    parts = _checked_parts(list(items))
    return FlatRow(_weiszfeld_parts(parts, _medians(parts), iterations))


def _medians(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The coordinate median (float64) of vectors given as parts, part by part."""
    return [coordinate_median([p[k] for p in parts], torch.float64) for k in range(len(parts[0]))]


def _weiszfeld_parts(
    rows: list[list[torch.Tensor]], z: list[torch.Tensor], iterations: int = 100, eps: float = 1e-12,
    tol: float = 1e-10,
) -> list[torch.Tensor]:
    """geometric_median on vectors given as parts, from `z` (parts of the coordinate median, whose
    dtype the sums take: the rows' values convert to it exactly), as `_clip_parts` does."""
    sums = RowSums()
    scale = max(sums.norms([FlatRow(row) for row in rows])) or 1.0
    for _ in range(iterations):
        weights = [1.0 / max(_difference_norm(sums, row, z), eps * scale) for row in rows]
        total = 0.0
        for w in weights:
            total += w
        new = []
        for k, t in enumerate(z):  # a tensor's weighted sum at a time: the same adds, in row order
            acc = torch.zeros_like(t)
            for w, row in zip(weights, rows, strict=True):
                acc += row[k].to(acc.dtype) * w
            new.append(acc / total)
        moved = _difference_norm(sums, new, z)
        z = new
        if moved <= tol * scale:
            break
    return z


def _take(params: dict[str, Any], allowed: dict[str, Any], method: str) -> dict[str, Any]:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"method {method!r} takes {sorted(allowed) or 'no parameters'}, got {unknown}"
        )
    return {**allowed, **params}


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def aggregate(deltas: Sequence[Delta] | Mapping[int, Delta], method: str, **params: Any) -> Delta:
    """Combine `deltas` with `method` (see the module docstring) into one delta of the same
    structure and dtype. A Mapping {worker: delta} is taken in ascending worker order; a list is
    taken in the order given, so callers that pass lists must sort by worker id themselves.

    Parameters: trimmed_mean: `trim_fraction` (default 0.2) or `trim_count`; centered_clip:
    `tau` (default: median distance to start), `iterations` (default 3), `start` (a delta, e.g.
    the previous aggregate; default the coordinate median); geometric_median: `iterations`
    (default 100). Bit-identical for identical inputs on any IEEE-754 machine.
    """
    if method not in METHODS:
        raise ValueError(f"unknown aggregation method {method!r}; choose one of {list(METHODS)}")
    items = _ordered(deltas)
    if method == "mean":
        _take(params, {}, method)
        return _mean(items)
    if method == "median":  # element by element: one tensor at a time
        _take(params, {}, method)
        return _assemble(items, _medians(_checked_parts(items)))
    n = len(items)
    if method == "trimmed_mean":
        p = _take(params, {"trim_fraction": None, "trim_count": None}, method)
        if p["trim_fraction"] is not None and p["trim_count"] is not None:
            raise ValueError(
                f"give trim_fraction or trim_count, not both (got {p['trim_fraction']}, {p['trim_count']})"
            )
        if p["trim_count"] is not None:
            k = p["trim_count"]
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ValueError(f"trim_count must be an int >= 0, got {k!r}")
        else:
            frac = 0.2 if p["trim_fraction"] is None else p["trim_fraction"]
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 0.5:
                raise ValueError(f"trim_fraction must be in [0, 0.5), got {frac!r}")
            k = math.floor(frac * n)
        return _by_tensor(items, lambda ts: trimmed_mean(_rows64(ts), k))
    # the methods below take norms of whole vectors: each delta's tensors as its parts, never
    # stacked into an [n, d] float64 matrix (they compute in float64, as on that matrix)
    parts = _checked_parts(items)
    if method == "centered_clip":
        p = _take(params, {"tau": None, "iterations": 3, "start": None}, method)
        tau = p["tau"]
        if tau is not None and (
            isinstance(tau, bool)
            or not isinstance(tau, (int, float))
            or not math.isfinite(tau)
            or tau <= 0
        ):
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        iterations = _positive_int("iterations", p["iterations"])
        if p["start"] is None:
            start = _medians(parts)  # v_0
        else:
            if _signature(p["start"]) != _signature(items[0]):
                raise ValueError("start does not have the structure of the deltas")
            flat = flatten(p["start"])
            if not bool(torch.isfinite(flat).all()):
                raise ValueError("start has non-finite values")
            start = list(flat.split([x.numel() for x in parts[0]]))
        out = _clip_parts(parts, start, None if tau is None else float(tau), iterations)
    else:  # geometric_median
        p = _take(params, {"iterations": 100}, method)
        out = _weiszfeld_parts(parts, _medians(parts), _positive_int("iterations", p["iterations"]))
    return _assemble(items, out)
