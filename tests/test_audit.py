"""`veriloco audit`: one real tiny run, then one tamper per test on a fresh copy of it.

Every tamper must make `audit_run` fail, and its `first_failure` must name the round and the
thing that was touched (ledger, bundle of worker j, checkpoint, corpus, manifest, verdict...).
The last tests drive the CLI in process: exit 0 ok / 1 tampered (one line) / 2 not a run, and
`veriloco prove`.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, rounds_of, tiny
from typer.testing import CliRunner

from veriloco.audit import audit_run
from veriloco.cli import app
from veriloco.hashing import canonical_json, json_hash
from veriloco.ledger import SqliteLedger
from veriloco.ledger.entry import ZERO_HASH, entry_hash
from veriloco.packet import decode_bundle
from veriloco.records import RunDirError
from veriloco.run import train
from veriloco.store import LocalStore

ROUNDS = 3
_TRIGGERS = ("entries_no_update", "entries_no_delete", "entries_next_only", "roots_no_update",
             "roots_no_delete")


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """One real run: 3 rounds, 2 worker processes (configs/tiny.toml). Never modified."""
    d = tmp_path_factory.mktemp("audit") / "run"
    train(tiny(f"--train.rounds={ROUNDS}"), str(d), quiet=True)
    return d


@pytest.fixture
def run(original, tmp_path) -> Path:
    """A fresh copy of the run, for one test to tamper with."""
    return Path(shutil.copytree(original, tmp_path / "run"))


def failure(run_dir: Path) -> str:
    report = audit_run(run_dir)
    assert not report.ok, "the tampered run audited ok"
    assert report.first_failure and "\n" not in report.first_failure
    print("first_failure:", report.first_failure)  # shown by pytest -s, or when a test fails
    return report.first_failure


# ---- tampering helpers --------------------------------------------------------------------------

def flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def blob(run_dir: Path, digest: str) -> Path:
    return LocalStore(run_dir / "store").path_of(digest)


def sql(run_dir: Path) -> sqlite3.Connection:
    """A raw connection to the run's ledger with the append-only triggers dropped (an attacker
    with write access to the file can do this; only the hashes can catch it)."""
    con = sqlite3.connect(run_dir / "ledger.sqlite", isolation_level=None)
    for t in _TRIGGERS:
        con.execute(f"DROP TRIGGER IF EXISTS {t}")
    return con


def write_records(run_dir: Path, records: list[dict]) -> None:
    (run_dir / "rounds.jsonl").write_text(
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def forge_ledger(run_dir: Path, edit: Callable[[int, dict], None]) -> None:
    """A sophisticated forger: edit entries in place, then rebuild the whole ledger so the hash
    chain, stored hashes and Merkle roots are all consistent again, and point rounds.jsonl at the
    new entry hashes."""
    path = run_dir / "ledger.sqlite"
    with SqliteLedger(path) as old:
        entries = old.entries()
    path.unlink()
    records = rounds_of(run_dir)
    prev = ZERO_HASH
    with SqliteLedger(path) as new:
        for r, e in enumerate(entries):
            edit(r, e)
            e["predicate"]["prev_entry_hash"] = prev
            new.append(e)
            prev = entry_hash(e)
            records[r]["entry"] = prev
    write_records(run_dir, records)


# ---- the untouched run ----------------------------------------------------------------------

def test_untouched_copy_audits_ok(run):
    report = audit_run(run)
    assert report.ok, report.first_failure
    assert report.rounds == ROUNDS and report.first_failure is None
    c = report.checked
    assert c["ledger_entries"] == ROUNDS and c["checkpoints"] == ROUNDS
    assert c["bundles"] == 2 * ROUNDS and c["signatures"] == 2 * ROUNDS
    assert c["corpus_chunks"] > 0
    with SqliteLedger(run / "ledger.sqlite") as ledger:
        assert report.ledger_root == ledger.root()


# ---- the ledger ---------------------------------------------------------------------------------

def test_ledger_row_byte_flipped(run):
    con = sql(run)
    (body,) = con.execute("SELECT body FROM entries WHERE idx = 1").fetchone()
    body = bytearray(body)
    body[len(body) // 2] ^= 0x01
    con.execute("UPDATE entries SET body = ? WHERE idx = 1", (bytes(body),))
    con.close()
    msg = failure(run)
    assert msg.startswith("round 1: ledger"), msg
    assert "does not match its bytes" in msg


def test_ledger_row_deleted(run):
    con = sql(run)
    con.execute("DELETE FROM entries WHERE idx = 1")
    con.close()
    msg = failure(run)
    assert msg.startswith("round 1: ledger"), msg
    assert "missing" in msg


def test_ledger_last_row_deleted(run):
    con = sql(run)
    con.execute(f"DELETE FROM entries WHERE idx = {ROUNDS - 1}")
    con.close()
    msg = failure(run)
    assert msg.startswith(f"round {ROUNDS - 1}: "), msg
    assert "ledger" in msg and "rounds.jsonl" in msg


def test_ledger_rows_reordered(run):
    con = sql(run)
    rows = dict(con.execute("SELECT idx, body FROM entries WHERE idx IN (1, 2)").fetchall())
    con.execute("UPDATE entries SET body = ? WHERE idx = 1", (rows[2],))
    con.execute("UPDATE entries SET body = ? WHERE idx = 2", (rows[1],))
    con.close()
    msg = failure(run)
    assert msg.startswith("round 1: ledger"), msg


def test_ledger_rows_reordered_with_their_hashes(run):
    """Swap whole rows (body and stored hash): the chain, round numbers and roots still catch it."""
    con = sql(run)
    rows = {i: (h, b) for i, h, b in con.execute("SELECT idx, hash, body FROM entries WHERE idx IN (1, 2)")}
    con.execute("UPDATE entries SET hash = ?, body = ? WHERE idx = 1", rows[2])
    con.execute("UPDATE entries SET hash = ?, body = ? WHERE idx = 2", rows[1])
    con.close()
    msg = failure(run)
    assert msg.startswith("round 1: ledger"), msg


# ---- bundles (signed commitment + packet) in the store ------------------------------------------

def test_bundle_byte_flipped(run):
    digest = rounds_of(run)[1]["bundles"][1]
    flip_byte(blob(run, digest))
    msg = failure(run)
    assert msg.startswith("round 1: bundle of worker 1: "), msg
    assert "corrupt" in msg


def test_bundle_deleted(run):
    digest = rounds_of(run)[2]["bundles"][0]
    blob(run, digest).unlink()
    msg = failure(run)
    assert msg.startswith("round 2: bundle of worker 0: "), msg
    assert "missing" in msg


def test_bundles_swapped(run):
    """Blob A's bytes written at blob B's path (and B's at A's): both names now lie."""
    recs = rounds_of(run)
    a, b = blob(run, recs[1]["bundles"][0]), blob(run, recs[1]["bundles"][1])
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    msg = failure(run)
    assert msg.startswith("round 1: bundle of worker 0: "), msg
    assert "corrupt" in msg


def test_bundle_of_an_earlier_round_named_in_records(run):
    """rounds.jsonl points round 1's worker 0 at its (genuine, stored) round-0 bundle: a replay."""
    recs = rounds_of(run)
    recs[1]["bundles"][0] = recs[0]["bundles"][0]
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 1: worker 0"), msg


