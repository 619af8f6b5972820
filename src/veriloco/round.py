"""One outer round, top to bottom: the only module where the parts meet.

Commands (see also `veriloco --help`):
    veriloco train                                  # configs/default.toml: 4 workers, this machine
    veriloco train configs/tiny.toml --train.rounds=3 --out runs/try
    veriloco train --resume runs/<run-id>           # continue from the last complete round
    veriloco train --train.mode=ddp                 # the all-reduce-every-step baseline
    veriloco train configs/tiny.toml --topology.stages=2 --topology.microbatches=2  # DiLoCoX pipeline
Several machines (every node runs the same command; RUN_DIR is local to each node):
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m veriloco.run CONFIG.toml --out RUN_DIR
    (with [topology] stages = S, use --nproc-per-node=S: one worker's stages on one node)

A round r on worker w (DiLoCo, Douillard et al. 2023, arXiv 2311.08105; DiLoCoX, 2506.21263):
    1. inner:     H AdamW steps from the start point S_r on batches data.batch(seed, w, r, step)
    2. encode:    delta = S_r - theta_local (+ error feedback) -> codec(s) -> packet -> store
    3. exchange:  start(packet): every worker's packet reaches every worker, each kept separate
    4. decode:    wait(); every received packet is decoded and checked against the model
    5. aggregate: mean of the deltas; outer Nesterov step  G <- outer(G, mean)
    6. record:    checkpoint -> store; eval; one line in rounds.jsonl (rank 0)
All workers run 4-6 on the same inputs, so all derive the same G; step 6 checks it.

`[topology] stages = S > 1` (DiLoCoX's pipeline inside a worker, topology.py): worker w is the S
processes of ranks w*S .. w*S+S-1, each holding one slice of the blocks (build_stage_model) with
its own inner AdamW (PipelineInnerLoop: steps 1 run through the worker's pipeline) and its own
outer optimizer. Steps 2-6 run per slice: stage s's packets, checks, aggregate, outer step and
agreement check stay among the W processes of stage s (its stage group, where a process's index
is its worker). All stages of a worker sign with the worker's key and commit to the same batches,
trace and losses; only the packet and base hash differ. Rank 0 (worker 0, stage 0) gathers its
worker's stage results and records one round: per-stage parts under "stages", and a checkpoint
manifest (the stage checkpoints' digests) as the ledger entry's subject.

`[outer] delay = 0`: S_r = G_r and steps 3-6 of round r finish before round r+1 starts.
`[outer] delay = 1`: the exchange of round r runs while round r+1's inner steps run; steps 4-6
of round r happen at the end of round r+1, so G moves one round late (the canonical G every
worker agrees on, and the ledger records, is this naive one-step-delayed sequence). With the
eager correction (Kale et al. 2025, arXiv 2502.12996) a worker does not start round r+1 from G
alone. Eager updates apply, at the end of each round, the average in which the worker's own
fresh delta replaces its own stale one; summed over the rounds that swap telescopes, so the
eager trajectory is the canonical G plus the worker's newest delta, not yet in any average:
    S_{r+1} = G - c / W * own_delta_r,  c = outer lr * (1 + momentum) (Nesterov), else outer lr
(exact for outer SGD, tests/test_eager.py; with momentum c is the delta's immediate effect).
`correction = "local"` lets the worker's newest delta stand in for the whole missing average,
S_{r+1} = G - c * own_delta_r (an outer step with its own delta as the estimate); measured
closer to delay 0 than "eager" at our scale (README, Communication). S is derived from G and
the worker's own (public) packet, so anyone can recompute it.
`[outer] overlap_steps = tau > 0` (delay 1; Streaming DiLoCo, arXiv 2501.18512): steps 4-6 of
round r run after tau of round r+1's inner steps (`land`), not after all of them. G moves to
G_{r+1}, the worker's params move by G_{r+1} - S_{r+1} (inner.shift_params), and round r+1's
delta is taken from G_{r+1}, its base, as with delay 0; only tau steps ran from the corrected
start point. A replay makes the same move at the same step (replay_run's `land`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from statistics import median_high
from typing import Any

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors import safe_open
from safetensors.torch import load as st_load

from .compress import (
    AdaptiveController,
    Codec,
    ErrorFeedback,
    build_codecs,
    codec_from_spec,
    round_budget_bytes,
)
from .compress.controller import UNLIMITED_BYTES, suggest_inner_steps
from .config import Config, VerifyConfig, codec_specs
from .data import batch_digest
from .exchange import Exchange, ExchangeError, ExchangeHandle
from .hashing import alongside, canonical_json, json_hash, sha256_hex, tensors_hash
from .inner import InnerLoop, Landing, Replicas, Spent, run_steps, shift_params
from .ledger import Ledger, SqliteLedger
from .ledger.entry import ZERO_HASH, entry_bytes, make_entry
from .link import Link, pace
from .membership import GroupComm, PgComm
from .model import model_from
from .outer import OuterOptimizer
from .packet import (
    HEADER_FIXED_BYTES,
    PacketError,
    decode_bundle,
    decode_packet,
    encode_bundle,
    encode_packet,
    header_share,
    packet_codecs,
)
from .pipeline import PipelineEval, PipelineInnerLoop
from .records import RunDir, metrics_of, prune_checkpoints
from .store import LocalStore, StoreError, atomic_write, check_digest, mark_peer, seen_peers
from .task import (
    CorpusTask,
    Task,
    corpus_task_of,
    load_params,
    on_device,
    process_device,
    take_device,
)
from .tensorfile import put_tensors, tensors_digest, write_tensors_file
from .topology import Topology, stage_model
from .verify import ABSENT, ACCEPT, OFFENCES, OTHER_STAGE
from .verify.adversary import Adversary, View, load_adversary
from .verify.aggregate import aggregate as robust_aggregate
from .verify.check import (
    RoundCheck,
    binds_commitment,
    check_round,
    hex_root,
    pooled_copies,
    take_whole_workers,
)
from .verify.commitment import (
    SALT_BYTES,
    Commitment,
    CommitmentError,
    EquivocationDetector,
    SignedCommitment,
    commitment_bytes,
    parse_signed_commitment,
    round_salt,
    sign_commitment,
    sign_reveal,
)
from .verify.identity import (
    derive_worker_key,
    load_private_key,
    public_key_hex,
    sign,
    verify_signature,
)
from .verify.kept import kept_states
from .verify.lossgain import (
    Settled,
    assign_checkers,
    gain_steps,
    reports_to_json,
    settle,
    stage_seed,
)
from .verify.replay import (
    Audit,
    PlanInputs,
    Replayed,
    Replayer,
    attributable,
    exchange_hops,
    from_state,
    hashes_match,
    judge_reported,
    newcomer_audits,
    packet_checkable,
    plain_replayer,
    replay_evidence,
    replay_failed,
    replay_run,
    replay_score,
    replayed_by_all,
    reveals_salts,
    slice_result,
    state_from_bytes,
    state_layout,
    state_nbytes,
    state_ref,
    state_to_bytes,
    unbound_audit,
    unsigned_reveal_action,
    worker_score,
)
from .verify.screen import LossGain


@dataclass
class Worker:
    """Everything one worker process (one stage of one worker) holds across rounds."""

    cfg: Config
    rank: int  # global rank = worker * stages + stage
    topo: Topology
    worker_group: dist.ProcessGroup  # this worker's stages, in stage order (pipeline, gathers)
    stage_group: dist.ProcessGroup  # this stage in every worker, in worker order (agreement, eval)
    task: Task
    run: RunDir
    store: LocalStore
    model: torch.nn.Module
    inner: InnerLoop
    outer: OuterOptimizer
    exchange: Exchange
    encoder: DeltaEncoder
    eval_set: list
    identity: Identity
    ledger: Ledger | None  # the recorder's (rank 0) ledger
    own_decoded: list = field(default_factory=list)  # [this worker's newest decoded delta] (delay 1, adversaries)
    base_hashes: dict = field(default_factory=dict)  # round -> hash of G when its inner steps began
    previous: tuple = ({}, {})  # last round's decoded packet hashes and accepted deltas (replay screen)
    earlier: dict = field(default_factory=dict)  # the round before's accepted deltas (screens_earlier)
    resumed_view: dict | None = None  # delay 1, resumed: the deltas an adversary saw as previous then
    adversary: Adversary | None = None  # set only when this worker is configured to attack
    history: dict = field(default_factory=dict)  # worker -> [its newest decoded delta] (replay starts)
    history_rounds: dict = field(default_factory=dict)  # worker -> the round of its newest delta in history
    bases: dict = field(default_factory=dict)  # round -> G its delta is measured from (replay, loss gains)
    starts: dict = field(default_factory=dict)  # overlap_steps: round -> G when its inner steps began (replay)
    base_momenta: dict = field(default_factory=dict)  # round -> the outer momentum then (replay)
    own_packet: bytes | None = None  # this worker's previous packet (an adversary's view)
    pipe_evals: dict = field(default_factory=dict)  # stages > 1: batch shape -> PipelineEval (pipeline_eval)
    start_states: dict = field(default_factory=dict)  # delay 1: round -> private state as it began (resume)
    resumed_outer: OuterOptimizer | None = None  # delay 1, resumed: G of the last recorded round, set after
    # the first resumed round's inner steps (which began from the G before it), as the interrupted run did
    eval_all: list = field(default_factory=list)  # elastic: the whole eval set, split among a round's members
    defer_entry: bool = False  # elastic: the ledger entry is appended at commit (elastic.py), not here
    applied: int = -1  # elastic: the last round whose outer step G holds
    banned: set = field(default_factory=set)  # workers convicted of an offence (verify.OFFENCES)
    disputes: set = field(default_factory=set)  # (auditor, worker): a private state disputed (disputed_pairs)
    schedule: StepSchedule | None = None  # H of each round (set by setup_worker)
    kept: dict = field(default_factory=dict)  # replay_extent "state": round -> its trace entries' states (KeptStates)
    kept_pool: list = field(default_factory=list)  # keep_states "memory": released states, whose memory is reused
    layout: list = field(default_factory=list)  # replay_extent "state": a sent state's layout (state_layout)
    device: torch.device = torch.device("cpu")  # where the model trains (`[run] device`); G stays on the CPU
    replicas: ReplicaSync | None = None  # [topology] replicas: the worker's other processes, fed each round
    protocol_group: dist.ProcessGroup | None = None  # every process of the round (None: the default group)
    writes_checkpoints: bool = True  # whether this process puts its stage's checkpoints into its store (checkpoint_writer)
    sole_writer: bool = False  # ... and nobody else does: written without looking first (static runs)
    store_mark: int = 0  # store.bytes_written at the last record

    @property
    def is_recorder(self) -> bool:
        return self.rank == 0

    @property
    def worker(self) -> int:
        return self.topo.worker_of(self.rank)

    @property
    def stage(self) -> int:
        return self.topo.stage_of(self.rank)

    @property
    def workers(self) -> int:
        return self.topo.workers


@dataclass
class Participants:
    """Who takes part in a round and how to reach them (static: everyone, the fixed world)."""

    members: list[int]  # workers whose packets the round has, ascending
    comm: GroupComm | PgComm  # this stage's processes of those workers; index = position in members
    stats_comm: GroupComm | PgComm  # every process of those workers (members x stages)
    absent: dict[int, str] = field(default_factory=dict)  # worker -> ABSENT or LATE

    @classmethod
    def everyone(cls, w: Worker) -> Participants:
        return cls(list(range(w.workers)), GroupComm(w.stage_group), GroupComm(w.protocol_group))


@dataclass
class Identity:
    """Who this worker is to the others: run id, its signing key, the admitted public keys."""

    run_id: str
    key: Ed25519PrivateKey
    admitted: dict[int, str]
    equivocation: EquivocationDetector
    # round -> worker -> the store hash of a bundle of the round that it received from that worker and that
    # held no commitment the worker signed for the round (keep_seen): check_bundles' unsigned_earlier
    unsigned: dict[int, dict[int, str]] = field(default_factory=dict)
    # round -> the members of this try of the round (elastic) that were not in its first try whose salts
    # went out (keep_seen): they may have been told those salts before they committed (replay_audits)
    newcomers: dict[int, list[int]] = field(default_factory=dict)


def worker_key(cfg: Config, worker: int) -> Ed25519PrivateKey:
    """Worker `worker`'s signing key: from [verify] key_dir, or derived from the seed (demo)."""
    if cfg.verify.key_dir:
        return load_private_key(Path(cfg.verify.key_dir) / f"worker-{worker}.key")
    return derive_worker_key(cfg.run.seed, worker)


@dataclass
class Sent:
    """What a worker keeps about a round whose exchange is in flight."""

    round: int
    handle: ExchangeHandle
    packet_hash: str
    result: object  # InnerResult
    codec_log: dict
    started: float
    waited_s: float = 0.0  # elastic: time already spent waiting for this round's quorum and exchange
    bundle: bytes | None = None  # what it sent (the exchange hands these very bytes back as its own)
    bundle_hash: str | None = None  # their sha256, the store's name for them
    batch_root: str = ""  # the root of the batches this worker was assigned for the round (the check's for it)


COMMITMENT_RESERVE_BYTES = 4096  # a signed commitment with its trace is 1-3 KB


def run_codecs(cfg: Config) -> frozenset[str]:
    """The codec specs (canonical, as a packet names them) an honest worker of this run encodes
    with: `[compress] codec`, or each rung of the adaptive ladder (check_bundles' `codecs`)."""
    return frozenset(codec_from_spec(x).spec() for x in codec_specs(cfg.compress))


