"""Replay spot checks: redo a sampled worker's inner steps and compare with what it committed.

With `[train] inner_state = "reset"` a worker's round is a function of public data only: its
start params S_r (the round's G plus, with the eager correction, its own previous packets) and
its assigned batches; the AdamW moments start empty every round. So an auditor can replay the
round without fetching a byte of private state — verification moves no model-sized traffic and
does not undo the compression. Two ways to compare (`[verify] replay_match`):

- "exact": segment j (inner steps j*k .. (j+1)*k - 1, k = `[verify] trace_every`) is checked by
  replaying steps 0 .. (j+1)*k - 1 and comparing the state hashes at every boundary with the
  committed trace, bit for bit. When that covers the whole round, the replayed delta is also
  encoded with the packet's codecs and must decode to the packet bit for bit (the score is then
  len(trace)): a clean trace does not vouch for a packet the worker made some other way. A
  PowerSGD tensor, whose warm start a replay cannot redo, must instead be the replayed delta
  projected onto its own columns (`lowrank_distance`); error feedback's packet, made from a
  residual only the worker has, is not checked (`packet_differs`, `plan.unchecked_packets`).
  Needs deterministic kernels: CPU, same torch, same thread count.
- "exact" with `[verify] replay_extent = "state"`: segment j > 0 is replayed alone, from its
  start state (params + AdamW moments), which the audited worker sends the auditor as a buffer
  in `state_layout`; it must hash to trace entry j (`state_matches`), else the replay fails
  there (withheld). k/H of a round's compute for the state's bytes (round.StateMoves).
- "distance": the auditor replays the whole round (all H inner steps), passes its delta
  S_r - theta through the codecs the packet names (a PowerSGD tensor: projected onto the
  packet's columns, `lowrank_parts`), and compares that with the committed delta (the decoded
  packet): the round passes when ||replayed - committed|| <= tolerance * ||committed||. For kernels that are not bit-reproducible (GPUs, other thread counts). The
  tolerance is a security parameter: Fang et al. 2023 ("Proof-of-Learning is Currently More
  Broken Than You Think", arXiv 2208.03567) spoof PoL exactly where its distance thresholds are
  loose, so it must sit just above honest nondeterminism (README: "Verification").

Which workers are checked is drawn from a seed that mixes the previous ledger entry's hash with
this round's commitment digests, so no worker knows its sample before it has committed; the
auditor of worker w is another worker chosen from the same seed, never w itself. Workers whose
delta failed the loss-gain screen (suspects) are replayed too, whether drawn or not
(`plan_audits`). One auditor's word never convicts: a reported failure is replayed by every
member before it counts, and an auditor whose failure does not reproduce is itself convicted
(FALSE_REPORT; round.py). `replay_score`
is the one function that both the round (`round.py`) and the offline audit (`audit.py`) call,
so both compute the same number and the same verdict from it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..compress import Codec, CodecError, codec_from_spec
from ..config import TrainConfig, VerifyConfig
from ..hashing import tensors_hash
from ..inner import InnerLoop, Landing, shift_params
from ..packet import decode_packet, encode_packet
from ..pipeline import combine_stage_hashes
from . import FALSE_REPORT, REPLAY_MISMATCH
from .check import RoundCheck, round_seed

# Codecs a replay can reproduce: they keep no sender state, so a fresh codec object encodes the
# replayed delta exactly as the worker's did. PowerSGD (lowrank) warm-starts from
# the sender's earlier rounds, which a replay of one round cannot know.
REPLAYABLE_CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "topk")
CHECKABLE_CODECS = (*REPLAYABLE_CODECS, "lowrank")  # lowrank by projection (packet_differs)
# A PowerSGD tensor an exact replay checks by what its warm start cannot change: an honest one is
# the worker's delta projected onto its own columns (P P^T M, sent as P and M^T P), off only by
# fp16's rounding of P and Q: `lowrank_distance` 2-3e-4 on honest encodings of model-sized
# matrices, p99.9 under 9e-4 and up to 1.4e-3 on the smallest ones the codec factors (rank 1
# of 3x3 .. 8x8, heavy-tailed values): `python bench/lowrank_check.py`. A delta scaled by 1.01 is
# at 1e-2; what the room leaves a worker (README, "Verification"): a push of its choosing under
# 2e-3 of the tensor's norm a round.
LOWRANK_TOLERANCE = 2e-3


@dataclass(frozen=True)
class Audit:
    """One sampled check: `auditor` replays `worker`'s round up to the end of `segment` (with
    `[verify] replay_extent = "state"`, only that segment, from its start state, unless `whole`:
    a suspect, or a run that replays whole rounds)."""

    worker: int
    segment: int
    auditor: int
    whole: bool = False


def sample_audits(seed_material: str, workers: list[int], world: int, segments: int, probability: float,
                  whole: bool = False) -> list[Audit]:
    """Deterministic sample: each listed worker is audited with `probability`, up to a segment
    drawn from `segments` (the last, with `whole`: `[verify] replay_extent = "round"`)."""
    out = []
    if world < 2 or segments < 1:
        return out
    for w in workers:
        h = hashlib.sha256(f"veriloco/replay/{seed_material}/{w}".encode()).digest()
        u = int.from_bytes(h[:8], "little") / 2**64
        if u >= probability:
            continue
        segment = segments - 1 if whole else int.from_bytes(h[8:12], "little") % segments
        auditor = (w + 1 + int.from_bytes(h[12:16], "little") % (world - 1)) % world
        out.append(Audit(w, segment, auditor, whole))
    return out


def sample_round_audits(seed_material: str, accepted: list[int], members: list[int], segments: int,
                        probability: float, whole: bool = False) -> list[Audit]:
    """`sample_audits` over the round's members (the workers whose packets it has: all of them,
    unless elastic membership left some out), so that no auditor is a worker that is not there.
    With every worker a member this is `sample_audits` itself."""
    pos = {j: i for i, j in enumerate(members)}
    drawn = sample_audits(seed_material, sorted(pos[j] for j in accepted), len(members), segments, probability, whole)
    return [Audit(members[a.worker], a.segment, members[a.auditor], a.whole) for a in drawn]


def reveals_salts(verify: VerifyConfig) -> bool:
    """Whether the run's rounds draw from their seed (replays, or the loss-gain screen's batches
    and checkers), so each worker reveals its salt once every bundle is in (check.round_seed).
    Without draws there is nothing to grind, and no second step on the link."""
    return verify.replay_probability > 0 or bool(verify.screen and verify.loss_gain_batches)


def exchange_hops(verify: VerifyConfig) -> int:
    """Messages of a round's exchange, one after another, each paying the link's latency: the
    bundles, and the reveals where the run reveals salts (`reveals_salts`)."""
    return 1 + reveals_salts(verify)


def unsigned_reveal_action(verify: VerifyConfig) -> str:
    """What a sender without a signed reveal gets (check.check_bundles): replayed whole this round
    when the run replays ("replay"), else rejected as withheld ("reject")."""
    return "replay" if verify.replay_probability > 0 else "reject"


@dataclass(frozen=True)
class PlanInputs:
    """What a round's replay plan is drawn from (`plan_audits`): the seed, the workers that may be
    sampled (accepted so far), the screen's suspects and the banned workers."""

    seed: str
    accepted: list[int]
    suspects: set[int]
    banned: set[int]

    @classmethod
    def of_round(cls, base_hash: str, check: RoundCheck, banned: set[int], leave_out: Collection[int] = ()) -> PlanInputs:
        """One slice's: the seed mixes the round's base with every worker's commitment and
        revealed salt (check.round_seed), so nobody knows its sample before all have committed.
        `leave_out`: workers to draw as if they had not taken part (newcomer_audits)."""
        return cls(round_seed(check, base_hash, leave_out), sorted(j for j in check.accepted if j not in leave_out),
                   set(check.suspects) - set(leave_out), set(banned))

    def audits(self, verify: VerifyConfig, train: TrainConfig, members: list[int]) -> list[Audit]:
        """The round's replays under the run's config (`plan_audits` with its segments, replay
        probability and `replay_extent`; a run recorded before that key existed drew a segment,
        and its manifest's config says "segment"). The round and the offline audit both call it."""
        return plan_audits(self.seed, self.accepted, members, segments_to_sample(verify, train),
                           verify.replay_probability, self.suspects, self.banned, whole=verify.replay_extent == "round")

    def to_json(self) -> dict:
        return {"seed": self.seed, "accepted": self.accepted, "suspects": sorted(self.suspects),
                "banned": sorted(self.banned)}

    @classmethod
    def pooled(cls, stages: list[dict]) -> PlanInputs:
        """A pipelined worker's plan, the same on each of its stages (a replay runs through all
        of them): from every stage's `to_json()` in stage order (after check.take_whole_workers,
        so their accepted workers agree), the seeds concatenated, banned if any stage banned it,
        a suspect if any stage made it one (a worker without a signed reveal on one stage's
        exchange is replayed through all of them)."""
        accepted = set.intersection(*(set(p["accepted"]) for p in stages))
        suspects = set.union(*(set(p["suspects"]) for p in stages)) & accepted
        banned = set().union(*(set(p["banned"]) for p in stages))
        return cls("".join(p["seed"] for p in stages), sorted(accepted), suspects, banned)