# ---- checkpoints, corpus, manifest, records -----------------------------------------------------

def test_checkpoint_byte_flipped(run):
    flip_byte(blob(run, rounds_of(run)[1]["checkpoint"]))
    msg = failure(run)
    assert msg.startswith("round 1: checkpoint: "), msg
    assert "corrupt" in msg


def test_corpus_chunk_byte_flipped(run):
    manifest = json.loads((run / "manifest.json").read_text())
    store = LocalStore(run / "store")
    chunks = json.loads(store.get(manifest["corpus_manifest"]))["chunks"]
    flip_byte(blob(run, chunks[len(chunks) // 2]))
    msg = failure(run)
    assert msg.startswith("corpus: "), msg
    assert "corrupt" in msg


def test_manifest_config_edited(run):
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["outer"]["lr"] = 0.5
    path.write_bytes(canonical_json(manifest) + b"\n")
    msg = failure(run)
    assert msg.startswith("manifest: "), msg
    assert "run id" in msg


def test_manifest_edited_and_run_id_recomputed(run):
    """The forger also recomputes the run id: the ledger entries name the old run."""
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["outer"]["lr"] = 0.5
    core = {k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")}
    manifest["run_id"] = json_hash(core)
    path.write_bytes(canonical_json(manifest) + b"\n")
    msg = failure(run)
    assert msg.startswith("round 0: "), msg
    assert "another run" in msg


def _rehashed_manifest(run: Path, edit: Callable[[dict], None]) -> None:
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["run_id"] = json_hash({k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")})
    path.write_bytes(canonical_json(manifest) + b"\n")


@pytest.mark.parametrize("what", ["bundles an int", "threads a string", "config a list", "no corpus_root"])
def test_malformed_fields_fail_in_one_line_not_a_traceback(run, what):
    """Each of these stopped `veriloco audit` with a traceback (TypeError, ValueError,
    AttributeError, KeyError) before the check that would have named it."""
    if what == "bundles an int":
        recs = rounds_of(run)
        recs[1]["bundles"] = 5
        write_records(run, recs)
        want = "round 1: the record's bundles are not a list of 2 digests (or nulls): 5"
    elif what == "threads a string":
        _rehashed_manifest(run, lambda m: m["config"]["train"].update(threads="x"))
        want = "manifest: config does not parse"
    elif what == "config a list":  # no run directory a run wrote: exit 2 (records.RunDirError), before the audit
        _rehashed_manifest(run, lambda m: m.update(config=[1]))
        with pytest.raises(RunDirError, match="manifest.json has no config"):
            audit_run(run)
        return
    else:
        _rehashed_manifest(run, lambda m: m.pop("corpus_root"))
        want = "corpus: Merkle root "
    assert failure(run).startswith(want)


def test_records_checkpoint_replaced(run):
    recs = rounds_of(run)
    recs[1]["checkpoint"] = recs[0]["checkpoint"]
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 1: "), msg
    assert "checkpoint" in msg and "rounds.jsonl" in msg


def test_records_verdict_edited(run):
    """rounds.jsonl (what the report shows) claims a rejection the ledger does not record."""
    recs = rounds_of(run)
    recs[1]["verdicts"][0] = "norm_outlier"
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 1: rounds.jsonl verdicts differ"), msg


def test_records_entry_hash_edited(run):
    recs = rounds_of(run)
    recs[2]["entry"] = recs[1]["entry"]
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 2: rounds.jsonl names entry"), msg


def test_records_last_round_removed(run):
    write_records(run, rounds_of(run)[:-1])
    msg = failure(run)
    assert msg.startswith(f"round {ROUNDS - 1}: "), msg
    assert "rounds.jsonl" in msg


# ---- a forger who keeps every hash consistent ---------------------------------------------------

def _forge_signature(run: Path, r: int, j: int) -> tuple[str, str]:
    """Flip one hex char of worker j's signature in its round-r bundle, store the new bundle
    under its new hash, and point rounds.jsonl at it. Returns (old, new) signature."""
    recs = rounds_of(run)
    store = LocalStore(run / "store")
    data = store.get(recs[r]["bundles"][j])
    old = json.loads(decode_bundle(data)[0])["signature"]
    new = ("1" if old[0] != "1" else "2") + old[1:]
    assert data.count(old.encode()) == 1
    forged = data.replace(old.encode(), new.encode())
    recs[r]["bundles"][j] = store.put(forged)
    write_records(run, recs)
    return old, new


def _set_signature(r: int, j: int, sig: str) -> Callable[[int, dict], None]:
    def edit(i: int, e: dict) -> None:
        if i == r:
            c = e["predicate"]["commitments"][j]
            c["signed"]["signature"] = sig
    return edit


def test_forged_signature_with_consistent_ledger(run):
    """Bundle, store, rounds.jsonl and the (rebuilt, re-chained) ledger all agree on the new
    signature; it does not verify, so the recomputed verdict is not the recorded accept."""
    _, new = _forge_signature(run, 1, 1)
    forge_ledger(run, _set_signature(1, 1, new))
    msg = failure(run)
    assert msg.startswith("round 1: worker 1's verdict recomputes to 'bad_signature'"), msg


def test_forged_signature_and_verdict(run):
    """The forger also records the honest verdict (bad_signature): the aggregate no longer
    matches the entry's, since worker 1's delta is now left out."""
    _, new = _forge_signature(run, 1, 1)

    def edit(i: int, e: dict) -> None:
        _set_signature(1, 1, new)(i, e)
        if i == 1:
            e["predicate"]["commitments"][1]["verdict"] = "bad_signature"
    forge_ledger(run, edit)
    recs = rounds_of(run)
    recs[1]["verdicts"][1] = "bad_signature"
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 1: the accepted packets aggregate to"), msg


def test_forged_signature_ledger_not_updated(run):
    """Only the bundle and rounds.jsonl were changed: the bundle's commitment fails to verify."""
    _forge_signature(run, 1, 1)
    msg = failure(run)
    assert msg.startswith("round 1: worker 1"), msg


def test_a_static_runs_rejected_worker_cannot_be_recorded_absent(run):
    """Worker 1's signed commitment, bundle and verdict replaced by "absent" in a rebuilt ledger
    and the records (and its bundle gone from the store): a static run never leaves a worker out,
    so the round fails, where it audited ok (the entry held no commitment to contradict)."""
    recs = rounds_of(run)
    blob(run, recs[1]["bundles"][1]).unlink()

    def edit(i: int, e: dict) -> None:
        if i == 1:
            e["predicate"]["commitments"][1] = {"worker": 1, "verdict": "absent", "signed": None, "bundle_sha256": None}
    forge_ledger(run, edit)
    recs = rounds_of(run)
    recs[1]["verdicts"][1], recs[1]["bundles"][1] = "absent", None
    write_records(run, recs)
    msg = failure(run)
    assert msg == ("round 1: worker 1 is recorded as absent without a bundle, which only an elastic run records "
                   "(a static run stops when a worker is missing)"), msg


@pytest.mark.parametrize("worker", [None, "1", 0])
def test_a_ledger_commitment_must_name_its_worker_once(run, worker, monkeypatch):
    """A commitment without its worker, or naming one as a string, or a worker twice: the audit
    stopped with a traceback (KeyError, TypeError); now the ledger's entry check refuses it."""
    monkeypatch.setattr("veriloco.ledger.base.parse_entry", json.loads)  # the forger's own writer checks nothing

    def edit(i: int, e: dict) -> None:
        if i == 1:
            c = e["predicate"]["commitments"][1]
            if worker is None:
                del c["worker"]
            else:
                c["worker"] = worker
    forge_ledger(run, edit)
    monkeypatch.undo()
    msg = failure(run)
    want = "is a second one of worker 0" if worker == 0 else "must name its worker (and stage) as integers >= 0"
    assert msg.startswith("round 1: ledger entry: ") and want in msg, msg


@pytest.mark.parametrize("field", ["eval_loss", "codecs"])
def test_a_recorders_claimed_eval_loss_and_codecs_are_recomputed(run, field):
    """The eval loss (the run's headline) and each worker's codecs, changed in a rebuilt ledger and
    the records alike: both were only compared with each other, so the audit passed; now the eval
    loss is recomputed from the recomputed params and the codecs from the signed commitments."""
    value = 1.2345 if field == "eval_loss" else [{"int8": 29}, {"int8": 29}]

    def edit(i: int, e: dict) -> None:
        if i == 1:
            e["predicate"][field] = value
    forge_ledger(run, edit)
    recs = rounds_of(run)
    recs[1][field] = value
    write_records(run, recs)
    msg = failure(run)
    if field == "eval_loss":
        assert re.match(r"round 1: the recomputed params' eval loss is \d\.\d{6}, the entry claims 1\.234500$", msg), msg
    else:
        assert msg.startswith("round 1: the record's codecs [{'int8': 29}, {'int8': 29}] are not the ones the signed "
                              "commitments name [{'fp32': "), msg


@pytest.mark.parametrize("key", ["eval_loss_end", "final_params_hash", "rounds", "eval_loss_start"])
def test_summary_and_the_starting_eval_loss_are_checked(run, key):
    """summary.json is not signed and the report showed its final eval loss and params hash beside
    "audit passed": the audit now holds it to the records and the ledger; and the starting eval loss
    (the records' only, under the signature) is recomputed from G_0."""
    if key == "eval_loss_start":
        write_records(run, [{**rec, key: 9.0} for rec in rounds_of(run)])
        assert re.match(r"round 0: the starting params' eval loss is \d\.\d{6}, the record claims 9\.0$", failure(run))
        return
    summary = json.loads((run / "summary.json").read_text())
    summary[key] = {"eval_loss_end": 0.5, "final_params_hash": "ab" * 32, "rounds": 2}[key]
    (run / "summary.json").write_text(json.dumps(summary))
    assert failure(run).startswith(f"summary: summary.json's {key} ")


def test_forged_ledger_alone_is_consistent_chain_but_fails_recompute(run):
    """A rebuilt ledger whose round-2 checkpoint digest is another (stored) checkpoint, with
    rounds.jsonl updated too: the chain is sound, the outer step recomputation is not."""
    recs = rounds_of(run)
    other = recs[0]["checkpoint"]

    def edit(i: int, e: dict) -> None:
        if i == 2:
            e["subject"][0]["digest"]["sha256"] = other
    forge_ledger(run, edit)
    recs = rounds_of(run)
    recs[2]["checkpoint"] = other
    write_records(run, recs)
    msg = failure(run)
    assert msg.startswith("round 2: the outer step recomputes to checkpoint"), msg


# ---- the CLI -------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_audit_ok(run):
    res = runner.invoke(app, ["audit", str(run)])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"audit ok: {ROUNDS} rounds, {ROUNDS} ledger entries")
    assert json.loads((run / "audit.json").read_text())["ok"] is True


def test_cli_audit_tampered_exits_1_with_one_line(run):
    flip_byte(blob(run, rounds_of(run)[1]["checkpoint"]))
    res = runner.invoke(app, ["audit", str(run)])
    assert res.exit_code == 1
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and re.match(r"audit FAILED: round 1: checkpoint: ", lines[0]), res.stderr
    saved = json.loads((run / "audit.json").read_text())
    assert saved["ok"] is False and saved["first_failure"].startswith("round 1: checkpoint")


def test_cli_audit_not_a_run_dir_exits_2(tmp_path):
    res = runner.invoke(app, ["audit", str(tmp_path)])
    assert res.exit_code == 2
    assert res.stderr.startswith("veriloco: error: ") and "not a run directory" in res.stderr
    assert len(res.stderr.splitlines()) == 1


def test_cli_prove(original):
    res = runner.invoke(app, ["prove", str(original), "1"])
    assert res.exit_code == 0, res.output
    proof = json.loads(res.stdout)
    assert proof["verified"] is True
    assert proof["round"] == 1 and proof["tree_size"] == ROUNDS
    with SqliteLedger(original / "ledger.sqlite") as ledger:
        assert proof["root"] == ledger.root()
    bad = runner.invoke(app, ["prove", str(original), str(ROUNDS)])
    assert bad.exit_code == 2 and "not in the ledger" in bad.stderr


def test_signed_checkpoint_manifest_checked(run):
    signed = json.loads((run / "checkpoint.sig.json").read_text())
    signed["manifest"]["round"] = 0  # any edit breaks the recorder's signature
    (run / "checkpoint.sig.json").write_text(json.dumps(signed))
    assert "signed checkpoint manifest" in failure(run) and "signature" in failure(run)
    (run / "checkpoint.sig.json").unlink()
    assert "checkpoint.sig.json is missing" in failure(run)


@pytest.mark.parametrize("unsigned", ["summary deleted", "summary incomplete", "a lock of pid 1"])
def test_edited_records_cannot_switch_the_signature_check_off(run, unsigned):
    """rounds.jsonl's fields the ledger does not hold (train_loss, evidence, bytes...) are bound
    only by the recorder's signature, which the audit checked only where summary.json (unsigned)
    said complete and RUN/.lock named no live pid: an edited record went through with either
    changed. The signature is now checked wherever the records are complete or it is present."""
    recs = rounds_of(run)
    recs[1]["train_loss"] = [0.1 for _ in recs[1]["train_loss"]]
    write_records(run, recs)
    if unsigned == "summary deleted":
        (run / "summary.json").unlink()
    elif unsigned == "summary incomplete":
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "complete": False}))
    else:
        (run / ".lock").write_text("1")  # pid 1 is alive, but holds no lock on the file
    msg = failure(run)
    assert msg.startswith("signed checkpoint manifest: ") and "rounds.jsonl" in msg, msg


def test_a_run_stopped_before_its_signature_is_signed_by_resume(run, monkeypatch, capsys):
    """A launcher stopped between the last record and its last act (the signature) left a run the
    audit now refuses (complete, unsigned); `veriloco train --resume` signs it. A run stopped
    earlier audits ok, and the line says its records are not signed."""
    from conftest import cli

    (run / "checkpoint.sig.json").unlink()
    (run / "summary.json").unlink()
    assert "checkpoint.sig.json is missing" in failure(run)
    code, err, out = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 0, err
    report = audit_run(run)
    assert report.ok and report.signed, report.first_failure
    assert json.loads((run / "summary.json").read_text())["complete"] is True
    code, err, _ = cli(monkeypatch, capsys, "train", "--resume", str(run), "--quiet")
    assert code == 2 and err == [f"veriloco: error: {run} is already complete ({ROUNDS}/{ROUNDS} rounds)"]
    # the first two rounds of it, as a run stopped there (--stop-after 2) leaves them
    short = run.parent / "short"
    shutil.copytree(run, short)
    for name in ("checkpoint.sig.json", "summary.json"):
        (short / name).unlink()
    write_records(short, rounds_of(short)[:2])
    with sql(short) as con:
        con.execute("DELETE FROM entries WHERE idx >= 2")
        con.execute("DELETE FROM roots WHERE size > 2")
    report = audit_run(short)
    assert report.ok and not report.signed, report.first_failure
    code, _, out = cli(monkeypatch, capsys, "audit", str(short))
    assert code == 0 and out.strip().endswith(
        f"(not signed: 2 of {ROUNDS} rounds recorded, so the recorder's signed checkpoint manifest, which a "
        "complete run writes, does not cover the records' other fields)"), out


@pytest.mark.parametrize("mode", [False, True])
def test_the_audit_leaves_the_process_as_it_found_it(run, mode):
    """Its thread count and torch's deterministic-algorithms setting are restored (and not set
    anew when unchanged: that call imports torch's compiler, ~1.5 s)."""
    import torch

    threads, before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode)
    try:
        assert audit_run(run).ok
        assert torch.are_deterministic_algorithms_enabled() is mode and torch.get_num_threads() == threads
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_users_task_run_is_audited_with_its_task(tmp_path, monkeypatch):
    """`veriloco audit` rebuilds only the built-in tasks; `audit_task(task, RUN)` audits a
    `train_task` run with the user's Task: every round redone, the drawn replays re-run bit for bit
    on the user's model, and another model or other batches fail at round 0."""
    import torch

    from veriloco import Task, load_config, train_task
    from veriloco.audit import audit_task

    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # the workers import the Task's functions from there too
    import custom_model as cm
    task = Task(cm.make_model, cm.loss, cm.batch, cm.eval_batches)
    cfg = load_config(overrides=["--topology.workers=3", "--train.rounds=4", "--train.inner_steps=10",
                                 "--train.warmup_steps=10", "--train.lr=0.01", "--train.eval_batches=4",
                                 "--verify.replay_probability=0.5", "--train.inner_state=reset",
                                 "--train.round_warmup_steps=2", "--verify.trace_every=5"])
    run = tmp_path / "run"
    train_task(task, cfg, str(run), quiet=True)
    report = audit_task(task, run, replay=100)
    assert report.ok, report.first_failure
    assert report.checked["replays"] >= 1 and report.checked["checkpoints"] == 4 and report.checked["signatures"] == 12
    assert audit_run(run).first_failure.startswith("manifest: the run trained a user's Task (make_model)")

    def doubled(w, r, s):
        x, y = cm.batch(w, r, s)
        return x, 2 * y

    def reseeded():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    assert audit_task(Task(cm.make_model, cm.loss, doubled, cm.eval_batches), run).first_failure == \
        "round 0: worker 0's verdict recomputes to 'wrong_data', the entry says 'accept'"
    assert audit_task(Task(reseeded, cm.loss, cm.batch, cm.eval_batches), run).first_failure == \
        "round 0: worker 0's verdict recomputes to 'stale_base', the entry says 'accept'"


def test_a_run_in_progress_is_audited_up_to_its_last_record(tmp_path):
    """`veriloco audit` of a run still training failed now and then (2 of 6 tries by hand): a
    round's ledger entry is appended before its record, and the ledger is read after the records,
    so it was one or more entries ahead; and the run prunes checkpoints on as the audit reads. With
    the run's launcher alive (RUN/.lock), the rounds recorded so far are audited, and the report
    says the run is in progress. A run whose launcher is gone is held to its records as before."""
    from conftest import holder

    from veriloco.ledger import SqliteLedger

    run = tmp_path / "run"
    train(tiny("--train.rounds=5", "--run.keep_checkpoints=2"), str(run), quiet=True)
    lines = (run / "rounds.jsonl").read_text().splitlines(keepends=True)
    (run / "rounds.jsonl").write_text("".join(lines[:2]))  # as read mid-run: the ledger holds 3 more entries
    (run / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]))
    dead = audit_run(run)
    assert not dead.ok and dead.first_failure.startswith("round 2: in the ledger but not in rounds.jsonl")
    held = holder(run)
    try:
        live = audit_run(run)
    finally:
        held.kill()
        held.wait()
    assert live.ok, live.first_failure
    assert live.in_progress == held.pid and live.rounds == 2 and live.checked["ledger_entries"] == 2
    with SqliteLedger(run / "ledger.sqlite") as ledger:
        assert live.ledger_root == ledger.root(2) != ledger.root()
    assert live.checked["checkpoints_pruned"] == 2  # rounds 0 and 1's, pruned since (keep_checkpoints = 2)


