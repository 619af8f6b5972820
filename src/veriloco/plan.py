"""`veriloco plan`: what a config will run, before anything runs.

For a DiLoCoX layout across sites it answers the questions to settle before renting the
machines: which process is which (and what to give torchrun), what slice of the model each
stage holds and the memory its weights and optimizers take, how many bytes a worker sends per
round against what DDP would send, how much each round adds to the run's store, and whether the
exchange hides under the inner steps on the configured `[link]`. Nothing is trained, no corpus
is read and no weights are made: the model's structure is built on the meta device
(`model.build_meta`), the packet sizes come from the codecs' own `estimate_bytes`, and the
exchange time from the link model the run paces with (`round_budget_bytes`'s formula).

What it cannot know is the time of an inner step on your hardware; give it (`--step-s`, e.g.
from a short run's `inner_s / inner_steps`) and it says whether the exchange hides, the
utilisation to expect with delay 0, and the adaptive codec's byte budget.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .compress import build_codecs
from .compress.controller import round_budget_bytes
from .config import Config, load_config
from .hashing import hash_threads, tensors_hash
from .inner import Replicas
from .link import Link
from .model import build_meta
from .records import RunDir, RunDirError
from .topology import Topology, layers_of_stage
from .verify.commitment import REVEAL_BYTES
from .verify.replay import exchange_hops, segments_to_sample, state_layout, state_nbytes

PARAM_BYTES = 4  # float32: the weights, their gradients, each AdamW moment, G and the outer momentum
MB = 1e6


# one-way latency from which plan warns that TCP (slow start, a window lost to an idle) makes the exchange slower
LONG_LINK_S = 0.01


def elastic_latencies(workers: int) -> int:
    """An elastic round's protocol on a long link, in one-way latencies: the quorum, the exchange's
    sends (each waits for its receiver's "ready") and the round's all-gathers (rings: a step more
    per worker). 0.858 s at 50 ms with 3 workers, 1.122 s with 4 (the tiny GPT's packets, the inner
    steps left out; bench/elastic_latency.py, thirty-first session); other counts are extrapolated."""
    return 17 + 5 * (workers - 3)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's slice of the model."""

    stage: int
    blocks: list[int]
    tensors: int
    params: int
    payload_bytes: int  # this slice's packet payload per round with the configured codec (fp32 for 'adaptive')
    owned: list[int] | None = None  # [topology] shard_optimizer: the slice's parameters each replica owns (ZeRO-1)
    state_bytes: int = 0  # an inner state of the slice (params + AdamW moments + counters): what a trace entry hashes


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
    def payload(self) -> int:
        """A worker's packet payload per round: its stages' together."""
        return sum(s.payload_bytes for s in self.stages)

    @property
    def sent_per_round(self) -> int:
        """Payload bytes one worker sends per round: each stage's packet to the W-1 others."""
        return self.payload * (self.topo.workers - 1)

    @property
    def checkpoint_bytes(self) -> int:
        """A round's checkpoint payload: G, and its outer momentum buffers when there is momentum."""
        return self.params * PARAM_BYTES * (2 if self.cfg.outer.momentum > 0 else 1)

    @property
    def store_per_round(self) -> int:
        """Payload bytes a round adds to a store all the workers share (RUN/store of a local run):
        the checkpoint and every worker's bundle (its packet and signed commitment)."""
        return self.checkpoint_bytes + self.topo.workers * self.payload

    def store_held(self, rounds: int, done: int = 0) -> int:
        """Payload bytes the store gains from round `done` to `rounds` (round by round: the
        bundles; the checkpoints, of which `[run] keep_checkpoints` = N keeps the newest N)."""
        keep, new = self.cfg.run.keep_checkpoints, max(rounds - done, 0)
        checkpoints = new if not keep else max(min(rounds, keep) - min(done, keep), 0)  # pruned as others come
        return new * self.topo.workers * self.payload + checkpoints * self.checkpoint_bytes

    @property
    def private_state_bytes(self) -> int:
        """What one process keeps on disk of its private state: its last two (AdamW moments, and
        with error feedback the residuals, of its stage's slice)."""
        model = self.params * PARAM_BYTES
        state = 2 * model + (model if self.cfg.compress.error_feedback else 0)
        return int(2 * state / self.topo.stages)

    @property
    def ddp_per_round(self) -> float:
        """What a worker would send in the round's H steps with DDP: a ring all-reduce of the fp32
        gradient, 2 (W-1)/W of the model per step."""
        w = self.topo.workers
        return self.cfg.train.inner_steps * 2 * (w - 1) / w * self.params * PARAM_BYTES

    @property
    def link(self) -> Link:
        return Link.from_strings(self.cfg.link.bandwidth, self.cfg.link.latency)

    @property
    def hops(self) -> int:
        """Messages of an exchange one after another (verify/replay.py: exchange_hops)."""
        return exchange_hops(self.cfg.verify)

    def exchange_s(self, payload_bytes: int) -> float:
        """Seconds one exchange of `payload_bytes` packets takes on the link: latency (twice with the
        salts' reveal) + (W-1) packets (and reveals) each way at the bandwidth (full duplex), as
        `[link]` paces it."""
        moved = (payload_bytes + (REVEAL_BYTES if self.hops > 1 else 0)) * (self.topo.workers - 1)
        return 0.0 if self.link.unlimited else self.link.transfer_time(moved, moved, self.hops)


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
    steps = []
    for i, rec in enumerate(run.rounds()):
        seconds, h = rec.get("inner_s"), rec.get("inner_steps", H)
        if not seconds:
            continue
        if not (isinstance(seconds, list) and all(_seconds(x) for x in seconds) and type(h) is int and h >= 1):
            raise RunDirError(f"{run.rounds_path} line {i + 1}: its inner_s is not a list of seconds, or its "
                              "inner_steps not a number of steps")
        steps.append(sum(seconds) / len(seconds) / h)
    cfg = load_config(None, overrides, base=config)
    return cfg, (statistics.median(steps) if steps else None)


def _seconds(x: object) -> bool:
    """Whether a record's x is a number of seconds (finite, >= 0; a bool is not one)."""
    return type(x) in (int, float) and math.isfinite(x) and x >= 0


def _figures(recs: list[dict], key: str) -> float:
    """The sum of a per-worker figure over a run's rounds (0 where a record lacks it)."""
    return sum(float(x) for rec in recs for x in (rec.get(key) or []) if isinstance(x, (int, float)))


def measured_verification(run_dir: str | Path) -> str | None:
    """What a run directory's records measured of its verification, beside the plan's figures:
    replays and loss gains in CPU seconds against the inner steps' (each worker's thread), and the
    start states its replays fetched per round. None before a round is recorded."""
    recs = RunDir(run_dir).rounds()
    inner = _figures(recs, "inner_cpu_s")
    if not recs or inner <= 0:
        return None
    replay, gain, states = (_figures(recs, k) for k in ("replay_cpu_s", "loss_gain_cpu_s", "state_bytes_sent"))
    fetched = sum(1 for rec in recs for x in (rec.get("state_bytes_sent") or []) if isinstance(x, int) and x > 0)
    return (f"  measured in {run_dir} ({len(recs)} round(s), its own [verify]): replays {replay / inner:.1%} and loss "
            f"gains {gain / inner:.1%} on top of the inner steps (CPU seconds), {fetched} start state(s) fetched, "
            f"{_mb(states / len(recs))} a round")


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
                                sum(codecs[k].estimate_bytes(v) for k, v in shapes.items()), owned,
                                state_nbytes(state_layout(model))))
    return Plan(cfg, topo, stages, step_s)


