"""Shared helpers: the tiny config and a one-call local run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veriloco.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def tiny(*overrides: str) -> Config:
    """configs/tiny.toml with `--section.key=value` overrides."""
    return load_config(TINY, list(overrides))


def rounds_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture
def tiny_cfg():
    return tiny