def plan_audits(seed_material: str, accepted: list[int], members: list[int], segments: int, probability: float,
                suspects: list[int] | set[int] = (), banned: set[int] | frozenset[int] = frozenset(),
                whole: bool = False) -> list[Audit]:
    """The round's replays, in worker order: the random sample over the accepted workers (each
    to a drawn segment, or to the last with `whole`), plus every suspect (check.py: failed the
    loss-gain test) whether drawn or not, replayed to its last segment. Auditors are members that
    are not banned, never the audited worker."""
    eligible = [m for m in members if m not in banned]
    audits = {a.worker: a for a in sample_round_audits(
        seed_material, [j for j in accepted if j in eligible], eligible, segments, probability, whole)}
    for w in sorted(set(suspects) & set(eligible)):
        others = [m for m in eligible if m != w]
        if not others:
            continue
        if w in audits:
            audits[w] = Audit(w, segments - 1, audits[w].auditor, True)
            continue
        h = hashlib.sha256(f"veriloco/suspect/{seed_material}/{w}".encode()).digest()
        audits[w] = Audit(w, segments - 1, others[int.from_bytes(h[:8], "little") % len(others)], True)
    return [audits[w] for w in sorted(audits)]


# replayer(start, steps_before) -> (params, loop): a fresh copy of the worker's inner loop at the
# start params and at step `steps_before` of the run's schedule; `params.named_parameters()` are
# the params the loop trains (the whole model, or one pipeline stage's slice: then `start` is
# that slice), `loop.run(batch_of_step, steps, trace_every)` as InnerLoop's.
Replayer = Callable[[dict[str, torch.Tensor], int], tuple[Any, Any]]


