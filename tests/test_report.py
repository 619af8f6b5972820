"""The run report (`veriloco report RUN`): a real tiny run rendered in headless Chromium.

One real 3-round run (2 worker processes) is shared by the tests in this module; each test
copies it before editing it. The browser checks need Debian's `chromium` and `chromium-driver`
(installed here when missing and we are root) and the `selenium` package.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from veriloco.config import load_config
from veriloco.records import RunDirError
from veriloco.report import render_report, write_report

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-round run of configs/tiny.toml (2 workers), stopped after round 2 and then resumed:
    {"stopped": a copy of its records at the stop, "finished": the resumed, complete run}."""
    from veriloco.run import resume, train

    cfg = load_config(ROOT / "configs" / "tiny.toml", ["--train.rounds=3"])
    base = tmp_path_factory.mktemp("report")
    run, summary = train(cfg, str(base / "run"), quiet=True, stop_after=2)
    assert summary["rounds"] == 2 and summary["complete"] is False
    stopped = copy_run(run.root, base / "stopped")
    run, summary = resume(str(run.root), quiet=True)
    assert summary["rounds"] == 3 and summary["complete"] is True
    return {"stopped": stopped, "finished": run.root}


@pytest.fixture(scope="module")
def real_run(runs: dict[str, Path]) -> Path:
    return runs["finished"]


def copy_run(src: Path, dst: Path) -> Path:
    """The run's records only (the report reads no blobs)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("store", "workers", "report.html"))
    return dst


def read_records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def write_records(run: Path, records: list[dict]) -> None:
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _install_chromium() -> str | None:
    """Install Debian's chromium + chromium-driver; None on success, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root or no apt-get"
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
    for cmd in (install, ["apt-get", "update", "-q"], install):  # the index may be stale or empty
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{' '.join(cmd)}: {err}"
        if done.returncode == 0 and cmd is install and CHROMIUM.exists() and CHROMEDRIVER.exists():
            return None
    return f"apt-get install failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}"


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """A headless Chromium driven by selenium through Debian's chromedriver."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium (dev extra)")
    from selenium.webdriver.chrome.service import Service

    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        why = _install_chromium()
        if why is not None:
            pytest.skip(f"headless Chromium is missing and could not be installed ({why}); "
                        "install it with: apt-get install -y chromium chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1200,900"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver path: selenium must not go looking for (downloading) one
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    yield driver
    driver.quit()


def open_page(driver, page: Path, screenshot: Path) -> list[dict]:
    """Load `page`, save a full-page screenshot; the browser console errors it caused."""
    driver.get_log("browser")  # drain what earlier pages left
    driver.get(page.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1200, min(height + 120, 8000))
    driver.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000
    return [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]


def cell(driver, r: int, w: int):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'#verdict-grid td[data-round="{r}"][data-worker="{w}"]')


# -- tests ---------------------------------------------------------------------------------
def test_report_of_a_real_run_renders_in_chromium(real_run: Path, browser, tmp_path: Path) -> None:
    page = write_report(real_run)
    assert page == real_run / "report.html"
    text = page.read_text()

    # self-contained: nothing to fetch, nothing to run
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:|//|file:)""", text)
    assert not re.search(r"""url\(\s*["']?\s*(?:https?:|//|file:)""", text)
    assert "<script" not in text.lower()
    assert hashlib.sha256((real_run / "manifest.json").read_bytes()).hexdigest() in text

    errors = open_page(browser, page, tmp_path / "report.png")
    assert errors == []
    from selenium.webdriver.common.by import By

    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    plots = browser.find_elements(By.CSS_SELECTOR, "svg.plot")
    assert len(plots) == 3  # loss, bytes, utilisation
    assert all(p.size["width"] > 300 and p.size["height"] > 100 for p in plots)
    assert browser.find_element(By.ID, "status").text == "complete"
    cells = browser.find_elements(By.CSS_SELECTOR, "#verdict-grid td.v")
    assert len(cells) == 6  # 2 workers x 3 rounds
    assert {c.get_attribute("data-state") for c in cells} == {"accept"}
    assert "3 / 3" in browser.find_element(By.CSS_SELECTOR, "header").text
    peak = max(x for line in (real_run / "rounds.jsonl").read_text().splitlines() for x in json.loads(line)["peak_rss_mb"])
    assert f"PEAK MEMORY\n{peak:.0f} MB" in browser.find_element(By.CSS_SELECTOR, "header").text.upper()
    assert "None: every recorded packet was accepted" in browser.find_element(By.ID, "trust").text


