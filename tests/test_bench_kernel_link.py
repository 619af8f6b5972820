"""bench/kernel_link.py: bad arguments are one line (its runs are test_elastic's kernel-shaped run,
repeated beside the emulation)."""

from __future__ import annotations

from conftest import bench_arguments


def test_bad_arguments_exit_with_one_line():
    p = bench_arguments("kernel_link.py", "--bandwidth", "inf", timeout=60)
    assert p.returncode == 2 and "needs a finite --bandwidth" in p.stderr.splitlines()[-1]
