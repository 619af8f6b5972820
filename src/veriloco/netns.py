"""Netns: a real kernel link shaped with `tc`, to check the software emulation in `link.py`.

`shaped_link(bandwidth_bps, n)` builds, and always tears down, this topology:

    ns 0 (eth0 198.18.0.1) ─veth─ p0 ┐
    ns 1 (eth0 198.18.0.2) ─veth─ p1 ├─ br0 in a hub namespace
    ...                              ┘

Every namespace is our own (named `veriloco-<pid>-<random>-<i>`, so parallel runs never
collide) and the veth pairs are created directly inside them, so nothing is added to the host's
own network namespace and no traffic can leave the machine. Addresses come from 198.18.0.0/15,
the range RFC 2544 sets aside for network benchmarks, and exist only inside the namespaces.

Shaping: a `tc ... root tbf` qdisc at `bandwidth_bps` on *both* ends of each veth — the worker
end limits its upload, the hub end its download — so each worker has a full-duplex access link
of that rate, the model `link.Link` assumes. (With n=2 a transfer crosses two shapers of equal
rate in series, which does not change its throughput.)

Latency: this kernel has no `netem`, and `tbf`'s `latency` option only bounds its queue, so
`latency_s > 0` adds a userspace delay line (`_DELAY_SCRIPT`) on every node's path to the hub:

    ns i (eth0) ─veth─ q<i> ┐ delay line: every frame held latency_s / 2, ┌ r<i> ─veth─ p<i> ─ br0
                            └ each way (a process in the hub, AF_PACKET)  ┘

so a frame from node i to node j is held latency_s / 2 on i's path and again on j's: latency_s
one way, 2 latency_s round trip, ACKs included, so TCP's slow start and window see a real long
link. Frames keep their order, and are forwarded with their virtio-net header
(PACKET_VNET_HDR): GSO frames and unfinished checksums cross as they came, as on the veth alone.
`compare_emulated_vs_kernel(bw, latency)` checks the kernel link against `Link(bw, latency)`.

Needs root, `ip` and `tc`; `available()` says why not, so tests and benchmarks skip cleanly.

    sudo .venv/bin/python -m veriloco.netns 100mbit 3 [50ms]   # kernel vs emulated, median of 3
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import selectors
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .link import Link, parse_bandwidth, parse_duration

_PREFIX = "veriloco-"
_SUBNET = "198.18.0"  # RFC 2544 benchmarking range; only ever configured inside our namespaces
_MAX_NODES = 250

# Receiver: print its port; `count` times read exactly nbytes, answer one byte; then print when
# the last byte of each came. Sender (with congestion control `cc`, or "-" for the namespace's):
# `count` times (idle `gap` seconds between them, on the same connection) note when it began to
# send, send, wait for the answer; then print those times. A
# transfer is the difference, one way, as link.Link counts it (latency + bytes / bandwidth).
_PEER_SCRIPT = r"""
import socket, sys, time
if sys.argv[1] == "recv":
    host, nbytes, count = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = socket.create_server((host, 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    view, done = memoryview(bytearray(1 << 20)), []
    for _ in range(count):
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[: min(len(view), nbytes - got)])
            if not n:
                sys.exit(f"receiver: sender closed after {got} of {nbytes} bytes")
            got += n
        done.append(time.monotonic())  # the last byte is here (one clock for every namespace: CLOCK_MONOTONIC)
        conn.sendall(b"k")
    conn.close()
    print(*done, flush=True)
else:
    host, port, nbytes, count, gap = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    chunk = memoryview(bytes(1 << 20))
    conn = socket.socket()
    if sys.argv[7] != "-":  # a congestion control for this connection (the sender's decides)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, sys.argv[7].encode())
    conn.settimeout(60)
    conn.connect((host, port))
    # Without NODELAY, Nagle holds the last partial segment for the receiver's delayed ACK,
    # adding ~5-10 ms per transfer (doubling the time of a 1 MiB transfer at 1 gbit).
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    starts = []
    for i in range(count):
        if i:
            time.sleep(gap)  # the connection idles, as between two rounds' exchanges
        starts.append(time.monotonic())
        left = nbytes
        while left:
            left -= conn.send(chunk[: min(left, len(chunk))])
        if conn.recv(1) != b"k":
            sys.exit("sender: receiver did not acknowledge")
    print(*starts, flush=True)
"""

# The delay line (run in the hub namespace): DELAY_S IF_A IF_B [IF_A IF_B ...]. Every frame that
# arrives on IF_A leaves on IF_B DELAY_S later, and the other way; frames keep their order (a
# constant delay and a sequence number). Prints "ready" once its sockets are bound; runs until
# killed. PACKET_VNET_HDR hands a frame over with its virtio-net header (GSO size, checksum
# offsets), so a GSO frame or one whose checksum the stack left to the device is re-injected as it
# was; PACKET_IGNORE_OUTGOING keeps the line from reading back what it sent.
_DELAY_SCRIPT = r"""
import heapq, itertools, select, socket, sys, time
SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING, SO_RCVBUFFORCE, ETH_P_ALL = 263, 15, 23, 33, 3
delay, names = float(sys.argv[1]), sys.argv[2:]
socks, peer = {}, {}
for name in names:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1 << 25)  # a burst must wait in the socket, not be dropped
    s.bind((name, ETH_P_ALL))
    s.setblocking(False)
    socks[s.fileno()] = s