@dataclass(frozen=True)
class VerifyPlan:
    """What `[verify]` adds to a round, expected with every packet accepted and no suspect (a
    flagged or failed packet is replayed whole, and by every member when a failure is reported).
    Replays are drawn per worker with `replay_probability` (verify/replay.py: sample_audits)."""

    audits: float  # replays a round across the run: W x p
    steps_per_audit: float  # inner steps one replay runs, on average over the segment drawn
    fetched: float  # share of replays that fetch the segment's start state (replay_extent = "state", a segment past the first)
    state_bytes: int  # one such state: the largest stage slice's (each stage process sends its own slice)
    kept_states: int  # states a process keeps until its round is checked (replay_extent = "state")
    gain_forwards: int  # loss-gain forward passes a round across the run

    def replay_share(self, cfg: Config, workers: int) -> float:
        """Replayed inner steps over the run's inner steps."""
        return self.audits * self.steps_per_audit / (workers * cfg.train.inner_steps)

    def gain_share(self, cfg: Config, workers: int) -> float:
        """Loss-gain forward passes over the run's inner steps, a forward taken as a third of a
        training step (forward + backward, the backward about twice the forward)."""
        return self.gain_forwards / 3 / (workers * cfg.train.inner_steps)

    @property
    def state_per_round(self) -> float:
        """Start-state bytes sent a round across the run (by the audited workers, to their auditors)."""
        return self.audits * self.fetched * self.state_bytes


