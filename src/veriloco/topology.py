"""Workers x stages: which process is which, and the process groups that join them.

DiLoCoX (Qi et al. 2025, arXiv 2506.21263) runs pipeline parallelism inside each worker: a worker
is `stages` processes, one per contiguous slice of the model, and the outer exchange of round r
happens per stage, among the `workers` processes that hold the same slice. This module is the one
place that owns that layout (torchtitan's `ParallelDims` habit):

    global rank = worker * stages + stage          (0 <= worker < workers, 0 <= stage < stages)

so the `stages` processes of one worker are consecutive ranks (on one machine under `torchrun
--nproc-per-node=stages`, where the pipeline's activations travel), and stage s of every worker is
the strided set {s, s + stages, s + 2 * stages, ...} (the slow link carries only that slice).

Two kinds of group:
- the **worker group** of worker w: its `stages` ranks in stage order, so a rank's index inside
  the group is its stage. The pipeline's send/recv and the inner loop's global grad-norm run here.
- the **stage group** of stage s: the `workers` ranks that hold slice s, in worker order, so a
  rank's index inside the group is its worker. The outer exchange of slice s runs here.

`[topology] replicas = R` runs each (worker, stage) on R processes that split every inner step's
batch (data parallel inside a worker, on its fast local links; `inner.Replicas`): process
`v * R + i` is replica i of the process above with global rank v (its *protocol rank*). Only
replica 0 takes part in the round (exchange, checks, records); the groups above join replica 0s,
a **replica group** joins the R processes of one protocol rank, and with stages, replica i > 0 of
each stage of a worker form that replica's own **pipeline group** (replica 0s use the worker group).

A stage's module holds only its own layers, under the full model's names (`build_stage_model`), so
its parameter names and initial values are exactly the full model's: deltas, packets and
checkpoints of the slices line up with the unsplit model's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .config import Config, ModelConfig
from .model import build_model, model_from


class Topology:
    """The layout of `workers` x `stages` processes (see the module docstring for the rank order).

    `workers` is the number of DiLoCo workers (M in DiLoCo), `stages` the pipeline depth inside
    each worker. `world_size`, when given (e.g. from torchrun), must equal workers * stages.
    """

    def __init__(self, workers: int, stages: int, world_size: int | None = None, replicas: int = 1) -> None:
        if workers < 1 or stages < 1 or replicas < 1:
            raise ValueError(f"workers ({workers}), stages ({stages}) and replicas ({replicas}) must all be >= 1")
        if world_size is not None and workers * stages != world_size:
            raise ValueError(
                f"workers ({workers}) x stages ({stages}) = {workers * stages} "
                f"but world size is {world_size}"
            )
        self.workers, self.stages, self.replicas = workers, stages, replicas

    @property
    def world_size(self) -> int:
        """Number of processes: workers * stages."""
        return self.workers * self.stages

    def __repr__(self) -> str:
        replicas = f", replicas={self.replicas}" if self.replicas > 1 else ""
        return f"Topology(workers={self.workers}, stages={self.stages}{replicas})"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) for {self!r}")

    def worker_of(self, rank: int) -> int:
        """The worker a global rank belongs to."""
        self._check_rank(rank)
        return rank // self.stages

    def stage_of(self, rank: int) -> int:
        """The pipeline stage a global rank runs."""
        self._check_rank(rank)
        return rank % self.stages

    def rank_of(self, worker: int, stage: int) -> int:
        """The global rank of (worker, stage)."""
        if not (0 <= worker < self.workers and 0 <= stage < self.stages):
            raise ValueError(
                f"(worker {worker}, stage {stage}) is outside {self.workers} workers x {self.stages} stages"
            )
        return worker * self.stages + stage

    def worker_ranks(self, worker: int) -> list[int]:
        """Global ranks of one worker's pipeline, in stage order."""
        return [self.rank_of(worker, s) for s in range(self.stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """Global ranks holding one stage's slice, in worker order."""
        return [self.rank_of(w, stage) for w in range(self.workers)]

    def layers_of_stage(self, stage: int, n_layer: int) -> list[int]:
        """The blocks stage `stage` holds; see `layers_of_stage`."""
        return layers_of_stage(stage, n_layer, self.stages)

    def build_groups(
        self, timeout: timedelta | None = None
    ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Create every worker group and every stage group; return this rank's two.

        `torch.distributed.new_group` is collective over the default group: every rank must call
        it for every group, in the same order, even for groups it is not in. So each rank creates
        all `workers` worker groups (worker 0 first), then all `stages` stage groups (stage 0
        first), and keeps the two it belongs to. Call it after `init_process_group`, on every rank
        at the same point among its other `new_group` calls. Each call creates fresh groups: call
        it again for an independent set, e.g. stage groups for an exchange thread that must not
        interleave with the main thread's collectives.
        """
        rank = self._process_rank() // self.replicas  # its protocol rank (replica 0's, for replicas)
        me_w, me_s = self.worker_of(rank), self.stage_of(rank)
        mine_w = mine_s = None
        for w in range(self.workers):
            g = dist.new_group([r * self.replicas for r in self.worker_ranks(w)], timeout=timeout)
            if w == me_w:
                mine_w = g
        for s in range(self.stages):
            g = dist.new_group([r * self.replicas for r in self.stage_ranks(s)], timeout=timeout)
            if s == me_s:
                mine_s = g
        assert mine_w is not None and mine_s is not None  # every rank is in one of each
        return mine_w, mine_s

    def build_replica_groups(self, timeout: timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Create every replica group (the R processes of each protocol rank, in replica order:
        a process's index in it is its replica) and the protocol group (every replica 0, in
        protocol rank order: what the default group is without replicas); return this process's
        replica group and the protocol group. Collective over the default group, as `build_groups`."""
        me = self._process_rank() // self.replicas
        mine = None
        for v in range(self.world_size):
            g = dist.new_group([v * self.replicas + i for i in range(self.replicas)], timeout=timeout)
            if v == me:
                mine = g
        protocol = dist.new_group([v * self.replicas for v in range(self.world_size)], timeout=timeout)
        return mine, protocol

    def build_pipeline_groups(self, timeout: timedelta | None = None) -> dist.ProcessGroup | None:
        """With stages and replicas: create the pipeline of every replica i > 0 of every worker (its
        S processes, replica i of each stage, in stage order; replica 0's pipeline is the worker
        group) and return this process's, or None on a replica 0. Collective over the default
        group, as `build_groups`."""
        me, mine = self._process_rank(), None
        for w in range(self.workers):
            for i in range(1, self.replicas):
                ranks = [v * self.replicas + i for v in self.worker_ranks(w)]
                g = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    mine = g
        return mine

    def _process_rank(self) -> int:
        """This process's global rank, after checking the world is workers x stages x replicas."""
        if not dist.is_initialized():
            raise RuntimeError("build_groups needs torch.distributed to be initialised first")
        world, want = dist.get_world_size(), self.world_size * self.replicas
        if world != want:
            replicas = f" x replicas ({self.replicas})" if self.replicas > 1 else ""
            raise ValueError(f"workers ({self.workers}) x stages ({self.stages}){replicas} = {want} "
                             f"but world size is {world}")
        return dist.get_rank()


def layers_of_stage(stage: int, n_layer: int, stages: int) -> list[int]:
    """Global block indices held by `stage`: an even, contiguous split of `n_layer` blocks.

    When `n_layer` is not a multiple of `stages`, the first `n_layer % stages` stages hold one
    block more. Stage 0 also holds the embedding and the last stage the final norm and head
    (`build_stage_model`). Every stage holds at least one block, so `stages <= n_layer`.
    """
    if stages < 1 or n_layer < 1:
        raise ValueError(f"n_layer ({n_layer}) and stages ({stages}) must both be >= 1")
    if stages > n_layer:
        raise ValueError(f"stages ({stages}) > n_layer ({n_layer}): every stage needs at least one block")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside [0, {stages})")
    base, extra = divmod(n_layer, stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def build_stage_model(model_cfg: ModelConfig, seed: int, stage: int, stages: int,
                      params: Mapping[str, torch.Tensor] | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """The module of one pipeline stage, its parameters the full model's under the same names
    (GPT: `blocks.<global index>.*`, `tok_emb.*` on stage 0, `ln_f.*` / `lm_head.*` on the last;
    transformers archs: `model.layers.<i>.*`, `model.embed_tokens.*`, `model.norm.*` / `lm_head.*`).

    With `params` (a stored G_0 read lazily, a round's start state) the stage is materialised from
    them alone (`model.model_from`): no memory for the other stages' layers, nothing initialised.
    Without, it is the full model built from `seed` (`model.build_model`, the G_0 every worker of
    a run that keeps none builds) with what the stage does not hold deleted (`keep_stage`).
    """
    keep = (set(layers_of_stage(stage, model_cfg.n_layer, stages)), stage == 0, stage == stages - 1)
    if params is not None:
        return model_from(model_cfg, params, device, stage=keep)
    model = build_model(model_cfg, seed)
    model.keep_stage(*keep)
    return model.to(device)


def stage_model(cfg: Config, stage: int, stages: int, device: torch.device | str = "cpu",
                params: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """`build_stage_model` of the run's model, on `device` (`[run] device`); with `[train]
    precision = "bf16"` its forward runs under bf16 autocast and returns fp32 (what the next stage,
    or the loss on the last, takes; one stage's autocast covers its own forward, and the backward
    follows it). Every process that runs a stage builds it here: the workers, their replays, the
    audit's emulated pipeline, so all of them compute alike."""
    model = build_stage_model(cfg.model, cfg.run.seed, stage, stages, params, device)
    if cfg.train.precision == "bf16":
        forward, kind = model.forward, torch.device(device).type

        def autocast_forward(*args, **kwargs):  # an instance attribute: the param names stay the model's
            with torch.autocast(kind, dtype=torch.bfloat16):
                out = forward(*args, **kwargs)
            return out.float()

        model.forward = autocast_forward
    return model


__all__ = ["Topology", "build_stage_model", "layers_of_stage", "stage_model"]