class DeltaEncoder:
    """delta -> packet: a fixed codec or the adaptive controller, with optional error feedback."""

    def __init__(self, cfg: Config, shapes: dict[str, tuple[int, ...]], link: Link | None, workers: int) -> None:
        self.cfg, self.shapes, self.link, self.workers = cfg.compress, shapes, link, workers
        self.hops = exchange_hops(cfg.verify)
        self.feedback = ErrorFeedback() if cfg.compress.error_feedback else None
        if cfg.compress.codec == "adaptive":
            ladder = codec_specs(cfg.compress)
            # the budget covers the wire, not just the payload: charge each tensor its share of the
            # safetensors header (names, dtypes, shapes, offsets, codec spec), as that codec writes it ...
            # (its offsets have at most the digits of 8 bytes an element: no rung sends more)
            digits = len(str(8 * sum(math.prod(s) for s in shapes.values())))
            self.controller: AdaptiveController | None = AdaptiveController(
                ladder, overhead_bytes_per_tensor=partial(header_share, offset_digits=digits))
            self.codecs: dict[str, Codec] = {}
        else:
            self.controller = None
            self.codecs = build_codecs(cfg.compress.codec, shapes)

    def budget(self, compute_s: float) -> int:
        """Packet bytes that fit under `compute_s` of compute on this link."""
        if self.cfg.budget_bytes:
            total = self.cfg.budget_bytes
        elif self.link is None or compute_s <= 0:
            return UNLIMITED_BYTES
        else:
            total = round_budget_bytes(self.link.bandwidth_bps, self.link.latency_s * self.hops, compute_s, self.workers,
                                       self.cfg.safety)
        return max(total - COMMITMENT_RESERVE_BYTES - HEADER_FIXED_BYTES, 0)  # ... the header's own, and the signed commitment

    def encode(self, delta: dict[str, torch.Tensor], compute_s: float) -> tuple[bytes, dict[str, torch.Tensor], dict]:
        """(packet, what receivers will decode from it, codec log)."""
        if self.feedback is not None:
            delta = {k: self.feedback.compensate(k, v) for k, v in delta.items()}
        log: dict = {}
        if self.controller is not None:
            self.codecs, log = self.controller.choose(delta, self.budget(compute_s))
            log = {k: log[k] for k in ("budget_bytes", "total_bytes", "min_bytes", "fits", "codecs")}
        packet = encode_packet(delta, self.codecs)
        decoded = decode_packet(packet, self.shapes, len(packet))
        if self.feedback is not None:
            for k in delta:
                self.feedback.update(k, delta[k], decoded[k])
        return packet, decoded, log

    def adopt(self, encoded: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
        """`sent` (decoded) went out instead of `encoded`, the last packet encode() made
        (round._noted): error feedback keeps what `sent` dropped of the compensated delta, the
        residual moved by what the two packets differ in."""
        if self.feedback is not None:
            for k, v in sent.items():
                self.feedback.update(k, self.feedback.residual(k) + encoded[k], v)

    def _stateful(self) -> dict[tuple[str, str], Codec]:
        """(tensor, spec) -> the codec objects that keep sender state (PowerSGD's warm start)."""
        codecs = self.controller.kept() if self.controller is not None else {(k, c.spec()): c for k, c in self.codecs.items()}
        return {ks: c for ks, c in codecs.items() if hasattr(c, "state_dict")}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What the encoder carries from round to round (a resume restores it): error feedback's
        residuals and the codecs' warm starts."""
        out = {f"feedback/{k}": v for k, v in self.feedback.state_dict().items()} if self.feedback else {}
        for (key, spec), codec in self._stateful().items():
            out |= {f"codec/{spec}/{k}": v for k, v in codec.state_dict().items() if k == key}
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.feedback is not None:
            self.feedback.load_state_dict({k[len("feedback/"):]: v for k, v in tensors.items() if k.startswith("feedback/")})
        for name, v in tensors.items():
            if name.startswith("codec/"):
                spec, key = name[len("codec/"):].split("/", 1)
                codec = self.controller.codec(key, spec) if self.controller is not None else self.codecs[key]
                codec.load_state_dict({key: v})


def check_splittable(task: Task, stages: int) -> None:
    """Only the built-in task's model ([model]) can be cut into pipeline stages; say so before anything starts."""
    if stages > 1 and corpus_task_of(task) is None:
        raise ValueError(
            f"topology.stages = {stages}: a custom Task's model cannot be split into pipeline stages "
            "(only the built-in task's [model] can); set topology.stages = 1"
        )


def inner_loop_of(cfg: Config, task: Task, stage: int, pipeline_group: dist.ProcessGroup | None,
                  device: torch.device, source: CorpusTask | None) -> tuple[torch.nn.Module, InnerLoop]:
    """A process's model (its stage's slice) and inner loop: the same on every replica of it.
    `pipeline_group`: its pipeline's processes in stage order (with stages)."""
    total_steps, stages = cfg.train.rounds * cfg.train.inner_steps, cfg.topology.stages
    if stages == 1:
        model = task.make_model()
        return model, InnerLoop(model, cfg.train, total_steps, task.loss)
    model = stage_model(cfg, stage, stages, device, source.initial_params())  # a stage is the built-in task: its slice of G_0
    return model, PipelineInnerLoop(
        model, cfg.train, total_steps, stage=stage, stages=stages, group=pipeline_group,
        microbatches=cfg.topology.microbatches, schedule=cfg.topology.schedule, device=device,
        groups=cfg.topology.replicas,
    )


def setup_worker(cfg: Config, rank: int, world: int, task: Task, run_dir: str, resume_round: int,
                 elastic: bool = False, process_rank: int | None = None) -> Worker:
    """Build one process's state (one stage of one worker): model slice, optimizers, groups,
    exchange; restore it when resuming. `elastic`: no fixed world (membership.py); the groups
    and the exchange are made per round by the elastic loop (elastic.py). With `[topology]
    replicas`, `rank` and `world` are protocol ranks (replica 0s) and `process_rank` the global one."""
    torch.set_num_threads(cfg.train.threads)
    topo = Topology(cfg.topology.workers, cfg.topology.stages, world, replicas=cfg.topology.replicas)
    worker, stage, stages = topo.worker_of(rank), topo.stage_of(rank), topo.stages
    check_splittable(task, stages)
    source = corpus_task_of(task)  # the built-in task: G_0 may be weights from its store
    device = process_device(cfg, rank if process_rank is None else process_rank)
    take_device(device, cfg.verify.replay_match == "exact")
    task = on_device(task, device, cfg.train.precision)
    run = RunDir(run_dir)
    store = LocalStore(run.store_dir)
    timeout = timedelta(seconds=cfg.run.timeout_s)
    if elastic:
        worker_group = stage_group = exchange_group = None
    else:
        worker_group, stage_group = topo.build_groups(timeout)  # main thread: pipeline, agreement, eval
        _, exchange_group = topo.build_groups(timeout)  # the exchange thread's own stage group
    replica_group = protocol_group = None  # [topology] replicas: made after the two above, as replica_loop does
    if topo.replicas > 1 and elastic:  # the worker's own processes, which it started (elastic.WorkerReplicas)
        replica_group = dist.group.WORLD
    elif topo.replicas > 1:
        replica_group, protocol_group = topo.build_replica_groups(timeout)
        if stages > 1:
            topo.build_pipeline_groups(timeout)  # the other replicas' pipelines (collective)
    model, inner = inner_loop_of(cfg, task, stage, worker_group, device, source)
    if replica_group is not None:
        inner.replicas = Replicas(replica_group, 0, topo.replicas, shard=shards_optimizer(cfg), bucket_bytes=bucket_bytes(cfg))
    outer = OuterOptimizer(dict(model.named_parameters()), cfg.outer)  # this stage's slice of G
    link = Link.paced(cfg.link.bandwidth, cfg.link.latency)
    exchange = None if elastic else Exchange(exchange_group, cfg.run.max_packet_bytes, link=link)
    shapes = {k: tuple(v.shape) for k, v in outer.params.items()}
    encoder = DeltaEncoder(cfg, shapes, link, topo.workers)
    eval_set = task.eval_batches()[worker :: topo.workers]  # the same share on every stage of a worker
    manifest = run.read_manifest()
    if stage_group is not None:
        check_same_run(manifest, stage_group)
    admitted = {int(k): v for k, v in manifest["worker_keys"].items()}
    # a worker's stages share its key: they are one participant, trusted to each other
    identity = Identity(manifest["run_id"], worker_key(cfg, worker), admitted, EquivocationDetector(admitted))
    if public_key_hex(identity.key) != admitted.get(worker):
        raise RuntimeError(f"worker {worker}'s key is not the one the run manifest admits")
    ledger = open_ledger(cfg, run) if rank == 0 or elastic else None  # elastic: whoever commits first records
    w = Worker(cfg, rank, topo, worker_group, stage_group, task, run, store, model, inner, outer, exchange,
               encoder, eval_set, identity, ledger, device=device)
    if replica_group is not None:
        w.replicas, w.protocol_group = ReplicaSync(replica_group, inner), protocol_group
        inner.ask_state = w.replicas.ask_state
    if elastic:
        w.eval_all = task.eval_batches()
    if str(worker) in cfg.adversary:
        w.adversary = load_adversary(cfg.adversary[str(worker)], worker, cfg.run.seed)
    w.schedule = StepSchedule.of(cfg, w.run.rounds()[:resume_round] if resume_round > 0 and cfg.train.inner_steps_max else [])
    if states_sent(cfg):
        w.layout = state_layout(model)
        for stale in run.worker_dir(rank).glob("kept-*.bin"):  # keep_states "disk": an interrupted run's
            stale.unlink()
    if not elastic:  # elastic: whoever commits a round first records it, so every member stores its checkpoint
        w.writes_checkpoints = w.sole_writer = checkpoint_writer(store, stage_group, worker)
    if resume_round > 0:
        restore(w, resume_round)
    return w


def check_same_run(manifest: dict, group: dist.ProcessGroup) -> None:
    """RuntimeError, on every member of `group` (the same stage of every worker), unless all read
    the same run manifest. Under torchrun each machine prepares its own run directory from its
    own config, code and torch (the manifest's `torch_version`); a machine that differs made
    another run id. Such a run stopped after round 0's steps at best, on "workers disagree on the
    global params", which names neither the cause nor the machine."""
    mine = torch.tensor(_hash_words(manifest["run_id"]), dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    odd = [i for i, t in enumerate(every) if not torch.equal(t, every[0])]
    if odd:
        raise RuntimeError(f"the workers' run manifests differ (member {odd[0]} of the stage's group has another "
                           "run id than member 0): every machine must prepare the run from the same config, "
                           f"corpus, veriloco and torch version (this one: torch {manifest.get('torch_version')})")


def checkpoint_writer(store: LocalStore, stage_group: dist.ProcessGroup, worker: int) -> bool:
    """Whether this process stores its stage's round checkpoints: every process of the stage
    computes the same G and outer state, so one copy per store is enough, and the highest worker
    among the stage's processes that share this store writes it (not the recorder's, which has
    the records to write: worker 0's processes only hash the checkpoint its record names, unless
    they have a store of their own). A store is shared by the processes of one machine, and of
    machines that share the run directory; a machine with a run directory of its own writes its
    own copies. Found here by markers: each process leaves one under a random token, and every
    process looks for the others' tokens in its store (collective over the stage group)."""
    token = secrets.token_hex(16)
    marker = mark_peer(store, token)
    try:
        tokens = [p.get("token") for p in _gather_json({"token": token}, stage_group)]  # every marker is there now
        sharing = seen_peers(store, tokens)
        dist.barrier(group=stage_group)  # and every process has looked before any is removed
    finally:
        marker.unlink(missing_ok=True)
    return max(sharing, default=worker) == worker


def carried(rec: dict | None) -> tuple[set[int], set[tuple[int, int]]]:
    """What a round's record carries on to the rounds after it (resume, heal): the workers banned
    so far and the (auditor, worker) pairs whose states go in public (run.check_carried checks them)."""
    rec = rec or {}
    return set(rec.get("banned", [])), {(a, j) for a, j in rec.get("disputes", [])}


def restore(w: Worker, next_round: int) -> None:
    """Load G, outer state and this worker's private state as of the end of round next_round-1.

    With delay 1, round next_round's inner steps began before round next_round-1's outer step
    (its exchange ran under them): the resumed round starts from the G before it (round
    next_round-2's checkpoint, or G_0) with the worker's own delta of next_round-1 as the eager
    correction, and G moves on to round next_round-1's checkpoint once those inner steps are
    done (`resumed_outer`). The private state of a delay-1 run is the one saved as round
    next_round began (finish_round), and the replays of round next_round start from each
    worker's newest decoded delta, as the interrupted run held them (the state's metadata names
    their rounds; the store has their bundles)."""
    cfg = w.cfg
    records = w.run.rounds()
    part = lambda rec: rec["stages"][w.stage] if w.topo.stages > 1 else rec  # noqa: E731 (this stage's slice)
    mine = part(records[next_round - 1])
    outer = _load_checkpoint(w, mine, next_round - 1)
    w.banned, w.disputes = carried(mine)
    # the screen's "previous round": its accepted packets, decoded again from the store
    shapes = {k: tuple(v.shape) for k, v in outer.params.items()}

    def delta_of(j: int, rec: dict = mine) -> dict[str, torch.Tensor]:
        return decode_packet(decode_bundle(w.store.get(rec["bundles"][j]))[1], shapes, cfg.run.max_packet_bytes)

    accepted = [j for j, v in enumerate(mine["verdicts"]) if v == "accept"]
    deltas = {j: delta_of(j) for j in accepted}
    w.previous = ({j: h for j, h in enumerate(mine["packets"]) if h is not None}, deltas)
    if base_lag(cfg) == 1:  # the interrupted run sent round next_round before it had applied next_round-1:
        # round next_round-2's accepted deltas were its newest (an adversary's view, the screen's `earlier`)
        before = part(records[next_round - 2]) if next_round >= 2 and screens_earlier(cfg) else {"verdicts": []}
        w.resumed_view = {j: delta_of(j, before) for j, v in enumerate(before["verdicts"]) if v == "accept"}
        w.earlier = w.resumed_view
    load_seen(w, next_round)
    path = w.run.worker_dir(w.rank) / f"state-{next_round - 1}.safetensors"
    state = st_load(path.read_bytes())
    w.inner.load_state_tensors({k: v for k, v in state.items() if k.startswith("inner/")})
    w.encoder.load_state_tensors(state)
    if not cfg.outer.delay:
        w.outer = outer
        return
    w.resumed_outer = outer
    if next_round >= 2:
        w.outer = _load_checkpoint(w, part(records[next_round - 2]), next_round - 2)
    w.own_packet = decode_bundle(w.store.get(mine["bundles"][w.worker]))[1]
    w.own_decoded = [decode_packet(w.own_packet, shapes, cfg.run.max_packet_bytes)]
    rounds = state_history(path, w.workers, next_round)
    w.history_rounds = rounds
    w.history = {j: [deltas[j] if j in deltas and x == next_round - 1 else delta_of(j, part(records[x]))]
                 for j, x in rounds.items()}


def state_history(path: Path, workers: int, next_round: int, run_id: str | None = None,
                  process: int | None = None) -> dict[int, int]:
    """worker -> the round of its newest decoded delta, from a private state file's metadata
    (finish_round); ValueError naming the file when it is not that (run.resume checks it first):
    with `run_id` and `process`, also when its metadata names another run, process or round (files
    written before the thirty-eighth session name none)."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        raw = meta.get("history", "{}")
        rounds = {int(j): int(x) for j, x in json.loads(raw).items()}
    except Exception as e:  # a torn or foreign file: say which, in one line
        raise ValueError(f"{path} is not a private state file veriloco wrote ({type(e).__name__})") from None
    if run_id is not None and "run_id" in meta:
        want = {"run_id": run_id, "process": str(process), "round": str(next_round - 1)}
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise ValueError(f"{path} is the private state of run {str(got['run_id'])[:16]}, process {got['process']:.8}, "
                             f"round {got['round']:.8}, not of run {run_id[:16]}, process {process}, round {next_round - 1}")
    if any(not (0 <= j < workers and 0 <= x < next_round) for j, x in rounds.items()):
        raise ValueError(f"{path}: its 'history' metadata is not a map of worker -> earlier round: {raw[:80]!r}")
    return rounds


def _load_checkpoint(w: Worker, mine: dict, r: int) -> OuterOptimizer:
    """G and the outer optimizer's state after round r, from the checkpoint its record names."""
    ckpt = st_load(w.store.get(mine["checkpoint"]))
    params = {k[len("param/"):]: v for k, v in ckpt.items() if k.startswith("param/")}
    if tensors_hash(params) != mine["params_hash"]:
        raise RuntimeError(f"checkpoint of round {r} does not match its record")
    outer = OuterOptimizer(params, w.cfg.outer)
    outer.load_state_tensors(ckpt)
    return outer


def evaluate(w: Worker, part: Participants | None = None) -> float:
    """Held-out loss of the global params, averaged over all workers' shares of the eval set
    (elastic: the whole eval set, split among the round's members)."""
    part = part or Participants.everyone(w)
    total = eval_sums(w, part)
    part.comm.all_reduce(total)  # over the workers (each stage sums the same numbers)
    return float(total[0] / total[1])


def eval_sums(w: Worker, part: Participants) -> torch.Tensor:
    """This worker's share of `evaluate`: [sum of loss * target tokens, target tokens], float64."""
    load_params(w.model, w.outer.params)
    total = torch.zeros(2, dtype=torch.float64)  # [sum of loss * target tokens, target tokens]
    share = w.eval_all[part.comm.rank :: part.comm.size] if w.eval_all else w.eval_set
    if w.topo.stages == 1:
        with torch.no_grad():
            for x, y in share:
                total[0] += float(w.task.loss(w.model, x, y)) * y.numel()
                total[1] += y.numel()
    elif w.eval_set:  # forward through the worker's pipeline; every stage gets the worker's loss
        loss = pipeline_eval(w, w.eval_set)
        tokens = sum(y.numel() for _, y in w.eval_set)
        total += torch.tensor([loss * tokens, tokens], dtype=torch.float64)
    return total


def pipeline_eval(w: Worker, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The whole model's mean loss over `batches` through this worker's pipeline, at the params its
    stage model holds (collective over the worker's stages); one schedule per batch shape, kept."""
    shape = tuple(batches[0][0].shape) if batches else ()
    if shape not in w.pipe_evals:
        w.pipe_evals[shape] = PipelineEval(w.model, w.worker_group, stage=w.stage, stages=w.topo.stages,
                                           microbatches=w.cfg.topology.microbatches, device=w.device)
    return w.pipe_evals[shape](batches)


def start_point(cfg: Config, G: dict[str, torch.Tensor], own: list, workers: int,
                momentum: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """S_r: the canonical G, plus the correction when the exchange runs one round late.

    `own`: [the worker's own newest decoded delta] (public: its packet), or [] before it has one:
    round r-1's, in no average G holds yet (module docstring).
    `momentum`: the outer optimizer's buffers with G (OuterOptimizer.state_tensors, public: in
    the checkpoint). With `[outer] lookahead`, S_r is G after a dry run of the outer step that G
    still lacks, with the correction's estimate (own/W for eager, own for local) standing in for
    the missing average: Nesterov moves G by lr ((1 + mu) avg + mu^2 m), heavy ball by
    lr (avg + mu m), and the m part is known exactly. Without it, only the avg part is taken."""
    if not (cfg.outer.delay and cfg.outer.correction in ("eager", "local") and own):
        return G
    o = cfg.outer
    c = o.lr * (1 + o.momentum) if o.nesterov else o.lr
    if cfg.outer.correction == "eager":
        c /= workers  # its own share of the missing average; "local": its delta for the whole average
    fresh = own[-1]
    out = {k: G[k] - c * fresh[k] for k in G}
    if o.lookahead and o.momentum > 0 and momentum:
        m_coef = o.lr * (o.momentum**2 if o.nesterov else o.momentum)
        for k in out:
            buf = momentum.get(f"outer/{k}/momentum")
            if buf is not None:
                out[k] = out[k] - m_coef * buf
    return out


def base_lag(cfg: Config) -> int:
    """How many rounds older than round r-1's update the G is that round r's delta is measured from
    (its base): the delay, unless the update lands inside round r (`overlap_steps`), where the
    base is the G after round r-1 as with delay 0 (the start point S_r still lags by the delay)."""
    return 0 if cfg.outer.overlap_steps else cfg.outer.delay


def screens_earlier(cfg: Config) -> bool:
    """Whether the screen also compares a round's deltas with the round before the previous one:
    with the update a whole round late, a worker sends round r before it has applied round r-1,
    so the newest deltas it could resubmit (stale) or copy are round r-2's (fixed membership)."""
    return base_lag(cfg) == 1 and cfg.run.membership == "static"


def lookahead_momentum(cfg: Config, outer: OuterOptimizer) -> dict[str, torch.Tensor] | None:
    """A copy of the outer momentum when start_point's lookahead needs it (delay 1, lookahead on,
    momentum > 0), else None: a model-sized copy per round is not made for nothing."""
    o = cfg.outer
    return outer.state_tensors() if o.delay and o.lookahead and o.momentum > 0 else None


def private_state(w: Worker, copy: bool = True) -> dict[str, torch.Tensor]:
    """This process's private state (inner AdamW, error feedback, codec warm starts): what a resume
    needs. Copied; with `copy=False` the live tensors (twice the model and more not allocated), for a
    caller that is done with them before the next inner step or encode."""
    if not copy:
        return w.inner.state_views() | w.encoder.state_tensors()
    return w.inner.state_tensors() | {k: v.clone() for k, v in w.encoder.state_tensors().items()}  # the first are copies


def run_inner_and_send(w: Worker, r: int, land: Callable[[float], None] | None = None,
                       poll: Callable[[], None] | None = None) -> Sent:
    """Steps 1-3 of round r: inner steps from S_r, encode the delta, start the exchange.

    `land(seconds)` (`[outer] overlap_steps` = tau > 0): called before inner step tau with the
    seconds of the steps so far; it moves G (finishes the round in flight). The params then move
    by as much as G moved from S_r, and this round's delta is taken from the new G, its base.
    `poll()`: called after every inner step (train_worker records a round whose figures arrived)."""
    t0, cfg, adv = time.perf_counter(), round_cfg(w.cfg, w.schedule.at(r)), w.adversary or Adversary(w.worker, 0)
    w.inner.total_steps = w.schedule.total(r)
    w.inner.round_start = w.schedule.before(r)  # the per-round LR ramp's origin
    if cfg.outer.delay:  # finish_round(r - 1), which runs after this round's inner steps, saves it
        w.start_states[r] = private_state(w)
    keep = cfg.verify.replay_probability > 0 or cfg.verify.loss_gain_batches
    momentum = lookahead_momentum(cfg, w.outer)

    def take_base() -> None:  # what this round's delta is measured from: G now
        w.base_hashes[r] = w.outer.params_hash()
        if keep:
            w.bases[r] = {k: v.clone() for k, v in w.outer.params.items()}

    if keep:
        w.base_momenta[r] = momentum
    start = start_point(cfg, w.outer.params, w.own_decoded, w.workers, momentum)
    landing = None
    if land is None:
        take_base()
    else:  # G moves in place when it lands: keep what S_r was
        start = {k: v.clone() for k, v in start.items()}
        if keep:
            w.starts[r] = {k: v.clone() for k, v in w.outer.params.items()}

        def move() -> None:
            mine = {k: p.detach().clone() for k, p in w.model.named_parameters()}
            land(time.perf_counter() - t_inner)  # may load other params into w.model (eval, loss gains)
            load_params(w.model, mine)
            shift_params(w.model, w.outer.params, start)
            take_base()
            if w.replicas is not None:
                w.replicas.landed()

        landing = Landing(cfg.outer.overlap_steps, move)
    load_params(w.model, start)
    if cfg.train.inner_state == "reset":
        w.inner.reset_state()
    k = cfg.verify.trace_every or cfg.train.inner_steps
    if w.adversary is not None:  # what an honest trace holds at this round's H
        w.adversary.params["_trace_entries"] = str(trace_entries(cfg))
    steps = adv.inner_steps(r, cfg.train.inner_steps)  # an adversary may skip work ...
    t_inner = time.perf_counter()
    if states_sent(cfg):  # the state behind each trace entry, for the auditor of one of its segments
        if r in w.kept:  # an elastic retry of the round: its first try's states are done with
            w.kept.pop(r).release()
        w.inner.keep = kept_states(cfg.verify.keep_states, w.layout, w.kept_pool,
                                   w.run.worker_dir(w.rank) / f"kept-{r}.bin")
    if w.replicas is not None:  # the worker's other processes run these steps with it
        w.replicas.begin(r, steps, k)
    result = w.inner.run(lambda step: adv.batch(r, step, *w.task.batch(w.worker, r, step)), steps, trace_every=k,
                         land=landing, poll=poll)
    if w.inner.keep is not None:
        w.kept[r], w.inner.keep = w.inner.keep, None
    if steps < cfg.train.inner_steps:  # ... and keep the LR schedule as if it had not
        w.inner.step_count += cfg.train.inner_steps - steps
    base = start if land is None else w.outer.params
    seen = w.previous[1] if w.resumed_view is None else w.resumed_view
    w.resumed_view = None
    view = View(w.workers, seen, w.own_packet, w.own_decoded[-1] if w.own_decoded else None)
    with torch.no_grad():
        delta = adv.delta(r, {key: base[key] - p.detach().cpu() for key, p in w.model.named_parameters()}, view)
    # the budget hides the exchange under the next round's inner steps (measured: this round's), or
    # under the first overlap_steps of them, after which the update must land
    window_s = result.seconds * (cfg.outer.overlap_steps or steps) / max(steps, 1)
    before = sent_note(w, r)  # a redo of a round whose bundle went out (a restart): the same budget
    if before is not None:
        window_s = before["window_s"]
    packet, decoded, codec_log = w.encoder.encode(delta, window_s)
    packet = adv.packet(r, packet, view)
    if w.adversary is not None:  # what receivers decode is what it really sent
        decoded = decode_packet(packet, w.encoder.shapes, len(packet) + 1)
    # start_point (delay 1) and an adversary's view read the newest; at delay 0 nothing else would
    w.own_decoded = [decoded] if cfg.outer.delay or w.adversary is not None else []
    w.own_packet = packet if w.adversary is not None else None  # read by nothing else: not kept a round
    packet_hash = sha256_hex(packet)  # stored inside its bundle (finish_round), not a second time on its own
    own_root = batch_root(w.task, w.worker, r, cfg.train.inner_steps)  # the round's check takes it from Sent
    losses = [sum(result.losses[i : i + k]) / len(result.losses[i : i + k]) for i in range(0, len(result.losses), k)]
    commitment = {
        "run_id": w.identity.run_id, "round": r, "worker": w.worker, "base_hash": w.base_hashes[r],
        "batch_root": own_root,
        "trace_root": hex_root(result.trace), "trace": list(result.trace), "losses": losses or [0.0],
        "packet_hash": packet_hash, "packet_bytes": len(packet), "codec": packet_codecs(packet),
    }
    salt = round_salt(w.identity.key, w.identity.run_id, r, w.stage)  # revealed once every bundle is in
    commitment["salt_hash"] = sha256_hex(salt)
    commitment = adv.commitment(r, commitment)
    own_commitment = Commitment.from_dict(commitment)
    signed = canonical_json(sign_commitment(own_commitment, w.identity.key))
    second = adv.second_commitment(r, commitment)
    extras = (canonical_json(sign_commitment(Commitment.from_dict(second), w.identity.key)),) if second else ()
    bundle = adv.bundle(r, encode_bundle(signed, packet, extras), view)
    # stored by its sender before anyone has it, so a receiver that shares the store finds it there
    # and writes nothing (finish_round's put); one copy of each bundle per store, not one per process
    bundle_hash = w.store.put(bundle)
    held = getattr(w.exchange, "holds", False)  # elastic: it goes out once the round's quorum forms (mark_out)
    if before is not None and before["bundle"] != bundle_hash and before["out"]:  # the others may hold the noted one
        bundle, bundle_hash, own_commitment, packet = _noted(w, r, before["bundle"])
        packet_hash, codec_log = sha256_hex(packet), before["codec_log"]
        write_sent_note(w, r, before["window_s"], bundle_hash, codec_log, out=True, resent=True)
        sent = decode_packet(packet, w.encoder.shapes, len(packet) + 1)
        w.encoder.adopt(decoded, sent)
        if w.own_decoded:
            w.own_decoded = [sent]
    elif before is None or before["bundle"] != bundle_hash:  # first made, or noted but never sent (other work now)
        write_sent_note(w, r, window_s, bundle_hash, codec_log, out=not held)
    reveal = None
    if reveals_salts(cfg.verify):  # sent once every bundle is in, signed for the commitment it opens
        reveal = sign_reveal(w.identity.key, sha256_hex(commitment_bytes(own_commitment)),
                             adv.reveal(r, salt)[:SALT_BYTES].ljust(SALT_BYTES, b"\0"))
    handle = w.exchange.start(bundle, reveal=reveal, on_packets=partial(keep_seen, w, round=r) if reveal is not None else None)
    return Sent(r, handle, packet_hash, result, codec_log, t0, bundle=bundle, bundle_hash=bundle_hash,
                batch_root=own_root)


def sent_note(w: Worker, r: int) -> dict | None:
    """What this worker noted of round r's bundle before it went out (write_sent_note), or None.

    A worker killed after its bundle left, and started again (elastic `[run] max_restarts`, a
    `restart` fault, a resumed run), redoes the round from its saved state. The others may hold
    the commitment it sent: a different one would be equivocation (EQUIVOCATION, both signed),
    and until the fortieth session the adaptive codec, whose budget follows the measured
    seconds of the inner steps, chose other rungs on the redo, so every restarted honest worker
    equivocated. The redo now encodes under the noted budget window, so the same state makes the
    same bundle; where it still differs (a delta or inner steps that do not reproduce: a GPU's
    nondeterministic kernels; a redo from another start), run_inner_and_send sends the noted
    bundle again (`_noted`) if it went out (`out`: an elastic worker notes a bundle as it is
    made and holds it for the round's quorum, mark_out). A note of a bundle that never went out
    binds nothing: the redo's goes out (the review's case, fortieth session: with delay 1 a
    worker left out of the round before heals and redoes the held round from another start, and
    its held bundle, sent instead, was convicted of replay_mismatch)."""
    path = w.run.worker_dir(w.rank) / f"sent-{r}.json"
    note = _read_note(path)
    if note is None:
        return None
    ok = (isinstance(note, dict) and type(note.get("round")) is int and note["round"] == r
          and type(note.get("window_s")) in (int, float)
          and math.isfinite(note["window_s"]) and note["window_s"] >= 0 and isinstance(note.get("codec_log"), dict)
          and isinstance(note.get("out"), bool) and _hex64(note.get("bundle")))
    if not ok:
        raise RuntimeError(f"{path}: not a note of round {r}'s bundle (round, window_s, bundle, codec_log, out)")
    return note


def write_sent_note(w: Worker, r: int, window_s: float, bundle_hash: str, codec_log: dict, out: bool,
                    resent: bool = False) -> None:
    """Note round r's bundle (its store hash) and the budget window it was encoded under, before it
    goes out (sent_note; `out`: it goes out now, not held for a quorum); the note of round r-2
    goes (a redo is of the round in flight, or with delay 1 of the one before it). `resent`: a
    redo sent it again (_noted), as the note says."""
    d = w.run.worker_dir(w.rank)
    d.mkdir(parents=True, exist_ok=True)
    note = {"round": r, "window_s": window_s, "bundle": bundle_hash, "codec_log": codec_log, "out": out, "resent": resent}
    atomic_write(d / f"sent-{r}.json", json.dumps(note).encode())
    (d / f"sent-{r - 2}.json").unlink(missing_ok=True)


def mark_out(w: Worker, r: int, bundle_hash: str) -> None:
    """An elastic worker's held bundle of round r goes out now (its quorum formed): its note says
    so, so that a redo after a restart sends it again (sent_note)."""
    note = sent_note(w, r)
    if note is not None and not note["out"] and note["bundle"] == bundle_hash:
        write_sent_note(w, r, note["window_s"], note["bundle"], note["codec_log"], out=True, resent=note.get("resent") is True)


def keep_seen(w: Worker, packets: list, rank: int, members: list[int] | None = None, round: int | None = None,
              first_try: Callable[[list[int]], list[int] | None] | None = None) -> None:
    """Exchange.on_packets: write down the round's signed commitments this worker received
    (RUN/workers/W/seen-R.json), once every bundle is in and before its own reveal goes out;
    load_seen gives them back to its equivocation detector when it redoes the round. The round
    is its own bundle's (packets[rank]); another's bundle cannot name it (the second review: a
    bundle that claimed this worker's name and round 9 made it write seen-9 and keep nothing of
    the round being exchanged); `round` names it where the caller knows it (its own bundle may be
    junk: an adversary's, which notes itself as one). `members`: the worker of each rank
    (elastic: the try's members; by default rank = worker).

    A worker that has seen every salt can kill the run (its own process: a static run stops) and
    commit anew in the resumed round with a salt chosen so that the draw passes it over. An
    elastic worker restarted after a failed try forgot the commitments `elastic._pin` had kept.
    Until the fortieth session both forgot what they had been sent; now a second commitment
    is an equivocation (both signed) for every member that received the first.

    A sender whose bundle holds no commitment it signed for this run and round (junk) is bound
    by nothing, yet it receives every salt too (the reveal waits for every bundle to arrive, not
    to verify). Its bundle goes into the store and the note names it (`unsigned`: worker -> store
    hash), so that in a redo it is unbound: out of the round's seed, and replayed by every member
    that noted it, or rejected where the run does not replay (check_bundles' unsigned_earlier;
    forty-first session: until then it could commit in the redo with a salt ground against the
    salts it had seen, and skim unreplayed).

    A worker that joins an elastic retry of the round is bound by its new commitment, but a
    member of the first try may have passed it every salt of that try (which the retry reveals
    again), so it could choose the retry's draw. The note keeps the members of the first try of
    the round this worker took part in (`members`, its own view then); the members of this try
    not among them are its `newcomers` (Identity.newcomers: replay_audits). A worker without such
    a note (in its first try of the round, or in a retry it joined: it cannot tell which) takes
    the first try's members from `first_try` (elastic: Membership.first_try, the coordinator's
    key, first writer wins), or, where that is no answer, its own try's. Anyone can write that
    key, so a note records no member but the worker's own view: the key can mislead a worker
    that joined a retry, never the first try's members, who replay a newcomer whatever it says
    (and where their verdicts then differ, the round's agreement check stops the run)."""
    def parsed(data) -> tuple[bytes, SignedCommitment] | None:
        try:
            raw = decode_bundle(data, view=True)[0]
            return bytes(raw), parse_signed_commitment(raw)
        except (PacketError, CommitmentError):
            return None

    seen = [parsed(data) for data in packets]  # (each bundle parsed once: this runs between packets and reveal)
    own = seen[rank][1].commitment if seen[rank] is not None else None
    if round is None and (own is None or own.run_id != w.identity.run_id):  # its own bundle is not one (an adversary's)
        return
    r = own.round if round is None else round
    kept = [(s.commitment.round, raw.decode()) for raw, s in filter(None, seen) if s.commitment.run_id == w.identity.run_id]
    workers = range(len(packets)) if members is None else members
    unsigned = {j: w.store.put(bytes(data)) for j, data, x in zip(workers, packets, seen, strict=True)
                if x is None or not binds_commitment(x[1], run_id=w.identity.run_id, round=r, worker=j,
                                                     admitted_keys=w.identity.admitted)}
    d = w.run.worker_dir(w.rank)
    d.mkdir(parents=True, exist_ok=True)
    # its own too: the redo of an honest worker sends the same (sent_note), and a worker that
    # commits anew then convicts itself as every other member does (the params stay agreed).
    # An elastic retry of the round adds to what the failed try brought (a second commitment
    # of a sender is the evidence, not a replacement of the first)
    texts, earlier, first = _seen_note(d / f"seen-{r}.json", r) or ([], {}, None)
    texts += [text for q, text in kept if q == r and text not in texts]
    unsigned |= earlier  # (a sender's first junk of the round stays)
    if members is not None and first_try is not None:  # its own note first: the coordinator's key anyone can write
        noted, first = first, first if first is not None else list(members)  # the note: its own view, never the key's
        told = first_try(first)  # (what it knows, where the key is new)
        known = noted if noted is not None else told if told is not None else first
        w.identity.newcomers = {q: v for q, v in w.identity.newcomers.items() if r - 1 <= q != r} | {
            r: [j for j in members if j not in known]}
    note = {"round": r, "commitments": texts} | ({"unsigned": {str(j): h for j, h in sorted(unsigned.items())}} if unsigned else {}) | (
        {"members": first} if first is not None else {})
    atomic_write(d / f"seen-{r}.json", json.dumps(note).encode())
    (d / f"seen-{r - 2}.json").unlink(missing_ok=True)
    _remember_unsigned(w, r, unsigned)


def _remember_unsigned(w: Worker, r: int, unsigned: dict[int, str]) -> None:
    """Round r's junk senders (keep_seen) for this process's checks; rounds before r-1 are done."""
    for q in [q for q in list(w.identity.unsigned) if q < r - 1]:  # (an elastic flight's thread may note too)
        w.identity.unsigned.pop(q, None)
    if unsigned:
        w.identity.unsigned[r] = dict(unsigned)


def load_seen(w: Worker, r: int) -> None:
    """The commitments of round r and later this worker received before it was stopped
    (keep_seen), into its equivocation detector, and the senders whose bundle held no signed
    commitment, when it redoes them from round r (a resume, a restart; with delay 1 a process
    can have exchanged a round past the last recorded one's next)."""
    for path in sorted(w.run.worker_dir(w.rank).glob("seen-*.json")):
        q = path.name[len("seen-"):-len(".json")]
        if not (q.isascii() and q.isdigit()) or int(q) < r:
            continue
        texts, unsigned, _ = _seen_note(path, int(q)) or ([], {}, None)
        for text in texts:
            try:
                signed = parse_signed_commitment(text.encode())
            except CommitmentError:
                continue
            if signed.commitment.run_id == w.identity.run_id and signed.commitment.round == int(q):
                w.identity.equivocation.observe(signed)  # (a signature that does not verify counts for nothing)
        if unsigned:
            w.identity.unsigned[int(q)] = unsigned


def _hex64(x: Any) -> bool:
    """Whether `x` is a sha256 as the store names blobs (store.check_digest)."""
    try:
        check_digest(x)
    except StoreError:
        return False
    return True


def _read_note(path: Path) -> Any:
    """A worker's own note (sent_note, keep_seen) as JSON, or None when there is none; one line
    naming the file when it cannot be read."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{path}: unreadable ({e})") from None


def _seen_note(path: Path, r: int) -> tuple[list[str], dict[int, str], list[int] | None] | None:
    """The commitments a seen note holds (keep_seen), its junk senders (worker -> store hash) and
    the members of the round's first try (elastic; else None), or None when there is none."""
    note = _read_note(path)
    if note is None:
        return None
    unsigned = note.get("unsigned", {}) if isinstance(note, dict) else None
    members = note.get("members") if isinstance(note, dict) else None
    if not (isinstance(note, dict) and type(note.get("round")) is int and note["round"] == r
            and isinstance(note.get("commitments"), list)
            and all(isinstance(t, str) for t in note["commitments"])
            and isinstance(unsigned, dict) and all(k.isascii() and k.isdigit() and len(k) <= 10 and _hex64(h) for k, h in unsigned.items())
            and (members is None or isinstance(members, list) and all(type(j) is int and j >= 0 for j in members))):
        raise RuntimeError(f"{path}: not a list of round {r}'s commitments (round, commitments, unsigned, members)")
    return note["commitments"], {int(k): h for k, h in unsigned.items()}, members


def _noted(w: Worker, r: int, bundle_hash: str) -> tuple[bytes, str, Commitment, bytes]:
    """The bundle of round r this worker sent before a restart (sent_note), from the store:
    (bundle, its hash, its commitment, its packet)."""
    try:
        bundle = w.store.get(bundle_hash)
        signed, packet, _ = decode_bundle(bundle)
        commitment = parse_signed_commitment(signed).commitment
    except (StoreError, PacketError, CommitmentError) as e:
        raise RuntimeError(f"worker {w.worker}: round {r}'s noted bundle {bundle_hash[:12]} cannot be read ({e}); "
                           f"its redo made another one, and sending that would be equivocation") from None
    if (commitment.run_id, commitment.round, commitment.worker) != (w.identity.run_id, r, w.worker):
        raise RuntimeError(f"worker {w.worker}: round {r}'s note names a bundle that is not its own for the round")
    print(f"worker {w.worker}: round {r}'s redo made another bundle than the one it sent before its restart; "
          f"sending that one again", file=sys.stderr, flush=True)
    return bundle, bundle_hash, commitment, packet


def loss_gain_fn(w: Worker, r: int):
    """The screen's loss-gain check for round r on this worker (see make_loss_gain)."""
    return make_loss_gain(w.task, w.model, w.bases.get(r, w.outer.params), r, w.cfg.verify.loss_gain_batches,
                          w.schedule.at(r))


def timed_loss_gain(w: Worker, r: int, spent: Spent):
    """loss_gain_fn(w, r) that adds the time each call takes to `spent`."""
    gain = loss_gain_fn(w, r)

    def timed(j: int, delta: dict[str, torch.Tensor], seed: str) -> LossGain:
        with spent.timing():
            return gain(j, delta, seed)

    return timed


def make_loss_gain(task: Task, model: torch.nn.Module, G_r: dict[str, torch.Tensor], r: int, n: int, steps: int):
    """gain(j, delta, seed): loss of G_r and of G_r - delta on n of worker j's `steps` batches of
    round r, the ones lossgain.gain_steps draws from the round's screen seed. Deterministic, so
    every worker (and the audit) computes the same numbers."""

    def loss_at(params: dict[str, torch.Tensor], j: int, at: list[int]) -> float:
        load_params(model, params)
        with torch.no_grad():
            return sum(float(task.loss(model, *task.batch(j, r, s))) for s in at) / len(at)

    def gain(j: int, delta: dict[str, torch.Tensor], seed: str) -> LossGain:
        at = gain_steps(seed, steps, n)
        before = loss_at(G_r, j, at)
        after = loss_at({k: G_r[k] - delta[k] for k in G_r}, j, at)
        return LossGain.on_own_batches(before, after)

    return gain


def loss_gain_checkers(v: VerifyConfig) -> int:
    """How many checkers compute each packet's loss gain this run (lossgain.py); 0 = every worker
    computes every gain, as when a failed test rejects (a checker's word must then not matter)."""
    return v.loss_gain_checkers if v.loss_gain_batches and loss_gain_action(v) == "audit" else 0


def loss_gains_for(w: Worker, r: int, part: Participants, spent: Spent) -> tuple[Any, Any]:
    """check_round's (loss_gain_of, loss_gains_of) for round r on this process: none without the
    loss-gain screen; through the worker's pipeline with stages; shared among checkers when
    there are checkers; else every gain computed here. Adds the time they take to `spent`."""
    if not w.cfg.verify.loss_gain_batches:
        return None, None
    if w.topo.stages > 1:
        return None, StageLossGains(w, r, part, spent)
    gain = timed_loss_gain(w, r, spent)
    return (None, SharedLossGains(w, r, part, gain)) if loss_gain_checkers(w.cfg.verify) else (gain, None)


def shared_gains(w: Worker, r: int, part: Participants, gain, workers: list[int], seed: str, banned: set[int],
                 agree=None) -> Settled:
    """The gains of `workers`' packets settled among checkers (lossgain.py): the checkers drawn from
    `seed` among the members not in `banned` compute theirs with `gain(j)`, every member gathers
    the reports (over this stage's processes; `agree(table)` may then replace the gathered
    [member, worker, 3] table in place), and settles them, computing with `gain` what it must."""
    members = part.members
    checkers = assign_checkers(seed, workers, [m for m in members if m not in banned], loss_gain_checkers(w.cfg.verify))
    mine = torch.zeros((w.workers, 3), dtype=torch.float64)  # [reported?, own_before, own_after]
    for j in workers:
        if w.worker not in checkers[j]:
            continue
        g: LossGain | None = gain(j)
        if w.adversary is not None:
            g = w.adversary.loss_gain_report(r, j, g)
        if g is not None:
            mine[j] = torch.tensor([1.0, g.own_before, g.own_after], dtype=torch.float64)
    table = torch.stack(signed_gather(w, part, r, "loss-gain reports", mine))
    if agree is not None:
        agree(table)
    reports = {c: {j: LossGain.on_own_batches(float(t[j, 1]), float(t[j, 2]))
                   for j in workers if c in checkers[j] and t[j, 0] == 1.0}
               for c, t in zip(members, table, strict=True)}
    settled = settle(workers, checkers, reports, gain, w.cfg.verify.loss_gain_floor)
    settled.record = reports_to_json(checkers, reports)
    return settled


class StageLossGains:
    """check_round's `loss_gains_of` for a pipelined worker (`[topology] stages > 1`): each gain is
    the whole model's, the losses of G_r and of G_r - delta on the n of the sender's batches that
    gain_steps draws, computed through this worker's pipeline (pipeline_eval: every stage takes part, each
    with its slice of G_r and of the delta), so all of a worker's stages get the same numbers.
    Gains are computed for the senders whose every slice this worker decoded; any other
    sender's update is refused whole (check.take_whole_workers), so its slices need none.

    With checkers (`loss_gain_checkers` > 0) they are shared as without stages (shared_gains).
    A worker's stages must run the same pipelines in the same order, so they pool what decides
    which: the senders (as above), the screen seed (each stage's, in stage order:
    lossgain.stage_seed), the banned (any stage's) and the reports, which every stage takes as
    its stage 0 gathered them (a checker that tells another worker's stages different numbers
    cannot split them). Without checkers every worker computes every gain."""

    def __init__(self, w: Worker, r: int, part: Participants, spent: Spent) -> None:
        self.w, self.r, self.part, self.spent = w, r, part, spent
        self.n = w.cfg.verify.loss_gain_batches

    def loss(self, params: dict[str, torch.Tensor], j: int, at: list[int]) -> float:
        w = self.w
        load_params(w.model, params)
        return pipeline_eval(w, [w.task.batch(j, self.r, s) for s in at])

    def __call__(self, decoded: dict[int, dict[str, torch.Tensor]], seed: str) -> Settled:
        with self.spent.timing():
            return self._settle(decoded, seed)

    def _settle(self, decoded: dict[int, dict[str, torch.Tensor]], seed: str) -> Settled:
        w, G_r = self.w, self.w.bases[self.r]
        pooled = _gather_json({"decoded": sorted(decoded), "seed": seed, "banned": sorted(w.banned)}, w.worker_group)
        workers = sorted(set.intersection(*(set(p["decoded"]) for p in pooled)))
        pooled_seed = stage_seed([p["seed"] for p in pooled])
        at = gain_steps(pooled_seed, w.schedule.at(self.r), self.n)  # the same batches on every stage

        def gain(j: int) -> LossGain:
            return LossGain.on_own_batches(self.loss(G_r, j, at), self.loss({k: G_r[k] - decoded[j][k] for k in G_r}, j, at))

        def agree(table: torch.Tensor) -> None:
            dist.broadcast(table, group=w.worker_group, group_src=0)

        if loss_gain_checkers(w.cfg.verify):
            banned = set().union(*(p["banned"] for p in pooled))
            return shared_gains(w, self.r, self.part, gain, workers, pooled_seed, banned, agree)
        return Settled({j: gain(j) for j in workers})


class SharedLossGains:
    """check_round's `loss_gains_of` for round r on this worker: computes with `gain` (j, delta)
    the gains of the packets it is drawn to check, gathers every member's reports, settles them
    (shared_gains)."""

    def __init__(self, w: Worker, r: int, part: Participants, gain) -> None:
        self.w, self.r, self.part, self.gain = w, r, part, gain

    def __call__(self, decoded: dict[int, dict[str, torch.Tensor]], seed: str) -> Settled:
        return shared_gains(self.w, self.r, self.part, lambda j: self.gain(j, decoded[j], seed), sorted(decoded), seed,
                            self.w.banned)


def replay_audits(w: Worker, r: int, check: RoundCheck, base_hash: str, part: Participants) -> Spent:
    """Sampled replays of round r (and of the screen's suspects): the assigned auditor redoes the
    worker's round from public data and compares (trace hashes bit for bit, or the delta within a
    distance: `[verify] replay_match`); every worker learns the auditor's number. A reported
    failure convicts no one on one auditor's word: every member replays that round itself and
    judges by its own number, so an honest majority's verdicts agree; if the replay passes, the
    auditor lied and is convicted (FALSE_REPORT). With `[verify] replay_extent = "state"` a drawn
    segment is replayed from its start state, which the worker sends (`StateMoves`). Returns the
    time this worker spent replaying, and the states moved."""
    cfg = round_cfg(w.cfg, w.schedule.at(r))
    plan = PlanInputs.of_round(base_hash, check, w.banned)
    if w.topo.stages > 1:  # a replay runs through all of a worker's stages: they must draw one plan
        plan = PlanInputs.pooled(_gather_json(plan.to_json(), w.worker_group))
    audits = plan.audits(cfg.verify, cfg.train, part.members)
    extra = newcomer_audits(cfg.verify, cfg.train, base_hash, check, w.banned, part.members,
                            check.newcomers) if check.newcomers else {}
    G_r, spent, mine = w.bases.get(r), Spent(), {}
    replayer = replayer_of(w)
    land = (cfg.outer.overlap_steps, G_r) if cfg.outer.overlap_steps else None  # G_r landed mid-round
    moves = StateMoves(w, r, part)
    for a in audits:  # replay_extent "state": each drawn segment's start state, worker -> its auditor
        if from_state(cfg.verify, a):
            with spent.timing():  # (a replay's cost: moving, checking and storing its state too)
                moves.send(a, check)

    def replay(a: Audit) -> float:  # this worker's own replay of audit a
        with spent.timing():
            own = w.history.get(a.worker, []) if cfg.outer.delay else []
            signed = check.commitments[a.worker].commitment
            state = moves.received.get(a.worker) if from_state(cfg.verify, a) else None
            if from_state(cfg.verify, a) and state is None:
                return float(a.segment)  # no state that hashes to the segment's start in the trace
            start = start_point(cfg, w.starts[r] if land else G_r, own, w.workers, w.base_momenta.get(r))
            run = lambda: replay_run(cfg.verify, replayer, cfg.train, start, r,  # noqa: E731
                                     lambda step, j=a.worker: w.task.batch(j, r, step), a, land,
                                     steps_before=w.schedule.before(r), total_steps=w.schedule.total(r), state=state)
            committed = check.decoded[a.worker]
            codecs = replay_codecs(cfg, signed, committed)
            if w.topo.stages == 1:
                return replay_score(cfg.verify, run, list(signed.trace), committed, codecs)
            return stage_replay_score(w, run(), list(signed.trace), committed, codecs)

    scores = torch.full((w.workers,), math.nan, dtype=torch.float64)  # NaN: not replayed here
    for a in audits:
        if a.auditor == w.worker and G_r is not None:
            mine[a.worker] = replay(a)
            scores[a.worker] = w.adversary.audit_report(r, a.worker, mine[a.worker]) if w.adversary else mine[a.worker]
    # the auditor's number reaches everyone: each member's row is its own, and only the auditor's row counts for
    # its audit (a MAX all-reduce let any member raise any slot, and framed an honest auditor as a false reporter)
    rows = signed_gather(w, part, r, "replay scores", scores)
    reports = pooled_reports(w, [float(rows[part.members.index(a.auditor)][a.worker]) if a.auditor in part.members
                                 else math.nan for a in audits])
    for a, reported in zip(audits, reports, strict=True):
        unreported = math.isnan(reported)
        if unreported:
            # its auditor reported no number (it had no base, or drew another plan: a note it lacks, or it keeps
            # quiet): until the forty-first session that read as -1, a pass. Each member sees for itself, blaming
            # no one: from the round's public start, or (replay_extent "state") from the segment's start state,
            # which the worker now sends every member, as for a reported failure (the auditor's was private)
            if from_state(cfg.verify, a) and a.worker not in moves.public:
                with spent.timing():
                    moves.resend(a, check)
                moves.public.add(a.worker)
                mine.pop(a.worker, None)
            score = (mine[a.worker] if a.worker in mine else replay(a)) if G_r is not None else -1.0
            if replay_failed(cfg.verify, score):
                judge_reported(cfg.verify, check, a, reported, score)
                continue
            reported = score
        if not replay_failed(cfg.verify, reported):
            check.evidence.setdefault(a.worker, {})["replayed"] = replay_evidence(cfg.verify, a, reported) | (
                {"unreported": True} if unreported else {})
            if a.worker in check.suspects:
                check.evidence[a.worker]["suspect"] = check.suspects[a.worker]
            continue
        public = a.worker in moves.public
        if from_state(cfg.verify, a) and not public:  # the worker sends the state again, to every member alike
            with spent.timing():
                moves.resend(a, check)
            mine.pop(a.worker, None)
        score = mine[a.worker] if a.worker in mine else replay(a)  # a reported failure: see for itself
        judge_reported(cfg.verify, check, a, reported, score, public or attributable(cfg.verify, a, reported))
    unbound, copies = check.unbound, check.copies
    if w.topo.stages > 1:  # its stages replay together: the senders any of them noted (each stage's seed left out
        # its own), and the ends of a copy any of them found
        pooled = _gather_json({"unbound": {str(j): h for j, h in unbound.items()},
                               "copies": {str(j): of for j, of in copies.items()}}, w.worker_group)
        unbound = {int(j): h for d in pooled for j, h in d["unbound"].items()}
        copies = pooled_copies({int(j): of for j, of in d["copies"].items()} for d in pooled)
    # noted as having signed nothing in an earlier try, an elastic retry's newcomers and what the draw without
    # them replays, the ends of a copy of the round's packets: replayed here, by this member itself
    for j, judge, _ in replayed_by_all(unbound, extra, copies):
        if (j in check.accepted or j in copies) and G_r is not None:  # (an end of a copy refused on another flag too)
            a = unbound_audit(cfg.verify, cfg.train, j, w.worker)
            judge(cfg.verify, check, a, replay(a))
    w.disputes |= disputed_pairs(audits, check)
    for x in [x for x in w.kept if x <= r]:  # their memory (or file) is done with
        w.kept.pop(x).release()
    return spent, moves


def pooled_reports(w: Worker, reports: list[float]) -> list[float]:
    """The auditors' numbers for a round's audits (NaN: none), one list for all of a worker's
    stages: with S > 1 each stage learns them from its own stage's rows, and a lying auditor's
    stages may tell its stages apart, while a replay runs through all of them together. Pooled:
    NaN where any stage saw none, else the worst any stage saw."""
    if w.topo.stages == 1 or not reports:
        return reports
    mine = torch.tensor(reports, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(w.topo.stages)]
    dist.all_gather(every, mine, group=w.worker_group)
    both = torch.stack(every)
    return [math.nan if bool(col.isnan().any()) else float(col.max()) for col in both.T]


def disputed_pairs(audits: list[Audit], check: RoundCheck) -> set[tuple[int, int]]:
    """(auditor, worker) of the round's audits whose private state neither could be blamed for
    (`state_resent` in the worker's evidence): from then on that worker sends that auditor its
    states in public (StateMoves.send), so each pair disputes once and a lying auditor or framing
    worker moves at most one state to everyone per peer. round.py and audit.py both derive it."""
    out = set()
    for a in audits:
        ev = check.evidence.get(a.worker) or {}
        if isinstance(ev.get("replayed"), dict) and ev["replayed"].get("state_resent") is True:
            out.add((a.auditor, a.worker))
    return out


def states_sent(cfg: Config) -> bool:
    """Whether this run's auditors replay segments from start states the workers send them."""
    return cfg.verify.replay_probability > 0 and cfg.verify.replay_extent == "state"


class StateMoves:
    """`[verify] replay_extent = "state"`: the start states of round r's drawn segments, each sent
    by the audited worker to its auditor alone (`send`), or, when the auditor reports a failure,
    to every member (`resend`), so that the judges all replay from the same bytes and nobody can be
    framed with a state the others never saw. A state is a fixed-size buffer in the layout of the
    model (verify/replay.py: state_layout), checked against the trace entry of the segment's start;
    one that does not hash to it counts as withheld. A checked state goes into the store (the
    offline audit replays from it); the bytes moved are counted and paced on the emulated link."""

    def __init__(self, w: Worker, r: int, part: Participants) -> None:
        self.w, self.r, self.part = w, r, part
        self.layout = w.layout
        self.size = state_nbytes(self.layout)
        self.received: dict[int, dict[str, torch.Tensor]] = {}  # worker -> its checked state
        self.public: set[int] = set()  # workers whose state went to every member at the first send
        self.sent_bytes = self.received_bytes = 0
        self.seconds = 0.0

    def _mine(self, segment: int) -> torch.Tensor:
        """This worker's buffer for segment `segment` of round r (zeros: an adversary's withheld state)."""
        w, kept = self.w, self.w.kept.get(self.r)
        if w.adversary is None:
            buf = kept.buffer(segment) if kept is not None else None
            if buf is None:
                raise RuntimeError(f"round {self.r}: the state at segment {segment}'s start was not kept")
            return buf
        tensors = w.adversary.state(self.r, segment, kept.tensors(segment) if kept is not None else None)
        try:
            return state_to_bytes(tensors, self.layout) if tensors is not None else torch.zeros(self.size, dtype=torch.uint8)
        except ValueError:
            return torch.zeros(self.size, dtype=torch.uint8)

    def _take(self, a: Audit, buf: torch.Tensor, check: RoundCheck, public: bool = False) -> None:
        """Keep `buf` as a's state if it hashes to the trace entry of its segment's start. With S > 1
        stages `buf` is this stage's slice, and the entry hashes every stage's: the receiving
        worker's stages pool their slices' hashes (all of them take a's state here together).
        A `public` state (sent to every member) goes into the store whether it hashes or not: the
        members judge from it, and so must the offline audit (a worker that sent its auditor the
        right state in private and every member another had the audit replay from the first, and
        fail a run that had convicted it rightly: the review of the forty-second session)."""
        w = self.w
        state = state_from_bytes(buf, self.layout)
        hashes = [tensors_hash(state)]
        if w.topo.stages > 1:
            hashes = [x["hash"] for x in _gather_json({"hash": hashes[0]}, w.worker_group)]
        matches = hashes_match(hashes, list(check.commitments[a.worker].commitment.trace), a.segment)
        if matches:
            self.received[a.worker] = state
        else:
            self.received.pop(a.worker, None)
        if matches or public:
            self._store(a, buf)

    def _store(self, a: Audit, buf: torch.Tensor) -> None:
        """`buf` into the store, under the ref the offline audit reads a's state by."""
        w = self.w
        digest = w.store.put(buf.numpy().tobytes())
        stage = w.stage if w.topo.stages > 1 else None
        w.store.put_ref(state_ref(w.identity.run_id, self.r, a.worker, a.segment, stage), digest.encode())

    def _pace(self, t0: float, sent: int, received: int) -> None:
        link = self.w.encoder.link
        if link is not None and not link.unlimited:
            pace(t0, sent, received, link)
        self.seconds += time.perf_counter() - t0
        self.sent_bytes, self.received_bytes = self.sent_bytes + sent, self.received_bytes + received

    def send(self, a: Audit, check: RoundCheck) -> None:
        """a's state from the worker to its auditor alone; to every member when the two have
        disputed a private send before (`Worker.disputes`): then the bytes are public from the
        start, and a report on them is pinned on whoever is wrong."""
        if (a.auditor, a.worker) in self.w.disputes:
            self.resend(a, check)
            self.public.add(a.worker)
            return
        pos, me, t0 = self.part.members.index, self.w.worker, time.perf_counter()
        if me == a.worker:
            self.part.comm.send(self._mine(a.segment), pos(a.auditor))
            self._pace(t0, self.size, 0)
        elif me == a.auditor:
            buf = torch.empty(self.size, dtype=torch.uint8)
            self.part.comm.recv(buf, pos(a.worker))
            self._pace(t0, 0, self.size)
            self._take(a, buf, check)

    def resend(self, a: Audit, check: RoundCheck) -> None:
        """a's state from the worker to every member."""
        t0 = time.perf_counter()
        buf = self._mine(a.segment) if self.w.worker == a.worker else torch.empty(self.size, dtype=torch.uint8)
        self.part.comm.broadcast_from(buf, self.part.members.index(a.worker))
        if self.w.worker == a.worker:
            self._pace(t0, self.size * (len(self.part.members) - 1), 0)
        else:
            self._pace(t0, 0, self.size)
        self._take(a, buf, check, public=True)  # (the worker too judges its round from what it sent everyone)


def stage_replay_score(w: Worker, replayed: Replayed, trace: list[str], committed: dict[str, torch.Tensor],
                       codecs: dict[str, str]) -> float:
    """A pipelined worker's number for one replay, the same on each of its stages: every stage's
    `slice_result`, gathered over the worker's stages and combined by `worker_score`."""
    mine = torch.tensor(slice_result(w.cfg.verify, replayed, trace, committed, codecs), dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(w.topo.stages)]
    dist.all_gather(every, mine, group=w.worker_group)
    return worker_score(w.cfg.verify, [(float(t[0]), float(t[1])) for t in every])


def replayer_of(w: Worker) -> Replayer:
    """How this process replays a round: a fresh copy of its own kind of inner loop. With S > 1
    stages that is the worker's pipeline: every stage of the auditor replays its slice of the
    audited worker's round together, so the trace comes out bit for bit as the audited worker's
    stages made it, and no process needs memory for more than its slice."""
    cfg, total = w.cfg, w.cfg.train.rounds * w.cfg.train.inner_steps
    if w.topo.stages == 1:
        built_in = corpus_task_of(w.task) is not None  # then the model is built at the start (no G_0 read)
        return plain_replayer(w.task.make_model, w.task.loss, cfg.train, total,
                              (lambda start: model_from(cfg.model, start, w.device)) if built_in else None,
                              replicas=cfg.topology.replicas)

    def replayer(start: dict[str, torch.Tensor], steps_before: int) -> tuple[torch.nn.Module, PipelineInnerLoop]:
        model = stage_model(cfg, w.stage, w.topo.stages, w.device, start)
        loop = PipelineInnerLoop(model, cfg.train, total, stage=w.stage, stages=w.topo.stages, group=w.worker_group,
                                 microbatches=cfg.topology.microbatches, schedule=cfg.topology.schedule,
                                 device=w.device, groups=cfg.topology.replicas)
        loop.step_count = steps_before
        return model, loop

    return replayer


def replay_codecs(cfg: Config, signed: Commitment, names: Iterable[str]) -> dict[str, str]:
    """The codecs a replay re-encodes the tensors `names` (the packet's) with: the committed ones,
    a commitment's one spec for every tensor as that spec for each (until the forty-third
    session's review it read as none, which turned off an exact replay's packet check: a worker
    with a clean trace could send any delta); none when error feedback made the packet from
    state the replay cannot know."""
    if cfg.compress.error_feedback:
        return {}
    return dict(signed.codec) if isinstance(signed.codec, dict) else dict.fromkeys(names, signed.codec)


def copies_replayable(cfg: Config) -> Callable[[SignedCommitment, dict[str, torch.Tensor]], bool] | None:
    """check.screen_checked's `replay_copies`: where the run replays, whether a sender's whole-round
    replay can tell if its packet is its own (a replay checks every tensor of it: replay_codecs,
    replay.packet_checkable);
    None where it replays nothing. round.py and audit.py both screen with it."""
    if cfg.verify.replay_probability <= 0:
        return None
    return lambda signed, delta: packet_checkable(replay_codecs(cfg, signed.commitment, delta), delta)


def loss_gain_action(v: VerifyConfig) -> str:
    """What a failed loss-gain test gets this run: "audit" needs replays to decide."""
    return v.loss_gain_action if v.replay_probability > 0 else "reject"


def trace_entries(cfg: Config) -> int:
    """State hashes an honest trace holds: the start, then one every trace_every inner steps."""
    k = cfg.verify.trace_every or cfg.train.inner_steps
    return 1 + cfg.train.inner_steps // k


def grow_steps(cfg: Config, steps: int, hide: int | None) -> int:
    """Adaptive H (`[train] inner_steps_max`): the H that follows a round of `steps` inner steps
    whose exchange needed `hide` of them to hide under (its record's `hide_steps`): `steps` when
    that was enough, else `hide` rounded up to a whole number of trace segments, at most
    inner_steps_max. H never shrinks, so noise in the measured step time cannot make it swing."""
    t = cfg.train
    if not t.inner_steps_max or hide is None or hide <= steps:
        return steps
    k = cfg.verify.trace_every or 1
    return max(steps, min(t.inner_steps_max, -(-hide // k) * k))


@dataclass
class StepSchedule:
    """H of every round decided so far, and the LR schedule's clock that follows from it.

    Rounds 0 and 1 run train.inner_steps; with adaptive H (`[train] inner_steps_max`), round
    r+2's H grows from round r's `hide_steps` (`grow`: finish_round(r) runs after round r+1's
    inner steps, so r+2 is the first round it can change). Without adaptive H every round runs
    train.inner_steps and nothing is kept. The run, its resume and the audit all derive H here."""

    cfg: Config
    steps: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: Config, records: list[dict]) -> StepSchedule:
        """The schedule a run's records (rounds 0.. in order) decide."""
        sched = cls(cfg, [cfg.train.inner_steps] * 2)
        for rec in records:
            sched.grow(rec.get("hide_steps"))
        return sched

    @property
    def adaptive(self) -> bool:
        return bool(self.cfg.train.inner_steps_max)

    def grow(self, hide: int | None) -> None:
        """Decide the next round's H after a round whose exchange needed `hide` steps to hide."""
        if self.adaptive:
            self.steps.append(grow_steps(self.cfg, self.steps[-1], hide))

    def at(self, r: int) -> int:
        """Round r's H."""
        return self.steps[r] if self.adaptive else self.cfg.train.inner_steps

    def before(self, r: int) -> int:
        """Inner steps the run took before round r (the LR schedule's clock at its start)."""
        return sum(self.steps[:r]) if self.adaptive else r * self.cfg.train.inner_steps

    def total(self, r: int) -> int:
        """The LR schedule's length as round r runs: the steps before it plus the rounds left at
        its H (rounds x H when H is fixed; re-aimed whenever adaptive H grows)."""
        return self.before(r) + (self.cfg.train.rounds - r) * self.at(r)


def round_cfg(cfg: Config, steps: int) -> Config:
    """`cfg` with round r's H as train.inner_steps (the same object when H has not changed)."""
    if steps == cfg.train.inner_steps:
        return cfg
    return replace(cfg, train=replace(cfg.train, inner_steps=steps))


def batch_root(task: Task, worker: int, r: int, steps: int) -> str:
    """Merkle root over the digests of the batches worker `worker` is assigned in round r."""
    return hex_root([batch_digest(*task.batch(worker, r, step)) for step in range(steps)])


def finish_round(w: Worker, sent: Sent, overlapped_s: float, part: Participants | None = None) -> dict:
    """Steps 4-6 of sent.round: wait, decode, aggregate, outer step, checkpoint, record.

    `part`: the round's members (elastic membership); None is every worker of the fixed world."""
    return start_finish(w, sent, overlapped_s, part).complete()


@dataclass
class Finishing:
    """A round whose work on this process is done (checks, outer step, checkpoint, private state)
    and whose figures' gather (the last collective of a round, which also checks that every member
    holds the same G) may still be in flight. `complete()` waits for it and returns the record."""

    work: Any  # the gather's torch.distributed work; None: gathered already
    build: Callable[[], dict]

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def complete(self) -> dict:
        if self.work is not None:
            work, self.work = self.work, None
            work.wait()
        return self.build()


def start_finish(w: Worker, sent: Sent, overlapped_s: float, part: Participants | None = None,
                 defer: bool = False) -> Finishing:
    """finish_round up to its figures' gather. `defer` (the fixed world's groups only): start the
    gather and return at once, so this process goes on to its next round's inner steps while the
    others are still finishing theirs; the record is built when `complete()` is called."""
    r = sent.round
    cfg = round_cfg(w.cfg, w.schedule.at(r))
    part = part or Participants.everyone(w)
    W, members = w.workers, part.members
    wait0 = time.perf_counter()
    packets = dict(zip(members, sent.handle.wait(), strict=True))
    wait_s = time.perf_counter() - wait0 + sent.waited_s
    reveals = None
    if reveals_salts(cfg.verify):  # each sender's signed salt, revealed after every bundle was in
        if sent.handle.reveals is None:
            raise ExchangeError(f"round {r}: the exchange brought no salts")
        reveals = dict(zip(members, sent.handle.reveals, strict=True))
    sent.handle.forget()  # the bundles are held here only: the check takes each out as it decodes it
    sizes = {j: len(data) for j, data in packets.items()}  # commitment + packet, as sent
    stats = sent.handle.stats

    # 4. verify every bundle: signature, commitment, packet, data, screen (verify/check.py)
    G = w.outer.params
    shapes = {k: tuple(v.shape) for k, v in G.items()}
    # this worker's own bundle comes back as the very bytes it sent: stored and hashed then, and
    # an honest one's packet is the one it hashed for its commitment (an adversary may have changed either)
    own = sent.bundle is not None and packets.get(w.worker) is sent.bundle
    bundle_hashes = {j: sent.bundle_hash if own and j == w.worker else w.store.put(data) for j, data in packets.items()}
    known = {w.worker: sent.packet_hash} if own and w.adversary is None else None
    verify0 = time.perf_counter()
    base_hash = w.base_hashes.pop(r)
    checks, loss_gains = Spent(), Spent()  # this worker's time in check_round, of which loss gains
    gain, gains = loss_gains_for(w, r, part, loss_gains)
    with checks.timing():
        check = check_round(
            packets, consume=True, run_id=w.identity.run_id, round=r, base_hash=base_hash,
            admitted_keys=w.identity.admitted, shapes=shapes, max_packet_bytes=cfg.run.max_packet_bytes,
            batch_root_of=lambda j: sent.batch_root if j == w.worker and sent.batch_root
            else batch_root(w.task, j, r, cfg.train.inner_steps),
            equivocation=w.identity.equivocation, screen=cfg.verify.screen, previous=w.previous,
            earlier=w.earlier if screens_earlier(cfg) else None,
            trace_entries=trace_entries(cfg),
            loss_gain_of=gain, loss_gains_of=gains,
            loss_gain_action=loss_gain_action(cfg.verify), loss_gain_floor=cfg.verify.loss_gain_floor,
            replay_copies=copies_replayable(cfg),
            banned=w.banned, bundle_hashes=bundle_hashes, packet_hashes_known=known, reveals=reveals,
            unsigned_reveal=unsigned_reveal_action(cfg.verify),
            # (not the junk of this try: that is plain malformed, and binds it in no redo yet)
            unsigned_earlier={j: h for j, h in w.identity.unsigned.get(r, {}).items() if bundle_hashes.get(j) != h},
            # an elastic retry's members that were not in the round's first try (keep_seen; elastic runs are not pipelined)
            newcomers=w.identity.newcomers.get(r, []) if w.topo.stages == 1 else (), codecs=run_codecs(cfg),
        )
    if w.topo.stages > 1:  # a worker's update is taken whole or not at all (its stages are one participant)
        take_whole_workers(check, [p["accepted"] for p in _gather_json({"accepted": sorted(check.accepted)}, w.worker_group)])
    hashes = [check.packet_hashes.get(j) for j in range(W)]
    if w.adversary is None and hashes[w.worker] != sent.packet_hash:
        raise ExchangeError(f"worker {w.worker}: its own packet came back altered")
    replays, moves = replay_audits(w, r, check, base_hash, part) if cfg.verify.replay_probability > 0 else (Spent(), None)
    if cfg.verify.ban:
        w.banned |= {j for j, v in check.verdicts.items() if v in OFFENCES}
    for j, d in check.decoded.items():
        w.history[j] = [d]  # a replay of the next round starts from it (start_point: the newest counts)
        w.history_rounds[j] = r
    for r_old in [x for x in w.bases if x <= r]:
        w.bases.pop(r_old)
        w.base_momenta.pop(r_old, None)
        w.starts.pop(r_old, None)
    w.earlier = w.previous[1] if screens_earlier(cfg) else {}
    # every packet this round decoded (a rejected one resent next round is still a replay), and the accepted deltas
    w.previous = (dict(check.packet_hashes), check.accepted)
    for j in range(W):  # a worker that missed the round has no "last delta" to start from
        if j not in sizes:
            w.history.pop(j, None)
            w.history_rounds.pop(j, None)
    verify_s = time.perf_counter() - verify0

    # 5. aggregate the accepted deltas (robustly, if configured) and take the outer step
    aggregate = None
    if check.accepted:
        aggregate = aggregate_deltas(check.accepted, cfg.verify)
        w.outer.step(aggregate)

    # 6. record: checkpoint, private state, agreement check, eval, one line per round
    ckpt = {f"param/{k}": v for k, v in G.items()} | w.outer.state_tensors()
    state_dir = w.run.worker_dir(w.rank)
    state_dir.mkdir(parents=True, exist_ok=True)
    # what a resume at round r+1 starts from: as round r+1 began (delay 1: before its inner steps, which
    # have run by now; at the run's end none has), and which round each worker's newest delta is from
    state = w.start_states.pop(r + 1, None) or private_state(w, copy=False)  # written before they move
    history = json.dumps({str(j): x for j, x in sorted(w.history_rounds.items())})

    def checkpoint() -> str | None:
        # store.put(st_save(ckpt, ...)), streamed, by one process of the stage per store (checkpoint_writer),
        # before the agreement below, so the blob is there before any record names it; the recorder's
        # worker hashes it only
        if w.writes_checkpoints:
            return put_tensors(w.store, ckpt, {"round": str(r)}, fresh=w.sole_writer)
        return tensors_digest(ckpt, {"round": str(r)}) if w.worker == 0 else None

    # the private state is written (and synced) on a thread while the checkpoint is hashed and written here
    whose = {"history": history, "run_id": w.identity.run_id, "process": str(w.rank), "round": str(r)}  # (resume checks)
    ckpt_digest, _ = alongside(checkpoint, lambda: write_tensors_file(state_dir / f"state-{r}.safetensors", state, whose))
    params_hash = w.outer.params_hash()
    # keep two (the record of r may not exist yet), and a process other than the recorder three: it can reach round
    # r's finish while the records end at r - 2 (with delay 1, a recorder slow to write them; then a kill), and a
    # resume from there needs state r - 2 of every process
    stale = state_dir / f"state-{r - 2 - (not w.is_recorder)}.safetensors"
    if stale.exists():
        stale.unlink()
    commitments = [check.commitments.get(j) for j in range(W)]
    verdicts = [check.verdicts[j] if j in sizes else part.absent.get(j, ABSENT) for j in range(W)]
    stage_record = {  # what this stage decided; the whole record when there is one stage
        "packets": hashes,
        "bundles": [bundle_hashes.get(j) for j in range(W)],
        "bundle_bytes": [sizes.get(j, 0) for j in range(W)],  # commitment + packet, as sent
        "verdicts": verdicts,
        "evidence": {str(j): e for j, e in check.evidence.items()},
        "commitments": [c.digest if c else None for c in commitments],
        "codecs": [codec_summary(c.commitment.codec) if c and isinstance(c.commitment.codec, dict) else {} for c in commitments],
        "codec_log": sent.codec_log,
        "aggregate_hash": tensors_hash(aggregate) if aggregate is not None else None,
        "params_hash": params_hash,
        "checkpoint": ckpt_digest,
    }
    if reveals is not None:  # the signed reveals the round examined: the audit redraws from them (check.round_seed)
        stage_record["reveals"] = [check.reveals.get(j) for j in range(W)]
    if check.unbound:  # noted as having signed nothing in an earlier try: out of the seed, replayed by the noters
        stage_record["unbound"] = {str(j): h for j, h in sorted(check.unbound.items())}
    if check.newcomers:  # an elastic retry's members that were not in its first try: out of the screen's seed, replayed by all
        stage_record["newcomers"] = check.newcomers
    if check.loss_gains is not None and check.loss_gains.record is not None:
        stage_record["loss_gain_reports"] = check.loss_gains.record  # the audit re-settles from them
    if w.banned:
        stage_record["banned"] = sorted(w.banned)  # after this round's verdicts
    if w.disputes:
        stage_record["disputes"] = sorted([a, j] for a, j in w.disputes)  # so far: these pairs send in public
    entry_commitments = [
        {"worker": j, "signed": c.to_dict() if c else None, "bundle_sha256": None if c else hashes[j],
         "verdict": verdicts[j]}
        for j, c in enumerate(commitments)
    ]
    res = sent.result
    evaluating = evaluates(cfg, r)
    # the eval's sums ride on the figures' gather too (each stage sums the same numbers)
    sums = eval_sums(w, part).tolist() if evaluating else [0.0, 0.0]
    mine = torch.tensor(
        [res.mean_loss, res.seconds, stats.bytes_sent, stats.bytes_received, stats.seconds, wait_s, overlapped_s, verify_s,
         checks.wall + replays.wall, replays.wall, loss_gains.wall,
         res.cpu_seconds, checks.cpu + replays.cpu, replays.cpu, loss_gains.cpu,
         moves.sent_bytes if moves else 0, moves.received_bytes if moves else 0, moves.seconds if moves else 0.0,
         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
         torch.cuda.max_memory_allocated(w.device) / 2**20 if w.device.type == "cuda" else 0.0,
         w.store.bytes_written - w.store_mark, time.perf_counter() - sent.started - overlapped_s,
         *sums, *_hash_words(params_hash)],
        dtype=torch.float64,
    )
    w.store_mark = w.store.bytes_written
    row = signed_row(w, r, "figures", mine, part.members)  # signed: they pass through other members' processes
    gathered = [torch.zeros_like(row) for _ in range(part.stats_comm.size)]
    work = None
    if defer:  # this process's part of the round ends here: the wait for the others' figures is not its round's
        work = part.stats_comm.all_gather_start(gathered, row)
    else:
        part.stats_comm.all_gather(gathered, row)
    # the recorder learns its worker's other stages' results (its own processes: trusted); gathered
    # here, so that what is left to build the record with holds no collective and may run between
    # two inner steps
    stages = _gather_json({"record": stage_record, "entry": entry_commitments}, w.worker_group) if w.topo.stages > 1 else None
    senders = [(m, s) for m in part.members for s in range(w.topo.stages)]
    return Finishing(work, lambda: _record_of(w, r, cfg, part, sent,
                                              opened_rows(w, r, "figures", gathered, senders, mine, part.members),
                                              stage_record, entry_commitments, stages, sizes, evaluating, defer,
                                              overlapped_s))


def _record_of(w: Worker, r: int, cfg: Config, part: Participants, sent: Sent, gathered: list[torch.Tensor],
               stage_record: dict, entry_commitments: list[dict], stages: list[dict] | None, sizes: dict[int, int],
               evaluating: bool, deferred: bool, overlapped_s: float) -> dict:
    """The round's record from every member's gathered figures (finish_round's last step), and
    with stages, from every stage's record and commitments (`stages`, in stage order)."""
    W, members, res = w.workers, part.members, sent.result
    g = torch.full((W, w.topo.stages, gathered[0].numel()), float("nan"), dtype=torch.float64)  # [worker, stage, figure]
    g[members] = torch.stack(gathered).view(len(members), w.topo.stages, -1)
    # the agreement check rides on the same gather (one collective less a round: on a long link each
    # costs a round trip or two): every stage's G must be the same on all the round's members
    if not hashes_agree(g[members]):
        raise RuntimeError(f"round {r}: workers disagree on the global params; refusing to continue")
    eval_total = g[members, w.stage, EVAL_AT:EVAL_AT + 2].sum(0)  # in members' order: the same on every one
    eval_loss = float(eval_total[0] / eval_total[1]) if evaluating else None
    record: dict = {"round": r}
    if stages is None:
        record |= stage_record
    else:
        record |= combine_stages([p["record"] for p in stages], w.store if w.is_recorder else None)
        entry_commitments = [c | {"stage": s} for s, p in enumerate(stages) for c in p["entry"]]
    here = [j in sizes for j in range(W)]  # an absent worker: null figures, 0 bytes
    record |= {
        "hashes_agree": True,
        "train_loss": [float(x) if h else None for x, h in zip(g[:, -1, 0], here, strict=True)],  # the same on a worker's stages
        "eval_loss": eval_loss,
        "bytes_sent": [int(x) if h else 0 for x, h in zip(g[:, :, 2].sum(1), here, strict=True)],  # a worker's stages' summed
        "bytes_received": [int(x) if h else 0 for x, h in zip(g[:, :, 3].sum(1), here, strict=True)],
        "inner_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 1].amax(1), here, strict=True)],  # stages in lockstep
        "exchange_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 4].amax(1), here, strict=True)],
        "wait_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 5].amax(1), here, strict=True)],
        "verify_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 7].amax(1), here, strict=True)],  # checks + replays
        # of which computing (its own checks and replays), not waiting for another's replay
        "verify_compute_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 8].amax(1), here, strict=True)],
        "replay_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 9].amax(1), here, strict=True)],  # of which replays
        "loss_gain_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 10].amax(1), here, strict=True)],  # of which loss gains
        # the same in CPU seconds of the worker's thread (time.thread_time): compute, not time spent
        # waiting or descheduled; a pipelined worker's stages summed
        **{key: [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, i].sum(1), here, strict=True)]
           for key, i in (("inner_cpu_s", 11), ("verify_cpu_s", 12), ("replay_cpu_s", 13), ("loss_gain_cpu_s", 14))},
        # the most resident memory each process has held so far, MB (a worker's stages summed)
        "peak_rss_mb": [round(float(x), 1) if h else 0.0 for x, h in zip(g[:, :, 18].sum(1), here, strict=True)],
        # the bytes each worker's processes wrote into their stores since the last record (its bundle, and a
        # checkpoint where it is its store's writer; not the private state, which is its own file)
        "store_bytes_written": [int(x) if h else 0 for x, h in zip(g[:, :, 20].sum(1), here, strict=True)],
        # deferred: the slowest process's own seconds of the round, from its start to the end of its work
        # on it (each measures its own: the figures' gather is no one's round); blocking: this process's,
        # from its start to the gathered figures
        "round_s": round(float(g[members, :, OWN_AT].amax()) if deferred
                         else time.perf_counter() - sent.started - overlapped_s, 4),
        "tokens": int(res.tokens * len(members)),
    }
    if w.device.type == "cuda":  # the most GPU memory each process's tensors have held, MiB (stages summed)
        record["peak_gpu_mb"] = [round(float(x), 1) if h else 0.0 for x, h in zip(g[:, :, 19].sum(1), here, strict=True)]
    if states_sent(cfg):  # the start states replays fetched: verification's own traffic, and its time
        record |= {"state_bytes_sent": [int(x) if h else 0 for x, h in zip(g[:, :, 15].sum(1), here, strict=True)],
                   "state_bytes_received": [int(x) if h else 0 for x, h in zip(g[:, :, 16].sum(1), here, strict=True)],
                   "state_s": [round(float(x), 4) if h else 0.0 for x, h in zip(g[:, :, 17].amax(1), here, strict=True)]}
    steps = hide_steps(w.encoder.link, record, cfg.train.inner_steps, cfg.compress.safety, w.encoder.hops)
    if steps is not None:
        record["hide_steps"] = steps
    if w.schedule.adaptive:
        record["inner_steps"] = cfg.train.inner_steps
        w.schedule.grow(steps)  # round r+2's H
    if part.absent:
        record["members"] = members
    if w.defer_entry:
        record["_entry_commitments"] = entry_commitments
    elif w.ledger is not None:
        record["entry"] = append_entry(w, record, entry_commitments)
    return record


def evaluates(cfg: Config, r: int) -> bool:
    """Whether round r's record holds an eval loss: every `[train] eval_every` rounds, and the last."""
    return (r + 1) % cfg.train.eval_every == 0 or r == cfg.train.rounds - 1


def hide_steps(link: Link | None, rec: dict, steps: int, safety: float, hops: int = 1) -> int | None:
    """The fewest inner steps whose compute would hide this round's exchange on `link`.

    `compress.suggest_inner_steps` on the round's median bundle (commitment + packet, as sent) and
    the median worker's seconds per inner step, among the workers present: what H (or, with
    `[outer] overlap_steps`, tau) would let a one-round-late exchange run entirely under the next
    round's compute with the adaptive controller's `safety` margin (of two middle values, the
    larger). None without a declared link or with fewer than two workers present. Adaptive H
    grows H from it (`StepSchedule`); otherwise `hide_warning` reports it. `hops`: the exchange's
    messages one after another, each paying the latency (2 with the salts' reveal)."""
    here = [j for j, b in enumerate(rec["bundle_bytes"]) if b]
    if link is None or len(here) < 2 or steps < 1:
        return None
    step_s = median_high(rec["inner_s"][j] for j in here) / steps
    if step_s <= 0:
        return None
    size, bandwidth = int(median_high(rec["bundle_bytes"][j] for j in here)), link.bandwidth_bps
    if math.isinf(bandwidth):  # a latency-only link: the bytes take no time (0 bytes at any finite rate)
        size, bandwidth = 0, 1.0
    return suggest_inner_steps(size, bandwidth, link.latency_s * hops, step_s, len(here), safety)


def hide_warning(cfg: Config, rec: dict) -> str | None:
    """One line when a delayed exchange needs more compute to hide under than the round gives it."""
    need = rec.get("hide_steps")
    if not cfg.outer.delay or need is None:
        return None
    window, name = (cfg.outer.overlap_steps, "outer.overlap_steps") if cfg.outer.overlap_steps else (cfg.train.inner_steps, "train.inner_steps")
    if cfg.train.inner_steps_max:  # adaptive H grows the round's H up to the cap: only the cap can be short
        window, name = rec.get("inner_steps", window), "train.inner_steps_max"
        if window < cfg.train.inner_steps_max:
            return None
    if need <= window:
        return None
    smaller = "" if cfg.compress.codec == "adaptive" else \
        ", or first let --compress.codec=adaptive fit the packets to the link (bench/adaptive_h.py: it did better)"
    return (f"warning: round {rec['round'] + 1}'s exchange needs about {need} inner steps of compute to hide under, "
            f"{name} = {window} gives it {window}: raise {name} to >= {need}{smaller}")


def combine_stages(parts: list[dict], store: LocalStore | None) -> dict:
    """The record of a round of S > 1 stages from each stage's own (`parts`, in stage order).

    A worker's verdict is "accept" when every stage accepted its slice, else the first stage's
    own reason (not other_stage, which only says another stage rejected it); `checkpoint` is
    the digest of a JSON manifest of the stage checkpoints (put into `store` when given),
    `params_hash` and `aggregate_hash` hash the stages' lists of them."""
    n = len(parts[0]["verdicts"])
    verdicts, evidence = [], {}
    for j in range(n):
        bad = [(s, p["verdicts"][j]) for s, p in enumerate(parts) if p["verdicts"][j] not in (ACCEPT, OTHER_STAGE)] \
            or [(s, p["verdicts"][j]) for s, p in enumerate(parts) if p["verdicts"][j] != ACCEPT]
        verdicts.append(bad[0][1] if bad else "accept")
        if bad:
            evidence[str(j)] = {"stage": bad[0][0], "evidence": parts[bad[0][0]]["evidence"].get(str(j))}
    codecs = []
    for j in range(n):
        counts: dict[str, int] = {}
        for p in parts:
            for spec, k in p["codecs"][j].items():
                counts[spec] = counts.get(spec, 0) + k
        codecs.append(dict(sorted(counts.items())))
    manifest = canonical_json({"stages": [{"checkpoint": p["checkpoint"], "params_hash": p["params_hash"]} for p in parts]})
    aggregates = [p["aggregate_hash"] for p in parts]
    return {
        "stages": parts,
        "verdicts": verdicts,
        "evidence": evidence,
        "codecs": codecs,
        "bundle_bytes": [sum(p["bundle_bytes"][j] for p in parts) for j in range(n)],
        "aggregate_hash": json_hash(aggregates) if any(a is not None for a in aggregates) else None,
        "params_hash": json_hash([p["params_hash"] for p in parts]),
        "checkpoint": store.put(manifest) if store is not None else sha256_hex(manifest),
    }


def aggregate_deltas(accepted: dict[int, dict[str, torch.Tensor]], v: VerifyConfig) -> dict[str, torch.Tensor]:
    """The configured (robust) aggregate of the accepted deltas, in worker order."""
    params: dict = {}
    if v.aggregator == "trimmed_mean":
        params["trim_fraction"] = v.trim_fraction
    elif v.aggregator == "centered_clip" and v.clip_tau > 0:
        params["tau"] = v.clip_tau
    return robust_aggregate(dict(sorted(accepted.items())), v.aggregator, **params)


def append_entry(w: Worker, record: dict, commitments: list[dict]) -> str:
    """Append the round's ledger entry (in-toto Statement); returns its hash.

    With stages, `commitments` holds every stage's (each marked with its "stage") and the
    subject is the stage-checkpoint manifest; the predicate lists the stages' own hashes."""
    extra = {}
    if "stages" in record:
        extra["stages"] = [{k: p[k] for k in ("checkpoint", "params_hash", "aggregate_hash")} for p in record["stages"]]
    r, ledger = record["round"], w.ledger
    held = ledger.size()  # > r: a crash fell between this round's ledger append and its record
    entry = make_entry(
        run_id=w.identity.run_id, round=r, prev_entry_hash=ledger.entry_hash(r - 1) if r else ZERO_HASH,
        checkpoint=record["checkpoint"], commitments=commitments, aggregate_hash=record["aggregate_hash"],
        codecs=record["codecs"], eval_loss=record["eval_loss"], params_hash=record["params_hash"],
        aggregator=w.cfg.verify.aggregator, **extra,
    )
    if held > r:  # the redone round must be the one the ledger already holds, byte for byte
        if held > r + 1 or ledger.entry_bytes(r) != entry_bytes(entry):
            raise RuntimeError(f"round {r}: the ledger already holds a different entry for this round "
                               f"({held} entries); the redone round did not reproduce it")
        return ledger.entry_hash(r)
    ledger.append(entry)
    return ledger.head_hash()


def open_ledger(cfg: Config, run: RunDir) -> Ledger | None:
    """The recorder's ledger: RUN/ledger.sqlite by default, an EVM contract, or none."""
    if cfg.ledger.backend == "none":
        return None
    if cfg.ledger.backend == "sqlite":
        return SqliteLedger(run.root / "ledger.sqlite")
    from .ledger.evm import EvmLedger

    return EvmLedger.connect(cfg.ledger.rpc_url, cfg.ledger.contract, run.read_manifest()["run_id"],
                             cfg.ledger.key_file, str(run.root / "ledger-bodies"))


def codec_summary(codecs: dict[str, str]) -> dict[str, int]:
    """{spec: number of tensors} of one packet."""
    out: dict[str, int] = {}
    for spec in codecs.values():
        out[spec] = out.get(spec, 0) + 1
    return dict(sorted(out.items()))


OWN_AT = 21  # where finish_round's gathered figures hold each process's own seconds of the round (round_s)
EVAL_AT = OWN_AT + 1  # then the eval sums (eval_sums)
HASH_AT = EVAL_AT + 2  # and, after those two, the params hash (_hash_words)


def hashes_agree(g: torch.Tensor) -> bool:
    """Whether, in finish_round's gathered figures of the round's members ([member, stage, figure]),
    every stage's params hash is the same on every member."""
    held = g[:, :, HASH_AT:]
    return bool(torch.equal(held, held[:1].expand_as(held)))


def _hash_words(digest_hex: str) -> list[float]:
    """A SHA-256 hex digest as 8 32-bit words, each exact in a float64 (finish_round gathers them
    with the round's figures to check that every member holds the same G)."""
    raw = bytes.fromhex(digest_hex)
    return [float(int.from_bytes(raw[i:i + 4], "big")) for i in range(0, len(raw), 4)]


GATHER_DOMAIN = b"veriloco/gather/v1\n"  # what a process signs its row of a gather under


class RowTampered(RuntimeError):
    """A gathered row whose signature does not verify (opened_rows): the run stops, an elastic
    run too (retrying would meet the same relay)."""


def _row_message(w: Worker, r: int, purpose: str, worker: int, stage: int, members: list[int], data: bytes) -> bytes:
    """What a row's signature covers: the run, round, purpose, sender, its stage, and the
    round's members (an elastic round retried among other members is another gather: a row of
    an earlier try does not verify in it)."""
    head = canonical_json({"run_id": w.identity.run_id, "round": r, "purpose": purpose, "worker": worker,
                           "stage": stage, "members": members})
    return GATHER_DOMAIN + head + b"\n" + data


def signed_row(w: Worker, r: int, purpose: str, t: torch.Tensor, members: list[int]) -> torch.Tensor:
    """`t`'s bytes and this process's signature of them (its worker's key, over the run, round,
    purpose, worker, stage and the round's `members`), as one uint8 row to gather (`opened_rows`
    checks them)."""
    data = t.detach().cpu().contiguous().numpy().tobytes()
    signature = bytes.fromhex(sign(w.identity.key, _row_message(w, r, purpose, w.worker, w.stage, members, data)))
    return torch.frombuffer(bytearray(data + signature), dtype=torch.uint8)


def opened_rows(w: Worker, r: int, purpose: str, rows: list[torch.Tensor], senders: list[tuple[int, int]],
                like: torch.Tensor, members: list[int]) -> list[torch.Tensor]:
    """The tensors (shaped and typed as `like`) in gathered `signed_row`s, from `senders`
    ((worker, stage) of each row); a row whose signature does not verify under its worker's
    admitted key raises RowTampered naming the worker (see signed_gather)."""
    n, out = like.numel() * like.element_size(), []
    for (worker, stage), row in zip(senders, rows, strict=True):
        raw = row.numpy().tobytes()
        body, sig = raw[:n], raw[n:]
        if (worker, stage) != (w.worker, w.stage) and not verify_signature(
                w.identity.admitted.get(worker), _row_message(w, r, purpose, worker, stage, members, body), sig.hex()):
            where = f" (stage {stage})" if w.topo.stages > 1 else ""
            raise RowTampered(f"round {r}: worker {worker}'s row{where} of the {purpose} does not verify under its key: "
                              "altered on its way through another member's process, or signed wrong; refusing to "
                              "continue")
        out.append(torch.frombuffer(bytearray(body), dtype=like.dtype).view(like.shape).clone())
    return out


def signed_gather(w: Worker, part: Participants, r: int, purpose: str, t: torch.Tensor) -> list[torch.Tensor]:
    """Every member's `t` (same shape and dtype on each), in members' order, over `part.comm` (this
    stage's processes), each row signed by its member (`signed_row`).

    What travels on collectives is signed (this, and finish_round's figures): gloo's all-gather
    is a ring, so a member's row passes through other members' processes on its way, and one
    running a modified gloo could rewrite it: a replay's pass into a failure frames an honest
    auditor, a failure into a pass hides a cheater. A row whose signature does not verify under
    its member's admitted key stops the round on every member that received it, naming the
    member (RowTampered), as a disagreement on G does: tampering can stop a run, not skew it."""
    mine = signed_row(w, r, purpose, t, part.members)
    rows = [torch.empty_like(mine) for _ in part.members]
    part.comm.all_gather(rows, mine)
    return opened_rows(w, r, purpose, rows, [(m, w.stage) for m in part.members], t, part.members)


def _gather_json(obj: dict, group: dist.ProcessGroup) -> list[dict]:
    """Every rank's `obj` (JSON) in group order: JSON bytes in uint8 tensors, never pickle."""
    data = json.dumps(obj, sort_keys=True, allow_nan=False).encode()
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(bufs, mine, group=group)
    return [json.loads(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]


def progress_line(rec: dict, rounds: int, elapsed: float, tokens_per_s: float) -> str:
    """One dense line per round (nanochat style)."""
    left = rounds - rec["round"] - 1
    eta = elapsed / (rec["round"] + 1) * left if rec["round"] >= 0 else 0.0
    ev = f"{rec['eval_loss']:.4f}" if rec["eval_loss"] is not None else "   -  "
    acc = sum(v == "accept" for v in rec["verdicts"])
    losses = [x for x in rec["train_loss"] if x is not None]
    mb = sum(rec["bytes_sent"]) / len(losses) / 1e6
    train = sum(losses) / len(losses)
    return (
        f"round {rec['round'] + 1:>4}/{rounds} | eval {ev} | train {train:.4f} | "
        f"{tokens_per_s / 1e3:6.1f}k tok/s | sent {mb:7.3f} MB/worker | "
        f"accepted {acc}/{len(rec['verdicts'])} | {rec['round_s']:.2f}s | eta {eta:5.0f}s"
        + (f" | H {rec['inner_steps']}" if "inner_steps" in rec else "")  # adaptive H
    )


def train_worker(
    cfg: Config, rank: int, world: int, task: Task, run_dir: str, start_round: int,
    quiet: bool = False, stop_after: int | None = None,
) -> dict | None:
    """The whole run on one process, i.e. one stage of one worker (dist already
    initialised; `world` = workers * stages * replicas processes). Rank 0 writes the records.
    A replica other than 0 runs `replica_loop`.

    `stop_after`: stop cleanly once that many rounds are recorded (a preemption point)."""
    replicas = cfg.topology.replicas
    if rank % replicas:
        replica_loop(cfg, rank, task)
        return None
    w = setup_worker(cfg, rank // replicas, world // replicas, task, run_dir, start_round, process_rank=rank)
    prior = w.run.rounds()[:start_round] if w.is_recorder else []
    eval_start = evaluate(w) if start_round == 0 else prior[0]["eval_loss_start"] if prior else None
    wall0 = time.perf_counter() - sum(p["round_s"] for p in prior)
    tokens0 = sum(p["tokens"] for p in prior)
    end = cfg.train.rounds if stop_after is None else min(stop_after, cfg.train.rounds)
    pending: Sent | None = None
    warned = False
    # [run] keep_checkpoints: the recorder and every process that writes checkpoints prune their store (a machine of
    # a multi-machine run may have its own), any but the recorder one round later: the record that names its newest
    # may not be written yet
    keep = cfg.run.keep_checkpoints
    if keep and not w.is_recorder:
        keep += 1
    recent = list(prior[-keep:]) if keep else []  # the newest records, for pruning

    # A round's figures are gathered while this process runs its next round's inner steps
    # (start_finish's defer), so it does not wait every round for the slowest worker to finish its
    # own; the record is written as soon as they are here (between inner steps), and at the latest
    # before the next round's finish begins, which deletes the private state that a resume from the
    # round before needs. Not with adaptive H (a round's record sets the H of the round after next,
    # which may start before it).
    defer = not w.schedule.adaptive
    settling: Finishing | None = None

    def settle() -> None:
        nonlocal settling
        if settling is not None:
            done, settling = settling, None
            record(done.complete())

    def poll() -> None:
        if settling is not None and settling.done():
            settle()

    def finish(sent: Sent, overlapped_s: float) -> None:
        nonlocal settling
        settle()
        finishing = start_finish(w, sent, overlapped_s, defer=defer)
        if defer:
            settling = finishing
        else:
            record(finishing.complete())

    def land(overlapped_s: float) -> None:  # overlap_steps: round r-1's update lands inside round r
        nonlocal pending
        if pending is not None:
            done, pending = pending, None
            finish(done, overlapped_s)
        elif w.resumed_outer is not None:  # resumed: G moves on to the last recorded round's
            w.outer, w.resumed_outer = w.resumed_outer, None

    def record(rec: dict) -> None:
        nonlocal tokens0, warned
        rec["eval_loss_start"] = eval_start
        if keep:
            recent[:] = [*recent, rec][-keep - 1:]
        if w.is_recorder:
            elapsed = time.perf_counter() - wall0
            tokens0 += rec["tokens"]
            w.run.append_round(rec)
            w.run.append_metrics(metrics_of(rec, tokens0, elapsed))
            if not quiet:
                print(progress_line(rec, cfg.train.rounds, elapsed, tokens0 / elapsed), flush=True)
                warning = hide_warning(cfg, rec)
                if warning is not None and not warned:  # once a run: the records keep every round's
                    warned = True
                    print(warning, flush=True)
        if keep and (w.writes_checkpoints or w.is_recorder):  # after the record that names the newer ones is written
            prune_checkpoints(w.store, recent, keep)

    # (a resume with nothing left to run, --stop-after at the rounds recorded, runs no round: with delay 1 it ran one)
    for r in range(start_round, end + cfg.outer.delay if end > start_round else start_round):
        if r < end:
            sent = run_inner_and_send(w, r, land if cfg.outer.overlap_steps else None, poll if defer else None)
        if cfg.outer.delay == 0:
            finish(sent, 0.0)
        elif cfg.outer.overlap_steps and r < end:  # round r-1 landed inside round r (land)
            pending = sent
        elif pending is None:  # delay 1, first round (of the run or the resume): its exchange runs during the next
            pending = sent
            if w.resumed_outer is not None:  # resumed: G moves on to the last recorded round's
                w.outer, w.resumed_outer = w.resumed_outer, None
        else:  # delay 1: finish round r-1 (its exchange ran under round r's inner steps)
            done, pending = pending, (sent if r < end else None)
            # round r so far (its inner steps and its send) is round r's, not r-1's: r-1's round_s is its own work
            finish(done, time.perf_counter() - sent.started if r < end else 0.0)
    settle()
    if w.replicas is not None:
        w.replicas.end()
    head, root = (w.ledger.head_hash(), w.ledger.root()) if w.ledger is not None else (None, None)
    if w.ledger is not None:  # the last SQLite connection to close folds its WAL into ledger.sqlite: one file
        w.ledger.close()
    if not w.is_recorder:
        return None
    records = w.run.rounds()
    wall = time.perf_counter() - wall0
    last = records[-1]
    evals = [p["eval_loss"] for p in records if p["eval_loss"] is not None]
    return {
        "eval_loss_start": eval_start,
        "eval_loss_end": evals[-1] if evals else None,
        "tokens": sum(p["tokens"] for p in records),
        "rounds": len(records),
        "workers": w.workers,
        "stages": w.topo.stages,
        "replicas": w.topo.replicas,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(p["tokens"] for p in records) / wall, 1),
        "bytes_sent_per_worker": int(sum(sum(p["bytes_sent"]) for p in records) / w.workers),
        # inner-step time over wall time, averaged over workers: the share of time spent computing
        "utilisation": round(sum(sum(p["inner_s"]) for p in records) / w.workers / wall, 4),
        "final_checkpoint": last["checkpoint"],
        "final_params_hash": last["params_hash"],
        "mode": "diloco",
        "complete": len(records) == cfg.train.rounds,
        "ledger_head": head,
        "ledger_root": root,
    }


# what (1: a round, 2: send replica 0 your optimizer state, 0: stop), round, steps, step_count, total_steps,
# round_start (-1: None), state sent, trace_every
REPLICA_CONTROL = 8


class ReplicaSync:
    """Replica 0's side of `[topology] replicas`: before each round's inner steps it sends the
    worker's other processes what they need to run the steps with it: the round, its steps and
    LR schedule, the params the steps start from, and, the first time, the inner optimizer state
    (a resume's; afterwards every replica takes the same steps on the same summed gradients, so
    theirs stays equal to its own). Only replica 0 takes part in the round: exchange, checks,
    eval, records. `end` lets them go."""

    def __init__(self, group: dist.ProcessGroup, inner: InnerLoop) -> None:
        self.group, self.inner, self.state_sent = group, inner, False

    def begin(self, r: int, steps: int, trace_every: int) -> None:
        inner = self.inner
        start = -1 if inner.round_start is None else inner.round_start
        self._control(1, r, steps, inner.step_count, inner.total_steps, start, int(not self.state_sent), trace_every)
        share_params(inner.model, self.group)
        if not self.state_sent:  # what this process holds: the whole state after a resume (the others hold none yet)
            inner.replicas.broadcast_state(inner._state_views())
            if inner.replicas.shard:
                inner.drop_unowned_state()
            self.state_sent = True

    def ask_state(self) -> None:
        """Sharded replicas, between rounds: each of the others sends replica 0 its optimizer state
        (`Replicas.gather_state` receives it)."""
        self._control(2)

    def landed(self) -> None:
        """`[outer] overlap_steps`: the late update moved the params inside the round; the other
        replicas take them at the same step (`replica_loop`'s Landing)."""
        share_params(self.inner.model, self.group)

    def end(self) -> None:
        self._control(0)

    def _control(self, *values: int) -> None:
        """One control message to the other replicas (`REPLICA_CONTROL` numbers, zeros after `values`)."""
        control = torch.zeros(REPLICA_CONTROL, dtype=torch.int64)
        control[: len(values)] = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(control, group=self.group, group_src=0)


def shards_optimizer(cfg: Config) -> bool:
    """`[topology] shard_optimizer`, where it applies: with replicas (of a whole model, or of each
    pipeline stage's slice)."""
    return cfg.topology.shard_optimizer and cfg.topology.replicas > 1


def bucket_bytes(cfg: Config) -> int:
    """`[topology] bucket_mb` in bytes, where it applies: replicas of a whole model (a pipeline
    stage's backward runs inside its schedule, so its replicas reduce after it)."""
    return int(cfg.topology.bucket_mb * 1e6) if cfg.topology.replicas > 1 and cfg.topology.stages == 1 else 0


def share_params(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Replica 0's params to every replica of its group (collective: each calls it)."""
    for p in model.parameters():
        dist.broadcast(p.data, group=group, group_src=0)


def replica_loop(cfg: Config, rank: int, task: Task) -> None:
    """A replica other than 0 of a worker (`[topology] replicas`) in a fixed world: the groups
    replica 0 makes (`setup_worker`), then `replica_steps` on its replica group."""
    topo = Topology(cfg.topology.workers, cfg.topology.stages, replicas=cfg.topology.replicas)
    timeout = timedelta(seconds=cfg.run.timeout_s)
    topo.build_groups(timeout)  # the groups replica 0 makes (setup_worker), in its order: new_group is collective
    topo.build_groups(timeout)
    group, _ = topo.build_replica_groups(timeout)
    pipeline = topo.build_pipeline_groups(timeout) if topo.stages > 1 else None
    protocol_rank = rank // topo.replicas
    replica_steps(cfg, task, rank, topo.worker_of(protocol_rank), topo.stage_of(protocol_rank), group, pipeline)


def replica_steps(cfg: Config, task: Task, rank: int, worker: int, stage: int, group: dist.ProcessGroup,
                  pipeline: dist.ProcessGroup | None = None) -> None:
    """A replica other than 0 of a worker: its part of every inner step of the rounds replica 0
    starts (`ReplicaSync`) over `group` (the worker's replicas, replica 0 first), until it says
    stop. It holds the model and the inner optimizer, and nothing of the round (no exchange,
    records, eval or store). `rank`: the process's global rank (its device)."""
    torch.set_num_threads(cfg.train.threads)
    device = process_device(cfg, rank)
    take_device(device, cfg.verify.replay_match == "exact")
    task = on_device(task, device, cfg.train.precision)
    model, inner = inner_loop_of(cfg, task, stage, pipeline, device, corpus_task_of(task))
    inner.replicas = replicas = Replicas(group, rank % cfg.topology.replicas, cfg.topology.replicas,
                                         shard=shards_optimizer(cfg), bucket_bytes=bucket_bytes(cfg))
    # the worker's adversary trains on what its batch hook gives on every replica (its other hooks
    # act on replica 0's round alone; how many steps it takes comes with each round's control)
    spec = cfg.adversary.get(str(worker))
    adv = Adversary(worker, cfg.run.seed) if spec is None else load_adversary(spec, worker, cfg.run.seed)
    while True:
        control = torch.zeros(REPLICA_CONTROL, dtype=torch.int64)
        dist.broadcast(control, group=group, group_src=0)
        what, r, steps, step_count, total_steps, start, state_sent, trace_every = (int(v) for v in control)
        if what == 0:
            return
        if what == 2:
            replicas.send_state(inner._state_views())
            continue
        share_params(model, group)
        if cfg.train.inner_state == "reset":
            inner.reset_state()
        if state_sent:
            inner.load_state_tensors(replicas.broadcast_state(None))
            if replicas.shard:
                inner.drop_unowned_state()
        inner.step_count, inner.total_steps, inner.round_start = step_count, total_steps, None if start < 0 else start
        land = Landing(cfg.outer.overlap_steps, lambda: share_params(model, group)) if cfg.outer.overlap_steps else None

        def trace() -> str:  # sharded: replica 0 hashes the whole state at each trace point, this one's part too
            replicas.send_state(inner._state_views())
            return ""

        run_steps(inner.step, trace, lambda step, r=r: adv.batch(r, step, *task.batch(worker, r, step)),
                  steps, trace_every if replicas.shard else 0, land)


def process_backend(cfg: Config, local_processes: int = 1) -> str:
    """The torch.distributed backend of a run's world (`[run] backend`): gloo, which carries every
    tensor the rounds move (packets, checks, evals: all on the CPU); with run.device = 'cuda' also
    nccl for CUDA tensors (pipeline activations, DDP's gradients), when 'nccl' was asked for, or
    with 'auto' when this machine has a GPU for each of its `local_processes` (NCCL refuses two
    ranks of one group on one GPU: several workers sharing a GPU then move CUDA tensors over
    gloo). The CPU needs gloo whatever was asked: nccl alone had every CPU collective fail."""
    if cfg.run.device != "cuda" or cfg.run.backend == "gloo":
        return "gloo"
    if cfg.run.backend == "nccl" or torch.cuda.device_count() >= local_processes:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_distributed(cfg: Config, rank: int, world: int, init_method: str) -> None:
    """Join the run's world: `world` processes on this machine (a local launch), or torchrun's
    (LOCAL_RANK, LOCAL_WORLD_SIZE). A CUDA process takes its GPU first, so that nothing (a barrier
    on nccl) runs on another process's GPU."""
    take_device(process_device(cfg, rank), exact=False)
    backend = process_backend(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world,
        timeout=timedelta(seconds=cfg.run.timeout_s),
    )

