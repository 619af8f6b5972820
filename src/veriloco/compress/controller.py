"""Adaptive compression: per round, pick a codec per tensor so the packet fits a byte budget.

DiLoCoX (Qi et al. 2025, arXiv 2506.21263) adapts the compression of pseudo-gradients to the
link so that communication hides under the next round's computation (one-step delay). Here:

* `round_budget_bytes` turns the link (bandwidth, latency), the measured compute time of the
  next round's inner steps, and the worker count into the packet size one worker may send.
* `AdaptiveController.choose` starts every tensor on its most faithful rung of a ladder of codec
  specs (fp32 > bf16 > int8 > int4 > lowrank(r) / topk(density)) and, while the packet is over
  budget, moves down the tensor whose next rung saves the most bytes per unit of squared error
  added; then it spends any slack moving tensors back up by the same measure. Errors are
  measured on the actual tensors (encode + decode with a throwaway copy of each codec), or, when
  only shapes are given, estimated for unit-variance Gaussian values.
* `suggest_inner_steps` says how many inner steps (H in DiLoCo) a round needs for the smallest
  packet to hide under compute, for when even the lowest rungs do not fit.

"Adaptive" is just a codec per tensor: the chosen spec is written in the packet next to each
tensor, so receivers need nothing from the controller.
"""

from __future__ import annotations

import copy
import heapq
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..codecspec import DEFAULT_LADDER
from .base import Codec, codec_from_spec, numel_of
from .blockquant import Int4Codec, Int8Codec
from .casts import Bf16Codec, Fp16Codec
from .identity import IdentityCodec
from .lowrank import LowRankCodec
from .topk import TopKCodec

LOSSLESS = "fp32"  # the rung with no error: when it fits, it is the choice
UNLIMITED_BYTES = sys.maxsize  # the budget of a lone worker: it sends nothing


