"""bench/elastic_sever.py: its "off" variant still switches the probes off in today's
membership.py (the bench stops if the code it patches moved), and bad arguments are one line.
The bench's runs themselves are the partial-partition test of tests/test_elastic.py, repeated."""

from __future__ import annotations

import importlib.util

from conftest import ROOT, bench_arguments


def _bench():
    spec = importlib.util.spec_from_file_location("elastic_sever", ROOT / "bench" / "elastic_sever.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_off_variant_patches_both_probes_out(tmp_path):
    src = _bench().probes_off(tmp_path)
    text = (src / "veriloco" / "membership.py").read_text()
    assert text.count("(bench: probes off)") == 2
    assert (src / "veriloco" / "elastic.py").read_text() == (ROOT / "src" / "veriloco" / "elastic.py").read_text()


def test_bad_arguments_exit_with_one_line():
    p = bench_arguments("elastic_sever.py", "--cuts", "0", timeout=60)
    assert p.returncode == 2 and "--cuts must be seconds in (0, 120]" in p.stderr.splitlines()[-1]
