"""bench/lazy_screens.py on a tiny run: the honest replay is worker 1's packet, a lazy worker's
short delta is shorter than an honest one, and scaling it moves its norm and nothing else."""

from __future__ import annotations

import json

import pytest
from conftest import bench_arguments


def test_lazy_screens_on_a_tiny_run(tmp_path):
    out = tmp_path / "ls.json"
    p = bench_arguments("lazy_screens.py", "--config", "tiny", "--inner-steps", "8", "--rounds", "2",
                        "--rounds-checked", "1", "--scales", "1.0,1.5", "--out", str(out))
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["config"]["lazy_steps"] == 6 and res["config"]["scales"] == [1.0, 1.3333, 1.5]
    assert len(res["honest_norm_ratios"]) == 4 and 1.0 in res["honest_norm_ratios"]
    (row,) = res["rounds"]
    v = row["variants"]
    assert v["honest"]["gain_ratio_mean"] == 1.0 and v["honest"]["fails_at_floor"]["0.75"] == 0.0
    assert v["honest"]["norm_ratio"] in res["honest_norm_ratios"]  # the replay is worker 1's packet, bit for bit
    assert v["lazy x1"]["norm_ratio"] < v["honest"]["norm_ratio"]  # 6 steps travel less far than 8
    assert v["lazy x1.5"]["norm_ratio"] == pytest.approx(1.5 * v["lazy x1"]["norm_ratio"], rel=1e-3)
    assert set(v) == {"honest", "skim", "lazy x1", "lazy x1.3333", "lazy x1.5"}


def test_bad_arguments_exit_with_one_line():
    p = bench_arguments("lazy_screens.py", "--skip", "1.5", timeout=60)
    assert p.returncode == 2 and "--skip must be in (0, 1)" in p.stderr.splitlines()[-1]