def plain_replayer(make_model: Callable[[], nn.Module], loss_fn, cfg: TrainConfig, total_steps: int,
                   build: Callable[[dict[str, torch.Tensor]], nn.Module] | None = None,
                   replicas: int = 1) -> Replayer:
    """The replayer of a worker that is one pipeline stage (`[topology] stages = 1`). `build(start)`,
    when given, makes the model at `start` directly (the built-in task: `model.model_from`, no
    G_0 read and no second model); else `make_model()` and then `start` copied in. `replicas`:
    the worker's `[topology] replicas`, whose way of adding up a step's parts it reproduces."""

    def replayer(start: dict[str, torch.Tensor], steps_before: int) -> tuple[nn.Module, InnerLoop]:
        if build is not None:
            model = build(start)
        else:
            model = make_model()
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(start[k])
        inner = InnerLoop(model, cfg, total_steps, loss_fn)
        inner.step_count, inner.emulated_replicas = steps_before, replicas
        return model, inner

    return replayer


def check_replay(committed: list[str], replayed: list[str], offset: int = 0) -> int | None:
    """Index of the first trace entry that differs (None: all replayed boundaries match);
    `replayed` holds entries offset, offset + 1, ... (a replay from a segment's start state)."""
    for i, h in enumerate(replayed, start=offset):
        if i >= len(committed) or committed[i] != h:
            return i
    return None


# `[verify] replay_extent = "state"`: a segment's start state travels from the audited worker to
# its auditor as one flat byte buffer in a layout both derive from the model (`state_layout`), so
# nothing from the peer is parsed but raw numbers, and its size is known before it arrives.
StateLayout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def from_state(verify: VerifyConfig, audit: Audit) -> bool:
    """Whether `audit` replays one segment from a start state the worker must send: the "state"
    extent, a drawn segment past the first (the round's start is public)."""
    return verify.replay_extent == "state" and not audit.whole and audit.segment > 0


def state_layout(model: nn.Module) -> StateLayout:
    """The names, dtypes and shapes of an inner state after at least one AdamW step (what a trace
    entry hashes, `InnerLoop.state_hash`), in name order."""
    out: StateLayout = [("inner/step_count", torch.int64, ())]
    for n, p in model.named_parameters():
        shape = tuple(p.shape)
        out += [(f"param/{n}", p.dtype, shape), (f"inner/{n}/exp_avg", p.dtype, shape),
                (f"inner/{n}/exp_avg_sq", p.dtype, shape), (f"inner/{n}/step", torch.float32, ())]
    return sorted(out)


def state_nbytes(layout: StateLayout) -> int:
    """The size of a state buffer in `layout`."""
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, dt, shape in layout)


def state_to_bytes(tensors: dict[str, torch.Tensor], layout: StateLayout) -> torch.Tensor:
    """`tensors` as one uint8 buffer in `layout`; ValueError when they do not have its names,
    dtypes and shapes."""
    if sorted(tensors) != [name for name, _, _ in layout]:
        raise ValueError("the state's tensors are not the layout's")
    parts = []
    for name, dt, shape in layout:
        t = tensors[name]
        if t.dtype != dt or tuple(t.shape) != shape:
            raise ValueError(f"state tensor {name} is {t.dtype} {tuple(t.shape)}, not {dt} {shape}")
        parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def state_from_bytes(buf: torch.Tensor | bytes, layout: StateLayout) -> dict[str, torch.Tensor] | None:
    """The tensors of a state buffer (None when it is not the layout's size)."""
    if isinstance(buf, bytes | bytearray):
        buf = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    if buf.numel() != state_nbytes(layout):
        return None
    out, at = {}, 0
    for name, dt, shape in layout:
        size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        out[name] = buf[at : at + size].clone().view(dt).reshape(shape)
        at += size
    return out


def state_matches(state: dict[str, torch.Tensor] | None, trace: list[str], segment: int) -> bool:
    """Whether `state` is what trace entry `segment` (the segment's start) hashes."""
    return state is not None and hashes_match([tensors_hash(state)], trace, segment)


