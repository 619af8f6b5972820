"""The commit-reveal behind a round's draws: every commitment carries sha256(salt), each worker
reveals its salt only once it holds every bundle, the seed of the replay sample and the loss-gain
draws mixes the salts in, and a salt that does not open its commitment is an offence."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import rounds_of, tiny

from veriloco.audit import audit_run
from veriloco.compress import build_codecs
from veriloco.hashing import canonical_json, sha256_hex
from veriloco.packet import encode_bundle, encode_packet
from veriloco.run import train
from veriloco.verify import ACCEPT, UNREVEALED, WITHHELD
from veriloco.verify.check import RoundCheck, check_bundles, hex_root, round_seed
from veriloco.verify.commitment import (
    REVEAL_BYTES,
    SALT_BYTES,
    Commitment,
    EquivocationDetector,
    commitment_bytes,
    round_salt,
    sign_commitment,
    sign_reveal,
)
from veriloco.verify.identity import derive_worker_key, public_key_hex
from veriloco.verify.replay import PlanInputs, reveals_salts

RUN, BASE = sha256_hex(b"run"), sha256_hex(b"G_r")
SHAPES = {"w": (4, 3)}
KEYS = {j: derive_worker_key(7, j) for j in range(3)}


def test_a_salt_is_the_keys_own_per_run_round_and_stage():
    salt = round_salt(KEYS[0], RUN, 5)
    assert len(salt) == SALT_BYTES and round_salt(KEYS[0], RUN, 5) == salt  # a rerun draws the same
    others = [round_salt(KEYS[1], RUN, 5), round_salt(KEYS[0], RUN, 6), round_salt(KEYS[0], RUN, 5, stage=1),
              round_salt(KEYS[0], sha256_hex(b"another run"), 5)]
    assert len({salt, *others}) == 5


def _commitment(j: int) -> Commitment:
    packet = encode_packet({"w": torch.full(SHAPES["w"], 0.1 * (j + 1))}, build_codecs("fp32", SHAPES))
    return Commitment(run_id=RUN, round=2, worker=j, base_hash=BASE, batch_root=sha256_hex(b"%d" % j),
                      trace_root=hex_root(["ab" * 32]), trace=("ab" * 32,), losses=(1.0,),
                      packet_hash=sha256_hex(packet), packet_bytes=len(packet), codec="fp32",
                      salt_hash=sha256_hex(round_salt(KEYS[j], RUN, 2)))


def _bundle(j: int) -> bytes:
    packet = encode_packet({"w": torch.full(SHAPES["w"], 0.1 * (j + 1))}, build_codecs("fp32", SHAPES))
    return encode_bundle(canonical_json(sign_commitment(_commitment(j), KEYS[j])), packet)


def _reveal(j: int, salt: bytes | None = None, key: int | None = None) -> bytes:
    """Worker j's signed reveal of `salt` (its own by default), signed by worker `key`'s key."""
    digest = sha256_hex(commitment_bytes(_commitment(j)))
    return sign_reveal(KEYS[j if key is None else key], digest, round_salt(KEYS[j], RUN, 2) if salt is None else salt)


def _check(reveals: dict[int, bytes] | None, bundles: dict[int, bytes] | None = None):
    return check_bundles(bundles or {j: _bundle(j) for j in range(3)}, run_id=RUN, round=2, base_hash=BASE,
                         admitted_keys={j: public_key_hex(k) for j, k in KEYS.items()}, shapes=SHAPES,
                         max_packet_bytes=1 << 20, batch_root_of=lambda j: sha256_hex(b"%d" % j),
                         equivocation=EquivocationDetector(), reveals=reveals)


def test_a_signed_salt_that_does_not_open_its_commitment_is_an_offence_and_stays_out_of_the_seed():
    salts = {j: round_salt(KEYS[j], RUN, 2) for j in range(3)}
    reveals = {j: _reveal(j) for j in range(3)}
    assert all(len(x) == REVEAL_BYTES for x in reveals.values())
    honest = _check(reveals)
    assert honest.verdicts == {0: ACCEPT, 1: ACCEPT, 2: ACCEPT}
    assert honest.salts == {j: s.hex() for j, s in salts.items()}
    assert honest.reveals == {j: x.hex() for j, x in reveals.items()}
    # its own signed word that its salt is one its commitment does not hash to: an offence, and the evidence
    # re-checks offline (the signature, and the salt against salt_hash)
    wrong = _check({**reveals, 1: _reveal(1, bytes(SALT_BYTES))})
    assert wrong.verdicts[1] == UNREVEALED and 1 not in wrong.decoded and sorted(wrong.decoded) == [0, 2]
    assert wrong.evidence[1]["reveal"] == _reveal(1, bytes(SALT_BYTES)).hex() and 1 not in wrong.salts
    # no signed reveal (missing, cut, signed by another key, or signed for another commitment): no one's word,
    # so rejected (withheld) but no offence; a recorder could have written such bytes for anyone
    for bad in (b"", _reveal(1)[:-1], _reveal(1, key=2), bytes(REVEAL_BYTES)):
        unsigned = _check({**reveals, 1: bad})
        assert unsigned.verdicts[1] == WITHHELD and 1 not in unsigned.salts, bad
    # where the run replays, such a sender is not let off: a suspect, replayed whole whatever the draw
    replayed = check_bundles({j: _bundle(j) for j in range(3)}, run_id=RUN, round=2, base_hash=BASE,
                             admitted_keys={j: public_key_hex(k) for j, k in KEYS.items()}, shapes=SHAPES,
                             max_packet_bytes=1 << 20, batch_root_of=lambda j: sha256_hex(b"%d" % j),
                             equivocation=EquivocationDetector(), reveals={**reveals, 1: b""}, unsigned_reveal="replay")
    assert replayed.verdicts[1] == ACCEPT and 1 in replayed.decoded and 1 not in replayed.salts
    assert replayed.suspects == {1: {"reveal": "none signed for its commitment"}}
    assert [a.worker for a in PlanInputs.of_round(BASE, replayed, set()).audits(tiny().verify, tiny().train, [0, 1, 2])] \
        == [1]  # (the defaults draw no replay: the suspect is replayed all the same)
    # the seed: the base, the commitments' digests and the passed senders' salts; without reveals (a run that
    # draws nothing), the base and the digests only
    plain = _check(None)
    assert plain.verdicts == honest.verdicts and plain.salts == {} and plain.reveals == {}
    assert round_seed(honest, BASE) == round_seed(plain, BASE) + "".join(s.hex() for s in salts.values())
    assert PlanInputs.of_round(BASE, honest, set()).seed == round_seed(honest, BASE)
    assert round_seed(wrong, BASE) == round_seed(plain, BASE) + salts[0].hex() + salts[2].hex()


def test_a_rejected_senders_reveal_is_not_examined_and_does_not_seed():
    """A sender rejected before the reveal (here a bundle that is no bundle) has no say in the draw: a
    recorder that could drop or keep its salt would otherwise choose one bit of the audit's seed."""
    reveals = {j: _reveal(j) for j in range(3)}
    check = _check(reveals, {0: _bundle(0), 1: b"not a bundle", 2: _bundle(2)})
    assert check.verdicts[1] != ACCEPT and sorted(check.reveals) == [0, 2] and sorted(check.salts) == [0, 2]