fds = list(socks)
for a, b in zip(fds[::2], fds[1::2]):
    peer[a], peer[b] = socks[b], socks[a]
poll = select.epoll()
for fd in fds:
    poll.register(fd, select.EPOLLIN)
print("ready", flush=True)
held, seq = [], itertools.count()
while True:
    wait = max(0.0, held[0][0] - time.monotonic()) if held else -1
    for fd, _ in poll.poll(wait):
        s, out = socks[fd], peer[fd]
        while True:
            try:
                frame = s.recv(1 << 17)
            except BlockingIOError:
                break
            heapq.heappush(held, (time.monotonic() + delay, next(seq), out, frame))
    now = time.monotonic()
    while held and held[0][0] <= now:
        _, _, out, frame = heapq.heappop(held)
        try:
            out.send(frame)
        except OSError:
            pass  # its port is down (a partition): lost, as on a cut wire
"""


class NetnsError(RuntimeError):
    """A namespace, veth or tc command failed, or a process inside a namespace did."""


def _cmd(argv: Sequence[str], timeout: float = 10.0) -> str:
    """Run a setup command; raise NetnsError with the command and its first stderr line."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {e}") from e
    if p.returncode != 0:
        first = (p.stderr.strip() or p.stdout.strip() or f"exit {p.returncode}").splitlines()[0]
        raise NetnsError(f"{' '.join(argv)}: {first}")
    return p.stdout


def _tbf_args(bandwidth_bps: float) -> list[str]:
    """`tbf` parameters for a rate; burst and queue scale with it."""
    rate_Bps = bandwidth_bps / 8
    # Burst: at least a few MTU-sized packets, and ~1 ms of traffic so the token bucket is not
    # starved between timer ticks at high rates; it lets the first `burst` bytes pass unshaped,
    # which is why small transfers come out faster than the emulation predicts.
    burst = max(16 * 1024, int(rate_Bps * 1e-3))
    # Queue of ~50 ms: deep enough that TCP is not pushed into loss recovery, which would
    # measure TCP's loss handling rather than the link's rate.
    return ["rate", f"{int(bandwidth_bps)}bit", "burst", str(burst), "latency", "50ms"]


