"""Hostile bytes: every decoder of peer input rejects garbage with its own error, never crashes.

Here a few hundred inputs per decoder (random and mutated-valid); `bench/fuzz.py` runs 100,000.
"""

from __future__ import annotations

import pytest
from fuzz_targets import TARGETS, mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_valid_seeds_decode(name):
    decoder, _, seeds = TARGETS[name]
    for seed in seeds:
        decoder(seed)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_hostile_bytes_rejected_cleanly(name):
    decoder, allowed, seeds = TARGETS[name]

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.one_of(st.binary(max_size=512), st.builds(lambda s, r: mutate(seeds[s % len(seeds)], r),
                                                             st.integers(0, 100), st.randoms(use_true_random=False))))
    def run(data):
        try:
            decoder(data)
        except allowed:
            pass

    run()
