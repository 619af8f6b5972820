"""Shared helpers: the tiny config, a one-call local run, and a bench script run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from veriloco.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS...` in a fresh interpreter, its output captured as text."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout)


def bench_arguments(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS...` for arguments the script refuses before doing any work (or a
    run whose work is in child processes of its own), run in this process (its `main()` with ARGS
    as the command line): the same returncode, stdout and stderr as `run_bench` gives, without
    starting an interpreter (3 s each). `timeout` is unused, for the same call as run_bench."""
    import contextlib
    import importlib.util
    import io

    path = ROOT / "bench" / script
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # the scripts import each other by name
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [str(path), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result = module.main()
                code = result if isinstance(result, int) else 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def set_args(overrides: list[str]) -> list[str]:
    """`--set KEY=VALUE` for each override (the row benches' per-row overrides)."""
    return [a for o in overrides for a in ("--set", o)]


def cli(monkeypatch, capsys, *args: str) -> tuple[int, list[str], str]:
    """`veriloco ARGS...` in this process (no interpreter start): its exit code, its stderr's
    non-blank lines and its stdout."""
    from veriloco.cli import main

    monkeypatch.setattr(sys, "argv", ["veriloco", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main()
    out, err = capsys.readouterr()
    return e.value.code, [ln for ln in err.splitlines() if ln.strip()], out


def tiny(*overrides: str) -> Config:
    """configs/tiny.toml with `--section.key=value` overrides."""
    return load_config(TINY, list(overrides))


def rounds_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture
def tiny_cfg():
    return tiny


def holder(run_dir: Path) -> subprocess.Popen:
    """Another process that claims `run_dir` (as a launcher training into it does) and holds it
    until killed."""
    code = ("import sys; from veriloco.records import RunDir; RunDir(sys.argv[1]).claim(); "
            "print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p
