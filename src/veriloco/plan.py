"""`veriloco plan`: what a config will run, before anything runs.

For a DiLoCoX layout across sites it answers the questions to settle before renting the
machines: which process is which (and what to give torchrun), what slice of the model each
stage holds and the memory its weights and optimizers take, how many bytes a worker sends per
round against what DDP would send, and whether the exchange hides under the inner steps on the
configured `[link]`. Nothing is trained, no corpus is read and no weights are made: the model's
structure is built on the meta device (`model.build_meta`), the packet sizes come from the
codecs' own `estimate_bytes`, and the exchange time from the link model the run paces with
(`round_budget_bytes`'s formula).

What it cannot know is the time of an inner step on your hardware; give it (`--step-s`, e.g.
from a short run's `inner_s / inner_steps`) and it says whether the exchange hides, the
utilisation to expect with delay 0, and the adaptive codec's byte budget.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .compress import build_codecs
from .compress.controller import round_budget_bytes
from .config import Config, load_config
from .inner import Replicas
from .link import Link
from .model import build_meta
from .records import RunDir, RunDirError
from .topology import Topology, layers_of_stage

PARAM_BYTES = 4  # float32: the weights, their gradients, each AdamW moment, G and the outer momentum
MB = 1e6


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's slice of the model."""

    stage: int
    blocks: list[int]
    tensors: int
    params: int
    payload_bytes: int  # this slice's packet payload per round with the configured codec (fp32 for 'adaptive')
    owned: list[int] | None = None  # [topology] shard_optimizer: the slice's parameters each replica owns (ZeRO-1)


@dataclass(frozen=True)
class Plan:
    cfg: Config
    topo: Topology
    stages: list[StagePlan]
    step_s: float | None

    @property
    def params(self) -> int:
        return sum(s.params for s in self.stages)

    @property
    def sent_per_round(self) -> int:
        """Payload bytes one worker sends per round: each stage's packet to the W-1 others."""
        return sum(s.payload_bytes for s in self.stages) * (self.topo.workers - 1)

    @property
    def ddp_per_round(self) -> float:
        """What a worker would send in the round's H steps with DDP: a ring all-reduce of the fp32
        gradient, 2 (W-1)/W of the model per step."""
        w = self.topo.workers
        return self.cfg.train.inner_steps * 2 * (w - 1) / w * self.params * PARAM_BYTES

    @property
    def link(self) -> Link:
        return Link.from_strings(self.cfg.link.bandwidth, self.cfg.link.latency)

    def exchange_s(self, payload_bytes: int) -> float:
        """Seconds one exchange of `payload_bytes` packets takes on the link: latency + (W-1)
        packets each way at the bandwidth (full duplex), as `[link]` paces it."""
        moved = payload_bytes * (self.topo.workers - 1)
        return 0.0 if self.link.unlimited else self.link.transfer_time(moved, moved)


def run_config(run_dir: str | Path, overrides: list[str]) -> tuple[Config, float | None]:
    """A run directory's config (its manifest's) with `overrides`, and the seconds of an inner step
    the run measured: over its rounds, the median of the workers' mean `inner_s` over the round's
    steps (None before a round is recorded). That is the run's layout on the run's machines: plan
    another layout with it only as an estimate."""
    run = RunDir(run_dir)
    config = run.read_manifest().get("config")
    if not isinstance(config, dict):
        raise RunDirError(f"{run_dir}: its manifest holds no config")
    H = load_config(base=config).train.inner_steps  # the run's own H (adaptive H records each round's)
    steps = [sum(rec["inner_s"]) / len(rec["inner_s"]) / rec.get("inner_steps", H)
             for rec in run.rounds() if rec.get("inner_s")]
    cfg = load_config(None, overrides, base=config)
    return cfg, (statistics.median(steps) if steps else None)


def make_plan(cfg: Config, step_s: float | None = None) -> Plan:
    """The plan of `cfg` (validated already: `config.load_config`)."""
    if step_s is not None and not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"--step-s must be a positive number of seconds, got {step_s}")
    t = cfg.topology
    topo = Topology(t.workers, t.stages, replicas=t.replicas)
    full = build_meta(cfg.model)
    spec = "fp32" if cfg.compress.codec == "adaptive" else cfg.compress.codec
    stages = []
    for s in range(t.stages):
        blocks = layers_of_stage(s, cfg.model.n_layer, t.stages)
        model = full if t.stages == 1 else copy.deepcopy(full)
        if t.stages > 1:
            model.keep_stage(set(blocks), s == 0, s == t.stages - 1)
        shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
        codecs = build_codecs(spec, shapes)
        owned = None
        if t.replicas > 1 and t.shard_optimizer:
            params = list(model.parameters())
            owners = Replicas(None, 0, t.replicas, shard=True).owners(params)
            owned = [sum(p.numel() for p, o in zip(params, owners, strict=True) if o == i) for i in range(t.replicas)]
        stages.append(StagePlan(s, blocks, len(shapes), sum(math.prod(v) for v in shapes.values()),
                                sum(codecs[k].estimate_bytes(v) for k, v in shapes.items()), owned))
    return Plan(cfg, topo, stages, step_s)


def _mb(n: float) -> str:
    return f"{n / MB:,.2f} MB" if n >= 0.1 * MB else f"{n / 1e3:,.1f} KB"


