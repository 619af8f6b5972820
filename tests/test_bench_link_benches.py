"""bench/delay_line.py and bench/elastic_latency.py: bad arguments are one line; the delay line's
bench measures (a short run where network namespaces are available). elastic_latency's runs are
tests/test_elastic.py's kernel-shaped run, longer."""

from __future__ import annotations

import json

import pytest
from conftest import bench_arguments


def test_bad_arguments_exit_with_one_line():
    p = bench_arguments("delay_line.py", "--latency", "0ms")
    assert p.returncode == 2 and "needs 0 < --latency <= 100ms" in p.stderr.splitlines()[-1]
    p = bench_arguments("delay_line.py", "--flows", "9")
    assert p.returncode == 2 and "2 <= --flows <= 8" in p.stderr.splitlines()[-1]
    p = bench_arguments("elastic_latency.py", "--bandwidth", "inf")
    assert p.returncode == 2 and "--bandwidth must be finite" in p.stderr.splitlines()[-1]
    p = bench_arguments("elastic_latency.py", "--rounds", "1")
    assert p.returncode == 2 and "needs --rounds >= 2" in p.stderr.splitlines()[-1]


def test_the_delay_line_bench_measures_every_setting(tmp_path):
    from veriloco import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "dl.json"
    p = bench_arguments("delay_line.py", "--mb", "0.5", "--count", "2", "--links", "1", "--flows", "2",
                        "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1gbit, no line", "1gbit, line", "unshaped, no line", "unshaped, line",
                         "1gbit x2, no line", "1gbit x2, line"}
    for name, r in rows.items():
        assert r["warm_s"] > 0 and (r["line_cpu_s_per_gb"] is not None) == name.endswith(", line")
    # 0.5 MB at 1 Gbit/s: 4 ms, less tbf's burst (1 ms of traffic passes unshaped); the line adds its 1 ms
    assert rows["1gbit, no line"]["warm_s"] >= 0.0025
    assert rows["1gbit, line"]["warm_s"] >= 0.001