def test_a_rejected_worker_shows_in_the_grid_with_its_evidence(real_run: Path, browser, tmp_path: Path) -> None:
    run = copy_run(real_run, tmp_path / "run")
    records = read_records(run)
    hostile = "<img src=x onerror=alert(1)>"  # record contents are untrusted
    records[1] |= {
        "verdicts": ["accept", "reject:norm_outlier"],
        "evidence": {"1": {"norm_ratio": 7.25, "median_norm": 0.31, "note": hostile}},
        "replayed": [0],
    }
    write_records(run, records)
    page = write_report(run)
    assert hostile not in page.read_text()

    errors = open_page(browser, page, tmp_path / "report-rejected.png")
    assert errors == []  # the hostile <img> would have tried (and failed) to load
    from selenium.webdriver.common.by import By

    assert browser.find_elements(By.CSS_SELECTOR, "main img") == []
    rejected = cell(browser, 1, 1)
    assert rejected.get_attribute("data-state") == "reject"
    assert "reject" in rejected.get_attribute("class").split()
    assert "norm_outlier" in rejected.get_attribute("title")
    replayed = cell(browser, 1, 0)
    assert replayed.get_attribute("class").split() == ["v", "accept", "replayed"]
    assert cell(browser, 2, 1).get_attribute("data-state") == "accept"

    listed = browser.find_elements(By.CSS_SELECTOR, "#rejections tr.rejection")
    assert len(listed) == 1
    row = listed[0].text
    assert "norm_outlier" in row and "7.25" in row and hostile in row  # shown as text, not markup
    assert listed[0].get_attribute("id") == "rej-1-1"
    assert "5 accepted, 1 rejected" in browser.find_element(By.ID, "trust").text


def test_a_run_in_progress_still_renders(real_run: Path, tmp_path: Path) -> None:
    run = copy_run(real_run, tmp_path / "run")
    (run / "summary.json").unlink()
    records = read_records(run)
    write_records(run, records[:-1])
    with open(run / "rounds.jsonl", "a") as f:
        f.write('{"round": 2, "verdicts": ["acc')  # a record being written right now
    text = render_report(run)
    assert "in progress" in text
    assert "2 / 3" in text
    assert text.count('data-state="accept"') == 4  # 2 workers x 2 complete rounds
    assert "not valid JSON" not in text  # a torn last line is normal, not a problem to report
    assert text.count('class="plot"') == 3

    # stopped with --stop-after: a summary that says the run is not complete
    (run / "summary.json").write_text(json.dumps({"complete": False, "rounds": 2}))
    assert "stopped" in render_report(run)


def test_a_stopped_then_resumed_run(runs: dict[str, Path]) -> None:
    text = render_report(runs["stopped"])
    assert "stopped" in text and "2 / 3" in text
    assert text.count('data-state="accept"') == 4
    text = render_report(runs["finished"])  # the fixture's run was resumed after round 2
    assert "id=status>complete<" in text and "3 / 3" in text
    assert text.count('data-state="accept"') == 6


