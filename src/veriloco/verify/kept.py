"""The start states a worker keeps for its auditor (`[verify] replay_extent = "state"`).

Every `trace_every` inner steps the worker hashes its state (params + AdamW moments) into the
trace (`InnerLoop.state_hash`). Which segment gets replayed is drawn only after the round is
committed, so the worker keeps the state behind every entry until its round is checked, and sends
the drawn segment's start state to its auditor (round.StateMoves). That is H / k + 1 states of 3x
the model per round in flight (two under `[outer] delay = 1`), so `[verify] keep_states` says
where they wait:

- "memory": in host memory (a copy off the accelerator), reusing the memory of the states of
  rounds already checked (`pool`): no fresh pages every entry of every round;
- "disk": appended to one file per round in the worker's private directory, in the layout a state
  travels in (verify/replay.py: `state_layout`), and read back only for a drawn segment; the file
  is deleted once the round is checked.

Both hand out a state as the buffer that is sent (`buffer`) or as its tensors (`tensors`, for an
adversary's hook), bit for bit the same.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from veriloco.verify.replay import StateLayout, state_from_bytes, state_nbytes, state_to_bytes

KEEP_STATES = ("memory", "disk")


def _fits(tensors: dict[str, torch.Tensor], layout: StateLayout) -> bool:
    """Whether `tensors` have `layout`'s names, dtypes and shapes (the state before a round's first
    AdamW step has no moments: it is never sent, segment 0 starts from the public round start)."""
    return sorted(tensors) == [name for name, _, _ in layout] and all(
        tensors[name].dtype == dt and tuple(tensors[name].shape) == shape for name, dt, shape in layout)


class KeptStates(ABC):
    """One round's kept states, in trace order (entry j: the start of segment j)."""

    def __init__(self, layout: StateLayout) -> None:
        self.layout = layout
        self.size = state_nbytes(layout)

    @abstractmethod
    def append(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `tensors` (live views of the training state: copied before the next step)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many entries were appended."""

    @abstractmethod
    def buffer(self, j: int) -> torch.Tensor | None:
        """Entry j as the uint8 buffer that is sent; None when it was not kept or is not in the layout."""

    @abstractmethod
    def tensors(self, j: int) -> dict[str, torch.Tensor] | None:
        """Entry j's tensors (None when not kept)."""

    @abstractmethod
    def release(self) -> None:
        """The round is checked: give back what its states hold."""


class InMemory(KeptStates):
    """`keep_states = "memory"`: copies in host memory; `pool` holds released states' memory."""

    def __init__(self, layout: StateLayout, pool: list[dict[str, torch.Tensor]]) -> None:
        super().__init__(layout)
        self.pool = pool
        self.entries: list[dict[str, torch.Tensor]] = []

    def append(self, tensors: dict[str, torch.Tensor]) -> None:
        self.entries.append(self._copy(tensors))

    def _copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for i in range(len(self.pool) - 1, -1, -1):
            spare = self.pool[i]
            if spare.keys() == tensors.keys() and all(
                    spare[k].shape == v.shape and spare[k].dtype == v.dtype for k, v in tensors.items()):
                del self.pool[i]
                for k, v in tensors.items():
                    spare[k].copy_(v)
                return spare
        return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}

    def __len__(self) -> int:
        return len(self.entries)

    def tensors(self, j: int) -> dict[str, torch.Tensor] | None:
        return self.entries[j] if 0 <= j < len(self.entries) else None

    def buffer(self, j: int) -> torch.Tensor | None:
        t = self.tensors(j)
        return state_to_bytes(t, self.layout) if t is not None and _fits(t, self.layout) else None

    def release(self) -> None:
        self.pool.extend(self.entries)
        self.entries = []


class OnDisk(KeptStates):
    """`keep_states = "disk"`: entries appended to `path` (created, truncated), one state buffer
    each; the file goes when the round is released."""

    def __init__(self, layout: StateLayout, path: Path) -> None:
        super().__init__(layout)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w+b")  # noqa: SIM115 (open until release)
        self.offsets: list[int | None] = []
        self.end = 0

    def append(self, tensors: dict[str, torch.Tensor]) -> None:
        if not _fits(tensors, self.layout):
            self.offsets.append(None)
            return
        try:
            self.file.seek(self.end)  # (past a write that failed part-way)
            for name, _, _ in self.layout:  # state_to_bytes's bytes, written part by part (no 3x-model buffer)
                part = tensors[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                self.file.write(memoryview(part.numpy()))
        except OSError as e:  # e.g. the disk is full: say which file, and how much each state needs
            raise OSError(e.errno, f"{self.path}: cannot keep trace entry {len(self.offsets)}'s state "
                                   f"({self.size} bytes each): {e.strerror}") from None
        self.offsets.append(self.end)
        self.end += self.size

    def __len__(self) -> int:
        return len(self.offsets)

    def buffer(self, j: int) -> torch.Tensor | None:
        at = self.offsets[j] if 0 <= j < len(self.offsets) else None
        if at is None:
            return None
        self.file.flush()
        out = bytearray(self.size)
        view, got = memoryview(out), 0
        while got < self.size:  # one read moves at most ~2 GiB on Linux
            n = os.preadv(self.file.fileno(), [view[got:]], at + got)
            if n <= 0:
                raise OSError(f"{self.path}: kept state {j} is truncated ({got} of {self.size} bytes)")
            got += n
        return torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)

    def tensors(self, j: int) -> dict[str, torch.Tensor] | None:
        buf = self.buffer(j)
        return state_from_bytes(buf, self.layout) if buf is not None else None

    def release(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.path.unlink(missing_ok=True)


def kept_states(how: str, layout: StateLayout, pool: list, path: Path) -> KeptStates:
    """A round's keeper: `how` is `[verify] keep_states`; `path` the file "disk" writes."""
    if how == "disk":
        return OnDisk(layout, path)
    return InMemory(layout, pool)
