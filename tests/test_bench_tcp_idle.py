"""bench/tcp_idle.py: a TCP connection's window after an idle, on the kernel-shaped link."""

from __future__ import annotations

import json

from conftest import bench_arguments

from veriloco import netns


def test_every_congestion_control_and_setting_is_measured_against_the_emulation(tmp_path):
    out = tmp_path / "idle.json"
    p = bench_arguments("tcp_idle.py", "--bandwidth", "100mbit", "--latency", "10ms", "--bytes", "200000",
                        "--idle", "0.3", "--repeats", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr
    if not netns.available()[0]:  # not root: says why and writes nothing
        assert p.stdout.startswith("skipped:") and not out.exists()
        return
    rows = json.loads(out.read_text())["rows"]
    assert [(r["congestion"], r["slow_start_after_idle"]) for r in rows] == [("cubic", 1), ("cubic", 0), ("bbr", 1),
                                                                             ("bbr", 0)]
    for r in rows:  # one way, measured: never under the emulation's latency + bytes / bandwidth
        assert len(r["runs_s"][0]) == 3 and min(r["new_s"], r["after_idle_s"]) > 0.9 * r["emulated_s"]


def test_bad_arguments_exit_2():
    p = bench_arguments("tcp_idle.py", "--bytes", "0")
    assert p.returncode == 2 and "--bytes and --repeats must be >= 1" in p.stderr
    p = bench_arguments("tcp_idle.py", "--latency", "fast")
    assert p.returncode == 2
