"""bench/stage_build.py: a stage built from the stored G_0 holds its slice; one built from the seed held the whole model."""

from __future__ import annotations

import json

from conftest import bench_arguments


def test_a_stage_from_the_store_peaks_at_its_slice(tmp_path):
    out = tmp_path / "stage_build.json"
    p = bench_arguments("stage_build.py", "--layers", "8", "--d-model", "256", "--heads", "4", "--stages", "4",
                        "--stage", "3", "--no-whole", "--repeats", "1", "--out", str(out))  # in-process; each build in its own
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    (stage,) = result["rows"]
    assert stage["stage"] == "3 of 4" and stage["params"] * 3 < result["model_params"]
    model_mb = result["model_params"] * 4 / 2**20
    assert stage["seed_peak_mb"] > 0.9 * model_mb  # the seed's way initialises the whole model, then cuts it
    assert stage["stored_peak_mb"] < 0.6 * stage["seed_peak_mb"]
    assert "| 3 of 4 |" in p.stdout


def test_bad_arguments_exit_2():
    p = bench_arguments("stage_build.py", "--stages", "1")
    assert p.returncode == 2 and "--stages between 2 and --layers" in p.stderr
    p = bench_arguments("stage_build.py", "--stage", "4")
    assert p.returncode == 2 and "--stage must be between 0 and 3" in p.stderr
    p = bench_arguments("stage_build.py", "--arch", "nope")
    assert p.returncode == 2 and "arch" in p.stderr