def hashes_match(stage_hashes: list[str], trace: list[str], segment: int) -> bool:
    """Whether the state hashes of a worker's stages, in stage order, are trace entry `segment`:
    one stage's hash is the entry itself; the hashes of S > 1 stages are combined as a pipelined
    worker's trace combines them (pipeline.combine_stage_hashes), so a stage's slice is checked
    only together with the others'."""
    if not 0 <= segment < len(trace):
        return False
    return (stage_hashes[0] if len(stage_hashes) == 1 else combine_stage_hashes(stage_hashes)) == trace[segment]


def state_ref(run_id: str, r: int, worker: int, segment: int, stage: int | None = None) -> str:
    """The store ref naming the blob of the state worker `worker` sent for segment `segment` of
    round r (written by whoever checked it against the trace; the offline audit reads it); with
    `[topology] stages` > 1, of one stage's slice of it."""
    return f"replay-states/{run_id}/{r}-{worker}-{segment}" + (f"-s{stage}" if stage is not None else "")


def segments_to_sample(verify: VerifyConfig, train: TrainConfig) -> int:
    """How many segments a sampled audit chooses from: H / k in exact mode; one (the whole
    round) in distance mode, whose replay always runs all H inner steps."""
    if verify.replay_match == "distance":
        return 1
    return max(train.inner_steps // (verify.trace_every or train.inner_steps), 1)


def _codec(spec: str) -> Codec | None:
    """The codec `spec` names; None for one that does not parse (check_bundles refuses those first)."""
    try:
        return codec_from_spec(spec)
    except CodecError:
        return None


def packet_checkable(codecs: dict[str, str], committed: dict[str, torch.Tensor]) -> bool:
    """Whether an exact replay of the whole round checks every tensor of the packet: re-encoded
    bit for bit (REPLAYABLE_CODECS, lowrank's fp16 fallback) or, for a PowerSGD
    matrix, by `lowrank_distance`. False with error feedback (`codecs` {}): its packet is made from
    a residual only the worker has."""
    return bool(codecs) and set(codecs) == set(committed) and all(checkable_codec(s) for s in codecs.values())


def checkable_codec(spec: str) -> bool:
    """Whether a replay can judge a tensor sent under `spec`: re-encoded (REPLAYABLE_CODECS) or,
    for PowerSGD, by `lowrank_parts`. Every codec veriloco has; config.py asks it of distance
    runs' codecs."""
    codec = _codec(spec)
    return codec is not None and codec.name in CHECKABLE_CODECS


def lowrank_parts(replayed: torch.Tensor, committed: torch.Tensor, rank: int) -> tuple[float, float]:
    """(||U U^T M - M_hat||^2, ||M_hat||^2) in float64, `distance_parts`' terms for one PowerSGD
    tensor: M the replayed delta and M_hat the decoded tensor, as (shape[0], rest) matrices, U an
    orthonormal basis of M_hat's columns (its at most `rank` singular directions above fp32's
    rounding, from M_hat times a fixed Gaussian of rank + 10 columns). An honest packet is M
    projected onto span(P), whatever the warm start made P, so the first is fp16's rounding of P
    and Q (2-3e-4 of the second's root on model-sized matrices, up to 1.4e-3 on tiny ones: bench/lowrank_check.py); a scaled, shifted or foreign tensor is far off. A zero
    M_hat leaves all of M as the difference; (inf, 1) when M_hat is not finite. Computed a block of
    columns at a time: float64 copies of a block, never of the whole matrix (a 50k x 1024
    embedding would be 400 MB each)."""
    hat = committed.reshape(committed.shape[0], -1)
    m = replayed.reshape(hat.shape)
    den = float(torch.linalg.vector_norm(hat, dtype=torch.float64)) ** 2
    if not math.isfinite(den):
        return math.inf, 1.0
    if den == 0:
        return float(torch.linalg.vector_norm(m, dtype=torch.float64)) ** 2, 0.0
    rows, cols = hat.shape
    step = max(1, (1 << 20) // rows)
    blocks = [(j, min(j + step, cols)) for j in range(0, cols, step)]
    # oversampled: with exactly `rank` columns an ill-conditioned Gaussian block hid a real
    # direction of M_hat now and then, and an honest packet failed (its review: 11 in 1500)
    gauss = torch.randn(cols, min(rank + 10, cols), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sketch = sum(hat[:, a:b].to(torch.float64) @ gauss[a:b] for a, b in blocks)
    u, sv, _ = torch.linalg.svd(sketch, full_matrices=False)
    u = u[:, :rank][:, sv[:rank] > sv[0] * 1e-6]
    num = 0.0
    for a, b in blocks:
        num += float(torch.linalg.vector_norm(u @ (u.T @ m[:, a:b].to(torch.float64)) - hat[:, a:b].to(torch.float64))) ** 2
    return num, den


def lowrank_distance(replayed: torch.Tensor, committed: torch.Tensor, rank: int) -> float:
    """||U U^T M - M_hat|| / ||M_hat|| (`lowrank_parts`): an exact replay's check of one PowerSGD
    tensor. 0 when both are zero; inf for a zero M_hat where M is not zero (nothing honest sends
    that) and for one that is not finite."""
    num, den = lowrank_parts(replayed, committed, rank)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    d = math.sqrt(num / den)
    return d if math.isfinite(d) else math.inf


def _by_check(codecs: dict[str, str], committed: dict[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, int]]:
    """The packet's tensors a replay checks, by how: ({name: spec} re-encoded bit for bit (fresh
    codecs, lowrank's fp16 fallback), {name: rank} PowerSGD matrices by `lowrank_parts`); a tensor
    under no codec a replay can judge (error feedback: `codecs` {}) is in neither."""
    exact, low = {}, {}
    for name in committed:
        spec = codecs.get(name)
        codec = _codec(spec) if spec is not None else None
        if codec is None or codec.name not in CHECKABLE_CODECS:
            continue
        # PowerSGD's factored form (its warm start a replay cannot know); its fp16 fallback
        # (vectors, small matrices) a fresh codec re-encodes bit for bit
        plan = codec._plan(tuple(committed[name].shape)) if codec.name == "lowrank" else None
        if plan is None:
            exact[name] = spec
        else:
            low[name] = plan[2]
    return exact, low


def packet_differs(delta: dict[str, torch.Tensor], committed: dict[str, torch.Tensor], codecs: dict[str, str]) -> bool:
    """Whether the packet (`committed`, decoded; `codecs` per tensor) is not what the replayed
    `delta` encodes to: each tensor a fresh codec reproduces must decode to it bit for bit, and
    each PowerSGD matrix must be the replayed delta on its own columns (`lowrank_distance` within
    LOWRANK_TOLERANCE). Tensors under no codec a replay can judge (error feedback: `codecs` {})
    are not checked: `packet_checkable` says whether that left any. Until the forty-fourth session
    one PowerSGD tensor (a rung of the default adaptive ladder) turned the check off for the
    whole packet, so a worker with a clean trace could send any delta (red_team.LowRankCover)."""
    exact, low = _by_check(codecs, committed)
    if exact:
        mine = as_committed({name: delta[name] for name in exact}, exact)
        if any(not torch.equal(mine[name], committed[name]) for name in exact):
            return True
    return any(lowrank_distance(delta[name], committed[name], rank) > LOWRANK_TOLERANCE for name, rank in low.items())


def replay_delta(
    make_model: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    cfg: TrainConfig,
    total_steps: int,
    start: dict[str, torch.Tensor],
    steps_before: int,
    batch_of_step: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """start - theta after all `cfg.inner_steps` inner steps of a replayed round (fp32)."""
    return _replayed_delta(plain_replayer(make_model, loss_fn, cfg, total_steps), cfg, start, steps_before,
                           batch_of_step)


def _replayed_delta(replayer: Replayer, cfg: TrainConfig, start: dict[str, torch.Tensor], steps_before: int,
                    batch_of_step: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    params, inner = replayer(start, steps_before)
    inner.run(batch_of_step, cfg.inner_steps)
    with torch.no_grad():
        return {k: start[k] - p.detach().cpu() for k, p in params.named_parameters()}


def as_committed(delta: dict[str, torch.Tensor], codecs: dict[str, str]) -> dict[str, torch.Tensor]:
    """What a packet of `delta` under the per-tensor `codecs` decodes to: the same encode ->
    safetensors -> decode path a worker's own packet takes (DeltaEncoder, decode_packet)."""
    packet = encode_packet(delta, {k: codec_from_spec(codecs[k]) for k in delta})
    return decode_packet(packet, {k: tuple(v.shape) for k, v in delta.items()}, len(packet))


def relative_distance(replayed: dict[str, torch.Tensor], committed: dict[str, torch.Tensor]) -> float:
    """||replayed - committed|| / ||committed|| over all tensors (L2, float64, keys in sorted
    order, so every machine gets the same bits from the same inputs); inf when the committed
    delta is zero or not finite (nothing honest commits that)."""
    return distance_of([distance_parts(replayed, committed)])


def distance_parts(replayed: dict[str, torch.Tensor], committed: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(||replayed - committed||^2, ||committed||^2) over `committed`'s tensors, keys in sorted order."""
    num = torch.zeros((), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for k in sorted(committed):
        c = committed[k].double()
        num += ((replayed[k].double() - c) ** 2).sum()
        den += (c**2).sum()
    return float(num), float(den)


def distance_of(parts: list[tuple[float, float]]) -> float:
    """The relative distance from the `distance_parts` of a model's slices, summed in slice
    (stage) order; inf when the committed delta is zero or anything is not finite."""
    num, den = sum(n for n, _ in parts), sum(d for _, d in parts)
    d = math.sqrt(num) / math.sqrt(den) if den > 0 else math.inf
    return d if math.isfinite(d) else math.inf


@dataclass
class Replayed:
    """What one replay gave: the trace hashes at each boundary it reached (exact mode), and the
    delta start - theta when it ran the whole round (else None)."""

    trace: list[str]
    delta: dict[str, torch.Tensor] | None
    offset: int = 0  # the trace entry `trace` starts at (a replay from a segment's start state)


def replay_run(
    verify: VerifyConfig,
    replayer: Replayer,
    train: TrainConfig,
    start: dict[str, torch.Tensor],
    round: int,
    batch_of_step: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    audit: Audit,
    land: tuple[int, dict[str, torch.Tensor]] | None = None,
    steps_before: int | None = None,
    total_steps: int | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Replayed:
    """Replay audit `audit` of round `round` from start point `start` with a loop from
    `replayer` (see `Replayer`: the worker's own kind of loop, or one that computes the same bits,
    pipeline.EmulatedPipeline for a pipelined worker): exact mode through the audited segment,
    distance mode the whole round. `land` = (step, G): `[outer] overlap_steps`, the previous
    round's update landed before that step, moving the params from `start` to G's side, and the
    delta is taken from G. `steps_before` (default round x H) and `total_steps` (default the
    replayer's) place the round on the run's LR schedule when H changed during the run
    (`[train] inner_steps_max`; `train` then holds this round's H). `state`: the audited segment's
    start state (`from_state`; already checked against the trace, `state_matches`): only that
    segment's k steps run, from it."""
    exact = verify.replay_match == "exact"
    k = verify.trace_every or train.inner_steps
    if state is None:  # from the round's start, through the audited segment (distance: the whole round)
        first, offset, steps = 0, 0, (audit.segment + 1) * k if exact else train.inner_steps
        params, inner = replayer(start, round * train.inner_steps if steps_before is None else steps_before)
    else:  # the audited segment alone, from its start state (its step counter comes with it)
        first, offset, steps = audit.segment, audit.segment * k, k  # (first: its trace entry)
        params, inner = replayer({key[len("param/"):]: v for key, v in state.items() if key.startswith("param/")}, 0)
        inner.load_state_tensors({key: v for key, v in state.items() if key.startswith("inner/")})
    if total_steps is not None:
        inner.total_steps = total_steps
    if steps_before is not None:  # the round's own ramp origin (the same as step % H when H is fixed)
        inner.round_start = steps_before
    end = offset + steps
    base, landing = start, None
    if land is not None:
        base, tau = land[1], land[0] - offset  # (tau < 0: it landed before the segment, in its state)
        if tau >= 0 and (tau < steps or end >= train.inner_steps):  # a round no longer than tau lands after its last step
            landing = Landing(tau, lambda: shift_params(params, base, start))
    trace = inner.run(lambda step: batch_of_step(offset + step), steps, trace_every=k if exact else 0,
                      land=landing).trace
    if end != train.inner_steps:
        return Replayed(trace, None, first)
    with torch.no_grad():
        return Replayed(trace, {name: base[name] - p.detach().cpu() for name, p in params.named_parameters()}, first)


def score_replayed(verify: VerifyConfig, replayed: Replayed, trace: list[str], committed: dict[str, torch.Tensor],
                   codecs: dict[str, str]) -> float:
    """The auditor's number for a replay against what the worker committed (`trace`; `committed`:
    the decoded packet, `codecs`: its codec per tensor; a pipeline stage's slice of them, or the
    whole model's): exact mode: the index of the first trace entry that differs, len(trace) when
    the trace matches but the packet is not what the replayed end state encodes to, -1 when all
    match; distance mode: the relative distance of the replayed, re-encoded delta to `committed`.
    `replay_failed` turns it into the verdict."""
    if verify.replay_match == "exact":
        bad = check_replay(trace, replayed.trace, replayed.offset)
        if bad is not None:
            return float(bad)
        if replayed.delta is not None and packet_differs(replayed.delta, committed, codecs):
            # the whole round was replayed: the packet must be what its end state encodes to, or
            # a worker could train honestly (a clean trace) and send another delta
            return float(len(trace))
        return -1.0
    return distance_of([replayed_parts(replayed, committed, codecs, verify.replay_tolerance)])


def replayed_parts(replayed: Replayed, committed: dict[str, torch.Tensor], codecs: dict[str, str],
                   tolerance: float) -> tuple[float, float]:
    """Distance mode: the `distance_parts` of the replayed delta, re-encoded with the packet's
    codecs, against `committed` (a slice of the model, or all of it), a PowerSGD tensor's part
    by `lowrank_parts`; (inf, 1) for a packet distance mode cannot judge (config keeps honest
    workers off it) and for one whose PowerSGD tensor is on its own further than `tolerance`
    from the replayed delta on its columns: summed into the packet's, a tiny tensor sent without
    knowing M (a rank-1 blank) was charged about ||M||^2 / rows, not ||M||^2 (its review)."""
    if replayed.delta is None or not packet_checkable(codecs, committed):
        return math.inf, 1.0
    exact, low = _by_check(codecs, committed)
    num, den = distance_parts(as_committed({k: replayed.delta[k] for k in exact}, exact),
                              {k: committed[k] for k in exact}) if exact else (0.0, 0.0)
    for name in sorted(low):  # PowerSGD: the replayed delta on the packet's own columns
        n, d = lowrank_parts(replayed.delta[name], committed[name], low[name])
        if not n <= tolerance**2 * d:
            return math.inf, 1.0
        num, den = num + n, den + d
    return num, den


def slice_result(verify: VerifyConfig, replayed: Replayed, trace: list[str], committed: dict[str, torch.Tensor],
                 codecs: dict[str, str]) -> tuple[float, float]:
    """One pipeline stage's part of a replay's number (its slice of `committed`): exact mode,
    (its `score_replayed`, 0); distance mode, its `replayed_parts`. `worker_score` combines them."""
    if verify.replay_match == "exact":
        return score_replayed(verify, replayed, trace, committed, codecs), 0.0
    return replayed_parts(replayed, committed, codecs, verify.replay_tolerance)


def worker_score(verify: VerifyConfig, results: list[tuple[float, float]]) -> float:
    """A pipelined worker's number from every stage's `slice_result`, in stage order: exact mode,
    the worst (the trace is the worker's, the packet check each slice's); distance mode, the whole
    model's relative distance. round.py (gathered from the stages) and audit.py both use it."""
    if verify.replay_match == "exact":
        return max(score for score, _ in results)
    return distance_of(results)


def replay_score(verify: VerifyConfig, run: Callable[[], Replayed], trace: list[str],
                 committed: dict[str, torch.Tensor], codecs: dict[str, str]) -> float:
    """`score_replayed` of `run()` (a `replay_run`), except that distance mode does not replay a
    packet it cannot compare with. The one number round.py and audit.py both compute for an
    audit, so both reach the same verdict."""
    if verify.replay_match != "exact" and not packet_checkable(codecs, committed):
        return math.inf
    return score_replayed(verify, run(), trace, committed, codecs)


def replay_failed(verify: VerifyConfig, score: float) -> bool:
    """Verdict of one audit from `replay_score`'s number (NaN fails)."""
    if verify.replay_match == "exact":
        return score >= 0
    return not score <= verify.replay_tolerance


def replay_evidence(verify: VerifyConfig, audit: Audit, score: float) -> dict:
    """What the round record keeps about one audit (rejected or not)."""
    if verify.replay_match == "exact":
        out = {"segment": audit.segment, "auditor": audit.auditor}
        if score < 0:
            return out
        # one past the last trace entry: the trace replays, but the packet is not its end state
        return out | {"first_mismatch": int(score)}
    # JSON has no inf: a packet that cannot be replayed records its distance as null
    return {"auditor": audit.auditor, "distance": score if math.isfinite(score) else None,
            "tolerance": verify.replay_tolerance}


def attributable(verify: VerifyConfig, audit: Audit, reported: float) -> bool:
    """Whether a reported failure that does not reproduce convicts the auditor: not when it said
    the start state it was sent privately did not hash to the trace (`from_state`; entry <= the
    segment's start): the worker may have sent it one state and the judges another."""
    return not (from_state(verify, audit) and verify.replay_match == "exact" and reported <= audit.segment)


def unbound_audit(verify: VerifyConfig, train: TrainConfig, worker: int, judge: int) -> Audit:
    """A judge's own replay of a sender its check holds `unbound` (check_bundles' unsigned_earlier):
    its whole round, to the last segment, as a suspect's."""
    return Audit(worker, segments_to_sample(verify, train) - 1, judge, True)


def judge_unbound(verify: VerifyConfig, check: RoundCheck, audit: Audit, score: float, bundle: str) -> None:
    """Judge a sender whose bundle of an earlier try of the round signed nothing (check.unbound) by
    `score`, this judge's own replay of it (unbound_audit). Every member that noted such a bundle
    replays the sender itself: the sender saw every salt before it first committed, so it may
    have chosen the round's draw, and with it the auditor a drawn replay would have; and a note
    is one member's own, not one every member holds. Failed: REPLAY_MISMATCH. `bundle`: the
    noted one's store hash (a worker's stages pool what they noted). round.py and audit.py both
    judge with this."""
    _judge_own_replay(verify, check, audit, score, {"unsigned_earlier_bundle": bundle}, "unsigned_earlier",
                      {"bundle": bundle})


def _judge_own_replay(verify: VerifyConfig, check: RoundCheck, audit: Audit, score: float, failed: dict,
                      passed_key: str, passed: dict) -> None:
    """Judge a replay a member made itself, whatever the draw, by `score`, its own number: failed,
    REPLAY_MISMATCH, the evidence of the replay and `failed` added to what the round knew of the
    worker (a drawn replay's dispute, say); passed, the evidence of the replay and `passed` under
    `passed_key`."""
    j = audit.worker
    if replay_failed(verify, score):
        check.verdicts[j] = REPLAY_MISMATCH
        check.evidence[j] = (check.evidence.get(j) or {}) | replay_evidence(verify, audit, score) | failed
        check.accepted.pop(j, None)
    else:
        check.evidence.setdefault(j, {})[passed_key] = replay_evidence(verify, audit, score) | passed


def newcomer_audits(verify: VerifyConfig, train: TrainConfig, base_hash: str, check: RoundCheck, banned: set[int],
                    members: list[int], newcomers: list[int]) -> dict[int, str]:
    """The replays a member makes itself, whatever the draw, in an elastic round whose try has
    `newcomers`: members that were not in the round's first try whose salts went out
    (round.keep_seen). A member of that try may have passed a newcomer every salt, which the
    retry reveals again (they are deterministic), so the newcomer could grind the commitment it
    now signs until the round's draw is the one it wants: itself unreplayed, or a colluder
    (the third review of the junk-first fix, forty-first session). So every member replays each
    newcomer's whole round, and every worker that the draw without the newcomers' say (their
    commitments and salts out of the seed, they out of the sample and the auditors) replays,
    each as unbound_audit replays a sender (its whole round, no state to send): also where the
    round's draw samples it too, since there the newcomer chose its auditor and segment (a
    colluder's, or one before what it skimmed: the review of the forty-second session). Drawn
    from the plan inputs of `check` before any replay. Returns worker -> why ("newcomer", or
    "drawn": by the draw without them), in worker order. round.py and audit.py both call it."""
    others = [m for m in members if m not in newcomers]
    without = PlanInputs.of_round(base_hash, check, banned, leave_out=newcomers).audits(verify, train, others)
    out = {a.worker: "drawn" for a in without} | {j: "newcomer" for j in newcomers}
    return dict(sorted(out.items()))


def judge_retry_replay(verify: VerifyConfig, check: RoundCheck, audit: Audit, score: float, why: str) -> None:
    """Judge a replay newcomer_audits asked for by `score`, this judge's own number: failed,
    REPLAY_MISMATCH (evidence `retry_replay`: why); passed, the evidence says so."""
    _judge_own_replay(verify, check, audit, score, {"retry_replay": why}, "retry_replay", {"why": why})


def judge_copy(verify: VerifyConfig, check: RoundCheck, audit: Audit, score: float, of: list[int]) -> None:
    """Judge an end of a copy of this round's packets (check.copies: its packet and those of `of`
    are one, or nearly) by `score`, this judge's own replay of its whole round: the original's
    replay reproduces its packet, a copier's batches cannot. Failed: REPLAY_MISMATCH (evidence
    `copy_of`); passed, it stays in (evidence `copy_replay`)."""
    _judge_own_replay(verify, check, audit, score, {"copy_of": of}, "copy_replay", {"copy_of": of})


def replayed_by_all(unbound: Mapping[int, str], extra: Mapping[int, str],
                    copies: Mapping[int, list[int]]) -> list[tuple[int, Callable, str]]:
    """The senders every member replays itself, whatever the draw, in the order they are judged:
    those noted as having signed nothing in an earlier try (check.unbound: judge_unbound), an
    elastic retry's newcomers and what the draw without them samples (newcomer_audits:
    judge_retry_replay), then the ends of a copy of the round's packets (check.copies:
    judge_copy), each once. Each with its judge, called as judge(verify, check, audit, score),
    and why it was replayed, in words. round.py and audit.py both go through it."""
    out = [(j, partial(judge_unbound, bundle=h),
            f"its bundle of an earlier try, {h[:12]}, had signed nothing, so the recorder replayed it itself")
           for j, h in sorted(unbound.items())]
    out += [(j, partial(judge_retry_replay, why=why),
             ("a newcomer to the retried round" if why == "newcomer" else "drawn without the retry's newcomers")
             + ", so every member replayed it itself") for j, why in extra.items() if j not in unbound]
    return out + [(j, partial(judge_copy, of=of),
                   f"its packet and worker {of[0]}'s of the round are one (a copy), so every member replayed it itself")
                  for j, of in sorted(copies.items()) if j not in unbound and j not in extra]


def judge_reported(verify: VerifyConfig, check: RoundCheck, audit: Audit, reported: float, score: float,
                   blame: bool = True) -> None:
    """Judge an audit whose auditor reported `reported`, a failure, by `score`: the judge's own
    replay of it. Failed: the worker is convicted (REPLAY_MISMATCH). Passed: the auditor reported a
    failure that does not reproduce, so the auditor is convicted (FALSE_REPORT) and the worker
    keeps its verdict; with `blame` False (`attributable`) no one is. round.py (every member) and
    audit.py both judge with this."""
    if replay_failed(verify, score):
        check.verdicts[audit.worker] = REPLAY_MISMATCH
        check.evidence[audit.worker] = replay_evidence(verify, audit, score)
        if audit.worker in check.suspects:
            check.evidence[audit.worker]["suspect"] = check.suspects[audit.worker]
        check.accepted.pop(audit.worker, None)
        return
    if not blame:
        check.evidence.setdefault(audit.worker, {})["replayed"] = (
            replay_evidence(verify, audit, score) | {"disputed": True, "state_resent": True})
        return
    prior = check.evidence.get(audit.auditor) if check.verdicts.get(audit.auditor) == FALSE_REPORT else None
    check.verdicts[audit.auditor] = FALSE_REPORT  # (it may have lied as a loss-gain checker too: keep both)
    check.evidence[audit.auditor] = (prior or {}) | {"accused": audit.worker,
                                                     "reported": reported if math.isfinite(reported) else None}
    check.accepted.pop(audit.auditor, None)
    check.evidence.setdefault(audit.worker, {})["replayed"] = replay_evidence(verify, audit, score) | {"disputed": True}

