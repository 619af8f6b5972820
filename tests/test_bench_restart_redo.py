"""bench/restart_redo.py refuses arguments it cannot run before it trains anything (a run of it
takes minutes: its old side stalls for a minute per run, by design)."""

import pytest
from conftest import bench_arguments


@pytest.mark.parametrize(("args", "needle"), [
    (["--rounds", "4"], "--rounds must be >= 5 (worker 2 dies in round 3), got 4"),
    (["--seeds", "1,1"], "--seeds has a seed twice"),
    (["--seeds", "a"], "--seeds must be integers"),
    (["--old", "no-such-revision", "--seeds", "0"], "is not a git revision"),
    (["--kinds", "honest,grind"], "--kinds must be distinct names among honest, nondeterministic, recommit, junk_first"),
    (["--kinds", "honest,honest"], "--kinds must be distinct names"),
])
def test_restart_redo_refuses_what_it_cannot_run(args, needle):
    done = bench_arguments("restart_redo.py", *args)
    assert done.returncode == 2 and needle in done.stderr, done.stderr