def verify_plan(plan: Plan) -> VerifyPlan:
    """The expected verification work and traffic of `plan`'s config per round."""
    cfg, v, W, H = plan.cfg, plan.cfg.verify, plan.topo.workers, plan.cfg.train.inner_steps
    p = v.replay_probability if W > 1 else 0.0  # no other worker, no auditor
    n = segments_to_sample(v, cfg.train)
    k = H // n  # a segment's steps (distance mode: the whole round)
    if v.replay_match == "distance" or v.replay_extent == "round":
        steps, fetched = float(H), 0.0
    elif v.replay_extent == "segment":  # steps 0 .. the end of a segment drawn uniformly
        steps, fetched = k * (n + 1) / 2, 0.0
    else:  # "state": the drawn segment alone; the first starts from the round's public start
        steps, fetched = float(k), (n - 1) / n
    kept = 0
    if p > 0 and v.replay_match == "exact" and v.replay_extent == "state":
        from .round import trace_entries

        kept = trace_entries(cfg) * (2 if cfg.outer.delay else 1)
    checkers = v.loss_gain_checkers if v.loss_gain_action == "audit" and p > 0 else 0
    gain = W * (checkers or W) * 2 * v.loss_gain_batches  # every packet: 2 forwards a batch on each of its checkers
    return VerifyPlan(W * p, steps, fetched, max(st.state_bytes for st in plan.stages), kept, gain)


def hash_rate(nbytes: int = 64 << 20) -> float:
    """This machine's `tensors_hash` rate, bytes per second (the best of three hashes of a
    `nbytes` tensor, its leaves on `hash_threads()` threads): what every trace hash runs at."""
    data, best = {"x": torch.zeros(nbytes, dtype=torch.uint8)}, math.inf
    for _ in range(3):
        t = time.perf_counter()
        tensors_hash(data)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def traces_compared(cfg: Config) -> bool:
    """Whether anything compares a worker's trace hashes with a replay's: exact replays, drawn
    (replay_probability > 0; a failed loss-gain test is replayed only then). Distance replays
    compare deltas, and with no replays the trace is committed and never checked."""
    return cfg.verify.replay_match == "exact" and cfg.verify.replay_probability > 0 and cfg.topology.workers > 1


def _trace_lines(plan: Plan) -> list[str]:
    """The trace's hashing: each stage process hashes its whole inner state (params + AdamW
    moments) at the round's start and every trace_every steps, between steps, on `hash_threads()`
    CPU threads."""
    from .round import trace_entries

    cfg, H = plan.cfg, plan.cfg.train.inner_steps
    hashes = trace_entries(cfg)
    state = max(st.state_bytes for st in plan.stages)
    rate, threads = hash_rate(), hash_threads()
    seconds = hashes * state / rate
    share = f", {seconds / (H * plan.step_s):.1%} of the inner steps" if plan.step_s else ""
    device = " (from GPU memory: a copy to the host first, not counted)" if cfg.run.device == "cuda" else ""
    out = [f"trace: {hashes} state hashes a round per stage process (params + AdamW moments, {_mb(state)} each: "
           f"{_mb(hashes * state)} hashed between inner steps on {threads} CPU thread{'s' if threads > 1 else ''}{device}; "
           f"here at {rate / 1e9:.2f} GB/s: {seconds:.3f} s a round{share})"]
    if not traces_compared(cfg) and hashes > 2:
        why = ("distance replays compare deltas" if cfg.verify.replay_match == "distance"
               else "replay_probability = 0: no replays")
        out.append(f"  nothing compares them in this config ({why}): --verify.trace_every=0 hashes twice a round")
    return out


def _mb(n: float) -> str:
    return f"{n / MB:,.2f} MB" if n >= 0.1 * MB else f"{n / 1e3:,.1f} KB"


