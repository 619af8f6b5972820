"""Link emulation: parsing, transfer-time arithmetic, pacing, and agreement with a kernel link."""

from __future__ import annotations

import math
import statistics
import subprocess
import time

import pytest

from veriloco.link import Link, LinkClock, pace, parse_bandwidth, parse_duration
from veriloco.netns import NetnsError, available, shaped_link

# --- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bps",
    [
        ("1gbit", 1e9),
        ("100mbit", 1e8),
        ("10gbit", 1e10),
        ("500kbit", 5e5),
        ("1.5gbit", 1.5e9),
        ("1 Gbit/s", 1e9),
        ("64bit", 64.0),
        ("", math.inf),
        ("inf", math.inf),
        ("unlimited", math.inf),
    ],
)
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["1gbps", "100", "fast", "-1gbit", "0mbit", "1.5.2gbit", "1 gbit extra", "nan"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_bandwidth(text)
    msg = str(e.value)
    assert repr(text) in msg and "\n" not in msg


def test_parse_bandwidth_explains_bps() -> None:
    with pytest.raises(ValueError, match="bytes/s"):
        parse_bandwidth("125mbps")


@pytest.mark.parametrize(
    "text, seconds",
    [("50ms", 0.05), ("0.2s", 0.2), ("0", 0.0), ("0ms", 0.0), ("250us", 250e-6), (" 1.5 s ", 1.5)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["50", "0.2", "", "-5ms", "5min", "inf", "ms"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_duration(text)
    assert repr(text) in str(e.value) and "\n" not in str(e.value)


# --- Link arithmetic ---------------------------------------------------------------------


def test_transfer_time_by_hand() -> None:
    link = Link.from_strings("1gbit", "50ms")
    assert link.bandwidth_bps == 1e9 and link.latency_s == pytest.approx(0.05)
    # 125 MB up, nothing down: 1e9 bits at 1e9 bit/s = 1 s, plus 50 ms.
    assert link.transfer_time(125_000_000, 0) == pytest.approx(1.05)
    # Full duplex: 10 MB up and 20 MB down overlap; the 20 MB (0.16 s) decides.
    assert link.transfer_time(10_000_000, 20_000_000) == pytest.approx(0.05 + 0.16)
    assert link.transfer_time(0, 0) == pytest.approx(0.05)
    assert Link.from_strings("100mbit").transfer_time(1_000_000, 1) == pytest.approx(0.08)


def test_unlimited() -> None:
    assert Link.from_strings("inf", "0").unlimited
    assert Link(math.inf, 0.0).transfer_time(10**12, 10**12) == 0.0
    # Infinite bandwidth still pays the latency, so such a link is not a no-op.
    assert not Link.from_strings("", "50ms").unlimited
    assert Link.from_strings("", "50ms").transfer_time(10**12, 0) == pytest.approx(0.05)
    assert not Link.from_strings("1gbit").unlimited


@pytest.mark.parametrize("bw, lat", [(0.0, 0.0), (-1.0, 0.0), (math.nan, 0.0), (1e9, -0.1), (1e9, math.inf)])
def test_link_rejects_bad_numbers(bw: float, lat: float) -> None:
    with pytest.raises(ValueError, match="Link"):
        Link(bw, lat)


def test_transfer_time_rejects_negative_bytes() -> None:
    with pytest.raises(ValueError, match="-5"):
        Link(1e9).transfer_time(-5, 0)


# --- pacing ------------------------------------------------------------------------------


def test_pace_with_fake_clock_sleeps_exactly_to_the_deadline() -> None:
    now = [100.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    clock = LinkClock(Link(8e6, 0.05), clock=lambda: now[0], sleep=sleep)
    # Started 0.02 s ago; 100 kB at 8 Mbit/s = 0.1 s, + 0.05 s latency: 0.13 s left to wait.
    slept = clock.pace(99.98, 100_000, 0)
    assert slept == pytest.approx(0.13) and sum(sleeps) == pytest.approx(0.13)
    assert now[0] == pytest.approx(99.98 + 0.15)


def test_pace_sleeps_for_real() -> None:
    link = Link(8e6, 0.05)  # 50 ms latency + 50 kB at 8 Mbit/s (50 ms) = 100 ms
    start = time.perf_counter()
    slept = pace(start, 50_000, 10_000, link)
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.1  # never early
    assert elapsed < 0.1 + 0.5  # oversleeping on a loaded 2-core machine is the scheduler's, not pace's
    assert slept == pytest.approx(elapsed, abs=0.05)


def test_pace_only_waits_for_the_remainder() -> None:
    link = Link(math.inf, 0.05)
    start = time.perf_counter()
    time.sleep(0.03)  # the "real" transfer took 30 ms of the 50 ms budget
    slept = pace(start, 0, 0, link)
    assert 0.0 < slept < 0.02 + 0.3  # asked for the 20 ms remainder; slack for a loaded machine
    assert time.perf_counter() - start >= 0.05


def test_pace_does_not_sleep_when_the_real_transfer_took_longer() -> None:
    link = Link.from_strings("1gbit", "900ms")
    start = time.perf_counter() - 1.0  # a transfer that already took 1 s; the link allows 0.901 s
    t = time.perf_counter()
    assert pace(start, 125_000, 125_000, link) == 0.0
    assert time.perf_counter() - t < 0.2  # returned at once (a wrong sleep would be ~0.9 s)


# --- a real kernel-shaped link -------------------------------------------------------------

_OK, _WHY = available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"kernel-shaped link unavailable: {_WHY}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_netns
def test_kernel_link_agrees_with_emulation() -> None:
    bw, nbytes = 1e8, 4 << 20  # 100 mbit, 4 MiB: 0.34 s emulated
    with shaped_link(bw, n=2) as link:
        names = {*link.namespaces, link.hub}
        assert names <= _namespaces()
        kernel_s = statistics.median(link.measure_transfer(nbytes) for _ in range(3))
    emulated_s = Link(bw, 0.0).transfer_time(nbytes, 0)
    ratio = kernel_s / emulated_s
    # The wire carries ~4.6% more than the payload (TCP+IP+Ethernet headers: 1514 bytes per
    # 1448 of payload at MTU 1500), and the 16 KiB tbf burst passes free (0.4% of 4 MiB), so
    # the expected ratio is ~1.04; measured 1.04-1.11 on a quiet machine, 1.39 once under load
    # (the sender and receiver processes compete for 2 cores, which can only slow the kernel
    # side). So the band is lopsided: a shaper that lets traffic through faster than the rate
    # (ratio well below 1) or is off by bits vs bytes (~8) still fails; load does not.
    # `python -m veriloco.netns 100mbit` reports the precise ratios as a benchmark.
    assert 0.9 < ratio < 3.0, f"kernel {kernel_s:.3f} s vs emulated {emulated_s:.3f} s"
    assert not names & _namespaces(), "namespaces left behind"


@needs_netns
def test_the_delay_line_holds_every_path_for_the_latency_one_way() -> None:
    """`latency_s`: a userspace delay line holds each frame half the latency on each node's path,
    so any two nodes are `latency_s` apart one way, whichever two."""
    with shaped_link(1e8, n=3, latency_s=0.05) as link:
        names = {*link.namespaces, link.hub}
        small = [link.measure_transfer(1, src=a, dst=b) for a, b in ((0, 1), (2, 0), (1, 2))]
        big = link.measure_transfer(1 << 20)
    # 1 byte: 50 ms and a little (measured 52-53 ms on a quiet machine); without the line < 1 ms
    assert all(0.05 <= t < 0.15 for t in small), small
    # 1 MiB on a new connection: TCP's slow start over the 100 ms round trip needs several of them,
    # so the emulation's latency + bytes / bandwidth (0.134 s) is a lower bound (measured 0.72 s)
    emulated_s = Link(1e8, 0.05).transfer_time(1 << 20, 0)
    assert 1.5 * emulated_s < big < 5.0, (big, emulated_s)
    assert not names & _namespaces(), "namespaces left behind"


@needs_netns
def test_three_nodes_share_a_hub_and_teardown_survives_errors() -> None:
    with pytest.raises(RuntimeError, match="boom"), shaped_link(1e9, n=3) as link:
        names = {*link.namespaces, link.hub}
        # Node 2 reaches node 0 through the bridge; 1 MiB at 1 gbit is ~8 ms.
        assert link.measure_transfer(1 << 20, src=2, dst=0) > 0
        assert link.run(1, ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.count(link.addresses[1]) == 1
        sleeper = link.popen(0, ["sleep", "30"])
        raise RuntimeError("boom")
    assert sleeper.poll() is not None, "process inside a namespace outlived the link"
    assert not names & _namespaces(), "namespaces left behind after an error"


@needs_netns
def test_run_reports_failures() -> None:
    with shaped_link(1e8) as link, pytest.raises(NetnsError, match="ns 1"):
        link.run(1, ["false"])


def test_sysctls_and_congestion_controls_are_checked_before_any_shell_sees_them() -> None:
    from veriloco.netns import ShapedLink

    link = ShapedLink(1e8, namespaces=[], hub="", addresses=[])
    for name, value in (("kernel.panic", "1"), ("net.ipv4.tcp_slow_start_after_idle", "0; reboot")):
        with pytest.raises(ValueError, match="not a network sysctl setting"):
            link.set_sysctl(name, value)
    with pytest.raises(ValueError, match="not a congestion control name"):
        link.measure_transfers(10, 1, 0.0, congestion="cubic; reboot")
