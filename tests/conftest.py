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
