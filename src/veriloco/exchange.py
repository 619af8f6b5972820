"""Exchange: every worker's packet reaches every other worker, each packet kept separate.

`start(packet) -> handle` returns at once; `handle.wait() -> [packet of rank 0, 1, ...]` blocks
until all arrive (torchft's prepare_sync / perform_sync split), so a caller can run the next
round's inner steps while the exchange is in flight (DiLoCoX's one-step delay).

Mechanism: an all-gather of variable-size byte tensors over torch.distributed (gloo on CPU, NCCL
on GPU) — first the sizes, then each worker sends its packet straight to every other (point to
point, all sends and receives in flight at once), exactly its bytes, so no byte of padding is
sent and each packet stays whole for per-worker verification. It runs on a background
thread over a process group of its own, so collectives of other groups (eval) never interleave
with it. The group's timeout turns a dead peer into an `ExchangeError` instead of a hang.

`start(packet, reveal=salt)` adds a second, small step (the commit-reveal, verify/commitment.py):
once this worker has received every packet, it sends its `reveal` (a fixed `len(reveal)` bytes)
to every other worker and receives theirs; `handle.reveals` holds them in rank order. No worker
sends its reveal before it holds every packet, so none learns a reveal before it has sent its
own packet. The reveal is one more message after the packets: the emulated link charges its
latency a second time.

Bytes are counted from the tensors actually handed to the collectives: a worker *sends* its
packet (and its 8-byte size) to each of the other W-1 workers and *receives* theirs. When a
`Link` is given, `wait()` does not return before `latency + max(sent, received) * 8 / bandwidth`
has passed since `start()`: the emulated slow link shows up in wall-clock time, and overlaps
with whatever the caller does meanwhile.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _send_view(packet: bytes) -> torch.Tensor:
    """`packet` as a uint8 tensor without a copy, for sending only: torch warns that the bytes
    are read-only, which a send never writes (a bytearray copy was the packet's size again)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(packet, dtype=torch.uint8)


def _received(buf: torch.Tensor) -> memoryview:
    """A received packet's bytes: a read-only view of `buf` (the memoryview keeps it alive)."""
    return memoryview(buf.cpu().numpy()).toreadonly()


class ExchangeError(RuntimeError):
    """The exchange failed (a peer died, timed out, or sent an oversized packet)."""


@dataclass
class ExchangeStats:
    """Byte and time accounting of one exchange."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # from start() to the end of wait(), link pacing included
    paced_s: float = 0.0  # of which: waiting for the emulated link


class ExchangeHandle:
    """An exchange in flight; `wait()` returns every rank's packet, in rank order."""

    def __init__(self, thread: threading.Thread, box: dict, started: float, link) -> None:
        self._thread, self._box, self._started, self._link = thread, box, started, link
        self.stats = ExchangeStats()
        self._result: list[bytes] | None = None
        self.reveals: list[bytes] | None = None  # every rank's reveal, after wait() (None: no reveal step)

    def wait(self) -> list[bytes | memoryview]:
        """Every rank's packet in rank order: this rank's as given, the others' as read-only
        memoryviews of what was received."""
        if self._result is not None:
            return self._result
        self._thread.join()
        if "error" in self._box:
            raise ExchangeError(self._box["error"])
        packets: list[bytes] = self._box["packets"]
        self.stats.bytes_sent = self._box["sent"]
        self.stats.bytes_received = self._box["received"]
        self.reveals = self._box.get("reveals")
        if self._link is not None:
            from .link import pace  # the link module is optional at import time

            self.stats.paced_s = pace(self._started, self.stats.bytes_sent, self.stats.bytes_received, self._link,
                                      hops=1 if self.reveals is None else 2)
        self.stats.seconds = time.perf_counter() - self._started
        self._result = packets
        return packets

    def received(self) -> list[bytes | memoryview] | None:
        """Every rank's packet once they all arrived, even when the exchange failed after that (in
        the reveal); None before. elastic._pin keeps the commitments a failed try brought."""
        if self._thread.is_alive():
            return None
        return self._box.get("packets")

    def forget(self) -> None:
        """Let go of the received packets (the caller is done with their bytes); `wait()` after
        this is an error."""
        self._result = None
        self._box.pop("packets", None)
        self._box.setdefault("error", "the exchange's packets were let go")


class Exchange:
    """All-gather of packets among the ranks of `group` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None, max_packet_bytes: int, link=None, device: str = "cpu",
                 comm=None, on_packets: Callable[[list, int], None] | None = None) -> None:
        """`comm`: a membership.PgComm (a quorum's own group) to run over instead of `group`.
        `on_packets(packets, rank)`: called with every rank's packet (and this rank) once all are in and before this
        rank's reveal goes out (exchanges with a reveal only): round.keep_seen writes down the
        commitments they carry before any salt is known."""
        self.group, self.comm, self.on_packets = group, comm, on_packets
        self.max_packet_bytes = max_packet_bytes
        self.link = link
        self._last: threading.Thread | None = None  # the thread of the latest start()
        self.device = torch.device(device)
        if comm is not None:
            self.rank, self.size = comm.rank, comm.size
            self._ranks = list(range(self.size))
        else:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self._ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(self.size)]

    def start(self, packet: bytes, reveal: bytes | None = None,
              on_packets: Callable[[list, int], None] | None = None) -> ExchangeHandle:
        """Begin sending `packet` (and then `reveal`, once every packet is in: the module
        docstring; every rank passes a reveal of the same length, or none); returns at once,
        unless the previous exchange of this object is still moving bytes: two exchanges on one group must not issue their collectives
        concurrently (each rank would order them by thread timing, and ranks that order them
        differently deadlock or swap packets). With delay 1 the previous one normally finished
        under the inner steps, so this waits for nothing. `on_packets`: this exchange's, instead
        of the object's (the constructor's)."""
        if self._last is not None:
            self._last.join()
        box: dict = {} if reveal is None else {"reveal": reveal}
        box["on_packets"] = on_packets or self.on_packets
        started = time.perf_counter()
        thread = threading.Thread(target=self._run, args=(packet, box), daemon=True)
        self._last = thread
        thread.start()
        return ExchangeHandle(thread, box, started, self.link)

    def _transfer(self, own: torch.Tensor | None, bufs: dict[int, torch.Tensor]) -> None:
        """`own` to every peer and each peer's packet into bufs[peer], all in flight at once. The
        operations and works, which hold the tensors, end with this call.

        Every packet goes straight to every peer (one hop, latency paid once). One broadcast per
        source, as before, ran the sources one after another through gloo's work queue, over a
        tree: on a kernel-shaped link (bench/kernel_link.py, 3 workers, 10 Mbit/s) it took 1.9x
        what the link allows."""
        peers_of = [r for r in range(self.size) if r != self.rank]
        if self.comm is not None:
            works = [self.comm.isend(own, r) for r in peers_of if own is not None]
            works += [self.comm.irecv(buf, r) for r, buf in bufs.items()]
            for w in works:
                self.comm.wait(w)
        else:
            ops = [dist.P2POp(dist.isend, own, self._ranks[r], group=self.group) for r in peers_of if own is not None]
            ops += [dist.P2POp(dist.irecv, buf, self._ranks[r], group=self.group) for r, buf in bufs.items()]
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()

    def _run(self, packet: bytes, box: dict) -> None:
        reveal = box.pop("reveal", None)  # sent once every packet is in (the module docstring)
        try:
            mine = torch.tensor([len(packet)], dtype=torch.int64, device=self.device)
            if self.comm is not None:
                out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
                self.comm.all_gather(out, mine)
                sizes_list = [int(s) for s in out]
            else:
                sizes = torch.zeros(self.size, dtype=torch.int64, device=self.device)
                dist.all_gather_single(sizes, mine, group=self.group)
                sizes_list = [int(s) for s in sizes.cpu()]
            for r, n in enumerate(sizes_list):
                if n < 0 or n > self.max_packet_bytes:
                    raise ExchangeError(f"rank {r} announced a packet of {n} bytes (limit {self.max_packet_bytes})")
            own = _send_view(packet).to(self.device) if packet else None
            bufs = {r: torch.empty(n, dtype=torch.uint8, device=self.device) for r, n in enumerate(sizes_list)
                    if r != self.rank and n}
            self._transfer(own, bufs)
            # a peer's packet is handed on as a read-only view of the memory it was received into, not
            # copied into bytes (on a GPU, copied to the host once): a packet's memory once, not twice
            box["packets"] = [packet if r == self.rank else _received(bufs.pop(r)) if r in bufs else b""
                              for r in range(self.size)]
            peers = self.size - 1
            box["sent"] = (len(packet) + 8) * peers
            box["received"] = sum(sizes_list) - len(packet) + 8 * peers
            if reveal is not None:  # every packet is here: now, and only now, this rank's reveal goes out
                if box["on_packets"] is not None:
                    box["on_packets"](box["packets"], self.rank)
                bufs = {r: torch.empty(len(reveal), dtype=torch.uint8, device=self.device)
                        for r in range(self.size) if r != self.rank}
                self._transfer(_send_view(reveal).to(self.device), bufs)
                box["reveals"] = [bytes(reveal) if r == self.rank else bytes(_received(bufs[r])) for r in range(self.size)]
                box["sent"] += len(reveal) * peers
                box["received"] += len(reveal) * peers
        except ExchangeError as e:
            box["error"] = str(e)
        except Exception as e:  # gloo/NCCL raise RuntimeError/DistBackendError on timeout or a dead peer
            box["error"] = f"exchange failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