def test_partial_and_malformed_run_directories_never_crash(real_run: Path, tmp_path: Path) -> None:
    with pytest.raises(RunDirError):
        render_report(tmp_path)  # no manifest: not a run directory

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(real_run / "manifest.json", fresh / "manifest.json")
    text = render_report(fresh)  # started, no round recorded yet
    assert "in progress" in text and "No rounds recorded yet" in text

    bad = copy_run(real_run, tmp_path / "bad")
    good = read_records(bad)
    junk = [
        {"round": "zz", "verdicts": "accept", "train_loss": "abc", "bytes_sent": {"a": 1},
         "eval_loss": [1], "inner_s": None, "round_s": 0, "codec": {"codecs": {"w": 5}},
         "replayed": [10**12, -1, "x"], "absent": "all", "evidence": [1, 2]},
        {"round": 7, "verdicts": [{"reason": "reject:cosine_outlier"}, None, 5], "late": ["1"],
         "codecs": {"codecs": {"a.weight": "int8", "b.weight": "topk:0.01"}}, "entry_hash": "ab" * 32,
         "bytes_sent": [1e400, -5], "train_loss": [float("nan"), 2.0]},
    ]
    lines = [json.dumps(r) for r in good[:2]] + ["not json", "[1, 2]"] + [json.dumps(r) for r in junk]
    (bad / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    (bad / "metrics.jsonl").write_text('{"round": 0, "utilisation": "high"}\n')
    (bad / "summary.json").write_text("[]")
    (bad / "audit.json").write_text(json.dumps({"ok": False, "first_failure": "<b>round 1</b>"}))
    text = render_report(bad)
    assert "rounds.jsonl line 3 is not valid JSON" in text
    assert "audit failed: &lt;b&gt;round 1&lt;/b&gt;" in text
    assert "cosine_outlier" in text and "topk:0.01" in text
    assert "ab" * 32 in text  # the ledger head, from the last entry hash


def test_the_utilisation_caption_says_when_the_exchange_did_not_hide(real_run: Path, tmp_path: Path) -> None:
    run = copy_run(real_run, tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["outer"]["delay"] = 1
    (run / "manifest.json").write_text(json.dumps(manifest))
    records = read_records(run)
    write_records(run, [r | {"hide_steps": n} for r, n in zip(records, (3, 40, 12), strict=True)])
    assert "In 2 of 3 rounds the exchange needed more compute to hide under than the 5 inner steps it overlaps: up to 40" in render_report(run)
    write_records(run, [r | {"hide_steps": 4} for r in records])
    assert "fit under the 5 inner steps it overlaps in all 3 rounds" in render_report(run)
    write_records(run, records)  # no link declared: nothing said
    assert "inner steps it overlaps" not in render_report(run)
    write_records(run, [r | {"inner_steps": n} for r, n in zip(records, (5, 5, 20), strict=True)])  # adaptive H
    assert "H = 5 to 20 inner steps each" in render_report(run)


def test_a_gpu_run_shows_its_peak_gpu_memory(real_run: Path, tmp_path: Path) -> None:
    run = copy_run(real_run, tmp_path / "run")
    records = read_records(run)
    assert "peak GPU memory" not in render_report(run)  # a CPU run records none
    write_records(run, [r | {"peak_gpu_mb": [812.0, n]} for r, n in zip(records, (900.4, 2100.0, 1500.0), strict=True)])
    assert "peak GPU memory</div><div class=value>2.05 GB" in render_report(run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["run"]["device"], manifest["config"]["train"]["precision"] = "cuda", "bf16"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "<code>diloco, cuda, bf16 / " in render_report(run)


def test_hostile_records_of_every_type_never_crash_the_report(real_run: Path, tmp_path: Path) -> None:
    """Seeded random junk in every field the report reads: it renders, or fails only on the manifest."""
    import random
    import warnings

    rng = random.Random(0)
    atoms = [None, True, 0, -1, 3.5, 1e308, -1e308, float("nan"), 10**30, "<b>x</b>", "accept"]

    def junk(depth: int = 0):
        kind = rng.randrange(len(atoms) + (2 if depth < 3 else 0))
        if kind < len(atoms):
            return atoms[kind]
        if kind == len(atoms):
            return {str(rng.randrange(4)): junk(depth + 1) for _ in range(rng.randrange(4))}
        return [junk(depth + 1) for _ in range(rng.randrange(5))]

    keys = ["round", "verdicts", "train_loss", "eval_loss", "eval_loss_start", "bytes_sent", "inner_s",
            "round_s", "codec", "codecs", "replayed", "absent", "late", "evidence", "entry_hash",
            "hashes_agree", "tokens", "params_hash", "hide_steps", "inner_steps"]
    real = read_records(real_run)
    manifest = json.loads((real_run / "manifest.json").read_text())
    for case in range(25):
        run = tmp_path / f"case{case}"
        run.mkdir()
        m = json.loads(json.dumps(manifest))
        if rng.random() < 0.3:
            m["config"]["topology"]["workers"], m["config"]["model"], m["run_id"] = junk(), junk(), junk()
        (run / "manifest.json").write_text(json.dumps(m))
        records = []
        for _ in range(rng.randrange(5)):
            rec = dict(rng.choice(real)) if rng.random() < 0.5 else {}
            rec |= {rng.choice(keys): junk() for _ in range(rng.randrange(1, 6))}
            records.append(rec)
        write_records(run, records)
        (run / "metrics.jsonl").write_text(json.dumps({"round": junk(), "utilisation": junk()}) + "\n")
        (run / "summary.json").write_text(json.dumps({k: junk() for k in (
            "tokens", "wall_s", "eval_loss_end", "complete", "baseline", "ledger_head", "ledger_root")}))
        (run / "audit.json").write_text(json.dumps({"ok": junk(), "first_failure": junk()}))
        (run / "events.jsonl").write_text("".join(json.dumps({k: junk() for k in rng.sample(
            ["event", "worker", "peer", "t", "round", "seconds", "exitcode", "error", "restarts_left"], 5)}) + "\n"
            for _ in range(rng.randrange(4))))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no NaN or overflow reaching matplotlib either
            text = render_report(run)
        assert "<b>x</b>" not in text


def test_an_elastic_run_lists_what_happened_to_its_workers(real_run: Path, tmp_path: Path) -> None:
    """RUN/events.jsonl (the elastic launcher's): deaths, restarts and cuts in the Membership section."""
    run = copy_run(real_run, tmp_path / "run")
    assert "id=membership" not in render_report(run)  # a static run has no events: no section
    events = [
        {"t": 0.0, "event": "started", "worker": 0, "round": 0}, {"t": 0.0, "event": "started", "worker": 1, "round": 0},
        {"t": 2.5, "event": "died", "worker": 1, "round": 1, "exitcode": -9},
        {"t": 2.6, "event": "restarting", "worker": 1, "round": 1, "restarts_left": 0},
        {"t": 4.1, "event": "started", "worker": 1, "round": 2},
        {"t": 5.0, "event": "committed", "worker": None, "round": 3, "committed": 2, "members": [0, 1]},
        {"t": 6.0, "event": "cut", "worker": 0, "peer": 1, "round": 3, "seconds": 4},
        {"t": 7.0, "event": "died", "worker": 0, "round": 3, "exitcode": 1, "error": "ValueError: <b>x</b>"},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in events))
    text = render_report(run)
    section = text[text.index("id=membership"):]
    assert "2 deaths, 1 restarts, 1 cuts" in section
    assert "worker 0 ↔ worker 1" in section and "for 4 s" in section and "0 restarts left" in section
    assert "exit -9" in section and "ValueError: &lt;b&gt;x&lt;/b&gt;" in section and "<b>x</b>" not in text
    assert section.count("<tr>") == 1 + len(events) - 1  # the header, every event but the commit


def test_the_headline_numbers_come_from_the_records_not_summary_json(real_run: Path, tmp_path: Path) -> None:
    """summary.json is not signed: the final eval loss and params hash beside the audit badge are
    the records' (which `veriloco audit` checks), not a number written into it by hand."""
    run = copy_run(real_run, tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "eval_loss_end": 0.1234, "final_params_hash": "ab" * 32}))
    text = render_report(run)
    last = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()][-1]
    assert "0.1234" not in text and "ab" * 32 not in text
    assert f"{last['eval_loss']:.4f}" in text and last["params_hash"] in text
