"""bench/tensor_hash.py: the tree hash against the one sha256 stream, on the same state."""

from __future__ import annotations

import json

from conftest import bench_arguments

from veriloco.hashing import TENSOR_HASH, hash_threads


def test_three_ways_hash_a_gpt_state_and_the_table_prints(tmp_path):
    out = tmp_path / "tensor_hash.json"
    p = bench_arguments("tensor_hash.py", "--n-layer", "1", "--d-model", "128", "--n-head", "2", "--repeats", "2",
                        "--out", str(out))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["scheme"] == TENSOR_HASH and r["tensors"] == 3 * 17  # a 1-layer GPT's 17 params, each with 2 moments
    rows = {x["way"]: x for x in r["rows"]}
    assert set(rows) == {"one-stream", "tree-1-thread", "tree"} and rows["tree"]["threads"] == hash_threads()
    assert rows["one-stream"]["vs_one_stream"] == 1.0
    for x in rows.values():
        assert len(x["seconds"]) == 2 and x["best_s"] == min(x["seconds"]) > 0
        assert abs(x["gb_per_s"] - r["bytes"] / x["best_s"] / 1e9) < 1e-9
    assert "vs one stream" in p.stdout and "tree-1-thread" in p.stdout


def test_bad_repeats_exit_2():
    p = bench_arguments("tensor_hash.py", "--repeats", "0")
    assert p.returncode == 2 and "--repeats must be >= 1" in p.stderr
