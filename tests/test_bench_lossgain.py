"""bench/lossgain_profile.py: the screen's rule applied to a table of gains, and the table of one
real (tiny) run, so a change in what the bench reads shows up here rather than in a bench run."""

from __future__ import annotations

import sys

import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import lossgain_profile  # noqa: E402


def test_suspects_are_the_gains_at_or_below_a_quarter_of_the_median():
    gains = torch.tensor([[0.40, 0.10], [0.40, 0.02], [0.40, 0.08], [0.09, 0.09]], dtype=torch.float64)  # [worker, step]
    assert lossgain_profile.suspects_at(gains, 0) == 1  # floor 0.25 x 0.40 = 0.10: 0.09 fails
    assert lossgain_profile.suspects_at(gains, 1) == 1  # floor 0.25 x 0.09 = 0.0225: 0.02 fails
    assert lossgain_profile.suspects_at(gains, (0, 1)) == 0  # on the mean of both steps: 0.09 passes 0.0625


def test_the_gain_table_of_a_real_run(tmp_path):
    table = lossgain_profile.gains_of_run(2, 0, tmp_path)
    assert table.shape == (2, lossgain_profile.WORKERS, lossgain_profile.H)
    assert bool(torch.isfinite(table).all())
    assert float(table.mean()) > 0  # honest deltas lower their own batches' loss on average
