"""bench/corpus_memory.py: a worker reading the corpus a chunk at a time holds a fraction of it."""

from __future__ import annotations

import json

from conftest import bench_arguments


def test_a_chunk_at_a_time_holds_less_than_the_corpus(tmp_path):
    out = tmp_path / "corpus_memory.json"
    p = bench_arguments("corpus_memory.py", "--mb", "16", "--steps", "20", "--repeats", "1", "--parts", "workers",
                        "--out", str(out))  # the prepare rows' two ways: tests/test_stored_corpus.py (4 s more here)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    whole, stored = result["rows"]
    assert whole["way"] == "whole" and stored["way"] == "stored" and result["chunks"] == 256
    assert whole["peak_mb"] > 16 and whole["chunks_read"] == 256  # the whole corpus, held
    assert stored["peak_mb"] < 0.6 * whole["peak_mb"] and stored["chunks_read"] < 200
    assert "| stored |" in p.stdout and result["prepare"] == []


def test_bad_arguments_exit_2(tmp_path):
    p = bench_arguments("corpus_memory.py", "--mb", "0")
    assert p.returncode == 2 and "--mb, --text-mb, --steps and --repeats must be >= 1" in p.stderr
    p = bench_arguments("corpus_memory.py", "--parts", "workers,disk")
    assert p.returncode == 2 and "--parts takes workers, prepare and/or text" in p.stderr
    p = bench_arguments("corpus_memory.py", "--parts", "text", "--before", str(tmp_path))
    assert p.returncode == 2 and "not a checkout's src directory" in p.stderr
