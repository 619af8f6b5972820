"""`hide_steps`: the H that would hide a round's exchange under compute, recorded every round."""

from __future__ import annotations

from conftest import rounds_of, tiny

from veriloco.compress import round_budget_bytes
from veriloco.link import Link
from veriloco.round import hide_steps, hide_warning

LINK = Link.from_strings("10mbit", "20ms")


def record(inner_s, bundle_bytes, r=0):
    return {"round": r, "inner_s": inner_s, "bundle_bytes": bundle_bytes}


def test_the_suggested_h_hides_the_median_bundle_and_one_step_less_does_not():
    rec = record([0.10, 0.12, 0.50], [200_000, 180_000, 9_000_000])  # one slow worker, one huge bundle
    need = hide_steps(LINK, rec, 10, 0.9)
    step_s = 0.12 / 10  # the medians, not the outliers
    assert round_budget_bytes(LINK.bandwidth_bps, LINK.latency_s, need * step_s, 3, 0.9) >= 200_000
    assert round_budget_bytes(LINK.bandwidth_bps, LINK.latency_s, (need - 1) * step_s, 3, 0.9) < 200_000


def test_absent_workers_do_not_count_and_no_link_or_one_worker_gives_none():
    rec = record([0.1, 0.0, 0.1], [100_000, 0, 100_000])
    assert hide_steps(LINK, rec, 10, 0.9) == hide_steps(LINK, record([0.1, 0.1], [100_000, 100_000]), 10, 0.9)
    assert hide_steps(None, rec, 10, 0.9) is None
    assert hide_steps(LINK, record([0.1, 0.0], [100_000, 0]), 10, 0.9) is None


def test_a_latency_only_link_needs_steps_for_the_latency_alone():
    rec = record([0.1, 0.1], [100_000, 100_000])  # 10 ms a step
    assert hide_steps(Link.from_strings("", "45ms"), rec, 10, 0.9) == 5  # 45 ms / (10 ms x 0.9)


def test_the_warning_names_the_window_that_is_too_short():
    rec = {"round": 2, "hide_steps": 40}
    assert hide_warning(tiny("--train.inner_steps=50", "--outer.delay=1"), rec) is None
    assert "train.inner_steps = 5 " in hide_warning(tiny("--outer.delay=1"), rec)
    assert "outer.overlap_steps = 2 " in hide_warning(tiny("--train.inner_steps=50", "--outer.delay=1", "--outer.overlap_steps=2"), rec)
    assert "--compress.codec=adaptive" in hide_warning(tiny("--outer.delay=1"), rec)
    assert "adaptive" not in hide_warning(tiny("--outer.delay=1", "--compress.codec=adaptive"), rec)  # already on
    assert hide_warning(tiny(), rec) is None  # delay 0: nothing to hide under
    assert hide_warning(tiny("--outer.delay=1"), {"round": 0}) is None  # no link declared


def test_a_run_at_the_suggested_h_waits_less_for_its_exchange(tmp_path):
    from veriloco.run import train

    # 5 Mbit/s: at 10 the exchange hid under 5 steps slowed by a loaded machine (waited 0.036 s)
    base = ("--outer.delay=1", "--outer.momentum=0.5", "--link.bandwidth=5mbit", "--link.latency=20ms",
            "--train.eval_every=1000", "--train.rounds=4")
    train(tiny(*base), str(tmp_path / "short"), quiet=True)
    short = rounds_of(tmp_path / "short")
    need = max(r["hide_steps"] for r in short)
    assert need > 5 and hide_warning(tiny(*base), short[0]) is not None
    train(tiny(*base, f"--train.inner_steps={2 * need}", f"--train.warmup_steps={2 * need}"), str(tmp_path / "long"), quiet=True)
    long = rounds_of(tmp_path / "long")
    # every round but the last finishes under the next round's steps (the last has nothing to hide
    # under); a wait can fall on either of two neighbouring rounds, so compare the sums
    waited = [sum(sum(r["wait_s"]) for r in run[:-1]) for run in (short, long)]
    assert waited[0] > 0.1, waited  # 177 KB at 5 Mbit/s is 0.28 s, against 5 steps of a few ms
    assert waited[1] < waited[0] / 3, waited