def test_a_sender_whose_earlier_bundle_signed_nothing_is_unbound_or_rejected():
    """A sender whose bundle of an earlier try of the round held no commitment it signed (junk) was
    bound by nothing and saw every salt of that try (round.keep_seen notes it): its first
    commitment, now, is `unbound`, whatever its bundle: its commitment and salt stay out of the
    round's seed (else it chose the draw, and so which others are replayed and by whom), each
    member that noted it replays it itself where the run replays, and it is rejected (withheld,
    no offence) where the run does not; a run that reveals nothing ignores it."""
    reveals, junk = {j: _reveal(j) for j in range(3)}, "cd" * 32

    def check(reveals, action="replay", bundles=None):
        return check_bundles(bundles or {j: _bundle(j) for j in range(3)}, run_id=RUN, round=2, base_hash=BASE,
                             admitted_keys={j: public_key_hex(k) for j, k in KEYS.items()}, shapes=SHAPES,
                             max_packet_bytes=1 << 20, batch_root_of=lambda j: sha256_hex(b"%d" % j),
                             equivocation=EquivocationDetector(), reveals=reveals, unsigned_reveal=action,
                             unsigned_earlier={1: junk})

    replayed = check(reveals)
    assert replayed.verdicts == {0: ACCEPT, 1: ACCEPT, 2: ACCEPT} and sorted(replayed.salts) == [0, 1, 2]
    assert replayed.unbound == {1: junk} and replayed.suspects == {}  # (not the draw's: no auditor is drawn for it)
    assert PlanInputs.of_round(BASE, replayed, set()).audits(tiny().verify, tiny().train, [0, 1, 2]) == []
    digests = sorted(sha256_hex(commitment_bytes(_commitment(j))) for j in (0, 2))
    assert round_seed(replayed, BASE) == BASE + "".join(digests) + "".join(replayed.salts[j] for j in (0, 2))
    both = check({**reveals, 1: b""})  # and without a signed reveal either: the draw's suspect too
    assert both.unbound == {1: junk} and both.suspects == {1: {"reveal": "none signed for its commitment"}}
    wrong = check({**reveals, 1: _reveal(1, bytes(SALT_BYTES))})  # its own signed wrong salt: an offence still
    assert wrong.verdicts[1] == UNREVEALED and wrong.unbound == {1: junk} and wrong.suspects == {}
    rejected = check(reveals, "reject")
    assert rejected.verdicts[1] == WITHHELD and rejected.evidence[1] == {"unsigned_earlier_bundle": junk}
    assert 1 not in rejected.decoded and sorted(rejected.salts) == sorted(rejected.reveals) == [0, 2]
    assert round_seed(rejected, BASE) == round_seed(replayed, BASE)  # (its commitment is no say in the draw)
    # a commitment rejected now for another reason (here a stale base) is out of the seed too: else a grinder
    # gave up its own update to choose the draw for a colluder's
    stale = dict(_commitment(1).to_dict(), base_hash=sha256_hex(b"another"))
    stale_bundle = encode_bundle(canonical_json(sign_commitment(Commitment.from_dict(stale), KEYS[1])), b"p")
    again = check(reveals, bundles={0: _bundle(0), 1: stale_bundle, 2: _bundle(2)})
    assert again.verdicts[1] != ACCEPT and again.commitments[1] is not None and again.unbound == {1: junk}
    assert round_seed(again, BASE) == round_seed(replayed, BASE)
    plain = check(None)  # a run that draws nothing revealed no salt to see
    assert plain.verdicts[1] == ACCEPT and plain.unbound == {}