def format_plan(plan: Plan, measured: str | None = None) -> str:
    """The plan as text, one fact a line; `measured`: a run's own verification figures
    (`measured_verification`), printed after the planned ones."""
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
    if cfg.run.membership == "elastic":
        out.append("  elastic: `veriloco train` starts the workers (`veriloco join --workers ...` on other machines), "
                   "a process each" + (f", which starts its {R - 1} other replica(s) on its machine" if R > 1 else ""))
    else:
        out.append(f"  torchrun, a node per worker: --nnodes={W} --nproc-per-node={S * R} (or --nproc-per-node={n} on one "
                   "machine)")
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
                   f"{mine}, + {_mb(2 * memory)}{outer} for G and the outer momentum, + {_mb(W * memory)}{outer} for "
                   f"the {W} workers' newest decoded deltas (replay starts, the next screen's previous round; as much "
                   "again while a round's are checked) (not counted: activations, error-feedback residuals, delay 1's "
                   "kept deltas)")
    codec = cfg.compress.codec
    payload = plan.payload
    shown = "fp32" if codec == "adaptive" else codec
    what = "adaptive: at most its fp32 figure, each round within its budget" if codec == "adaptive" else codec
    packets = f"packets of {_mb(payload)} (its {S} stages')" if S > 1 else f"a packet of {_mb(payload)}"
    out.append(f"traffic per round per worker ({what}): {packets} to each of {W - 1} other(s): "
               f"{_mb(plan.sent_per_round)} sent and as much received, plus a few KB of header and signed "
               f"commitment per packet")
    if W > 1:
        out.append(f"  DDP in the same {H} inner steps: {_mb(plan.ddp_per_round)} sent per worker "
                   f"({plan.ddp_per_round / max(plan.sent_per_round, 1):,.0f}x the payload above)")
    out.append(_store_line(plan))
    out += _verify_lines(plan) + ([measured] if measured else []) + _trace_lines(plan)
    slowest = max(plan.exchange_s(st.payload_bytes) for st in plan.stages)
    out.append(f"exchange on the link ({plan.link}): {slowest:.3f} s a round per stage process"
               + (f"; {plan.exchange_s(payload):.3f} s if a worker's stages share one link" if S > 1 else ""))
    if W > 1 and plan.link.latency_s >= LONG_LINK_S:
        out.append(f"  a lower bound over TCP on a {plan.link.latency_s * 1e3:.0f} ms link: a new connection, or one idle "
                   "for the inner steps, starts from a small window (at 1 Gbit/s and 50 ms a 3.5 MB exchange after 2 s "
                   "of idle took 0.68 s, 0.16 s with net.ipv4.tcp_slow_start_after_idle = 0 on every node: "
                   "bench/tcp_idle.py)")
    if W > 1 and plan.link.latency_s >= LONG_LINK_S and cfg.run.membership == "elastic":
        n = elastic_latencies(W)
        out.append(f"  elastic: the quorum, the exchange and the round's figures cost about {n} one-way latencies a "
                   f"round with {W} workers, {n * plan.link.latency_s:.2f} s on this link, where the workers and the "
                   f"coordinator are all that far apart (at 50 ms: 0.86 s with 3 workers, 1.12 s with 4; "
                   f"bench/elastic_latency.py); "
                   + ("the quorum and the exchange run under the next round's inner steps (delay 1), the rest does not"
                      if cfg.outer.delay else "with delay 0 none of it hides under the inner steps"))
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
        budget = round_budget_bytes(plan.link.bandwidth_bps, plan.link.latency_s * plan.hops, window * plan.step_s, W,
                                    cfg.compress.safety)
        largest = max(st.payload_bytes for st in plan.stages)
        out.append(f"  the adaptive codec's budget: {_mb(budget)} a packet per stage process "
                   f"({budget / max(largest, 1):.2f}x the largest slice's {shown} packet)")
    return "\n".join(out)


def _store_line(plan: Plan) -> str:
    """What a round adds to the run's store (RUN/store, one for all of a machine's workers): the
    checkpoint (G and, with outer momentum, its buffers) and every worker's bundle; and the
    private states each process keeps."""
    cfg, W, S = plan.cfg, plan.topo.workers, plan.topo.stages
    rounds, keep = cfg.train.rounds, cfg.run.keep_checkpoints
    kept = f"the newest {keep} checkpoints kept (run.keep_checkpoints)" if keep else "kept for the audit"
    return (f"store: each round adds {_mb(plan.store_per_round)} (a checkpoint of {_mb(plan.checkpoint_bytes)}, "
            f"the {W} bundles, {_mb(W * plan.payload)}), "
            f"{_mb(plan.store_held(rounds))} for {rounds} rounds, {kept}; "
            f"each {'stage ' if S > 1 else ''}process also keeps its last two private states, {_mb(plan.private_state_bytes)} "
            "(not counted: the corpus, G_0, replays' kept states)")


