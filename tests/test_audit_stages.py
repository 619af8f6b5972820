"""`veriloco audit` of a pipeline run ([topology] stages = 2, workers = 2): each stage's bundles,
verdicts, aggregate and outer step are redone on its slice of the model, then the stage
checkpoints must make the stage-checkpoint manifest the ledger entry names.

One real run (2 workers x 2 stages = 4 processes, 3 rounds); each test tampers a fresh copy and
the failure must name the round, the stage and the thing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import rounds_of, tiny
from typer.testing import CliRunner

from veriloco.audit import audit_run
from veriloco.cli import app
from veriloco.hashing import canonical_json
from veriloco.ledger import SqliteLedger
from veriloco.ledger.entry import ZERO_HASH, entry_hash
from veriloco.run import train
from veriloco.store import LocalStore

ROUNDS, WORKERS, STAGES = 3, 2, 2


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("stages") / "run"
    train(tiny(f"--train.rounds={ROUNDS}", f"--topology.workers={WORKERS}", f"--topology.stages={STAGES}"),
          str(d), quiet=True)
    return d


@pytest.fixture
def run(original, tmp_path) -> Path:
    return Path(shutil.copytree(original, tmp_path / "run"))


def failure(run_dir: Path) -> str:
    report = audit_run(run_dir)
    assert not report.ok, "the tampered run audited ok"
    assert report.first_failure and "\n" not in report.first_failure
    print("first_failure:", report.first_failure)
    return report.first_failure


def blob(run_dir: Path, digest: str) -> Path:
    return LocalStore(run_dir / "store").path_of(digest)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def write_records(run_dir: Path, records: list[dict]) -> None:
    (run_dir / "rounds.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def forge(run_dir: Path, edit: Callable[[int, dict, dict], None]) -> None:
    """Edit entries and records together, then rebuild the ledger so its chain and roots hold."""
    path = run_dir / "ledger.sqlite"
    with SqliteLedger(path) as old:
        entries = old.entries()
    path.unlink()
    records = rounds_of(run_dir)
    prev = ZERO_HASH
    with SqliteLedger(path) as new:
        for r, (e, rec) in enumerate(zip(entries, records, strict=True)):
            edit(r, e, rec)
            e["predicate"]["prev_entry_hash"] = prev
            new.append(e)
            prev = rec["entry"] = entry_hash(e)
    write_records(run_dir, records)


def test_untouched_stage_run_audits_ok(run):
    report = audit_run(run)
    assert report.ok, report.first_failure
    c = report.checked
    assert report.rounds == ROUNDS and c["ledger_entries"] == ROUNDS
    assert c["bundles"] == c["signatures"] == ROUNDS * WORKERS * STAGES
    assert c["checkpoints"] == ROUNDS * STAGES and c["signed_manifest"] == 1
    res = CliRunner().invoke(app, ["audit", str(run)])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"audit ok: {ROUNDS} rounds")


def test_stage_packet_byte_flipped(run):
    flip_byte(blob(run, rounds_of(run)[1]["stages"][1]["bundles"][0]))
    msg = failure(run)
    assert msg.startswith("round 1: stage 1: bundle of worker 0: ") and "corrupt" in msg, msg


def test_stage_checkpoint_byte_flipped(run):
    flip_byte(blob(run, rounds_of(run)[2]["stages"][0]["checkpoint"]))
    msg = failure(run)
    assert msg.startswith("round 2: stage 0: checkpoint: ") and "corrupt" in msg, msg


def test_stage_checkpoint_manifest_byte_flipped(run):
    flip_byte(blob(run, rounds_of(run)[1]["checkpoint"]))
    msg = failure(run)
    assert msg.startswith("round 1: stage-checkpoint manifest: ") and "corrupt" in msg, msg


def test_stage_bundle_swapped_for_another_workers(run):
    """rounds.jsonl gives stage 0's worker 0 the (genuine) bundle of worker 1."""
    recs = rounds_of(run)
    recs[1]["stages"][0]["bundles"][0] = recs[1]["stages"][0]["bundles"][1]
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 1: stage 0: worker 0"), msg


def test_stage_record_verdict_edited(run):
    recs = rounds_of(run)
    recs[2]["stages"][1]["verdicts"][1] = "norm_outlier"
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 2: stage 1: rounds.jsonl verdicts differ"), msg


def test_forged_stage_checkpoint_with_consistent_ledger(run):
    """A rebuilt ledger and records whose round-2 stage-1 checkpoint is another stored stage
    checkpoint, with a matching stage-checkpoint manifest: every hash is consistent, the outer
    step recomputation is not."""
    other = rounds_of(run)[0]["stages"][1]["checkpoint"]
    store = LocalStore(run / "store")

    def edit(r: int, e: dict, rec: dict) -> None:
        if r != 2:
            return
        e["predicate"]["stages"][1]["checkpoint"] = rec["stages"][1]["checkpoint"] = other
        manifest = canonical_json({"stages": [{"checkpoint": p["checkpoint"], "params_hash": p["params_hash"]}
                                              for p in rec["stages"]]})
        e["subject"][0]["digest"]["sha256"] = rec["checkpoint"] = store.put(manifest)
    forge(run, edit)
    msg = failure(run)
    assert msg.startswith("round 2: stage 1: the outer step recomputes to checkpoint"), msg


def test_forged_stage_manifest_subject(run):
    """The entry's subject names a manifest that is stored but is not the stages' checkpoints."""
    store = LocalStore(run / "store")
    fake = store.put(canonical_json({"stages": [{"checkpoint": "0" * 64, "params_hash": "0" * 64}]}))

    def edit(r: int, e: dict, rec: dict) -> None:
        if r == 1:
            e["subject"][0]["digest"]["sha256"] = rec["checkpoint"] = fake
    forge(run, edit)
    msg = failure(run)
    assert msg.startswith("round 1: the stage checkpoints make manifest"), msg
