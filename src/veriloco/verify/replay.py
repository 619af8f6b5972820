"""Replay spot checks: redo a sampled segment of a worker's inner steps and compare hashes.

With `[train] inner_state = "reset"` a worker's round is a function of public data only: its
start params S_r (the round's G plus, with the eager correction, its own previous packets) and
its assigned batches; the AdamW moments start empty every round. So an auditor can replay any
prefix of the round without fetching a byte of private state — verification moves no model-sized
traffic and does not undo the compression. Segment j (inner steps j*k .. (j+1)*k - 1, k =
`[verify] trace_every`) is checked by replaying steps 0 .. (j+1)*k - 1 and comparing the state
hashes at every boundary with the committed trace: bit-exact on CPU with the same torch and
thread count (the only mode implemented; a GPU-tolerant distance check is not, see the README).

Which (worker, segment) pairs are checked is drawn from a seed that mixes the previous ledger
entry's hash with this round's commitment digests, so no worker knows its sample before it has
committed; the auditor of worker w is another worker chosen from the same seed, never w itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TrainConfig
from ..inner import InnerLoop


@dataclass(frozen=True)
class Audit:
    """One sampled check: `auditor` replays `worker`'s round up to the end of `segment`."""

    worker: int
    segment: int
    auditor: int


def sample_audits(seed_material: str, workers: list[int], world: int, segments: int, probability: float) -> list[Audit]:
    """Deterministic sample: each listed worker is audited with `probability`."""
    out = []
    if world < 2 or segments < 1:
        return out
    for w in workers:
        h = hashlib.sha256(f"veriloco/replay/{seed_material}/{w}".encode()).digest()
        u = int.from_bytes(h[:8], "little") / 2**64
        if u >= probability:
            continue
        segment = int.from_bytes(h[8:12], "little") % segments
        auditor = (w + 1 + int.from_bytes(h[12:16], "little") % (world - 1)) % world
        out.append(Audit(w, segment, auditor))
    return out


def sample_round_audits(seed_material: str, accepted: list[int], members: list[int], segments: int,
                        probability: float) -> list[Audit]:
    """`sample_audits` over the round's members (the workers whose packets it has: all of them,
    unless elastic membership left some out), so that no auditor is a worker that is not there.
    With every worker a member this is `sample_audits` itself."""
    pos = {j: i for i, j in enumerate(members)}
    drawn = sample_audits(seed_material, sorted(pos[j] for j in accepted), len(members), segments, probability)
    return [Audit(members[a.worker], a.segment, members[a.auditor]) for a in drawn]


def replay_trace(
    make_model: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    cfg: TrainConfig,
    total_steps: int,
    start: dict[str, torch.Tensor],
    steps_before: int,
    batch_of_step: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    trace_every: int,
    segments: int,
) -> list[str]:
    """State hashes at the first `segments` + 1 boundaries of a replayed round."""
    model = make_model()
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(start[k])
    inner = InnerLoop(model, cfg, total_steps, loss_fn)
    inner.step_count = steps_before
    return inner.run(batch_of_step, segments * trace_every, trace_every=trace_every).trace


def check_replay(committed: list[str], replayed: list[str]) -> int | None:
    """Index of the first trace entry that differs (None: all replayed boundaries match)."""
    for i, h in enumerate(replayed):
        if i >= len(committed) or committed[i] != h:
            return i
    return None
