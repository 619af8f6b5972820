"""Robust aggregation of the accepted deltas of a round, bit-identical on every worker.

Every worker aggregates the same accepted deltas itself (there is no coordinator), so the result
must not depend on the machine: not on the thread count, not on the SIMD width. Library
reductions (`sum`, `norm`, `mean`) split work by thread and vector lane, so their rounding can
differ between machines. Here every reduction is built from elementwise IEEE operations in a
fixed order (`det_sum`: fixed-size blocks folded pairwise; worker sums in ascending worker
order), and sorting is exact, so equal inputs in equal order give equal bits everywhere.
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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

Delta = torch.Tensor | dict[str, torch.Tensor]
METHODS: tuple[str, ...] = ("mean", "median", "trimmed_mean", "centered_clip", "geometric_median")
_BLOCK = 1024  # det_sum block length; a power of two so the last fold halves evenly


def det_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of all elements of `x` (0-d tensor, same dtype), in an order fixed by its length
    alone: pad to blocks of 1024, add the second half of the blocks onto the first until one
    block is left, then halve that block the same way. Only elementwise adds, so the bits do
    not depend on threads or vector width."""
    x = x.reshape(-1)
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    pad = (-n) % _BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    x = x.view(-1, _BLOCK)
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


def det_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Deterministic float64 dot product of two flat tensors."""
    return float(det_sum(a.double() * b.double()))


def det_norm(a: torch.Tensor) -> float:
    """Deterministic float64 Euclidean norm of a flat tensor."""
    return math.sqrt(det_dot(a, a))


def flatten(delta: Delta) -> torch.Tensor:
    """One float64 vector: a tensor flattened, or a dict's tensors concatenated in name order."""
    if isinstance(delta, torch.Tensor):
        return delta.detach().reshape(-1).to(torch.float64)
    if not delta:
        raise ValueError("a delta dict must have at least one tensor")
    return torch.cat([delta[k].detach().reshape(-1).to(torch.float64) for k in sorted(delta)])


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


def stack(deltas: Sequence[Delta] | Mapping[int, Delta]) -> tuple[torch.Tensor, Delta]:
    """Check that all deltas share one structure and are finite; return the [n, d] float64
    matrix (rows in order; a Mapping is ordered by worker id) and the first delta as template."""
    items = _ordered(deltas)
    if not items:
        raise ValueError("cannot aggregate 0 deltas")
    want = _signature(items[0])
    for i, d in enumerate(items[1:], start=1):
        got = _signature(d)
        if got != want:
            raise ValueError(
                f"delta {i} has structure {str(got)[:120]}, delta 0 has {str(want)[:120]}"
            )
    rows = [flatten(d) for d in items]
    matrix = torch.stack(rows)
    bad = [i for i, r in enumerate(rows) if not bool(torch.isfinite(r).all())]
    if bad:
        raise ValueError(f"deltas {bad[:8]} have non-finite values")
    return matrix, items[0]


def _mean_rows(rows: torch.Tensor) -> torch.Tensor:
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        acc += rows[i]  # left to right, one worker at a time: a fixed order
    return acc / rows.shape[0]


def coordinate_median(matrix: torch.Tensor) -> torch.Tensor:
    """Per-coordinate median of the rows; for an even count, the mean of the two middle values."""
    n = matrix.shape[0]
    s = torch.sort(matrix, dim=0).values
    if n % 2:
        return s[n // 2].clone()
    return (s[n // 2 - 1] + s[n // 2]) / 2


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
    s = torch.sort(matrix, dim=0).values
    return _mean_rows(s[trim_count : n - trim_count])


def centered_clip(
    matrix: torch.Tensor, start: torch.Tensor, tau: float | None, iterations: int
) -> torch.Tensor:
    """Karimireddy et al. 2021 centered clipping from `start` (v_0); see the module docstring."""
    v = start.clone()
    if tau is None:
        tau = median_of([det_norm(row - v) for row in matrix])
        if tau == 0.0:  # a majority sits exactly on the start point: it is the answer
            return v
    n = matrix.shape[0]
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for row in matrix:
            diff = row - v
            dist = det_norm(diff)
            scale = 1.0 if dist <= tau else tau / dist
            step += diff * scale
        v = v + step / n
    return v


def geometric_median(
    matrix: torch.Tensor, iterations: int = 100, eps: float = 1e-12, tol: float = 1e-10
) -> torch.Tensor:
    """Weiszfeld's algorithm for argmin_z sum_i ||x_i - z||, from the coordinate median.

    Distances are floored at `eps` (relative to the largest row norm) so a point that coincides
    with a row stays finite; stops when a step moves less than `tol` times that scale.
    """
    z = coordinate_median(matrix)
    scale = max(det_norm(row) for row in matrix) or 1.0
    for _ in range(iterations):
        weights = [1.0 / max(det_norm(row - z), eps * scale) for row in matrix]
        total = 0.0
        acc = torch.zeros_like(z)
        for w, row in zip(weights, matrix, strict=True):
            acc += row * w
            total += w
        new = acc / total
        moved = det_norm(new - z)
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
    matrix, template = stack(deltas)
    n = matrix.shape[0]
    if method == "mean":
        _take(params, {}, method)
        out = _mean_rows(matrix)
    elif method == "median":
        _take(params, {}, method)
        out = coordinate_median(matrix)
    elif method == "trimmed_mean":
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
        out = trimmed_mean(matrix, k)
    elif method == "centered_clip":
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
            start = coordinate_median(matrix)
        else:
            if _signature(p["start"]) != _signature(template):
                raise ValueError("start does not have the structure of the deltas")
            start = flatten(p["start"])
            if not bool(torch.isfinite(start).all()):
                raise ValueError("start has non-finite values")
        out = centered_clip(matrix, start, None if tau is None else float(tau), iterations)
    else:  # geometric_median
        p = _take(params, {"iterations": 100}, method)
        out = geometric_median(matrix, _positive_int("iterations", p["iterations"]))
    return unflatten(out, template)