def test_a_judge_convicts_an_unbound_sender_by_its_own_replay():
    """replay.judge_unbound: the judge's own replay of an unbound sender's whole round decides;
    the evidence names the noted bundle either way."""
    from veriloco.verify import REPLAY_MISMATCH
    from veriloco.verify.replay import judge_unbound, unbound_audit

    v, t, junk = tiny("--train.inner_steps=4", "--verify.trace_every=2").verify, tiny("--train.inner_steps=4").train, "cd" * 32
    a = unbound_audit(v, t, 1, 0)
    assert (a.worker, a.segment, a.auditor, a.whole) == (1, 1, 0, True)  # its last segment, from the round's start
    for score, verdict in [(-1.0, ACCEPT), (1.0, REPLAY_MISMATCH)]:  # exact: -1 passes, an entry index fails
        check = _check({j: _reveal(j) for j in range(3)})
        check.accepted, check.unbound = dict(check.decoded), {1: junk}
        check.evidence[1] = {"replayed": {"auditor": 2, "segment": 0, "disputed": True}}  # a drawn replay's dispute
        judge_unbound(v, check, a, score, junk)
        assert check.verdicts[1] == verdict and (1 in check.accepted) == (verdict == ACCEPT)
        assert junk in json.dumps(check.evidence[1]) and check.evidence[1]["replayed"]["disputed"] is True


def test_only_runs_that_draw_reveal():
    from dataclasses import replace

    v = tiny().verify
    assert not reveals_salts(v)  # the defaults draw nothing
    assert reveals_salts(replace(v, replay_probability=0.25))
    assert reveals_salts(replace(v, loss_gain_batches=2))
    assert not reveals_salts(replace(v, loss_gain_batches=2, screen=False))


