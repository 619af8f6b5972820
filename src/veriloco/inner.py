"""The inner loop: H local AdamW steps from the global params (DiLoCo's inner optimizer).

The inner optimizer state is kept across rounds (DiLoCo, Douillard et al. 2023, arXiv 2311.08105:
"inner_steps" is H). The learning rate follows linear warmup then cosine decay over the run's
total inner steps. Every `trace_every` steps the loop hashes its state (params + optimizer state)
into a trace, so a verifier can later replay a segment and compare.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import TrainConfig
from .hashing import tensors_hash

if TYPE_CHECKING:
    from .verify.kept import KeptStates

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
BatchFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Spent:
    """Seconds spent, summed over the `timing()` blocks: wall clock, and CPU seconds of the
    calling thread (time.thread_time: the compute, without the time the process waited or shared
    its core with other workers, as 4 workers on this machine's 2 cores do in bench/)."""

    wall: float = 0.0
    cpu: float = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - t0
            self.cpu += time.thread_time() - c0


@dataclass
class InnerResult:
    """What one round of inner steps produced."""

    losses: list[float]
    seconds: float
    tokens: int
    trace: list[str] = field(default_factory=list)  # state hash every trace_every steps
    cpu_seconds: float = 0.0  # this thread's CPU seconds in those steps (see Spent)

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / max(len(self.losses), 1)


def lr_at(cfg: TrainConfig, step: int, total_steps: int, round_start: int | None = None) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine down to lr * min_lr_ratio; with
    `round_warmup_steps` = w (DiLoCo rounds only), times (s + 1) / w at step s < w of each round,
    s = step - round_start (step % inner_steps when every round has H steps: round_start None)."""
    ramp = 1.0
    if cfg.round_warmup_steps and cfg.mode == "diloco":
        s = step % cfg.inner_steps if round_start is None else step - round_start
        ramp = min(1.0, (s + 1) / cfg.round_warmup_steps)
    if step < cfg.warmup_steps:
        return ramp * cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return ramp * (floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress)))


@dataclass
class Landing:
    """Where a late outer update lands inside a round (`[outer] overlap_steps`, Streaming DiLoCo's
    tau): `move()` runs once before inner step `step` (after the trace hash of the steps before
    it), or after the last step when a round has no more than `step` steps. It may move the
    params; its seconds are not the loop's."""

    step: int
    move: Callable[[], None]


def shift_params(model: nn.Module, to: dict[str, torch.Tensor], frm: dict[str, torch.Tensor]) -> None:
    """Move the model's params by to - frm (a landing: the worker's params follow G from the start
    point it began from to the G that landed). One op order, so a replay moves the same bits."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.add_((to[k] - frm[k]).to(p.device))


def run_steps(step: Callable[[torch.Tensor, torch.Tensor], float], trace_hash: Callable[[], str],
              batch_of_step: BatchFn, steps: int, trace_every: int = 0, land: Landing | None = None,
              poll: Callable[[], None] | None = None) -> InnerResult:
    """`steps` calls of step(*batch_of_step(s)); trace_hash() at the start and every trace_every
    steps; `land.move()` before step land.step; `poll()` after every step (the loops' shared
    `run`). The seconds of move() and poll() are not the loop's."""
    t0, c0 = time.perf_counter(), time.thread_time()
    losses, trace, tokens, aside = [], [], 0, Spent()  # aside: move's and poll's time

    def move() -> None:
        with aside.timing():
            land.move()

    if trace_every:
        trace.append(trace_hash())
    for s in range(steps):
        if land is not None and s == land.step:
            move()
        x, y = batch_of_step(s)
        losses.append(step(x, y))
        tokens += y.numel()
        if trace_every and (s + 1) % trace_every == 0:
            trace.append(trace_hash())
        if poll is not None:
            with aside.timing():
                poll()
    if land is not None and steps <= land.step:
        move()
    return InnerResult(losses, time.perf_counter() - t0 - aside.wall, tokens, trace,
                       time.thread_time() - c0 - aside.cpu)


class Replicas:
    """The `[topology] replicas` processes of one worker, which split every inner step: of the
    step's `grad_accum` parts, replica `index` runs the `grad_accum / count` consecutive parts of
    group `index` (adding their gradients up in order, as autograd does), and `combine` gives each
    of them the sum of the groups' gradients and losses, added in group order. With one part per
    replica that is bit for bit what one process makes running the parts one after another; with
    more, a replay runs the groups in turn and adds them up the same way (`InnerLoop.
    emulated_replicas`). With `shard` (`[topology] shard_optimizer`, ZeRO-1) each param belongs to
    one replica (`owners`), which receives every group's gradient of it (all_to_all), adds them up
    in group order, clips it with the whole model's norm (`clip`), steps it with its own share of
    AdamW and broadcasts it (`share_owned`); replica 0 gathers the others' optimizer state where
    the whole is hashed or saved (`gather_state`). Without, the owners broadcast the summed
    gradients instead, and every replica steps the whole optimizer. Either moves 2 (R-1)/R of the
    model per replica per step, as a ring all-reduce does, but in a fixed order, so a one-process
    replay reproduces it exactly. With `bucket_bytes` (`[topology] bucket_mb`) the gradients go to
    their owners in buckets started inside the backward (`watch`, `_Buckets`), the same floats."""

    def __init__(self, group: object, index: int, count: int, shard: bool = False, bucket_bytes: int = 0) -> None:
        self.group, self.index, self.count, self.shard = group, index, count, shard
        self._owners: list[int] | None = None
        # `[topology] bucket_mb`: the reduce in buckets, each started as the backward finishes its
        # gradients (`watch`); 0 = all at once after the backward
        self.bucket_bytes = bucket_bytes
        self._watched: _Buckets | None = None

    def owners(self, params: list[torch.Tensor]) -> list[int]:
        """`shard`: the replica that owns each param (its summed gradient, its AdamW state and its
        update): the largest params first, each to the replica that owns the fewest elements so
        far (the lowest index on a tie), so the same on every replica and in every run."""
        if self._owners is None:
            load, owners = [0] * self.count, [0] * len(params)
            for j in sorted(range(len(params)), key=lambda j: (-params[j].numel(), j)):
                owners[j] = min(range(self.count), key=lambda i: (load[i], i))
                load[owners[j]] += params[j].numel()
            self._owners = owners
        return self._owners

    def owned(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p for p, o in zip(params, self.owners(params), strict=True) if o == self.index]

    def watch(self, model: nn.Module, parts: int) -> None:
        """Before this replica's `parts` backward passes of a step (`bucket_bytes` > 0): start each
        bucket's reduce (`_Buckets`) as soon as the last of them has made its gradients."""
        if self._watched is None or self._watched.model is not model:
            self._watched = _Buckets(self, model)
        self._watched.begin(parts)

    def combine(self, model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
        """Every param's gradient becomes the groups' sum (in group order); returns every group's
        `loss` (a tensor of one shape on every replica), in group order. With `shard`, only the
        params this replica owns keep a gradient (the others' is None): their sums come to it
        alone (`share_owned` sends the updated params after the step)."""
        import torch.distributed as dist

        params = list(model.parameters())
        watched = self._watched if self._watched is not None and self._watched.parts is not None else None
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        if missing:  # every part gives every param a gradient, or the one-process sum would differ
            if watched is not None:
                watched.abandon()
            raise RuntimeError(f"replicas: parameter {missing[0]} has no gradient after this replica's part")
        if watched is not None:  # this step's buckets, started in its backward (`watch`)
            watched.finish()
        else:
            self._reduce_to_owners(params)
        if not self.shard:  # every replica steps the whole optimizer: every summed gradient everywhere
            self._from_owners(params, grads=True)
        losses = [torch.empty_like(loss) for _ in range(self.count)]
        dist.all_gather(losses, loss, group=self.group)
        return losses

    def _reduce_to_owners(self, params: list[torch.Tensor]) -> None:
        """Each replica gets every group's gradient of the params it owns (all_to_all, uneven) and
        adds them up in group order."""
        self._take_sums(self._start_reduce(params, range(len(params))))

    def _start_reduce(self, params: list[torch.Tensor], which: Iterable[int], async_op: bool = False) -> _Reduce:
        """Start sending params `which` (indices) gradients to their owners: an uneven all_to_all
        of them, owner by owner, in index order."""
        import torch.distributed as dist

        owners = self.owners(params)
        which = list(which)
        by_owner = [[j for j in which if owners[j] == d] for d in range(self.count)]
        sizes = [sum(params[j].numel() for j in js) for js in by_owner]
        send = torch.cat([params[j].grad.reshape(-1) for js in by_owner for j in js])
        mine = sizes[self.index]
        parts = send.new_empty(mine * self.count)  # [group 0's gradient of my params, group 1's, ...]
        work = dist.all_to_all_single(parts, send, [mine] * self.count, sizes, group=self.group, async_op=async_op)
        return _Reduce(params, which, by_owner[self.index], parts, send, work)

    def _take_sums(self, reduce: _Reduce) -> None:
        """A started reduce's sums, added up in group order, into the gradients of the params this
        replica owns; the others' gradients go (None)."""
        if reduce.work is not None:
            reduce.work.wait()
        mine, parts = len(reduce.parts) // self.count, reduce.parts
        total = parts[:mine].clone()
        for j in range(1, self.count):
            total += parts[j * mine : (j + 1) * mine]
        at = 0
        for j in reduce.owned:
            p = reduce.params[j]
            p.grad.copy_(total[at : at + p.numel()].view_as(p.grad))
            at += p.numel()
        owned = set(reduce.owned)
        for j in reduce.which:
            if j not in owned:
                reduce.params[j].grad = None

    def param_norms(self, params: list[torch.Tensor], foreach: bool = False) -> list[torch.Tensor]:
        """`shard`: every param's gradient norm, in param order, each from its owner (all_gather):
        the per-param norms torch.nn.utils.clip_grad_norm_ takes (through the multi-tensor kernel
        with `foreach`, as InnerLoop's clip on a GPU)."""
        import torch.distributed as dist

        owners = self.owners(params)
        mine = [j for j, o in enumerate(owners) if o == self.index]
        norms = torch.zeros(len(params), dtype=params[0].dtype, device=params[0].device)
        grads = [params[j].grad for j in mine]
        own = torch._foreach_norm(grads, 2) if foreach and grads else [torch.linalg.vector_norm(g, 2) for g in grads]
        for j, n in zip(mine, own, strict=True):
            norms[j] = n
        every = [torch.empty_like(norms) for _ in range(self.count)]
        dist.all_gather(every, norms, group=self.group)
        return [every[o][j] for j, o in enumerate(owners)]

    def clip(self, params: list[torch.Tensor], max_norm: float, foreach: bool = False) -> None:
        """`shard`: clip_grad_norm_ over the whole model, each replica scaling the gradients it
        owns: the total and the coefficient from `param_norms` as clip_grad_norm_ computes them (a
        vector norm of the per-param norms in param order), so the scaled gradients are the
        one-process ones bit for bit."""
        total = torch.linalg.vector_norm(torch.stack(self.param_norms(params, foreach)), 2)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.owned(params):
            p.grad.mul_(coef)

    def share_owned(self, params: list[torch.Tensor]) -> None:
        """`shard`: after the step, each replica's updated params to the others, so every replica
        holds the whole model again."""
        self._from_owners(params, grads=False)

    def _from_owners(self, params: list[torch.Tensor], grads: bool) -> None:
        """Each owner's params (or their summed gradients) to the others: a broadcast from each."""
        import torch.distributed as dist

        owners = self.owners(params)
        for d in range(self.count):
            ps = [p for p, o in zip(params, owners, strict=True) if o == d]
            if not ps:
                continue
            if d == self.index:
                flat = torch.cat([(p.grad if grads else p.detach()).reshape(-1) for p in ps])
            else:
                flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            dist.broadcast(flat, group=self.group, group_src=d)
            if d != self.index:
                at = 0
                with torch.no_grad():
                    for p in ps:
                        part = flat[at : at + p.numel()].view_as(p)
                        if grads:
                            p.grad = part.clone()
                        else:
                            p.copy_(part)
                        at += p.numel()

    def send_state(self, views: dict[str, torch.Tensor]) -> None:
        """`shard`, a replica other than 0: its AdamW state (the params it owns) to replica 0."""
        import torch.distributed as dist

        size, data = _state_bytes({k: v for k, v in views.items() if k != "inner/step_count"})
        dist.send(size, group=self.group, group_dst=0)
        dist.send(data, group=self.group, group_dst=0)

    def gather_state(self) -> dict[str, torch.Tensor]:
        """`shard`, replica 0: the other replicas' AdamW state (`send_state`), merged."""
        import torch.distributed as dist

        out: dict[str, torch.Tensor] = {}
        for i in range(1, self.count):
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, group=self.group, group_src=i)
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(data, group=self.group, group_src=i)
            out.update(_state_of(data))
        return out

    def broadcast_state(self, views: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Replica 0's optimizer state (`views`; None on the others) to every replica: what each
        loads when a resume's state reaches them. Through the CPU (gloo) on any device."""
        import torch.distributed as dist

        size, data = _state_bytes(views) if views is not None else (torch.zeros(1, dtype=torch.int64), None)
        dist.broadcast(size, group=self.group, group_src=0)
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, group=self.group, group_src=0)
        return _state_of(data)


@dataclass
class _Reduce:
    """One started reduce of some params' gradients to their owners (`Replicas._start_reduce`)."""

    params: list[torch.Tensor]
    which: list[int]  # the params it carries (indices into params)
    owned: list[int]  # of which this replica owns these, in the order their sums arrive
    parts: torch.Tensor  # every group's gradients of them, group by group, as they arrive
    send: torch.Tensor  # (kept alive until the reduce is done)
    work: object | None  # the async all_to_all; None when it ran to completion


class _Buckets:
    """`[topology] bucket_mb`: a replica's reduce of a step's gradients in buckets of about
    `Replicas.bucket_bytes`, the params in reverse order (the backward makes the last layers'
    gradients first), as DDP's reducer groups them. A param's gradient is final at the `parts`-th
    time this step's backward passes accumulate into it (a post-accumulate hook counts them); a
    bucket's reduce starts once all of its gradients are final and every bucket before it has
    started, so every replica starts them in the same order whatever order its backward made them
    in. Each param's sum is added up in group order as without buckets: the same floats."""

    def __init__(self, replicas: Replicas, model: nn.Module) -> None:
        self.replicas, self.model = replicas, model
        self.params = list(model.parameters())
        self.index = {id(p): j for j, p in enumerate(self.params)}
        self.buckets: list[list[int]] = [[]]
        size = 0
        for j in reversed(range(len(self.params))):
            if size >= replicas.bucket_bytes and self.buckets[-1]:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(j)
            size += self.params[j].numel() * self.params[j].element_size()
        self.buckets = [sorted(js) for js in self.buckets]  # each sent in param order
        self.bucket_of = {j: b for b, js in enumerate(self.buckets) for j in js}
        self.parts: int | None = None  # watching a step: the backward passes that make its gradients
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def begin(self, parts: int) -> None:
        self.parts, self.counts = parts, [0] * len(self.params)
        self.left = [len(js) for js in self.buckets]
        self.started: list[_Reduce] = []

    def _accumulated(self, p: torch.Tensor) -> None:
        if self.parts is None:  # a backward outside a watched step
            return
        j = self.index[id(p)]
        self.counts[j] += 1
        if self.counts[j] == self.parts:
            self.left[self.bucket_of[j]] -= 1
            while len(self.started) < len(self.buckets) and not self.left[len(self.started)]:
                self.started.append(self.replicas._start_reduce(self.params, self.buckets[len(self.started)],
                                                                async_op=True))

    def finish(self) -> None:
        """After the backward: the buckets not started yet (none, when every gradient was made),
        then every bucket's sums in start order."""
        for b in range(len(self.started), len(self.buckets)):
            self.started.append(self.replicas._start_reduce(self.params, self.buckets[b], async_op=True))
        started, self.parts = self.started, None
        for reduce in started:
            self.replicas._take_sums(reduce)

    def abandon(self) -> None:
        """A failed step: stop watching (the started reduces' partners fail the same way)."""
        self.parts = None


def _state_bytes(views: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """An optimizer state as safetensors bytes in a uint8 tensor (never pickle), and its length."""
    from safetensors.torch import save

    data = save({k: v.detach().cpu().contiguous() for k, v in views.items()})
    return torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _state_of(data: torch.Tensor) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(bytes(data.numpy()))


def sum_groups(model: nn.Module, groups: int, group: Callable[[int], torch.Tensor], replicas: Replicas | None,
               zero_grad: Callable[..., None]) -> list[torch.Tensor]:
    """A step's gradient (left in .grad) from `groups` groups of its parts, added up in group
    order, and every group's loss in group order; `group(i)` runs group i, leaving its gradient in
    .grad and returning its loss. On a replica (`replicas`) this process runs its own group and
    `Replicas.combine` adds them up; otherwise (one group, or a replay of a replicas' worker) it
    runs every group in turn and adds them up the same way: the same floats."""
    if replicas is not None:
        return replicas.combine(model, group(replicas.index))
    if groups == 1:
        return [group(0)]
    params, losses = list(model.parameters()), []
    for i in range(groups):
        if i:
            zero_grad(set_to_none=True)
        losses.append(group(i))
        if any(p.grad is None for p in params):
            raise RuntimeError("replicas: a parameter has no gradient after a replica's parts")
        if i == 0:
            sums = [p.grad for p in params]
        else:
            for total, p in zip(sums, params, strict=True):
                total += p.grad
    for total, p in zip(sums, params, strict=True):
        p.grad = total
    return losses


class AdamW:
    """`torch.optim.AdamW`'s step, bit for bit (tests/test_inner_adamw.py compares them): the same
    lazily made state (`step` a CPU scalar, `exp_avg`, `exp_avg_sq`) and the same kernel call
    (`torch.optim.adam.adam` with decoupled weight decay), without `torch.optim.Optimizer`, whose
    first construction in a process imports torch._dynamo (0.9 s: an audit's first replay paid
    it). What the inner loop uses of an optimizer: `param_groups` (each step sets their lr),
    `state` (param -> its tensors, in the order they were made), `zero_grad`, `step`."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], foreach: bool,
                 eps: float = 1e-8) -> None:
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, **g, "params": list(g["params"])} for g in groups]
        for g in self.param_groups:  # what torch.optim.AdamW's constructor refuses
            b1, b2 = g["betas"]
            if not (g["lr"] >= 0 and g["eps"] >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1 and g.get("weight_decay", 0) >= 0):
                raise ValueError(f"AdamW: invalid lr {g['lr']}, eps {g['eps']}, betas {g['betas']} or weight decay "
                                 f"{g.get('weight_decay', 0)}")
        self.foreach = foreach
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)  # as torch's

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim.adam import adam

        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                if not self.state.get(p):
                    self.state[p] = {"step": torch.tensor(0.0, dtype=scalar, device="cpu"),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            st = [self.state[p] for p in params]
            adam(params, [p.grad for p in params], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
                 [s["step"] for s in st], foreach=self.foreach, capturable=False, differentiable=False, fused=None,
                 grad_scale=None, found_inf=None, has_complex=any(torch.is_complex(p) for p in params),
                 decoupled_weight_decay=True, amsgrad=False, beta1=g["betas"][0], beta2=g["betas"][1], lr=g["lr"],
                 weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)


class InnerLoop:
    """AdamW over one model (or one pipeline stage's slice of it)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, total_steps: int, loss_fn: LossFn) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.model, self.cfg, self.total_steps, self.loss_fn = model, cfg, total_steps, loss_fn
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        # one kernel path on the CPU, which keeps CPU runs bit-reproducible on every machine; on a GPU
        # the multi-tensor kernels (a replay there takes the same path)
        self._foreach = any(p.is_cuda for p in model.parameters())
        self.opt = AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            foreach=self._foreach,
        )
        self.step_count = 0  # inner steps taken so far in the run (drives the LR schedule)
        self.round_start: int | None = None  # step_count when this round began, when H varies (lr_at)
        # `[verify] replay_extent = "state"`: keeps a copy of the state behind every trace entry of
        # the round, in trace order, for an auditor drawn to replay a segment from its start
        # (verify/kept.py: its `append` copies the live tensors it is handed)
        self.keep: KeptStates | None = None
        self.replicas: Replicas | None = None  # [topology] replicas: this process runs its group of each step's parts
        self.emulated_replicas = 1  # a replay of a replicas' worker: every group here, summed as the replicas did
        self.in_steps = False  # inside run(): sharded replicas are at the same trace point
        self.ask_state: Callable[[], None] | None = None  # sharded replica 0, between rounds: the others send their state

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One AdamW step on (x, y); returns the loss before the step. With `grad_accum` = k the
        batch runs forward and backward in k equal parts, each loss divided by k, so the gradient
        is the whole batch's mean up to float rounding (DDP all-reduces after the last part only)."""
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.cfg, self.step_count, self.total_steps, self.round_start)
        self.opt.zero_grad(set_to_none=True)
        parts = self.cfg.grad_accum
        if parts == 1:
            loss = self.loss_fn(self.model, x, y)
            loss.backward()
        else:
            loss = self._accumulate(x, y, parts)
        sharded = self.replicas is not None and self.replicas.shard
        if self.cfg.grad_clip > 0 and sharded:
            self.replicas.clip(list(self.model.parameters()), self.cfg.grad_clip, self._foreach)
        elif self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip, foreach=self._foreach)
        self.opt.step()  # sharded: only the params with a gradient, this replica's (AdamW skips the rest)
        if sharded:
            self.replicas.share_owned(list(self.model.parameters()))
        self.step_count += 1
        return float(loss.detach())

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
        """The gradient (in .grad) and loss of a step run in `parts` parts, in groups of
        consecutive parts, one group per replica (`[topology] replicas`; else one group): each
        group's parts added up in order (autograd adds each part's gradient to what is there),
        then the groups' sums and losses in group order (`sum_groups`; a replay of a replicas'
        worker, `emulated_replicas`, runs every group in turn)."""
        groups = self.replicas.count if self.replicas is not None else self.emulated_replicas
        xs, ys, k = torch.tensor_split(x, parts), torch.tensor_split(y, parts), parts // groups

        def group(i: int) -> torch.Tensor:  # its parts' gradients accumulate in .grad; their loss
            loss = None
            for j in range(i * k, (i + 1) * k):
                quiet = self.model.no_sync() if j < parts - 1 and hasattr(self.model, "no_sync") else nullcontext()
                with quiet:  # DDP (the baseline) all-reduces after the last part only
                    part = self.loss_fn(self.model, xs[j], ys[j]) / parts
                    part.backward()
                loss = part.detach() if loss is None else loss + part.detach()
            return loss

        if self.replicas is not None and self.replicas.bucket_bytes:  # its reduce overlaps its backward
            self.replicas.watch(self.model, k)
        losses = sum_groups(self.model, groups, group, self.replicas, self.opt.zero_grad)
        loss = losses[0]
        for other in losses[1:]:  # in group order
            loss = loss + other
        return loss

    def run(self, batch_of_step: BatchFn, steps: int, trace_every: int = 0, land: Landing | None = None,
            poll: Callable[[], None] | None = None) -> InnerResult:
        """`steps` inner steps on batch_of_step(0..steps-1); trace hashes (`trace_hash`) every
        trace_every; a late update lands before step land.step."""
        self.in_steps = True
        try:
            return run_steps(self.step, self.trace_hash, batch_of_step, steps, trace_every, land, poll)
        finally:
            self.in_steps = False
            self.opt.zero_grad(set_to_none=True)  # the last step's gradients, not held through the round's checks

    def reset_state(self) -> None:
        """Forget the AdamW moments (the step counter, which drives the LR schedule, stays).

        With `[train] inner_state = "reset"` this runs at every round start, so a worker's whole
        round is a function of public data (its start params and its assigned batches) and any
        other worker can replay it bit for bit without fetching private optimizer state."""
        self.opt.state.clear()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Optimizer state as named tensors (safetensors-ready), plus the step counter."""
        return {k: v.clone() for k, v in self.state_views().items()}

    def state_views(self) -> dict[str, torch.Tensor]:
        """state_tensors without the copies (the live moments, which the next step changes): the whole
        optimizer state: with sharded replicas (replica 0), its own and the others'
        (between rounds it first asks them for it: `ask_state`, round.ReplicaSync)."""
        views = self._state_views()
        r = self.replicas
        if r is None or not r.shard or r.index != 0:
            return views
        if not self.in_steps and self.ask_state is not None:
            self.ask_state()
        return views | r.gather_state()

    def drop_unowned_state(self) -> None:
        """Sharded replicas: forget the AdamW state of the params another replica owns (after a
        resume's whole state reached every replica)."""
        mine = {id(p) for p in self.replicas.owned(list(self.model.parameters()))}
        for p in [p for p in self.opt.state if id(p) not in mine]:
            del self.opt.state[p]

    def _state_views(self) -> dict[str, torch.Tensor]:
        """This process's own part of state_views."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {"inner/step_count": torch.tensor(self.step_count, dtype=torch.int64)}
        for p, st in self.opt.state.items():
            for k, v in st.items():
                out[f"inner/{names[id(p)]}/{k}"] = torch.as_tensor(v).detach()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of state_tensors (used by resume and by replay)."""
        self.step_count = int(tensors["inner/step_count"])
        params = dict(self.model.named_parameters())
        self.opt.state.clear()
        for key, v in tensors.items():
            if key == "inner/step_count":
                continue
            _, rest = key.split("/", 1)
            pname, k = rest.rsplit("/", 1)
            if pname not in params:
                raise ValueError(f"optimizer state names unknown parameter {pname!r}")
            # moments on the param's device; AdamW keeps its scalar step count on the CPU
            self.opt.state[params[pname]][k] = v.to(params[pname].device, copy=True) if v.dim() else v.clone()

    def trace_hash(self) -> str:
        """One trace entry: `state_hash` (a pipeline stage's is its whole worker's)."""
        return self.state_hash()

    def state_hash(self) -> str:
        """Hash of params + optimizer state: one trace entry."""
        tensors = {f"param/{n}": p.detach() for n, p in self.model.named_parameters()}
        tensors.update(self.state_views())
        if self.keep is not None:
            self.keep.append(tensors)
        return tensors_hash(tensors)