def test_a_run_held_on_another_machine_is_a_run_in_progress_here(tmp_path, monkeypatch, capsys):
    """A run directory shared between machines (elastic): RUN/.lock names its launcher's pid and
    host. A pid of another host means nothing here, and it was looked up among this machine's
    processes: the run training there was no run in progress to an audit here (and the ledger
    runs a round ahead of the records: "in the ledger but not in rounds.jsonl", now and then).
    For another host the file's lock is asked instead; once nothing holds it, it is no run."""
    import signal
    import socket

    from conftest import cli, holder

    from veriloco.records import RunDir

    run = tmp_path / "run"
    train(tiny("--train.rounds=5"), str(run), quiet=True)
    lines = (run / "rounds.jsonl").read_text().splitlines(keepends=True)
    (run / "rounds.jsonl").write_text("".join(lines[:2]))  # as read mid-run: the ledger holds 3 more entries
    held = holder(run)
    try:
        (run / ".lock").write_text("2147483000 a-machine-elsewhere\n")  # a pid this machine has not, another host
        assert RunDir(run).holder() == 2147483000
        live = audit_run(run)
        assert live.ok and live.in_progress == 2147483000 and live.rounds == 2, live.first_failure
        code, _, out = cli(monkeypatch, capsys, "audit", str(run))
        assert code == 0 and "(a run in progress, pid 2147483000 on a-machine-elsewhere: its rounds recorded so far)" in out
    finally:
        held.send_signal(signal.SIGKILL)  # as a machine that died: its lock file stays, no one holds it
        held.wait()
    assert (run / ".lock").exists() and RunDir(run).holder() is None
    # and a launcher refused by another machine's lock says whose (records.Held)
    from veriloco.records import Held

    assert Held(f"123 {socket.gethostname()}").pid() == " (pid 123)" == Held("123").pid()
    assert Held("123 a-machine-elsewhere").pid() == " (pid 123 on a-machine-elsewhere)"
    dead = audit_run(run)
    assert not dead.ok and dead.first_failure.startswith("round 2: in the ledger but not in rounds.jsonl")


