"""`veriloco audit --ledger LEDGER --store URL`: a run audited from its ledger file and a remote
copy of its store (fsspec `memory://`), without its run directory.

One real tiny run; its store is copied into a fresh in-memory store per test. The untouched copy
audits ok; a tampered blob, record or ref in the remote store is named with a non-zero exit;
inputs that do not name a run give one line and exit code 2.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

import fsspec
import pytest
from conftest import rounds_of, tiny
from typer.testing import CliRunner

from veriloco.audit import AuditInputError, audit_published, audit_run
from veriloco.cli import app
from veriloco.hashing import sha256_hex
from veriloco.run import train
from veriloco.signing import signed_files
from veriloco.store import FsspecStore, LocalStore, run_ref

ROUNDS = 2
runner = CliRunner()


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """One real run: 2 rounds, 2 worker processes. Never modified."""
    d = tmp_path_factory.mktemp("remote") / "run"
    train(tiny(f"--train.rounds={ROUNDS}"), str(d), quiet=True)
    return d


def run_id_of(run: Path) -> str:
    return json.loads((run / "manifest.json").read_text())["run_id"]


@pytest.fixture
def remote(original) -> str:
    """A memory:// copy of the run's store (blobs and refs), as `aws s3 sync RUN/store` makes."""
    url = f"memory://veriloco-{uuid.uuid4().hex}/store"
    fs, root = fsspec.core.url_to_fs(url)
    local = original / "store"
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.pipe_file(f"{root}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return url


def failure(original: Path, url: str) -> str:
    report = audit_published(str(original / "ledger.sqlite"), url)
    assert not report.ok, "the tampered store audited ok"
    assert report.first_failure and "\n" not in report.first_failure
    print("first_failure:", report.first_failure)
    return report.first_failure


def overwrite(url: str, digest: str, data: bytes) -> None:
    store = FsspecStore(url)
    store.fs.pipe_file(store.path_of(digest), data)


def test_the_run_published_itself_into_its_store(original):
    store = LocalStore(original / "store")
    run_id = run_id_of(original)
    signed = store.get_ref(run_ref(run_id))
    assert signed == (original / "checkpoint.sig.json").read_bytes()
    files = signed_files(signed)
    final = rounds_of(original)[-1]["checkpoint"]
    assert set(files) == {"manifest.json", "rounds.jsonl", f"store/{final[:2]}/{final[2:]}"}
    assert store.get(files["manifest.json"]) == (original / "manifest.json").read_bytes()
    assert store.get(files["rounds.jsonl"]) == (original / "rounds.jsonl").read_bytes()
    assert sha256_hex(store.get(run_id)) == run_id  # the manifest core, named by the run id


def test_audit_from_ledger_file_and_memory_store(original, remote):
    report = audit_published(str(original / "ledger.sqlite"), remote)
    assert report.ok, report.first_failure
    local = audit_run(original)
    assert local.ok
    assert report.rounds == ROUNDS and report.checked == local.checked
    assert report.ledger_root == local.ledger_root
    assert report.checked["signed_manifest"] == 1 and report.checked["checkpoints"] == ROUNDS
    print(f"audit from memory:// store: {report.seconds:.3f}s, from the run directory: {local.seconds:.3f}s")


def test_cli_audit_ledger_and_store(original, remote):
    res = runner.invoke(app, ["audit", "--ledger", str(original / "ledger.sqlite"), "--store", remote])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"audit ok: {ROUNDS} rounds, {ROUNDS} ledger entries")
    # a file:// URL of the run's own store, and --run-id naming the same run
    res = runner.invoke(app, ["audit", "--ledger", str(original / "ledger.sqlite"), "--store",
                              f"file://{original / 'store'}", "--run-id", run_id_of(original)])
    assert res.exit_code == 0, res.output


# ---- tampering with the remote store ---------------------------------------------------------

def test_checkpoint_blob_tampered_in_remote_store(original, remote):
    digest = rounds_of(original)[1]["checkpoint"]
    overwrite(remote, digest, b"not the checkpoint")
    msg = failure(original, remote)
    assert msg.startswith("round 1: checkpoint: ") and "corrupt" in msg, msg
    res = runner.invoke(app, ["audit", "--ledger", str(original / "ledger.sqlite"), "--store", remote])
    assert res.exit_code == 1
    assert res.stderr.splitlines() == [f"audit FAILED: {msg}"]


def test_bundle_blob_deleted_from_remote_store(original, remote):
    digest = rounds_of(original)[0]["bundles"][1]
    store = FsspecStore(remote)
    store.fs.rm_file(store.path_of(digest))
    msg = failure(original, remote)
    assert msg.startswith("round 0: bundle of worker 1: ") and "missing" in msg, msg


def test_corpus_chunk_tampered_in_remote_store(original, remote):
    manifest = json.loads((original / "manifest.json").read_text())
    chunks = json.loads(LocalStore(original / "store").get(manifest["corpus_manifest"]))["chunks"]
    overwrite(remote, chunks[0], b"other text")
    msg = failure(original, remote)
    assert msg.startswith("corpus: ") and "corrupt" in msg, msg


