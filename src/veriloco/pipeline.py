"""Inner steps through a pipeline of stages: DiLoCoX's pipeline parallelism inside a worker.

DiLoCoX (Qi et al. 2025, arXiv 2506.21263) splits each worker's model into `stages` contiguous
slices, one process each, and trains them with a pipeline schedule; each stage keeps its own
inner AdamW state for its slice (the "dual optimizer" is that inner optimizer plus an outer
optimizer per slice, applied by the round to the stage's params after the exchange in the stage
group). The schedule is torch.distributed.pipelining's:

- `"gpipe"`: GPipe (Huang et al. 2019, arXiv 1811.06965), all micro-batch forwards, then all
  backwards;
- `"1f1b"`: one-forward-one-backward (PipeDream-Flush, Narayanan et al. 2021, arXiv 2006.09503),
  same result, fewer live activations.

One inner step is one pipeline step over the worker's batch, split into `microbatches` equal
micro-batches; the loss (pipelining's `loss_fn`, on the last stage) is the mean over each
micro-batch and the schedule divides the gradients by the number of micro-batches, so the
gradient is that of the full-batch mean loss, as in the unsplit `InnerLoop`. Then:

1. one `all_gather` in the worker group carries [squared grad norm of this stage's slice, the
   step's loss (last stage only)], so every stage clips with the GLOBAL grad norm of the whole
   model (clipping per slice would change the update) and learns the step's loss;
2. each stage applies AdamW to its slice with the LR schedule `inner.lr_at`.

The result is the unsplit model's step up to float rounding: micro-batching sums the gradient of
each micro-batch separately and then adds them, which rounds differently from one backward
over the whole batch (the tests measure the gap).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig
from .inner import BatchFn, InnerLoop, InnerResult, Landing, lr_at, run_steps, sum_groups
from .model import lm_loss, tied_ends

if TYPE_CHECKING:  # imported where a schedule is built (~1 s to import; a run without stages never needs it)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

TIE_TAG = 17  # TiedEnds' messages, apart from the schedule's own (tag 0) between the same ranks
OutputLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage output, targets)
SCHEDULES = ("gpipe", "1f1b")  # torch.distributed.pipelining.ScheduleGPipe / Schedule1F1B


def _make_schedule(
    model: nn.Module, stage: int, stages: int, group: dist.ProcessGroup, schedule: str,
    microbatches: int, loss_fn: OutputLoss, device: torch.device,
) -> ScheduleGPipe | Schedule1F1B:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside [0, {stages})")
    if dist.get_world_size(group) != stages or dist.get_rank(group) != stage:
        raise ValueError(
            f"stage {stage} of {stages} needs a worker group of {stages} ranks in stage order; "
            f"this rank is {dist.get_rank(group)} of {dist.get_world_size(group)} in it"
        )
    # Shapes are inferred from the first micro-batch (one metadata send/recv per stage pair),
    # so the stage needs no example inputs.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pipe_stage = PipelineStage(model, stage, stages, device, group=group)
    make = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return make(pipe_stage, microbatches, loss_fn=loss_fn, scale_grads=True)


def _check_split(n: int, microbatches: int) -> None:
    # Unequal micro-batches would weight the mean of micro-batch means wrongly.
    if n % microbatches:
        raise ValueError(f"batch of {n} sequences does not split into {microbatches} equal micro-batches")


def _pipe_step(
    sched: ScheduleGPipe | Schedule1F1B, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor,
    losses: list, forward_only: bool,
) -> None:
    """Run the schedule once; the first stage feeds x, the last takes y and fills `losses`."""
    args = (x,) if stage == 0 else ()
    kw = {"target": y, "losses": losses} if stage == stages - 1 else {}
    if forward_only:
        sched.eval(*args, **kw)
    else:
        sched.step(*args, return_outputs=False, **kw)


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """float64 sum of a slice's squared per-tensor grad norms (the norms clip_grad_norm_ takes)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([torch.linalg.vector_norm(g, 2) for g in grads]).double().square().sum()


def _tally(total: torch.Tensor, mb_losses: list[torch.Tensor], y: torch.Tensor) -> None:
    """Add one batch to total = [sum of loss * target tokens, tokens]: the mean of its micro-batch
    losses, weighted by its tokens (pipeline evals and the emulated ones alike)."""
    total[0] += float(torch.stack(mb_losses).mean()) * y.numel()
    total[1] += y.numel()