@dataclass
class ShapedLink:
    """Namespaces joined through a hub bridge, every port shaped to `bandwidth_bps`, every path
    `latency_s` long one way (a delay line; 0: none)."""

    bandwidth_bps: float
    namespaces: list[str]  # one per node, index = ns_index
    hub: str
    addresses: list[str]  # IPv4 address of node i, reachable from every other node
    latency_s: float = 0.0
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    delay_line: subprocess.Popen | None = field(default=None, repr=False)  # the hub's delay line, if any

    def command(self, ns_index: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside namespace `ns_index`."""
        if not 0 <= ns_index < len(self.namespaces):
            raise IndexError(f"ns_index {ns_index} out of range 0..{len(self.namespaces) - 1}")
        return ["ip", "netns", "exec", self.namespaces[ns_index], *argv]

    def run(
        self, ns_index: int, argv: Sequence[str], timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run `argv` inside namespace `ns_index`, wait, return its captured (text) output."""
        try:
            p = subprocess.run(
                self.command(ns_index, argv), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            raise NetnsError(f"ns {ns_index}: {' '.join(argv)} timed out after {timeout}s") from e
        if check and p.returncode != 0:
            tail = (p.stderr.strip() or f"exit {p.returncode}").splitlines()[-1]
            raise NetnsError(f"ns {ns_index}: {' '.join(argv)}: {tail}")
        return p

    def popen(self, ns_index: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside namespace `ns_index`; it is killed at teardown if still running."""
        p = subprocess.Popen(self.command(ns_index, argv), **kwargs)
        self._procs.append(p)
        return p

    def measure_transfer(self, nbytes: int, src: int = 0, dst: int = 1) -> float:
        """Seconds for a TCP sender in `src` to deliver `nbytes` to a receiver in `dst` over a new
        connection: from its first send (connected) to the receiver's last byte, on the one
        monotonic clock every namespace shares."""
        return self.measure_transfers(nbytes, 1, 0.0, src, dst)[0]

    def measure_transfers(self, nbytes: int, count: int, idle_s: float, src: int = 0, dst: int = 1,
                          congestion: str | None = None) -> list[float]:
        """`measure_transfer` `count` times over ONE connection, idle `idle_s` between transfers (as
        a connection idles between two rounds' exchanges): the first is a new connection's, the
        later ones show what the idle did to its window (`tcp_slow_start_after_idle`). `congestion`:
        the sender's TCP congestion control ('cubic', 'bbr', ...; None: the namespace's default)."""
        if nbytes <= 0 or count < 1 or idle_s < 0:
            raise ValueError(f"need nbytes > 0, count >= 1, idle_s >= 0; got {nbytes}, {count}, {idle_s}")
        if congestion is not None and not re.fullmatch(r"[a-z0-9_]+", congestion):
            raise ValueError(f"not a congestion control name: {congestion!r}")
        # Generous: a transfer at a tenth of the shaped rate is broken, not slow.
        per = 10 * nbytes * 8 / self.bandwidth_bps if self.bandwidth_bps < math.inf else 0
        timeout = 10.0 + count * (per + idle_s + 20 * self.latency_s)
        py = [sys.executable, "-I", "-c", _PEER_SCRIPT]
        recv = self.popen(
            dst, [*py, "recv", self.addresses[dst], str(nbytes), str(count)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        port = _read_line(recv, timeout=10.0)
        if not port.strip().isdigit():
            recv.kill()
            err = recv.communicate()[1].strip().splitlines()
            raise NetnsError(f"receiver in ns {dst} did not start: {err[-1] if err else port!r}")
        sent = self.run(src, [*py, "send", self.addresses[dst], port.strip(), str(nbytes), str(count), repr(idle_s),
                              congestion or "-"], timeout=timeout)
        if recv.wait(timeout=timeout) != 0:
            err = recv.stderr.read().strip().splitlines() if recv.stderr else []
            raise NetnsError(f"receiver in ns {dst} failed: {err[-1] if err else recv.returncode}")
        done, starts = recv.stdout.read().split(), sent.stdout.split()
        return [float(d) - float(t) for d, t in zip(done, starts, strict=True)]

    def set_sysctl(self, name: str, value: str) -> None:
        """Set a network sysctl (`net.ipv4.tcp_slow_start_after_idle`) in every node's namespace:
        they are per namespace, so the host's own stay as they are."""
        if not re.fullmatch(r"net(\.[a-z0-9_]+)+", name) or not re.fullmatch(r"[A-Za-z0-9_ ]+", value):
            raise ValueError(f"not a network sysctl setting: {name} = {value!r}")
        path = "/proc/sys/" + name.replace(".", "/")
        for i in range(len(self.namespaces)):
            self.run(i, ["sh", "-c", f"echo {value} > {path}"])

    def _kill_processes(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        self.delay_line = None


def _read_line(p: subprocess.Popen, timeout: float) -> str:
    """One line of p's stdout, or '' if none comes within `timeout` (a plain readline could hang)."""
    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return p.stdout.readline()


def _list_namespaces() -> list[str]:
    out = _cmd(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """Delete each namespace (deleting one end of a veth deletes the pair); return failures."""
    failed = []
    for name in names:
        try:
            _cmd(["ip", "netns", "del", name])
        except NetnsError as e:
            if name in _list_namespaces():
                failed.append(f"{name}: {e}")
    return failed


@contextlib.contextmanager
def shaped_link(bandwidth_bps: float, n: int = 2, latency_s: float = 0.0) -> Iterator[ShapedLink]:
    """`n` namespaces joined by a bridge, every port shaped to `bandwidth_bps` (inf: unshaped),
    every path between two of them `latency_s` long one way (0: no delay line).

    Everything is created on entry and removed on exit, also when setup or the body fails.
    """
    if not 2 <= n <= _MAX_NODES:
        raise ValueError(f"n must be in 2..{_MAX_NODES}, got {n}")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth_bps must be > 0 (math.inf for unshaped), got {bandwidth_bps}")
    if not (math.isfinite(latency_s) and 0 <= latency_s <= 10):
        raise ValueError(f"latency_s must be in [0, 10], got {latency_s}")
    base = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    link = ShapedLink(
        bandwidth_bps=bandwidth_bps,
        namespaces=[f"{base}-{i}" for i in range(n)],
        hub=f"{base}-hub",
        addresses=[f"{_SUBNET}.{i + 1}" for i in range(n)],
        latency_s=latency_s,
    )
    created: list[str] = []
    try:
        _cmd(["ip", "netns", "add", link.hub])
        created.append(link.hub)
        hub = ["ip", "-n", link.hub]
        _cmd([*hub, "link", "add", "br0", "type", "bridge"])
        _cmd([*hub, "link", "set", "br0", "up"])
        tbf = _tbf_args(bandwidth_bps) if math.isfinite(bandwidth_bps) else None
        for i, ns in enumerate(link.namespaces):
            _cmd(["ip", "netns", "add", ns])
            created.append(ns)
            node, port = ["ip", "-n", ns], f"p{i}"
            _cmd([*node, "link", "set", "lo", "up"])
            # Both ends are born inside our namespaces: the host namespace is never touched. With a
            # delay line, the node's veth ends at q<i> and a second pair r<i> - p<i> reaches the bridge.
            near = f"q{i}" if latency_s else port
            _cmd([*node, "link", "add", "eth0", "type", "veth", "peer", "name", near, "netns", link.hub])
            if latency_s:
                _cmd([*hub, "link", "add", f"r{i}", "type", "veth", "peer", "name", port])
                for end in (near, f"r{i}"):
                    _cmd([*hub, "link", "set", end, "up"])
            _cmd([*hub, "link", "set", port, "master", "br0"])
            _cmd([*node, "addr", "add", f"{link.addresses[i]}/24", "dev", "eth0"])
            _cmd([*node, "link", "set", "eth0", "up"])
            _cmd([*hub, "link", "set", port, "up"])
            if tbf is not None:
                _cmd(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf])
                _cmd(["tc", "-n", link.hub, "qdisc", "add", "dev", port, "root", "tbf", *tbf])
        if latency_s:
            _start_delay_line(link, n)
        yield link
    except BaseException:
        # Clean up, but let the original error be the one reported.
        link._kill_processes()
        _delete_namespaces(created)
        raise
    link._kill_processes()
    failed = _delete_namespaces(created)
    if failed:
        raise NetnsError("could not delete namespaces: " + "; ".join(failed))


def _start_delay_line(link: ShapedLink, n: int) -> None:
    """The hub's delay line between every q<i> and r<i>: half the latency each way on each node's
    path (module docstring); killed with the link's other processes."""
    argv = ["ip", "netns", "exec", link.hub, sys.executable, "-I", "-c", _DELAY_SCRIPT, repr(link.latency_s / 2),
            *[name for i in range(n) for name in (f"q{i}", f"r{i}")]]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    link._procs.append(p)
    link.delay_line = p
    if _read_line(p, timeout=10.0).strip() != "ready":
        p.kill()
        err = p.communicate()[1].strip().splitlines()
        raise NetnsError(f"the delay line in {link.hub} did not start: {err[-1] if err else p.returncode}")


def available() -> tuple[bool, str]:
    """(True, '') if shaped links can be built here, else (False, why): callers skip cleanly."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) not found on PATH"
    try:
        with shaped_link(1e8, n=2):  # exercises every setup step: netns, bridge, veth, tbf
            pass
    except (NetnsError, OSError) as e:
        return False, f"cannot build a shaped link: {e}"
    return True, ""


def cleanup_stale() -> list[str]:
    """Delete namespaces left by veriloco processes that no longer exist (e.g. SIGKILLed tests)."""
    stale = []
    for name in _list_namespaces():
        m = re.fullmatch(rf"{_PREFIX}(\d+)-[0-9a-f]+-(?:\d+|hub)", name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            stale.append(name)
        except PermissionError:
            pass  # the process exists
    _delete_namespaces(stale)
    return stale


def measure_transfer(bandwidth_bps: float, nbytes: int) -> float:
    """Wall seconds to move `nbytes` over TCP between two namespaces shaped to `bandwidth_bps`."""
    with shaped_link(bandwidth_bps, n=2) as link:
        return link.measure_transfer(nbytes)


def compare_emulated_vs_kernel(
    bandwidth: str | float = "100mbit",
    sizes: Sequence[int] = (256 * 1024, 1 << 20, 4 << 20, 8 << 20),
    repeats: int = 3,
    latency: str | float = 0.0,
) -> list[dict]:
    """Per payload size: measured kernel-shaped transfer time vs `Link(bw, latency).transfer_time`
    (with a latency, the kernel link's delay line holds every frame for it; each transfer is a
    new TCP connection, so its slow start over the round trip shows, as the emulation's does not).

    `kernel_s` is the median of `repeats` measurements; `ratio` = kernel_s / emulated_s. Expect
    a ratio a little above 1 for large payloads (TCP/IP and Ethernet headers, ~4.5% at MTU
    1500, are on the wire but not in the emulation's byte count) and below 1 for payloads near
    the tbf burst, which passes unshaped; transfers of a few tens of ms are also at the mercy
    of the scheduler on a busy machine, hence the median. The defaults take ~5 s at 100 mbit.
    """
    bw = parse_bandwidth(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
    if math.isinf(bw):
        raise ValueError("compare_emulated_vs_kernel needs a finite bandwidth")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    lat = parse_duration(latency) if isinstance(latency, str) else float(latency)
    emulated = Link(bw, lat)
    rows = []
    with shaped_link(bw, n=2, latency_s=lat) as link:
        # Warm-up: the first transfer on a fresh link also pays for ARP and bridge learning.
        link.measure_transfer(64 * 1024)
        for nbytes in sizes:
            runs = [link.measure_transfer(nbytes) for _ in range(repeats)]
            kernel_s = statistics.median(runs)
            emulated_s = emulated.transfer_time(nbytes, 0)
            rows.append({
                "bandwidth_bps": bw,
                "latency_s": lat,
                "bytes": nbytes,
                "kernel_s": kernel_s,
                "kernel_runs_s": runs,
                "emulated_s": emulated_s,
                "ratio": kernel_s / emulated_s,
            })
    return rows


if __name__ == "__main__":  # python -m veriloco.netns [bandwidth] [repeats] [latency]
    ok, why = available()
    if not ok:
        print(f"skipped: {why}")
        raise SystemExit(0)
    t = time.perf_counter()
    bw_arg = sys.argv[1] if len(sys.argv) > 1 else "100mbit"
    lat_arg = sys.argv[3] if len(sys.argv) > 3 else "0ms"
    for row in compare_emulated_vs_kernel(bw_arg, repeats=int(sys.argv[2]) if len(sys.argv) > 2 else 3, latency=lat_arg):
        print(f"{bw_arg:>8} {lat_arg:>6} {row['bytes']:>10} B  kernel {row['kernel_s'] * 1e3:8.1f} ms  "
              f"emulated {row['emulated_s'] * 1e3:8.1f} ms  ratio {row['ratio']:.3f}")
    print(f"({time.perf_counter() - t:.1f} s)")
