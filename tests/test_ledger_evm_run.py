"""A training run that records to an EVM chain, then `veriloco audit` against that chain.

The test starts an in-process chain (eth-tester + py-evm), serves it over HTTP JSON-RPC on
127.0.0.1 from a thread (the run's workers are spawned processes: only a URL reaches them),
deploys LineageLedger, and trains a tiny run with `[ledger] backend = "evm"`. The audit then
reads entry hashes, roots and events from the chain: from the run directory, and from the chain
plus the run's store (where the run published the entry bodies). A tampered entry body fails.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

_MISSING = [m for m in ("web3", "eth_tester", "eth") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"needs web3 and eth-tester[py-evm] (the 'chain' extra); missing {_MISSING}",
                allow_module_level=True)

from conftest import ROOT, tiny  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from veriloco.audit import audit_published, audit_run  # noqa: E402
from veriloco.cli import app  # noqa: E402
from veriloco.ledger.evm import InProcessChain, deploy  # noqa: E402
from veriloco.store import LocalStore  # noqa: E402

ROUNDS = 2


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    """(run directory, contract address, RPC URL): a 2-round run recorded on a served chain."""
    d = tmp_path_factory.mktemp("evm-run")
    chain = InProcessChain.start()
    server = chain.serve()
    contract = deploy(chain.w3, chain.account(0))
    key = d / "recorder.key"
    key.write_text(chain.keys[1].hex() + "\n")
    key.chmod(0o600)
    cfg = tiny(f"--train.rounds={ROUNDS}", "--ledger.backend=evm", f"--ledger.rpc_url={server.url}",
               f"--ledger.contract=\"{contract}\"", f"--ledger.key_file={key}")
    from veriloco.run import train

    train(cfg, str(d / "run"), quiet=True)
    yield d / "run", contract, server.url
    server.close()


def run_id_of(run: Path) -> str:
    return json.loads((run / "manifest.json").read_text())["run_id"]


def test_run_recorded_on_chain_audits_ok(chain_run):
    run, contract, url = chain_run
    assert not (run / "ledger.sqlite").exists()  # the chain is the ledger
    summary = json.loads((run / "summary.json").read_text())
    report = audit_run(run)
    assert report.ok, report.first_failure
    assert report.rounds == ROUNDS and report.checked["ledger_entries"] == ROUNDS
    assert report.ledger_root == summary["ledger_root"]
    assert report.checked["signed_manifest"] == 1
    print(f"audit against the chain: {report.seconds:.2f}s for {ROUNDS} rounds")

    # the same from the chain and the store alone (the run published the entry bodies there)
    published = audit_published(f"evm:{contract}@{url}", str(run / "store"), run_id_of(run))
    assert published.ok, published.first_failure
    assert published.checked == report.checked and published.ledger_root == report.ledger_root

    res = CliRunner().invoke(app, ["audit", "--ledger", f"evm:{contract}@{url}", "--run-id", run_id_of(run),
                                   "--store", f"file://{run / 'store'}"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"audit ok: {ROUNDS} rounds, {ROUNDS} ledger entries (root {summary['ledger_root']})")
    res = CliRunner().invoke(app, ["prove", str(run), "1"])
    assert res.exit_code == 0 and json.loads(res.stdout)["verified"] is True, res.output


def test_tampered_entry_body_fails_against_the_chain(chain_run, tmp_path):
    run, contract, url = chain_run
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    entry = json.loads((copy / "rounds.jsonl").read_text().splitlines()[1])["entry"]
    for store in (LocalStore(copy / "ledger-bodies"), LocalStore(copy / "store")):
        path = store.path_of(entry)
        path.write_bytes(path.read_bytes().replace(b'"round":1', b'"round":5'))
    report = audit_run(copy)
    assert not report.ok and report.first_failure.startswith("round 1: ledger entry"), report.first_failure
    published = audit_published(f"evm:{contract}@{url}", str(copy / "store"), run_id_of(copy))
    assert not published.ok and published.first_failure.startswith("round 1: ledger entry"), published.first_failure


def test_evm_inputs_that_name_no_run_exit_2(chain_run):
    run, contract, url = chain_run

    def bad(ledger: str, run_id: str, *words: str) -> None:
        res = CliRunner().invoke(app, ["audit", "--ledger", ledger, "--run-id", run_id, "--store", str(run / "store")])
        assert res.exit_code == 2, res.output
        assert len(res.stderr.splitlines()) == 1 and all(w in res.stderr for w in words), res.stderr

    bad(f"evm:{contract}@{url}", "e" * 64, "holds no entries")
    bad(f"evm:0x{'12' * 20}@{url}", run_id_of(run), "no contract")
    bad(f"evm:not-an-address@{url}", run_id_of(run), "not an EVM address")
    bad(f"evm:{contract}@http://127.0.0.1:9", run_id_of(run), "cannot reach")


def test_a_run_names_bad_chain_settings_before_it_makes_anything(chain_run, tmp_path):
    """Each of these was found by the recorder once the workers had started: exit 1 ("training
    failed: LedgerError ..." or another rank's gloo "Connection closed by peer"), the run directory
    left behind. Now `run.check_chain` refuses them first, in one line, exit 2."""
    run, contract, url = chain_run
    key = run.parent / "recorder.key"
    loose = tmp_path / "loose.key"
    loose.write_text(key.read_text())
    loose.chmod(0o644)
    for settings, needle in (
        ((url, contract, tmp_path / "missing.key"), "recorder key file"),
        ((url, contract, loose), "is accessible by others"),
        ((url, "not-an-address", key), "not an EVM address"),
        ((url, "0x" + "12" * 20, key), "no contract at"),
        (("http://127.0.0.1:9", contract, key), "cannot reach an EVM RPC at http://127.0.0.1:9"),
    ):
        rpc, address, key_file = settings
        res = CliRunner().invoke(app, ["train", str(ROOT / "configs" / "tiny.toml"), "--out", str(tmp_path / "r"),
                                       "--ledger.backend=evm", f"--ledger.rpc_url={rpc}",
                                       f"--ledger.contract=\"{address}\"", f"--ledger.key_file={key_file}"])
        assert res.exit_code == 2, (settings, res.output)
        assert len(res.stderr.splitlines()) == 1 and needle in res.stderr, (settings, res.stderr)
        assert not (tmp_path / "r").exists()


def test_elastic_run_recorded_on_chain_by_whichever_worker_commits_audits_ok(chain_run, tmp_path):
    """Elastic membership with the chain as ledger: each round's first finisher appends (all of
    them hold the recorder's key); a worker killed and restarted mid-run reopens the ledger."""
    _, contract, url = chain_run
    key = tmp_path / "recorder.key"
    key.write_text((chain_run[0].parent / "recorder.key").read_text())
    key.chmod(0o600)
    cfg = tiny("--topology.workers=3", "--train.rounds=4", "--run.membership=elastic", "--run.timeout_s=30",
               "--run.heartbeat_timeout_s=1.5", "--ledger.backend=evm", f"--ledger.rpc_url={url}",
               f"--ledger.contract=\"{contract}\"", f"--ledger.key_file={key}")
    from veriloco.run import train

    run, summary = train(cfg, str(tmp_path / "run"), quiet=True, faults=["die:2@1.1", "restart:2+1"])
    assert summary["complete"]
    report = audit_run(run.root)
    assert report.ok, report.first_failure
    assert report.checked["ledger_entries"] == 4 and report.ledger_root == summary["ledger_root"]
    published = audit_published(f"evm:{contract}@{url}", str(run.root / "store"), run_id_of(run.root))
    assert published.ok, published.first_failure