def _groups_of(microbatches: int, groups: int) -> int:
    """`groups` (`[topology] replicas`), after checking each gets an equal share of the micro-batches."""
    if groups < 1 or microbatches % groups:
        raise ValueError(f"{microbatches} micro-batches do not split into {groups} equal groups (one per replica)")
    return groups


def _group_losses(losses: list[torch.Tensor], groups: int, model: nn.Module) -> torch.Tensor:
    """A step run in `groups` groups of micro-batches (`[topology] replicas`), from `sum_groups`:
    each group's gradient is its micro-batches' mean (`scale_grads`) and the groups were added up,
    so the sums are divided by `groups`; the step's loss is the mean of every group's micro-batch
    losses (in order: what one pipeline running them all computes), as float64."""
    if groups > 1:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(groups)
    return torch.cat(losses).mean().double()


def _clip(cfg: TrainConfig, grads: list[torch.Tensor], stage_sq: list[float]) -> None:
    """Clip a slice's grads by the GLOBAL norm, from every stage's squared norm in stage order
    (summed in that order on every stage, so all stages get the same coefficient); the same rule
    as torch.nn.utils.clip_grad_norm_."""
    if cfg.grad_clip <= 0:
        return
    coef = cfg.grad_clip / (math.sqrt(sum(stage_sq)) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(torch.tensor(coef, dtype=g.dtype))


class TiedEnds:
    """`[model] tie` across a worker's pipeline. The first stage owns the token embedding; the last
    stage's head holds a copy of it (`model.head_copy`), which is no parameter of that stage.
    Before every step and eval the first stage sends the embedding to the last (`refresh`); after
    every backward the last sends the copy's gradient back (`return_grad`), divided by the
    micro-batches as the schedule divides the parameters' gradients, and the first adds it to the
    embedding's gradient, before the global-norm clip and the step. So the embedding's gradient
    is the tied model's (the embedding's own plus the head's), one optimizer steps it, and its
    deltas, packets, checkpoints and trace name it once, on the first stage. One message each way
    per step, the embedding's size, between the worker's first and last stage; middle stages and
    untied models do nothing. (Megatron-LM instead keeps the parameter, with its own optimizer
    state, on both ends and all-reduces their gradients: the same bytes per step, the state
    twice.)"""

    def __init__(self, model: nn.Module, stages: int, group: dist.ProcessGroup) -> None:
        self.embedding, self.copy = tied_ends(model)
        self.stages, self.group = stages, group
        if self.copy is not None:
            self.copy.requires_grad_(True)  # the head's gradient is the copy's

    def refresh(self) -> None:
        if self.embedding is not None:
            dist.send(self.embedding.detach(), group=self.group, group_dst=self.stages - 1, tag=TIE_TAG)
        if self.copy is not None:
            dist.recv(self.copy.detach(), group=self.group, group_src=0, tag=TIE_TAG)

    def return_grad(self, microbatches: int) -> None:
        if self.copy is not None:
            dist.send(_take_grad(self.copy, microbatches), group=self.group, group_dst=0, tag=TIE_TAG)
        if self.embedding is not None:
            head = torch.empty_like(self.embedding)
            dist.recv(head, group=self.group, group_src=self.stages - 1, tag=TIE_TAG)
            self.embedding.grad.add_(head)


def _take_grad(copy: torch.Tensor, microbatches: int) -> torch.Tensor:
    """The head copy's gradient over the step's micro-batches, divided as `scale_grads` divides a
    parameter's; the copy is left without one for the next step."""
    grad = copy.grad
    copy.grad = None
    if microbatches != 1:
        grad.div_(microbatches)
    return grad


def combine_stage_hashes(stage_hashes: list[str]) -> str:
    """One worker-wide trace entry from the per-stage state hashes, in stage order."""
    return hashlib.sha256(b"".join(bytes.fromhex(h) for h in stage_hashes)).hexdigest()


class PipelineInnerLoop(InnerLoop):
    """AdamW over one stage's slice, with the steps run through the worker's pipeline.

    Same interface as `InnerLoop` (`run`, `step_count`, `state_tensors`, `load_state_tensors`,
    `state_hash`, `.model`), so the round engine can use either. Differences:
    - `run(...).losses` are the worker's losses (computed on the last stage, sent to all), and
      `run(...).trace` entries are worker-wide: `combine_stage_hashes` of every stage's
      `state_hash()`. Both are identical on every stage of the worker.
    - `state_hash()`, `state_tensors()` cover only this stage's slice (names as in the full model).
    - every stage of the worker must call `run`/`step` together (they are collective).

    `model` is this stage's module (`topology.build_stage_model`); `group` is the worker group
    (`Topology.build_groups()[0]`), whose rank order is the stage order; `total_steps` drives
    the LR schedule (`inner.lr_at`), as in `InnerLoop`; `loss_fn(output, targets)` is applied on
    the last stage to each micro-batch and must be a mean over the micro-batch.

    `groups` = R (`[topology] replicas`): a step's `microbatches` run in R groups of consecutive
    micro-batches, each through the schedule (built for microbatches / R), the groups' gradients
    added up in order and divided by R. With `.replicas` (an `inner.Replicas`) this process runs
    its own group and `group` is its replica's pipeline; without, it runs every group in turn, as
    a replay of a replicas' worker does.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        total_steps: int,
        *,
        stage: int,
        stages: int,
        group: dist.ProcessGroup,
        microbatches: int = 1,
        schedule: str = "gpipe",
        loss_fn: OutputLoss = lm_loss,
        device: torch.device | str = "cpu",
        groups: int = 1,
    ) -> None:
        # InnerLoop builds the same AdamW param groups as the unsplit run, over this slice only.
        super().__init__(model, cfg, total_steps, lambda m, x, y: loss_fn(m(x), y))
        self.stage, self.stages, self.group = stage, stages, group
        self.microbatches, self.schedule, self.device = microbatches, schedule, torch.device(device)
        self.groups = _groups_of(microbatches, groups)
        self.sched = _make_schedule(model, stage, stages, group, schedule, microbatches // groups, loss_fn, self.device)
        self.tie = TiedEnds(model, stages, group)

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One pipelined AdamW step on (x, y) (collective over the worker group); returns the
        loss before the step, the same value on every stage."""
        _check_split(y.shape[0], self.microbatches)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.cfg, self.step_count, self.total_steps, self.round_start)
        self.opt.zero_grad(set_to_none=True)
        self.tie.refresh()
        per_group = self.microbatches // self.groups
        xs, ys = torch.tensor_split(x, self.groups), torch.tensor_split(y, self.groups)

        def group(i: int) -> torch.Tensor:  # group i's gradient (in .grad) and its loss (the last stage's)
            mb_losses: list[torch.Tensor] = []
            _pipe_step(self.sched, self.stage, self.stages, xs[i].to(self.device), ys[i].to(self.device), mb_losses,
                       forward_only=False)
            self.tie.return_grad(per_group)
            if self.is_last:
                return torch.stack(mb_losses).detach()
            return torch.zeros(per_group, device=self.device)

        loss = _group_losses(sum_groups(self.model, self.groups, group, self.replicas, self.opt.zero_grad),
                             self.groups, self.model)
        params = list(self.model.parameters())
        sharded = self.replicas is not None and self.replicas.shard
        if sharded:  # ZeRO-1: this replica holds the summed gradients of the params it owns; the
            # slice's norm from every param's norm, each from its owner, as _squared_norm sums them
            grads = [p.grad for p in self.replicas.owned(params)]
            sq = torch.stack(self.replicas.param_norms(params)).double().square().sum()
        else:
            grads = [p.grad for p in params if p.grad is not None]
            sq = _squared_norm(grads, self.device)
        mine = torch.stack([sq, loss]).to(self.device)  # collectives take tensors on the backend's device
        every = [torch.zeros_like(mine) for _ in range(self.stages)]
        dist.all_gather(every, mine, group=self.group)
        _clip(self.cfg, grads, [float(t[0]) for t in every])
        self.opt.step()
        if sharded:
            self.replicas.share_owned(params)
        self.step_count += 1
        return float(every[-1][1])

    # `run` (InnerLoop's): pipelined steps, a late update landing on every stage; every stage calls it
    # with the same batches (each uses x or y), and its trace entries are the worker's

    def trace_hash(self) -> str:
        return self.worker_state_hash()

    def worker_state_hash(self) -> str:
        """`combine_stage_hashes` of every stage's `state_hash()` (collective over the worker)."""
        digest = bytearray(bytes.fromhex(self.state_hash()))
        mine = torch.frombuffer(digest, dtype=torch.uint8).to(self.device)
        every = [torch.zeros_like(mine) for _ in range(self.stages)]
        dist.all_gather(every, mine, group=self.group)
        return combine_stage_hashes([bytes(t.cpu().tolist()).hex() for t in every])