def _exchange(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from veriloco.exchange import Exchange
    from veriloco.link import Link

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        link = Link.from_strings("", "150ms")
        packet, reveal = b"p" * (10 + rank), bytes([rank]) * REVEAL_BYTES
        t0 = time.perf_counter()
        handle = Exchange(None, 1 << 20, link=link).start(packet, reveal=reveal)
        packets = handle.wait()
        took = time.perf_counter() - t0
        assert [bytes(p) for p in packets] == [b"p" * (10 + j) for j in range(world)]
        assert handle.reveals == [bytes([j]) * REVEAL_BYTES for j in range(world)]
        assert handle.stats.bytes_sent == (len(packet) + 8 + REVEAL_BYTES) * (world - 1)
        assert handle.stats.bytes_received == sum(10 + j + 8 + REVEAL_BYTES for j in range(world) if j != rank)
        assert took >= 0.3, took  # two messages one after the other: the latency twice
        plain = Exchange(None, 1 << 20).start(packet)
        plain.wait()
        assert plain.reveals is None and plain.stats.bytes_sent == (len(packet) + 8) * (world - 1)
    finally:
        dist.destroy_process_group()


def test_the_exchange_reveals_after_the_packets_and_counts_the_bytes_and_the_second_latency():
    from veriloco.procs import start_workers
    from veriloco.run import free_port

    start_workers(_exchange, (3, free_port()), 3)


GRIND = ("--topology.workers=4", "--train.rounds=4", "--train.inner_steps=6", "--verify.trace_every=6",
         "--train.inner_state=reset", "--verify.replay_probability=0.5")


def test_the_last_sender_cannot_grind_the_replay_sample(tmp_path, monkeypatch):
    """red_team.GrindSkim receives every bundle before it sends its own and re-signs its
    commitment until the base and the digests draw no replay of it. Before the commit-reveal it was
    never sampled in these 4 rounds (README: the thirty-eighth session's repro) and the audit passed;
    the salts it cannot see make its grinding blind: it is replayed and convicted like `skim`."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    run, _ = train(tiny(*GRIND, "--adversary.3=red_team:GrindSkim:p=0.5,segments=1,workers=4"), str(tmp_path / "g"),
                   quiet=True)
    verdicts = [r["verdicts"][3] for r in rounds_of(run.root)]
    assert "replay_mismatch" in verdicts, verdicts
    assert verdicts[verdicts.index("replay_mismatch") + 1:] == ["banned"] * (3 - verdicts.index("replay_mismatch"))
    for r in rounds_of(run.root):  # a reveal for each sender the round examined (the banned are not)
        assert all((s is None) == (v == "banned") for s, v in zip(r["reveals"], r["verdicts"], strict=True)), r
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


@pytest.fixture(scope="module")
def wrong_salt_run(tmp_path_factory) -> Path:
    tests_dir = str(Path(__file__).parent)
    sys.path.insert(0, tests_dir)
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", tests_dir)
    try:
        run, _ = train(tiny("--topology.workers=3", "--train.rounds=3", "--train.inner_steps=4",
                            "--verify.trace_every=4", "--verify.replay_probability=0.5", "--train.inner_state=reset",
                            "--adversary.1=red_team:WrongSalt:round=1"),
                       str(tmp_path_factory.mktemp("reveal") / "w"), quiet=True)
    finally:
        mp.undo()
    return run.root


def test_a_worker_that_reveals_a_wrong_salt_is_rejected_and_banned(wrong_salt_run):
    recs = rounds_of(wrong_salt_run)
    assert [r["verdicts"] for r in recs] == [[ACCEPT] * 3, [ACCEPT, UNREVEALED, ACCEPT], [ACCEPT, "banned", ACCEPT]]
    evidence = recs[1]["evidence"]["1"]
    assert evidence["reveal"] == recs[1]["reveals"][1] and evidence["reveal"].startswith("ff" * SALT_BYTES)
    assert recs[2]["reveals"][1] is None  # banned: not examined
    assert all(s is not None for r in recs for j, s in enumerate(r["reveals"]) if (r["round"], j) not in ((2, 1),))
    report = audit_run(wrong_salt_run)
    assert report.ok, report.first_failure


def test_the_audit_redraws_from_the_recorded_salts(wrong_salt_run, tmp_path):
    root = Path(shutil.copytree(wrong_salt_run, tmp_path / "run"))
    lines = (root / "rounds.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    honest = rec["reveals"][2]
    # no signed reveal of worker 2: the audit makes it a suspect and replays it (it passes), but its salt
    # is out of the seed, so the audit's draw is not the round's, and the replays the record names are not it
    rec["reveals"][2] = "00" * REVEAL_BYTES
    (root / "rounds.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    report = audit_run(root, replay=100)
    assert not report.ok and report.checked["replays"] >= 1, report.first_failure
    assert report.first_failure == "round 0: worker 1 was in the replay sample, but the record has no replay of it", \
        report.first_failure
    rec["reveals"][2] = None  # dropped: the round examined one
    (root / "rounds.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    report = audit_run(root)
    assert not report.ok and report.first_failure == "round 0: the record's reveals are not the ones the round " \
        "examined (one for each sender that passed the checks, none for the others)", report.first_failure
    late = json.loads(lines[2])  # round 2: worker 1 is banned, so the round examined no reveal of it
    late["reveals"][1] = late["reveals"][0]
    (root / "rounds.jsonl").write_text("\n".join([*lines[:2], json.dumps(late)]) + "\n")
    report = audit_run(root)
    assert not report.ok and report.first_failure == "round 2: the record's reveals are not the ones the round " \
        "examined (one for each sender that passed the checks, none for the others)", report.first_failure
    rec["reveals"][2] = honest
    rec["reveals"] = rec["reveals"][:2]
    (root / "rounds.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    report = audit_run(root)
    assert not report.ok and "reveals are not a list of 3" in report.first_failure, report.first_failure


def test_a_worker_that_fails_a_try_to_commit_again_is_an_equivocator(tmp_path, monkeypatch):
    """red_team.AbortRegrind (the review's attacker): in an elastic run it takes every salt before it
    sends its own, gives the try up when the draw would replay it, and in the retry, knowing the
    honest salts (the same again), commits with a salt of its choosing that the draw passes over.
    Reviewed at 39db4c3 it was accepted in 8 of 8 rounds and never replayed, the audit passing.
    Every worker now keeps the commitments a failed try brought (elastic._pin): its second
    commitment is an equivocation, and the audit re-derives the proof from the record."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    run, _ = train(tiny("--topology.workers=4", "--train.rounds=8", "--train.inner_steps=6", "--verify.trace_every=6",
                        "--train.inner_state=reset", "--verify.replay_probability=0.5", "--run.membership=elastic",
                        "--run.heartbeat_timeout_s=1.5", "--adversary.3=red_team:AbortRegrind:p=0.5,segments=1"),
                   str(tmp_path / "e"), quiet=True)
    verdicts = [r["verdicts"][3] for r in rounds_of(run.root)]
    assert "equivocation" in verdicts, verdicts
    first = verdicts.index("equivocation")
    assert verdicts[first + 1:] == ["banned"] * (7 - first)
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_a_worker_that_keeps_its_reveal_when_it_would_be_drawn_is_replayed_anyway(tmp_path, monkeypatch):
    """red_team.WithholdSkim (the third review's attacker) sends an unsigned reveal whenever it sees
    that the draw would replay it. Judged `withheld` (rejected, no offence) at 0416e54, it was never
    convicted in 6 rounds at p = 0.5 and 4 of its skimmed updates went in, the audit passing. A
    sender without a signed reveal is now a suspect, replayed whole that round whatever the draw."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    run, _ = train(tiny(*GRIND[:1], "--train.rounds=6", *GRIND[2:],
                        "--adversary.3=red_team:WithholdSkim:p=0.5,segments=1,workers=4"), str(tmp_path / "w"), quiet=True)
    recs = rounds_of(run.root)
    verdicts = [r["verdicts"][3] for r in recs]
    assert "replay_mismatch" in verdicts, verdicts
    first = verdicts.index("replay_mismatch")
    assert verdicts[:first] == ["accept"] * first and verdicts[first + 1:] == ["banned"] * (5 - first), verdicts
    # convicted in a round it withheld its reveal in (it does so only when the draw would replay it)
    assert recs[first]["evidence"]["3"]["suspect"] == {"reveal": "none signed for its commitment"}
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_a_worker_that_kills_the_run_after_the_salts_cannot_commit_anew_in_the_resume(tmp_path, monkeypatch):
    """A static run stops when a worker's process dies. A worker that has taken every salt of
    round 2 can so kill the run (red_team.DiesOnceSent) and, once it is resumed, commit anew for
    round 2 (recommit: it also deletes its note of what it sent, which an honest redo sends
    again), free to choose what the draw then sees. Until the fortieth session the resume
    forgot the first commitments; every worker now writes down those it received before its own
    reveal goes out (round.keep_seen), and the resume (round.load_seen) convicts the second one:
    an equivocation, both signed, that the audit re-derives from the record."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    from veriloco.run import resume

    run_dir = tmp_path / "k"
    attacker = f"--adversary.2=red_team:DiesOnceSent:at=2,once={tmp_path / 'died'},recommit={run_dir}"
    with pytest.raises(Exception, match="exit code|exited|died|killed|terminated"):
        train(tiny("--topology.workers=3", "--train.rounds=4", "--train.inner_steps=4", "--verify.trace_every=4",
                   "--train.inner_state=reset", "--verify.replay_probability=0.5", attacker), str(run_dir), quiet=True)
    assert len(rounds_of(run_dir)) == 2 and (tmp_path / "died").exists()
    resume(str(run_dir), quiet=True)
    verdicts = [r["verdicts"][2] for r in rounds_of(run_dir)]
    assert verdicts == ["accept", "accept", "equivocation", "banned"], verdicts
    report = audit_run(run_dir, replay=100)
    assert report.ok, report.first_failure


