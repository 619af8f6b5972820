"""bench/check_speed.py: an old revision's screen against the current one, on the same round."""

from __future__ import annotations

import json

from conftest import TINY, run_bench


def test_old_and_new_screens_agree_and_the_times_print(tmp_path):
    out = tmp_path / "check_speed.json"
    p = run_bench("check_speed.py", "--config", str(TINY), "--set", "model.n_layer=1", "--old", "HEAD",
                  "--workers", "3", "--repeats", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr  # (the bench stops if old and new verdicts or evidence differ)
    result = json.loads(out.read_text())
    assert result["workers"] == 3 and result["old"] == "HEAD"
    for name in ("check_round", "screen_round"):
        assert result[name]["old_ms"] > 0 and result[name]["new_ms"] > 0
    assert "identical old/new" in p.stdout