def _check_number(name: str, value: float, low: float, low_inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if value < low or (value == low and not low_inclusive):
        raise ValueError(f"{name}={value} must be {'>=' if low_inclusive else '>'} {low}")
    return float(value)


def _check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an integer >= 1")
    return workers


def _check_safety(safety: float) -> float:
    safety = _check_number("safety", safety, 0.0, low_inclusive=False)
    if safety > 1.0:
        raise ValueError(f"safety={safety} must be in (0, 1]")
    return safety


def round_budget_bytes(
    bandwidth_bps: float, latency_s: float, compute_s: float, workers: int, safety: float = 0.9
) -> int:
    """Packet bytes one worker may send per round so the exchange hides under compute.

    Each worker sends its packet of B bytes to the W-1 others and receives W-1 packets of (at
    most) B bytes on a full-duplex link of `bandwidth_bps` bits/s, so the exchange takes
    `latency_s + max(sent, recv) * 8 / bandwidth_bps = latency_s + (W-1) * B * 8 / bandwidth_bps`.
    The largest B with that <= `compute_s * safety` (the next round's inner steps, which the
    exchange overlaps with a one-step delay) is returned: floor((compute_s * safety - latency_s)
    * bandwidth_bps / 8 / (W-1)), 0 when latency alone does not fit, UNLIMITED_BYTES for W = 1.
    """
    bandwidth_bps = _check_number("bandwidth_bps", bandwidth_bps, 0.0, low_inclusive=False)
    latency_s = _check_number("latency_s", latency_s, 0.0)
    compute_s = _check_number("compute_s", compute_s, 0.0)
    workers = _check_workers(workers)
    safety = _check_safety(safety)
    if workers == 1:
        return UNLIMITED_BYTES
    window_s = compute_s * safety - latency_s
    if window_s <= 0:
        return 0
    return int(math.floor(window_s * bandwidth_bps / 8.0 / (workers - 1)))


def suggest_inner_steps(
    packet_bytes: int,
    bandwidth_bps: float,
    latency_s: float,
    step_s: float,
    workers: int,
    safety: float = 0.9,
) -> int:
    """Fewest inner steps H >= 1 whose compute (H * `step_s`) hides a `packet_bytes` exchange.

    The inverse of `round_budget_bytes`: the smallest H with
    `round_budget_bytes(bandwidth_bps, latency_s, H * step_s, workers, safety) >= packet_bytes`.
    Use it when even the smallest ladder rungs (`log["min_bytes"]` of `choose`) do not fit.
    """
    if isinstance(packet_bytes, bool) or not isinstance(packet_bytes, int) or packet_bytes < 0:
        raise ValueError(f"packet_bytes={packet_bytes!r} must be an integer >= 0")
    bandwidth_bps = _check_number("bandwidth_bps", bandwidth_bps, 0.0, low_inclusive=False)
    latency_s = _check_number("latency_s", latency_s, 0.0)
    step_s = _check_number("step_s", step_s, 0.0, low_inclusive=False)
    workers = _check_workers(workers)
    safety = _check_safety(safety)
    need_s = latency_s + (workers - 1) * packet_bytes * 8.0 / bandwidth_bps
    steps = max(1, math.ceil(need_s / (step_s * safety)))
    # Float rounding can leave the closed form one step short; the budget function is the truth.
    while (
        round_budget_bytes(bandwidth_bps, latency_s, steps * step_s, workers, safety) < packet_bytes
    ):
        steps += 1
    return steps


def _gaussian_dropped_fraction(density: float) -> float:
    """Energy fraction outside the top `density` fraction of |x| for standard normal x."""
    if density >= 1.0:
        return 0.0
    t = math.sqrt(2.0) * float(
        torch.special.erfinv(torch.tensor(1.0 - density, dtype=torch.float64))
    )
    pdf = math.exp(-t * t / 2) / math.sqrt(2 * math.pi)
    # E[x^2; |x| > t] = density + 2 t pdf(t)
    return max(0.0, 1.0 - density - 2.0 * t * pdf)


def nominal_sq_error(codec: Codec, shape: tuple[int, ...]) -> float:
    """Expected squared error of `codec` on a tensor of `shape` with unit-variance Gaussian values
    (a shape-only estimate for when the tensor itself is not at hand)."""
    n = numel_of(shape)
    if isinstance(codec, IdentityCodec):
        rel = 0.0
    elif isinstance(codec, Fp16Codec):
        rel = 2.0**-22 / 3
    elif isinstance(codec, Bf16Codec):
        rel = 2.0**-16 / 3
    elif isinstance(codec, (Int8Codec, Int4Codec)):
        block = min(codec.block, max(n, 1))
        absmax = math.sqrt(2.0 * math.log(max(block, 2)))  # typical block absmax in sigmas
        rel = (absmax / codec.levels) ** 2 / 12
    elif isinstance(codec, TopKCodec):
        rel = _gaussian_dropped_fraction(codec.density)
        rel += (2.0**-22 / 3) if codec.bits == 16 else codec.density * (4.0 / 127) ** 2 / 12
    elif isinstance(codec, LowRankCodec):
        plan = codec._plan(shape)
        rel = 2.0**-22 / 3 if plan is None else 1.0 - plan[2] / min(plan[0], plan[1])
    else:
        raise ValueError(f"no shape-only error estimate for codec {codec.spec()!r}; pass tensors")
    return rel * n


class AdaptiveController:
    """Per-tensor codec choice under a byte budget (DiLoCoX-style adaptive compression).

    `ladder`: codec specs to choose from (any order; each tensor uses the ones that are not
    dominated for its shape). `overhead_bytes_per_tensor`: bytes to charge per tensor on top of
    `estimate_bytes` (the packet header's share), 0 to budget payload only; or a function
    (key, codec, shape) -> those bytes (round.py passes packet.header_share, the header's own
    bytes for that tensor and codec: a flat figure undercharged, and a "fitting" packet went over
    its budget), asked once per tensor and rung. The controller keeps
    one codec object per (key, spec) across rounds, so stateful codecs (PowerSGD's warm start)
    carry over while a tensor stays on the same rung.
    """

    def __init__(
        self, ladder: Sequence[str] = DEFAULT_LADDER,
        overhead_bytes_per_tensor: int | Callable[[str, Codec, tuple[int, ...]], int] = 0,
    ) -> None:
        if isinstance(ladder, str) or not ladder:
            raise ValueError(f"ladder must be a non-empty sequence of codec specs, got {ladder!r}")
        if not callable(overhead_bytes_per_tensor) and (
                not isinstance(overhead_bytes_per_tensor, int) or overhead_bytes_per_tensor < 0):
            raise ValueError(
                f"overhead_bytes_per_tensor={overhead_bytes_per_tensor!r} must be >= 0"
            )
        specs: list[str] = []
        for spec in ladder:
            canonical = codec_from_spec(spec).spec()
            if canonical not in specs:
                specs.append(canonical)
        self.ladder = tuple(specs)
        self.overhead_bytes_per_tensor = overhead_bytes_per_tensor
        self._codecs: dict[tuple[str, str], Codec] = {}
        self._overheads: dict[tuple[str, str, tuple[int, ...]], int] = {}

    def _bytes(self, key: str, spec: str, shape: tuple[int, ...]) -> int:
        """A tensor's bytes on rung `spec`: its payload and its share of the packet's header."""
        codec = self.codec(key, spec)
        over = self.overhead_bytes_per_tensor
        if callable(over):
            if (key, spec, shape) not in self._overheads:
                self._overheads[(key, spec, shape)] = int(over(key, codec, shape))
            over = self._overheads[(key, spec, shape)]
        return codec.estimate_bytes(shape) + over

    def kept(self) -> dict[tuple[str, str], Codec]:
        """(tensor, spec) -> every codec object kept so far (some hold sender state)."""
        return dict(self._codecs)

    def codec(self, key: str, spec: str) -> Codec:
        """The codec object kept for tensor `key` on rung `spec`."""
        if (key, spec) not in self._codecs:
            self._codecs[(key, spec)] = codec_from_spec(spec)
        return self._codecs[(key, spec)]

    def _options(
        self, key: str, value: torch.Tensor | Sequence[int]
    ) -> list[tuple[int, float, str]]:
        """Non-dominated (bytes, squared error, spec), most bytes (least error) first."""
        measured = isinstance(value, torch.Tensor)
        shape = tuple(value.shape) if measured else tuple(int(d) for d in value)
        if measured:
            x = value.detach().to(torch.float32)
        options = []
        for rank, spec in enumerate(self.ladder):
            codec = self.codec(key, spec)
            size = self._bytes(key, spec, shape)
            if measured:
                # A throwaway copy: measuring must not advance a stateful codec's warm start.
                probe = copy.deepcopy(codec)
                decoded = probe.decode(probe.encode(key, x), shape)
                err = float(((x - decoded) ** 2).sum())
            else:
                err = nominal_sq_error(codec, shape)
            options.append((size, err, rank, spec))
        options.sort()
        frontier: list[tuple[int, float, str]] = []
        for size, err, _, spec in options:  # fewest bytes first: keep only strict improvements
            if not frontier or err < frontier[-1][1]:
                frontier.append((size, err, spec))
        return frontier[::-1]

    def _lossless_fits(
        self, tensors: Mapping[str, torch.Tensor | Sequence[int]], budget_bytes: int
    ) -> tuple[dict[str, Codec], dict[str, Any]] | None:
        """fp32 for every tensor, without measuring a rung, when the ladder has fp32 and fp32
        fits the budget: no rung can do better than no error (measuring every rung of every
        tensor costs ~(ladder size) encodes per round, a few % of a round on a slow CPU, spent for
        nothing on a fast link). None otherwise."""
        if LOSSLESS not in self.ladder:
            return None
        keys = sorted(tensors)
        shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(int(d) for d in v)
                  for k, v in tensors.items()}
        sizes = {k: self._bytes(k, LOSSLESS, shapes[k]) for k in keys}
        total = sum(sizes.values())
        if total > budget_bytes:
            return None
        smallest = sum(min(self._bytes(k, spec, shapes[k]) for spec in self.ladder) for k in keys)
        log = {
            "budget_bytes": budget_bytes, "total_bytes": total, "min_bytes": smallest, "max_bytes": total,
            "fits": True, "measured": False,  # nothing to measure: fp32's error is 0
            "codecs": dict.fromkeys(keys, LOSSLESS), "sq_error": dict.fromkeys(keys, 0.0),
        }
        return {k: self.codec(k, LOSSLESS) for k in keys}, log

    def choose(
        self, tensors: Mapping[str, torch.Tensor | Sequence[int]], budget_bytes: int
    ) -> tuple[dict[str, Codec], dict[str, Any]]:
        """Codec per tensor so the sum of `estimate_bytes` fits `budget_bytes` where it can.

        `tensors`: {key: tensor} (errors measured on it; pass what will be encoded, i.e. after
        error feedback) or {key: shape} (errors estimated). Returns the codecs and a JSON-ready
        log: {"budget_bytes", "total_bytes", "min_bytes", "max_bytes", "fits", "measured",
        "codecs": {key: spec}, "sq_error": {key: float}}. When even the smallest rungs do not
        fit, every tensor gets its smallest rung and "fits" is false: see `suggest_inner_steps`.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r} must be an integer >= 0")
        keys = sorted(tensors)
        fits_lossless = self._lossless_fits(tensors, budget_bytes)
        if fits_lossless is not None:
            return fits_lossless
        frontier = {k: self._options(k, tensors[k]) for k in keys}
        pos = dict.fromkeys(keys, 0)
        total = sum(frontier[k][0][0] for k in keys)
        max_bytes = total

        def down_priority(k: str) -> tuple[float, str]:
            (b0, e0, _), (b1, e1, _) = frontier[k][pos[k]], frontier[k][pos[k] + 1]
            return (-(b0 - b1) / max(e1 - e0, 1e-300), k)

        heap = [down_priority(k) for k in keys if len(frontier[k]) > 1]
        heapq.heapify(heap)
        while total > budget_bytes and heap:
            _, k = heapq.heappop(heap)
            total -= frontier[k][pos[k]][0] - frontier[k][pos[k] + 1][0]
            pos[k] += 1
            if pos[k] + 1 < len(frontier[k]):
                heapq.heappush(heap, down_priority(k))

        # Greedy steps can overshoot; spend what is left moving tensors back up, best first.
        def up_step(k: str) -> tuple[float, int, str]:
            (b0, e0, _), (b1, e1, _) = frontier[k][pos[k] - 1], frontier[k][pos[k]]
            return (-(e1 - e0) / max(b0 - b1, 1), b0 - b1, k)

        if total <= budget_bytes:
            ups = [up_step(k) for k in keys if pos[k] > 0]
            heapq.heapify(ups)
            while ups:
                _, cost, k = heapq.heappop(ups)
                if total + cost > budget_bytes:
                    continue  # the slack only shrinks, so this step never fits later either
                total += cost
                pos[k] -= 1
                if pos[k] > 0:
                    heapq.heappush(ups, up_step(k))

        chosen = {k: frontier[k][pos[k]] for k in keys}
        codecs = {k: self.codec(k, chosen[k][2]) for k in keys}
        log = {
            "budget_bytes": budget_bytes,
            "total_bytes": total,
            "min_bytes": sum(frontier[k][-1][0] for k in keys),
            "max_bytes": max_bytes,
            "fits": total <= budget_bytes,
            "measured": all(isinstance(tensors[k], torch.Tensor) for k in keys),
            "codecs": {k: chosen[k][2] for k in keys},
            "sq_error": {k: chosen[k][1] for k in keys},
        }
        return codecs, log