def test_published_records_tampered(original, remote):
    files = signed_files(LocalStore(original / "store").get_ref(run_ref(run_id_of(original))))
    overwrite(remote, files["rounds.jsonl"], b'{"round": 0}\n')
    msg = failure(original, remote)
    assert msg.startswith("records: ") and "corrupt" in msg, msg


def test_records_replaced_and_ref_repointed(original, remote):
    """A forger stores edited records as a new blob and points the signed manifest at it (the
    signature no longer holds, but first the records disagree with the ledger)."""
    store = FsspecStore(remote)
    run_id = run_id_of(original)
    recs = rounds_of(original)
    recs[1]["verdicts"][0] = "norm_outlier"
    digest = store.put("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs).encode())
    signed = json.loads(store.get_ref(run_ref(run_id)))
    signed["manifest"]["files"]["rounds.jsonl"] = digest
    store.put_ref(run_ref(run_id), json.dumps(signed).encode())
    msg = failure(original, remote)
    assert msg.startswith("round 1: rounds.jsonl verdicts differ"), msg


def test_a_published_run_of_another_tensor_hash_is_refused_by_name(original, remote):
    """A store holding a run whose manifest hashes tensors another way (as the veriloco before the
    tree did): the audit says so, not that a params hash differs."""
    store = FsspecStore(remote)
    run_id = run_id_of(original)
    manifest = json.loads((original / "manifest.json").read_text())
    del manifest["tensor_hash"]
    signed = json.loads(store.get_ref(run_ref(run_id)))
    signed["manifest"]["files"]["manifest.json"] = store.put(json.dumps(manifest).encode())
    store.put_ref(run_ref(run_id), json.dumps(signed).encode())
    msg = failure(original, remote)
    assert msg.startswith("manifest: made by veriloco") and "one sha256 stream a dict" in msg, msg


def test_signed_manifest_ref_tampered_or_missing(original, remote):
    store = FsspecStore(remote)
    ref = run_ref(run_id_of(original))
    signed = json.loads(store.get_ref(ref))
    signed["manifest"]["round"] = 0
    store.put_ref(ref, json.dumps(signed).encode())
    msg = failure(original, remote)
    assert msg.startswith("signed checkpoint manifest: ") and "signature" in msg, msg
    store.fs.rm_file(f"{store.root}/refs/{ref}")
    msg = failure(original, remote)
    assert msg.startswith("signed checkpoint manifest: ") and "missing" in msg, msg


def test_ledger_row_tampered_with_remote_store(original, remote, tmp_path):
    ledger = tmp_path / "ledger.sqlite"
    ledger.write_bytes((original / "ledger.sqlite").read_bytes())
    con = sqlite3.connect(ledger, isolation_level=None)
    con.execute("DROP TRIGGER entries_no_update")
    (body,) = con.execute("SELECT body FROM entries WHERE idx = 1").fetchone()
    con.execute("UPDATE entries SET body = ? WHERE idx = 1", (body.replace(b'"round":1', b'"round":7'),))
    con.close()
    report = audit_published(str(ledger), remote)
    assert not report.ok and report.first_failure.startswith("round 1: ledger entry"), report.first_failure


# ---- bad inputs: one line, exit code 2 ----------------------------------------------------------

def bad(args: list[str], *words: str) -> None:
    res = runner.invoke(app, ["audit", *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("veriloco: error: "), res.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_bad_inputs_exit_2(original, remote, tmp_path):
    ledger = str(original / "ledger.sqlite")
    bad([], "run directory", "--ledger")
    bad(["--ledger", ledger], "--store")
    bad([str(original), "--ledger", ledger, "--store", remote], "not both")
    bad(["--ledger", str(tmp_path / "nope.sqlite"), "--store", remote], "does not exist")
    bad(["--ledger", str(tmp_path), "--store", remote], "not a file")
    (tmp_path / "text.sqlite").write_text("hello")
    bad(["--ledger", str(tmp_path / "text.sqlite"), "--store", remote], "not an SQLite ledger")
    bad(["--ledger", ledger, "--store", f"memory://veriloco-{uuid.uuid4().hex}/none"], "does not exist")
    bad(["--ledger", ledger, "--store", str(tmp_path / "no-store")], "does not exist")
    bad(["--ledger", ledger, "--store", "nosuchproto://bucket/x"], "cannot open store")
    empty = f"memory://veriloco-{uuid.uuid4().hex}/store"
    FsspecStore(empty).put(b"some other blob")
    bad(["--ledger", ledger, "--store", empty], "holds no run", run_id_of(original))
    bad(["--ledger", ledger, "--store", remote, "--run-id", "f" * 64], "records run", "not --run-id")
    bad(["--ledger", ledger, "--store", remote, "--run-id", "xyz"], "--run-id")
    bad(["--ledger", "evm:0xabc", "--store", remote, "--run-id", "f" * 64], "evm:CONTRACT@RPC_URL")
    bad(["--ledger", "evm:0xabc@http://127.0.0.1:9", "--store", remote], "--run-id")
    bad(["--ledger", ledger, "--store", remote, "--replay", "-1"], "--replay")
    with pytest.raises(AuditInputError, match="holds no run"):
        audit_published(ledger, empty)