def format_plan(plan: Plan) -> str:
    """The plan as text, one fact a line."""
    cfg, topo = plan.cfg, plan.topo
    W, S, R, H = topo.workers, topo.stages, topo.replicas, cfg.train.inner_steps
    n = W * S * R
    out = [f"processes: {W} worker(s) x {S} stage(s) x {R} replica(s) = {n}; rank = (worker * {S} + stage) * {R} + replica"]
    for w in range(min(W, 2)):
        parts = [f"stage {s}: ranks {(w * S + s) * R}-{(w * S + s) * R + R - 1}" if R > 1 else
                 f"stage {s}: rank {w * S + s}" for s in range(S)]
        out.append(f"  worker {w}: " + "; ".join(parts))
    if W > 2:
        last = f"ranks {(W - 1) * S * R}-{n - 1}" if S * R > 1 else f"rank {n - 1}"
        out.append(f"  ... worker {W - 1}: {last}")
    out.append(f"  torchrun, a node per worker: --nnodes={W} --nproc-per-node={S * R} (or --nproc-per-node={n} on one machine)")
    if cfg.train.mode == "ddp":
        out.append("train.mode = 'ddp': the DDP baseline, which all-reduces every step (its 'DDP' lines below); the "
                   "packets and exchange are what train.mode = 'diloco' would send")
    out.append(f"model: {cfg.model.arch}, {plan.params:,} parameters ({_mb(plan.params * PARAM_BYTES)} in float32)")
    for st in plan.stages:
        ends = (" + embedding" if st.stage == 0 else "") + (" + head" if st.stage == S - 1 else "")
        blocks = f"blocks {st.blocks[0]}-{st.blocks[-1]}" if len(st.blocks) > 1 else f"block {st.blocks[0]}"
        memory = st.params * PARAM_BYTES
        outer = " on replica 0" if R > 1 else ""
        if st.owned is None:
            mine = f"{_mb(4 * memory)} for weights, gradients and AdamW"
        else:  # ZeRO-1: a replica's AdamW moments (and summed gradients) are those of the params it owns
            mine = (f"{_mb(2 * memory)} for weights and gradients, + AdamW for the params it owns: "
                    + ", ".join(f"replica {i} {_mb(2 * n * PARAM_BYTES)}" for i, n in enumerate(st.owned)))
        out.append(f"  stage {st.stage}: {blocks}{ends}: {st.params:,} parameters in {st.tensors} tensors; per process "
                   f"{mine}, + {_mb(2 * memory)}{outer} for G and the outer momentum (not counted: activations, "
                   "error-feedback residuals, delay 1's kept deltas)")
    codec = cfg.compress.codec
    payload = sum(st.payload_bytes for st in plan.stages)
    shown = "fp32" if codec == "adaptive" else codec
    what = "adaptive: at most its fp32 figure, each round within its budget" if codec == "adaptive" else codec
    packets = f"packets of {_mb(payload)} (its {S} stages')" if S > 1 else f"a packet of {_mb(payload)}"
    out.append(f"traffic per round per worker ({what}): {packets} to each of {W - 1} other(s): "
               f"{_mb(plan.sent_per_round)} sent and as much received, plus a few KB of header and signed "
               f"commitment per packet")
    if W > 1:
        out.append(f"  DDP in the same {H} inner steps: {_mb(plan.ddp_per_round)} sent per worker "
                   f"({plan.ddp_per_round / max(plan.sent_per_round, 1):,.0f}x the payload above)")
    slowest = max(plan.exchange_s(st.payload_bytes) for st in plan.stages)
    out.append(f"exchange on the link ({plan.link}): {slowest:.3f} s a round per stage process"
               + (f"; {plan.exchange_s(payload):.3f} s if a worker's stages share one link" if S > 1 else ""))
    window = cfg.outer.overlap_steps or H
    if plan.step_s is None:
        if slowest > 0:
            out.append(f"  {'it' if cfg.outer.delay else 'with outer.delay = 1 it'} hides when {window} inner "
                       f"step(s) take at least {slowest:.3f} s: a step of >= {slowest / window * 1e3:.1f} ms "
                       "(give --step-s to check yours)")
        return "\n".join(out)
    compute = H * plan.step_s
    out.append(f"with {plan.step_s:g} s an inner step: {compute:.2f} s of inner steps a round")
    if cfg.outer.delay:
        hides = slowest <= window * plan.step_s
        out.append(f"  delay 1: the exchange {'hides' if hides else 'does NOT hide'} under "
                   f"{window} step(s) ({window * plan.step_s:.2f} s)")
    else:
        out.append(f"  delay 0: utilisation about {compute / (compute + slowest):.1%} (inner steps / (inner steps + exchange))")
    if W > 1 and not plan.link.unlimited:
        wire = int(plan.ddp_per_round / H)
        ddp_s = plan.link.transfer_time(wire, wire)
        out.append(f"  DDP instead: {ddp_s:.3f} s of all-reduce a step on this link (each DDP bucket pays the latency); "
                   f"utilisation at least {plan.step_s / (plan.step_s + ddp_s):.1%}, more where the all-reduce "
                   "overlaps the backward")
        budget = round_budget_bytes(plan.link.bandwidth_bps, plan.link.latency_s, window * plan.step_s, W,
                                    cfg.compress.safety)
        largest = max(st.payload_bytes for st in plan.stages)
        out.append(f"  the adaptive codec's budget: {_mb(budget)} a packet per stage process "
                   f"({budget / max(largest, 1):.2f}x the largest slice's {shown} packet)")
    return "\n".join(out)


__all__ = ["Plan", "StagePlan", "format_plan", "make_plan"]