def disk_warning(cfg: Config, directory: str | Path, done: int = 0) -> str | None:
    """One line when the rounds `done`.. of `cfg` will write more to `directory`'s filesystem
    (the run's store and its processes' private states, as `veriloco plan` counts them) than it
    has free now; None when they fit. A warning, not a refusal: compressed packets vary."""
    import shutil

    plan = make_plan(cfg)
    states = plan.private_state_bytes * plan.topo.workers * plan.topo.stages if done == 0 else 0  # then already there
    need = plan.store_held(cfg.train.rounds, done) + states
    free = shutil.disk_usage(directory).free
    if need <= free:
        return None
    hint = ""
    if not cfg.run.keep_checkpoints:
        pruning = copy.deepcopy(cfg)
        pruning.run.keep_checkpoints = 2
        hint = (f"; with --run.keep_checkpoints=2 (the newest two checkpoints kept) it would be "
                f"{_size(make_plan(pruning).store_held(cfg.train.rounds, done) + states)}")
    return (f"warning: rounds {done}..{cfg.train.rounds - 1} will write about {_size(need)} to {directory} "
            f"(`veriloco plan` counts it) and it has {_size(free)} free{hint}")


def _size(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else _mb(n)


def unchecked_packets(cfg: Config) -> str | None:
    """What a config's replays leave unchecked that a user would take for checked: with error
    feedback a packet is codec(delta + a residual only the worker has), so a replay checks the
    trace and not the packet. Said by `veriloco plan` and, on stderr, when such a run starts."""
    if cfg.verify.replay_probability <= 0 or not cfg.compress.error_feedback or cfg.topology.workers < 2:
        return None
    return ("error feedback: a replay checks the trace, not the packet (codec(delta + a residual only the worker "
            "has)): the screens and the aggregator are all that check what a packet carries")


def _verify_lines(plan: Plan) -> list[str]:
    """What verification adds to each round: replays, the start states they fetch, the states kept
    for them, and the loss-gain screen."""
    cfg, v, W = plan.cfg, plan.cfg.verify, plan.topo.workers
    vp = verify_plan(plan)
    if not vp.audits and not vp.gain_forwards:
        return ["verification: signatures, commitments and screens only (replay_probability = 0, loss_gain_batches "
                "= 0): no replays and no model-sized traffic"]
    out = []
    if vp.audits:
        how = f"'{v.replay_extent}'" if v.replay_match == "exact" else "distance (the whole round)"
        out.append(f"verification: {vp.audits:.2f} replays a round across the {W} workers (each worker's round drawn "
                   f"with p = {v.replay_probability:g}; replay_extent {how}), {vp.steps_per_audit:g} inner steps each "
                   f"on average: {vp.replay_share(cfg, W):.1%} on top of the inner steps")
        if vp.fetched:
            state = vp.state_bytes
            link = "" if plan.link.unlimited else f", {plan.link.transfer_time(state, 0):.3f} s on the link"
            out.append(f"  start states for the replays: {_mb(state)} each (params + AdamW moments{' of a stage slice' if plan.topo.stages > 1 else ''}"
                       f"{link}), fetched by {vp.fetched:.0%} of them: {_mb(vp.state_per_round)} a round across the "
                       f"run, {vp.state_per_round / max(plan.sent_per_round * W, 1):.1%} of the packets' "
                       f"{_mb(plan.sent_per_round * W)}")
            out.append(f"  states kept until a round is checked: {vp.kept_states} per process "
                       f"({_mb(vp.kept_states * state)}) in {'host memory' if v.keep_states == 'memory' else 'a file'}")
        else:
            out.append("  replays start from the round's public start (G and the worker's own packets): no model-sized traffic")
        if unchecked := unchecked_packets(cfg):
            out.append(f"  {unchecked}")
    if vp.gain_forwards:
        out.append(f"loss-gain screen: {vp.gain_forwards:,} forward passes a round across the run ({v.loss_gain_batches} "
                   f"batch(es) x 2 a packet on each of its checkers): about {vp.gain_share(cfg, W):.1%} on top of the "
                   "inner steps (a forward taken as a third of a step)")
    return out


__all__ = ["Plan", "StagePlan", "VerifyPlan", "format_plan", "make_plan", "measured_verification", "unchecked_packets",
           "verify_plan"]