class _EveryLoop:
    """An attribute that each of `EmulatedPipeline.loops` holds alike (the stages step in lockstep)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: EmulatedPipeline | None, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.loops[0], self.name)

    def __set__(self, obj: EmulatedPipeline, value: Any) -> None:
        for loop in obj.loops:
            setattr(loop, self.name, value)


class EmulatedPipeline:
    """A worker's S-stage pipeline run in ONE process, bit for bit: the same trace hashes, losses
    and params as `PipelineInnerLoop` on S processes (tests/test_pipeline.py checks it). It lets
    one process (the offline audit) replay a pipelined worker's round.

    Why it is exact: per micro-batch it runs the stages' forwards on the same tensors the pipeline
    sends (a stage's input is a fresh leaf, as a received activation is), takes the same backwards
    (the loss on the last stage, then each stage's outputs with the next stage's input grad, which
    is what the pipeline sends back), accumulates param grads over the micro-batches in the same
    order (GPipe and 1F1B both run backwards in micro-batch order), divides them by the number of
    micro-batches as `scale_grads` does, and clips and steps each slice with `_clip` and its own
    AdamW, exactly as `PipelineInnerLoop.step`. It needs memory for the whole model.

    `stage_models`: each stage's module (`topology.build_stage_model`), in stage order, at the
    start params. Interface of `InnerLoop`: `run`, `step`, `step_count`, and `named_parameters()`
    for the whole model's params (the stages' names are the full model's)."""

    def __init__(self, stage_models: list[nn.Module], cfg: TrainConfig, total_steps: int, *,
                 microbatches: int = 1, loss_fn: OutputLoss = lm_loss, groups: int = 1) -> None:
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.models, self.cfg, self.microbatches, self.loss_fn = stage_models, cfg, microbatches, loss_fn
        self.groups = _groups_of(microbatches, groups)  # [topology] replicas: each one's micro-batches, in turn
        self.loops = [InnerLoop(m, cfg, total_steps, None) for m in stage_models]  # each slice's AdamW
        self.embedding, self.copy = tied_ends(stage_models[0])[0], tied_ends(stage_models[-1])[1]  # TiedEnds, in one process
        if self.copy is not None:
            self.copy.requires_grad_(True)

    # the LR schedule's clock, the same on every stage's loop: read from the first, set on all
    step_count = _EveryLoop()
    total_steps = _EveryLoop()
    round_start = _EveryLoop()

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        for m in self.models:
            yield from m.named_parameters()

    def parameters(self) -> Iterable[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step of the worker's pipeline on (x, y); returns the loss before the step. With
        `groups` (a replicas' worker), each group of micro-batches as one replica's pipeline runs
        it, the groups added up as `Replicas.combine` adds them."""
        _check_split(y.shape[0], self.microbatches)
        for loop in self.loops:
            for g in loop.opt.param_groups:
                g["lr"] = lr_at(self.cfg, loop.step_count, loop.total_steps, loop.round_start)
            loop.opt.zero_grad(set_to_none=True)
        self._refresh()
        xs, ys = torch.tensor_split(x, self.groups), torch.tensor_split(y, self.groups)

        def zero_grad(set_to_none: bool = True) -> None:
            for loop in self.loops:
                loop.opt.zero_grad(set_to_none=set_to_none)

        loss = _group_losses(sum_groups(self, self.groups, lambda i: self._group(xs[i], ys[i]), None, zero_grad),
                             self.groups, self)
        grads = [[p.grad for p in m.parameters() if p.grad is not None] for m in self.models]
        stage_sq = [float(_squared_norm(gs, torch.device("cpu"))) for gs in grads]
        for loop, gs in zip(self.loops, grads, strict=True):
            _clip(self.cfg, gs, stage_sq)
            loop.opt.step()
            loop.step_count += 1
        return float(loss)

    def _group(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The pipeline's schedule on one group's micro-batches, in one process: the gradients
        (in .grad, each the micro-batches' mean, the tied head's added) and the mean loss."""
        microbatches = self.microbatches // self.groups
        mb_losses = []
        for xm, ym in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches), strict=True):
            inputs, outputs, h = [], [], xm
            for s, m in enumerate(self.models):
                if s > 0:  # what the next stage receives: a leaf with the same values
                    h = h.detach().requires_grad_(True)
                inputs.append(h)
                h = m(h)
                outputs.append(h)
            loss = self.loss_fn(h, ym)
            mb_losses.append(loss)
            torch.autograd.backward([loss])
            for s in range(len(self.models) - 2, -1, -1):
                torch.autograd.backward([outputs[s]], grad_tensors=[inputs[s + 1].grad])
        if microbatches != 1:  # scale_grads: a division, as the pipeline's stage does it
            for g in (p.grad for p in self.parameters() if p.grad is not None):
                g.div_(microbatches)
        if self.copy is not None:  # TiedEnds.return_grad
            self.embedding.grad.add_(_take_grad(self.copy, microbatches))
        return torch.stack(mb_losses).detach()

    def _refresh(self) -> None:
        """TiedEnds.refresh: the last stage's head copy := the first stage's embedding."""
        if self.copy is not None:
            with torch.no_grad():
                self.copy.copy_(self.embedding)

    def run(self, batch_of_step: BatchFn, steps: int, trace_every: int = 0, land: Landing | None = None,
            poll: Callable[[], None] | None = None) -> InnerResult:
        """As `PipelineInnerLoop.run`: worker-wide trace entries every trace_every steps."""
        return run_steps(self.step, self.worker_state_hash, batch_of_step, steps, trace_every, land, poll)

    def worker_state_hash(self) -> str:
        return combine_stage_hashes([loop.state_hash() for loop in self.loops])

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The whole worker's inner state (every stage's slice, merged) into each stage's AdamW:
        `InnerLoop.load_state_tensors` per slice, each with the keys of its own params."""
        for loop, m in zip(self.loops, self.models, strict=True):
            names = {n for n, _ in m.named_parameters()}
            loop.load_state_tensors({k: v for k, v in tensors.items()
                                     if k == "inner/step_count" or k[len("inner/"):].rsplit("/", 1)[0] in names})

    def eval_loss(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """`pipeline_eval_loss` of the stages' params, with the same arithmetic: per batch, the
        mean of the micro-batch losses, weighted by the batch's target tokens."""
        total = torch.zeros(2, dtype=torch.float64)  # [sum of loss * tokens, tokens]
        self._refresh()
        with torch.no_grad():
            for x, y in batches:
                _check_split(y.shape[0], self.microbatches)
                mb_losses = []
                for xm, ym in zip(torch.tensor_split(x, self.microbatches), torch.tensor_split(y, self.microbatches),
                                  strict=True):
                    h = xm
                    for m in self.models:
                        h = m(h)
                    mb_losses.append(self.loss_fn(h, ym))
                _tally(total, mb_losses, y)
        return float(total[0] / total[1])