@pytest.mark.parametrize("run", ["static", "stages", "elastic"])
def test_a_worker_whose_first_bundle_was_junk_is_replayed_in_the_redo(tmp_path, monkeypatch, run):
    """The gap the second review of the seen notes left (fortieth session): a worker whose first
    bundle of round 1 is junk signs nothing, yet receives every salt, kills its process, and
    commits for the first time in the redo (red_team.JunkFirst, a skimmer; a replay probability
    near 0 stands for a salt it ground against the salts it saw): the resume of a static run
    (with 2 pipeline stages: each stage process notes, and they replay together), or an elastic
    round's retry once the launcher has started it again. Before, it went in unreplayed; now
    every member noted the junk (round.keep_seen) and in the redo replays it itself, whatever the
    draw: convicted and banned, the audit re-checking the noted bundle and replaying the worker
    as the recorder did."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    from veriloco.run import resume

    run_dir = tmp_path / "k"
    attacker = f"--adversary.2=red_team:JunkFirst:at=1,once={tmp_path / 'died'},recommit={run_dir}"
    cfg = tiny("--topology.workers=3", "--train.rounds=3", "--train.inner_steps=4", "--verify.trace_every=4",
               "--train.inner_state=reset", "--verify.replay_probability=0.0001", attacker,
               *{"static": [], "stages": ["--topology.stages=2"],
                 "elastic": ["--run.membership=elastic", "--run.min_workers=3", "--run.max_restarts=1",
                             "--run.timeout_s=10", "--run.heartbeat_timeout_s=1.5"]}[run])
    if run == "elastic":  # started again by its launcher, it takes part in round 1's retry
        train(cfg, str(run_dir), quiet=True)
    else:
        with pytest.raises(Exception, match="exit code|exited|died|killed|terminated"):
            train(cfg, str(run_dir), quiet=True)
        assert len(rounds_of(run_dir)) == 1
        noted = [json.loads(p.read_text())["unsigned"] for p in sorted(run_dir.glob("workers/*/seen-1.json"))]
        # every process's (the attacker's own too: it runs this code, and so judges itself as the others do)
        assert len(noted) == (6 if run == "stages" else 3) and all(list(x) == ["2"] for x in noted), noted
        resume(str(run_dir), quiet=True)
    assert (tmp_path / "died").exists()
    recs = rounds_of(run_dir)
    assert [r["verdicts"][2] for r in recs] == ["accept", "replay_mismatch", "banned"], recs
    parts = recs[1].get("stages", [recs[1]])
    junk = set((tmp_path / "died.junk").read_text().split())
    assert all(part["evidence"]["2"]["unsigned_earlier_bundle"] in junk for part in parts), parts
    assert all(list(part["unbound"]) == ["2"] and part["unbound"]["2"] in junk for part in parts), parts
    report = audit_run(run_dir, replay=100)
    assert report.ok, report.first_failure


def test_the_audit_checks_a_noted_junk_bundle(tmp_path):
    """The audit takes a record's word that a sender's earlier bundle signed nothing (`unbound`)
    only where that bundle is stored and binds its sender to nothing in the round (it replays the
    sender or rejects it, never convicts it)."""
    from veriloco.audit import AuditFailure, _unsigned_earlier
    from veriloco.store import LocalStore

    store, cfg = LocalStore(tmp_path / "store"), tiny("--topology.workers=3")
    admitted = {j: public_key_hex(k) for j, k in KEYS.items()}
    junk, signed = store.put(b"no bundle"), store.put(_bundle(1))

    def claims(unbound):
        return _unsigned_earlier(cfg, store, {"unbound": unbound}, "round 2: ", 2, RUN, admitted)

    assert claims({"1": junk, "0": junk}) == {0: junk, 1: junk} and _unsigned_earlier(cfg, store, {}, "", 2, RUN, admitted) == {}
    assert claims({"2": signed}) == {2: signed}  # (1's commitment, not 2's)
    for unbound, says in [({"1": signed}, "holds its signed commitment"), ({"1": "ab" * 32}, "missing"),
                          ({"1": 5}, "not a sha256"), ({"3": junk}, "not a map of worker ids"),
                          ({"x": junk}, "not a map of worker ids"), (["1"], "not a map of worker ids")]:
        with pytest.raises(AuditFailure, match=says):
            claims(unbound)


def test_the_seen_note_is_of_the_round_of_its_own_bundle(tmp_path):
    """keep_seen writes the round its own bundle (this rank's) names; another's bundle that claims
    this worker and round 9 (the second review's forgery, fortieth session) moved the note to
    seen-9 and kept nothing of round 4, the round being exchanged."""
    import json
    from types import SimpleNamespace

    from veriloco.hashing import canonical_json
    from veriloco.packet import encode_bundle
    from veriloco.records import RunDir
    from veriloco.round import Identity, keep_seen
    from veriloco.store import LocalStore
    from veriloco.verify.commitment import Commitment, sign_commitment
    from veriloco.verify.identity import generate_key

    h = "ab" * 32

    def bundle(key, round, worker):
        c = Commitment(run_id=h, round=round, worker=worker, base_hash=h, batch_root=h, trace_root=h, trace=(h,),
                       losses=(1.0,), packet_hash=h, packet_bytes=1, codec="fp32", salt_hash=h)
        return encode_bundle(canonical_json(sign_commitment(c, key)), b"x")

    k0, k1, k2 = (generate_key()[0] for _ in range(3))
    w = SimpleNamespace(run=RunDir(tmp_path), rank=0, worker=0, store=LocalStore(tmp_path / "store"),
                        identity=Identity(h, k0, {j: public_key_hex(k) for j, k in enumerate((k0, k1, k2))}, None))
    forged = bundle(k2, 9, 0)
    keep_seen(w, [bundle(k0, 4, 0), bundle(k1, 4, 1), forged], 0)
    notes = {p.name: json.loads(p.read_text()) for p in (tmp_path / "workers" / "0").iterdir()}
    assert list(notes) == ["seen-4.json"] and len(notes["seen-4.json"]["commitments"]) == 2, notes
    # (and worker 2's bundle bound worker 2 to nothing in round 4: noted as such, see the next test)
    assert notes["seen-4.json"]["unsigned"] == {"2": sha256_hex(forged)} and w.store.get(sha256_hex(forged)) == forged


def test_the_seen_note_names_each_sender_that_signed_nothing_and_a_redo_gets_them_back(tmp_path):
    """keep_seen notes (and stores) a sender's bundle that holds no commitment of the round that the
    sender's admitted key signed: junk, another's commitment, another round's, a signature of another
    key. The worker of each rank is the try's member (elastic), the first junk of a sender stays
    across tries, and load_seen gives the senders back to a resumed or restarted worker's checks."""
    from types import SimpleNamespace

    from veriloco.records import RunDir
    from veriloco.round import Identity, keep_seen, load_seen
    from veriloco.store import LocalStore

    admitted = {j: public_key_hex(k) for j, k in KEYS.items()} | {5: public_key_hex(derive_worker_key(7, 5))}
    keys = KEYS | {5: derive_worker_key(7, 5)}

    def worker(run):
        return SimpleNamespace(run=run, rank=0, worker=0, store=LocalStore(tmp_path / "store"),
                               identity=Identity(RUN, KEYS[0], admitted, EquivocationDetector(admitted)))

    def as_signed_by(j, key):
        return encode_bundle(canonical_json(sign_commitment(_commitment(j), keys[key])), b"p")

    w = worker(RunDir(tmp_path / "run"))
    first = [_bundle(0), b"junk", _bundle(2), as_signed_by(2, 2)]  # members 0, 1, 2, 5: 5 sent 2's commitment
    keep_seen(w, first, 0, members=[0, 1, 2, 5])
    want = {1: sha256_hex(b"junk"), 5: sha256_hex(first[3])}
    assert w.identity.unsigned == {2: want} and w.store.get(want[1]) == b"junk"
    keep_seen(w, [_bundle(0), _bundle(1), b"other junk"], 0, members=[0, 1, 5])  # a retry: 1 signs now
    assert w.identity.unsigned == {2: want}  # the first junk of each stays
    note = json.loads((tmp_path / "run" / "workers" / "0" / "seen-2.json").read_text())
    assert note["unsigned"] == {str(j): x for j, x in want.items()}
    (tmp_path / "run" / "workers" / "0" / "seen-\u00b2.json").write_text("{}")  # a digit, not an ASCII one: not a note
    resumed = worker(RunDir(tmp_path / "run"))
    load_seen(resumed, 2)
    assert resumed.identity.unsigned == {2: want}
    for bad in ({"1": "xy"}, {"one": want[1]}, ["1"]):
        (tmp_path / "run" / "workers" / "0" / "seen-2.json").write_text(json.dumps(note | {"unsigned": bad}))
        with pytest.raises(RuntimeError, match="seen-2.json: not a list of round 2's commitments"):
            load_seen(worker(RunDir(tmp_path / "run")), 2)


def test_a_newcomer_to_a_retried_round_is_replayed_by_every_member(tmp_path, monkeypatch):
    """The gap the third review of the junk-first fix left (forty-first session): in an elastic
    run a colluder (red_team.PassSalts) takes every salt of round 1's first try, writes them down
    and gives the try up; its partner (red_team.LateGrind, a skimmer in round 1) stayed out of that
    try, joins the retry, and signs its one commitment of the round with a salt ground against
    those salts until the draw leaves it out. Bound by that commitment, it went in unreplayed.
    Now every member knows it for a newcomer to the round (round.keep_seen: the members of the
    first try whose salts went out, from its own note or the coordinator) and replays it itself,
    whatever the draw: convicted and banned, and the audit replays it as the recorder did."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    salts, ready = tmp_path / "salts", tmp_path / "ready"
    pair = f"at=1,salts={salts},ready={ready}"
    cfg = tiny("--topology.workers=4", "--train.rounds=3", "--train.inner_steps=4", "--verify.trace_every=4",
               "--train.inner_state=reset", "--verify.replay_probability=0.5", "--run.membership=elastic",
               "--run.min_workers=3", "--run.round_deadline=1", "--run.timeout_s=10", "--run.heartbeat_timeout_s=1.5",
               f"--adversary.2=red_team:PassSalts:{pair}", f"--adversary.3=red_team:LateGrind:{pair},p=0.5,segments=1")
    run, _ = train(cfg, str(tmp_path / "k"), quiet=True)
    assert salts.exists() and ready.exists()  # the pair did its part
    recs = rounds_of(run.root)
    first = json.loads((run.root / "workers" / "0" / "seen-1.json").read_text())["members"]
    assert 3 not in first and recs[1]["newcomers"] == [3], (first, recs[1])
    assert recs[1]["verdicts"][3] == "replay_mismatch", recs[1]
    assert recs[1]["evidence"]["3"]["retry_replay"] == "newcomer"
    assert [r["verdicts"][3] for r in recs] == ["accept", "replay_mismatch", "banned"]
    # (the colluder gave its try up: it is in the retry, or late for it while the others go on)
    assert all(r["verdicts"][:2] == ["accept"] * 2 for r in recs) and recs[0]["verdicts"][2] == "accept", recs
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure
    # the record's newcomers are what lets the conviction of a worker the draw did not sample stand
    lines = (run.root / "rounds.jsonl").read_text().splitlines()
    for newcomers, message in (([], "worker 3 is recorded as replay_mismatch but was not in the replay sample"),
                               ([3, 3], "the record's newcomers are not an ascending list of the round's members"),
                               (["3"], "the record's newcomers are not an ascending list of the round's members")):
        forged = Path(shutil.copytree(run.root, tmp_path / f"forged-{len(list(tmp_path.iterdir()))}"))
        rec = json.loads(lines[1]) | {"newcomers": newcomers}
        (forged / "rounds.jsonl").write_text("\n".join([lines[0], json.dumps(rec), *lines[2:]]) + "\n")
        report = audit_run(forged)
        assert not report.ok and message in report.first_failure, report.first_failure


ELASTIC_PAIR = ("--topology.workers=4", "--train.inner_steps=4", "--train.inner_state=reset", "--run.membership=elastic",
                "--run.min_workers=3", "--run.round_deadline=1", "--run.timeout_s=10", "--run.heartbeat_timeout_s=1.5")


def test_a_false_first_try_key_stops_the_run_rather_than_spare_a_newcomer(tmp_path, monkeypatch):
    """The review of the forty-second session: the coordinator's key of round 1's first try,
    written by the colluder before that try formed ("0 1 2 3": nobody a newcomer), was what the
    first try's members noted as its members, so in the retry none took the grinding skimmer
    for a newcomer and it went in unreplayed. A note now records the worker's own view only: the
    first try's members still replay the newcomer, while its own process, misled by the key,
    accepts itself, and the agreement check stops the run before anything of it is applied."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    salts, ready, run_dir = tmp_path / "salts", tmp_path / "ready", tmp_path / "k"
    pair = f"at=1,salts={salts},ready={ready}"
    cfg = tiny(*ELASTIC_PAIR, "--train.rounds=2", "--verify.trace_every=4", "--verify.replay_probability=0.5",
               f"--adversary.2=red_team:PassSalts:{pair},key=0_1_2_3,leave=1",
               f"--adversary.3=red_team:LateGrind:{pair},p=0.5,segments=1")
    with pytest.raises(RuntimeError, match="disagree on the global params"):
        train(cfg, str(run_dir), quiet=True)
    assert len(rounds_of(run_dir)) == 1  # round 1 applied nowhere
    notes = {int(d.parent.name): json.loads(d.read_text())["members"] for d in run_dir.glob("workers/*/seen-1.json")}
    assert notes[0] == notes[1] == [0, 1, 2] and notes[3] == [0, 1, 3], notes  # each its own view, not the key's


def test_a_newcomer_cannot_choose_how_a_colluder_is_replayed(tmp_path, monkeypatch):
    """The review of the forty-second session: a newcomer (red_team.SteerGrind, honest itself)
    ground its commitment until the retry's draw replayed its colluder of the first try
    (red_team.LateSkim, which skims round 1 from step 2 on) only to a segment before step 2.
    newcomer_audits replayed only what the draw without the newcomers sampled and the round's
    draw did not, so a worker both drew kept the segment (and auditor) the newcomer chose, and
    the skimmer went in. Now every member replays whatever the draw without them samples (here,
    at replay probability 1, everyone): the skimmer is caught."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir)
    sys.path.insert(0, tests_dir)
    salts, ready = tmp_path / "salts", tmp_path / "ready"
    pair = f"at=1,salts={salts},ready={ready}"
    cfg = tiny(*ELASTIC_PAIR, "--train.rounds=2", "--verify.trace_every=1", "--verify.replay_probability=1",
               "--verify.replay_extent=segment", "--verify.screen=false", "--verify.ban=false",
               "--adversary.1=red_team:LateSkim:at=1,cut=2", f"--adversary.2=red_team:PassSalts:{pair},leave=1",
               f"--adversary.3=red_team:SteerGrind:{pair},p=1,segments=4,target=1,cut=2")
    run, _ = train(cfg, str(tmp_path / "k"), quiet=True)
    rec = rounds_of(run.root)[1]
    assert rec["newcomers"] == [3] and rec["evidence"]["1"]["replayed"]["segment"] < 2, rec  # what the grinder chose
    assert rec["verdicts"][1] == "replay_mismatch" and rec["evidence"]["1"]["retry_replay"] == "drawn", rec
    assert [rec["verdicts"][j] for j in (0, 3)] == ["accept", "accept"], rec
    report = audit_run(run.root, replay=100)
    assert report.ok, report.first_failure


def test_the_screen_draws_without_a_newcomers_say():
    """The review of the forty-second session: a newcomer's ground commitment also chose the loss-
    gain screen's draws (the batches a gain is measured on, and the checkers), so it could give a
    colluder of the first try the very steps it trained on, or check it itself. check_bundles
    keeps the newcomers that sent a bundle (`check.newcomers`), and screen_checked draws from the
    seed without their say, which no commitment of theirs moves; not where they are half the
    senders or more (check.screen_leaves_out: a false coordinator key could so leave every honest
    salt out of a first try's screen)."""
    from veriloco.verify.check import screen_checked
    from veriloco.verify.lossgain import Settled

    signed, seeds = {j: type("C", (), {"digest": f"{j:064x}"})() for j in range(4)}, []
    for digest, newcomers in (("a" * 64, [3]), ("b" * 64, [3]), ("a" * 64, [2, 3])):
        decoded = {j: {"w": torch.full((8,), float(j + 1))} for j in range(4)}
        check = RoundCheck({j: ACCEPT for j in range(4)}, {}, signed | {3: type("C", (), {"digest": digest})()},
                           {j: f"{j:064x}" for j in range(4)}, {},
                           decoded, salts={j: f"{j + 10:064x}" for j in range(4)}, newcomers=newcomers)
        screen_checked(check, base_hash="base", loss_gains_of=lambda d, seed: seeds.append(seed) or Settled({}))
    assert seeds[0] == seeds[1] == round_seed(check, "base", [3]) != round_seed(check, "base")
    assert seeds[2] == round_seed(check, "base")  # two newcomers of four: every say in


def test_the_audit_refuses_newcomers_in_a_run_that_draws_nothing():
    """A record's `newcomers` leave senders out of a round's seed: where the run draws nothing
    (no replays, no loss-gain batches) there is none, and a record that lists them is refused."""
    from veriloco.audit import AuditFailure, _newcomers

    draws = tiny("--topology.workers=3", "--train.inner_state=reset", "--verify.trace_every=5", "--verify.replay_probability=0.5")
    assert _newcomers(draws, {"newcomers": [2]}, [0, 1, 2], "round 1: ") == [2]
    with pytest.raises(AuditFailure, match="round 1: the record has newcomers, but the run draws nothing"):
        _newcomers(tiny("--topology.workers=3", "--verify.replay_probability=0", "--verify.loss_gain_batches=0"),
                   {"newcomers": [2]}, [0, 1, 2], "round 1: ")


def test_the_first_try_of_a_round_is_whoever_wrote_first_and_a_malformed_one_is_none():
    """Membership.first_try: the coordinator's key of a round's first try (first writer wins);
    anyone can write it, so what is not an ascending list of admitted workers is no answer."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from veriloco.membership import Membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    me = SimpleNamespace(store=store, workers=4)
    assert Membership.first_try(me, 1, [0, 1, 2]) == [0, 1, 2]
    assert Membership.first_try(me, 1, [0, 1, 2, 3]) == [0, 1, 2]  # a retry's member learns the first try's
    assert Membership.first_try(me, 2, [0, 1, 3]) == [0, 1, 3]
    for r, text in ((3, "0 1 x"), (4, "2 1"), (5, "0 7"), (6, "0 0 1"), (7, " 1")):
        store.set(f"first/{r}", text)
        assert Membership.first_try(me, r, [0, 1]) is None, text


def test_newcomer_audits_replay_the_newcomers_and_what_the_draw_without_them_replays():
    """replay.newcomer_audits: each newcomer, plus every worker the draw without the newcomers'
    say samples, whether the round's draw samples it too or not (there the newcomer chose its
    auditor and segment); the draw without them moves with no newcomer's commitment or salt."""
    from veriloco.config import TrainConfig, VerifyConfig
    from veriloco.verify.check import RoundCheck
    from veriloco.verify.replay import newcomer_audits

    verify, train_cfg = VerifyConfig(replay_probability=0.5), TrainConfig(inner_steps=4)
    signed = {j: type("C", (), {"digest": f"{j:064x}"})() for j in range(4)}

    def check(newcomer_digest: str) -> RoundCheck:
        commitments = dict(signed) | {3: type("C", (), {"digest": newcomer_digest})()}
        return RoundCheck({j: ACCEPT for j in range(4)}, {j: {} for j in range(4)}, commitments, {}, {},
                          salts={j: f"{j + 10:064x}" for j in range(4)})

    without = PlanInputs.of_round("base", check("f" * 64), set(), leave_out=[3]).audits(verify, train_cfg, [0, 1, 2])
    assert without and all(a.auditor != 3 for a in without) and 3 not in {a.worker for a in without}
    both, moved = 0, set()
    for nonce in range(40):
        c = check(f"{nonce + 100:064x}")
        assert round_seed(c, "base", [3]) == round_seed(check("f" * 64), "base", [3])  # not the newcomer's to move
        extra = newcomer_audits(verify, train_cfg, "base", c, set(), [0, 1, 2, 3], [3])
        assert extra == {a.worker: "drawn" for a in without} | {3: "newcomer"}
        drawn = PlanInputs.of_round("base", c, set()).audits(verify, train_cfg, [0, 1, 2, 3])
        both += any(a.worker in extra for a in drawn if a.worker != 3)
        moved.add(tuple((a.worker, a.auditor) for a in drawn))
    assert len(moved) > 1 and both > 0  # the newcomer moves the round's draw, and not what every member replays
