"""Link: bandwidth/latency emulation of a slow link between workers (e.g. 1 Gbit/s, 50 ms).

The workers of a test or benchmark talk over loopback, which is far faster than the links
veriloco is built for. A `Link` says how long an exchange *would* take on the slow link, and
`pace()` makes the exchange last that long in wall-clock time: the exchange thread moves the
bytes at loopback speed, then `wait()` sleeps until `start + transfer_time(sent, received)`.
Because the sleep happens inside the exchange (which the caller started without waiting), the
slow link overlaps with whatever the caller computes meanwhile, exactly as a real one would.

Model (one exchange = one burst of traffic in each direction):

    transfer_time = latency + max(sent_bytes, recv_bytes) * 8 / bandwidth

- Full duplex: a link carries `bandwidth` in each direction at once (Ethernet, and the WAN
  links between data centres, are full duplex), so upload and download overlap and the slower
  direction decides; summing them would model a half-duplex radio link instead.
- Latency is paid once per exchange, not per message: the exchange's messages are pipelined
  (every packet sent straight to every peer, all in flight together: exchange.py), so their
  one-way delays overlap.
- Only payload bytes are counted; real links also carry headers (about 4.5% for TCP/IPv4 at
  MTU 1500), which `veriloco.netns.compare_emulated_vs_kernel` measures against a kernel-shaped
  link.

Units follow `tc`: bandwidth in decimal bits per second (`kbit` = 1000 bit/s), durations in
`s`/`ms`/`us`. `tc`'s `bps` means *bytes* per second, a classic trap, so it is rejected rather
than guessed.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_UNLIMITED = {"", "inf", "unlimited"}
MAX_DURATION_S = 86400.0  # a link latency at most: a day


def _split_number_unit(text: str) -> tuple[float, str] | None:
    """'1.5gbit' -> (1.5, 'gbit'); None if `text` is not a number followed by letters."""
    m = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z/]*)\s*", text)
    if m is None:
        return None
    return float(m.group(1)), m.group(3).lower().removesuffix("/s")


def parse_bandwidth(text: str) -> float:
    """'100mbit' -> 1e8 bits per second; '' or 'inf' (or 'unlimited') -> math.inf."""
    if not isinstance(text, str):
        raise ValueError(f"bad bandwidth {text!r}: expected a string such as '1gbit'")
    if text.strip().lower() in _UNLIMITED:
        return math.inf
    parsed = _split_number_unit(text)
    if parsed is None or parsed[1] not in _BANDWIDTH_UNITS:
        hint = " (tc's 'bps' means bytes/s; write kbit/mbit/gbit)" if "bps" in text.lower() else ""
        raise ValueError(
            f"bad bandwidth {text!r}: expected a number and one of "
            f"{'/'.join(_BANDWIDTH_UNITS)} such as '100mbit', or '' / 'inf' for unlimited{hint}"
        )
    value = parsed[0] * _BANDWIDTH_UNITS[parsed[1]]
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"bad bandwidth {text!r}: must be > 0 (use '' or 'inf' for unlimited)")
    if value < 1:  # a round's pacing would be past what a clock can wait for (1e-300bit: an overflow in sleep)
        raise ValueError(f"bad bandwidth {text!r}: must be at least 1bit")
    return value


def parse_duration(text: str) -> float:
    """'50ms' -> 0.05 seconds; '0.2s' -> 0.2; a bare '0' -> 0.0 (other numbers need a unit)."""
    if not isinstance(text, str):
        raise ValueError(f"bad duration {text!r}: expected a string such as '50ms'")
    parsed = _split_number_unit(text)
    if parsed is not None and parsed[1] == "" and parsed[0] == 0:
        return 0.0  # zero is zero in any unit; anything else bare is ambiguous (s? ms?)
    if parsed is None or parsed[1] not in _DURATION_UNITS:
        raise ValueError(
            f"bad duration {text!r}: expected a number and one of "
            f"{'/'.join(_DURATION_UNITS)} such as '50ms' or '0.2s', or '0'"
        )
    value = parsed[0] * _DURATION_UNITS[parsed[1]]
    if not math.isfinite(value):
        raise ValueError(f"bad duration {text!r}: must be finite")
    if value > MAX_DURATION_S:  # 1e300s overflowed the pacing's sleep
        raise ValueError(f"bad duration {text!r}: must be at most a day ({MAX_DURATION_S:.0f}s)")
    return value


@dataclass(frozen=True)
class Link:
    """A full-duplex link: `bandwidth_bps` each way (math.inf: unlimited), one-way `latency_s`."""

    bandwidth_bps: float  # bits per second in *each* direction; math.inf = no limit
    latency_s: float = 0.0  # paid once per exchange (its messages are pipelined)

    def __post_init__(self) -> None:
        bw, lat = self.bandwidth_bps, self.latency_s
        if not bw > 0:  # also rejects NaN
            raise ValueError(f"Link bandwidth_bps must be > 0 (math.inf for unlimited), got {bw}")
        if not (lat >= 0 and math.isfinite(lat)):
            raise ValueError(f"Link latency_s must be finite and >= 0, got {lat}")

    @classmethod
    def from_strings(cls, bandwidth: str, latency: str = "0") -> Link:
        """Link.from_strings('1gbit', '50ms')."""
        return cls(parse_bandwidth(bandwidth), parse_duration(latency))

    @classmethod
    def paced(cls, bandwidth: str, latency: str = "0") -> Link | None:
        """`from_strings`, or None for a link that adds nothing (what pacing code is handed)."""
        link = cls.from_strings(bandwidth, latency)
        return None if link.unlimited else link

    @property
    def unlimited(self) -> bool:
        """True when the link adds nothing (infinite bandwidth, zero latency): pace() never sleeps."""
        return math.isinf(self.bandwidth_bps) and self.latency_s == 0

    def transfer_time(self, sent_bytes: int, recv_bytes: int, hops: int = 1) -> float:
        """Seconds an exchange that sends `sent_bytes` and receives `recv_bytes` takes, in `hops`
        messages each sent after the one before arrived (the latency paid once a hop)."""
        if sent_bytes < 0 or recv_bytes < 0:
            raise ValueError(f"byte counts must be >= 0, got sent={sent_bytes} recv={recv_bytes}")
        # Full duplex: both directions run at once, so the larger one sets the time.
        return hops * self.latency_s + max(sent_bytes, recv_bytes) * 8 / self.bandwidth_bps

    def __str__(self) -> str:
        bw = "unlimited" if math.isinf(self.bandwidth_bps) else f"{self.bandwidth_bps / 1e6:g} Mbit/s"
        return f"{bw}, {self.latency_s * 1e3:g} ms"


@dataclass(frozen=True)
class LinkClock:
    """Paces exchanges on `link`; clock and sleep are injectable so tests need not sleep.

    `clock` must be the clock the exchange's start time was read from: time.perf_counter
    (monotonic, what `exchange.py` uses).
    """

    link: Link
    clock: Callable[[], float] = field(default=time.perf_counter)
    sleep: Callable[[float], None] = field(default=time.sleep)

    def pace(self, start_time: float, sent_bytes: int, recv_bytes: int, hops: int = 1) -> float:
        """Sleep until `start_time + link.transfer_time(sent, recv, hops)`; return seconds slept.

        If the real transfer already took longer than the slow link would have, return 0.0
        at once: the emulation only ever slows an exchange down, never hides real time.
        """
        deadline = start_time + self.link.transfer_time(sent_bytes, recv_bytes, hops)
        began = now = self.clock()
        # Loop because a sleep may end a hair early on some platforms; never return early.
        while now < deadline:
            self.sleep(deadline - now)
            now = self.clock()
        return now - began


def pace(start_time: float, sent_bytes: int, recv_bytes: int, link: Link, hops: int = 1) -> float:
    """`LinkClock(link).pace(...)` with time.perf_counter: the hook `exchange.py` calls."""
    return LinkClock(link).pace(start_time, sent_bytes, recv_bytes, hops)