def test_a_lock_file_that_names_no_live_process_is_no_run_in_progress(tmp_path):
    """RUN/.lock names the pid of the launcher training into RUN; a copy of a run directory may
    bring one along, or garbage: only a live pid makes the audit treat the run as in progress."""
    from veriloco.records import RunDir

    run = tmp_path / "run"
    train(tiny("--train.rounds=2"), str(run), quiet=True)
    for text in ("99999999999999999999999", "-1", "0", "abc", "٣", "", "2147483647"):
        (run / ".lock").write_text(text)
        assert RunDir(run).holder() is None, text
        report = audit_run(run)
        assert report.ok and report.in_progress is None, text


def test_what_was_given_stays_an_input_error_beside_the_malformed_backstop(run, monkeypatch):
    """The audit turns a record's or manifest's malformed field (KeyError, TypeError, ValueError...)
    into a failure; AuditInputError (a chain that cannot be reached: exit 2) is a ValueError too and
    must not become one."""
    import veriloco.audit as audit_mod

    def unreachable(*args, **kwargs):
        raise audit_mod.AuditInputError("chain at http://127.0.0.1:9 does not answer")

    monkeypatch.setattr(audit_mod, "_audit", unreachable)
    with pytest.raises(audit_mod.AuditInputError, match="does not answer"):
        audit_run(run)

    def malformed(*args, **kwargs):
        raise KeyError("corpus_root")

    monkeypatch.setattr(audit_mod, "_audit", malformed)
    report = audit_run(run)
    assert not report.ok and report.first_failure == "the run's files are malformed (KeyError: 'corpus_root')"