class PipelineEval:
    """Mean loss of the full model over batches (weighted by target tokens), computed forward
    only through the worker's stages; collective over `worker_group`, the same value on every
    stage, and every stage passes the same batches. The schedule is built once, for batches of
    one shape (building a stage costs a set-up and a shape exchange), so keep one per shape."""

    def __init__(self, stage_model: nn.Module, worker_group: dist.ProcessGroup, *, stage: int, stages: int,
                 microbatches: int = 1, loss_fn: OutputLoss = lm_loss, device: torch.device | str = "cpu") -> None:
        self.group, self.stage, self.stages, self.microbatches = worker_group, stage, stages, microbatches
        self.device = torch.device(device)
        self.sched = _make_schedule(stage_model, stage, stages, worker_group, "gpipe", microbatches, loss_fn, self.device)
        self.tie = TiedEnds(stage_model, stages, worker_group)

    def __call__(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # [sum of loss * tokens, tokens]
        self.tie.refresh()
        with torch.no_grad():
            for x, y in batches:
                _check_split(y.shape[0], self.microbatches)
                mb_losses: list[torch.Tensor] = []
                _pipe_step(self.sched, self.stage, self.stages, x.to(self.device), y.to(self.device), mb_losses,
                           forward_only=True)
                if self.stage == self.stages - 1:
                    _tally(total, mb_losses, y)
                else:
                    total[1] += y.numel()
        dist.broadcast(total, group=self.group, group_src=self.stages - 1)
        return float(total[0] / total[1])


def pipeline_eval_loss(
    stage_model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    worker_group: dist.ProcessGroup,
    *,
    stage: int,
    stages: int,
    microbatches: int = 1,
    loss_fn: OutputLoss = lm_loss,
    device: torch.device | str = "cpu",
) -> float:
    """One PipelineEval of `batches` (a schedule built for this call)."""
    return PipelineEval(stage_model, worker_group, stage=stage, stages=stages, microbatches=microbatches,
                        loss_fn=loss_fn, device=device)(batches)


__all__ = ["EmulatedPipeline", "PipelineEval", "PipelineInnerLoop", "TiedEnds", "pipeline_eval_loss", "combine_stage_hashes", "SCHEDULES"]
