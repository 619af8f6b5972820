"""Checking one round's bundles: every worker runs this on the same bytes and gets the same verdicts.

For each worker's bundle, in order (the first failure is its verdict):
  1. bundle format, signed-commitment format (MALFORMED)
  2. signature under the admitted key, run, round, base hash (BAD_SIGNATURE, UNKNOWN_WORKER,
     KEY_MISMATCH, STALE_BASE, LATE, MALFORMED); the commitment names the worker that sent it
  3. the packet is the one committed to: size, sha256, codecs (MALFORMED)
  4. the batch root is the one its assigned batches give (WRONG_DATA), the trace root is the
     root of its trace and the trace has one state hash per segment boundary (MALFORMED)
  5. equivocation: a second, different signed commitment for this round (EQUIVOCATION, with
     both signed commitments kept as evidence)
  6. the packet decodes to the model's shapes (MALFORMED)
  7. with reveals (the run draws replays or loss-gain batches): the salt it revealed after every
     bundle was in is signed for its commitment (else WITHHELD; where the run replays, a suspect
     replayed whatever the draw) and opens its salt_hash (UNREVEALED, an offence: its own signed
     word); a sender whose bundle of an earlier try of the round signed nothing is replayed
     by every member that noted it, or WITHHELD where the run does not replay (`unsigned_earlier`)
then the screen over the decodable deltas (verify/screen.py: norms, cosine to a robust centre,
copies, replays). A rejected packet never reaches the aggregate.

A worker banned in an earlier round (`banned`: it was proven to cheat, see verify.OFFENCES) gets
BANNED before any check. The loss-gain test is noisy over the few batches it can afford (honest
deltas fail it now and then), so with `loss_gain_action = "audit"` a delta that fails only that
test is not rejected here but made a *suspect*: round.py replays it this round, and the replay,
which is exact, decides. With "reject" (and whenever replays are off) it is rejected outright.
Likewise both ends of a copy of this round's packets: where the run replays, every member
replays each end whose packet a replay can re-encode, and the replay tells the original; an end
the screen holds nothing else against stays in until then (`replay_copies`, RoundCheck.copies).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hashing import sha256_hex
from ..ledger.merkle import root as merkle_root
from ..packet import PacketError, decode_bundle, decode_packet, header_limit
from . import (
    ACCEPT,
    BANNED,
    EQUIVOCATION,
    FALSE_REPORT,
    KEY_MISMATCH,
    MALFORMED,
    NO_LOSS_GAIN,
    OFFENCES,
    OTHER_STAGE,
    UNREVEALED,
    WITHHELD,
    WRONG_DATA,
)
from .commitment import (
    CommitmentError,
    EquivocationDetector,
    SignedCommitment,
    check_commitment,
    check_packet,
    check_signature,
    open_reveal,
    parse_signed_commitment,
)
from .lossgain import FLOOR_SHARE, Settled, gain_floor
from .screen import LossGain, ScreenConfig, copied_only, copy_partners, screen_round


def hex_root(hashes: list[str]) -> str:
    """Merkle root (RFC 9162) over a list of hex digests, as hex."""
    return merkle_root([bytes.fromhex(h) for h in hashes]).hex()


@dataclass
class RoundCheck:
    """Verdicts of one round: reason per worker, decoded deltas of the accepted ones, evidence."""

    verdicts: dict[int, str]
    accepted: dict[int, dict[str, torch.Tensor]]
    commitments: dict[int, SignedCommitment | None]
    packet_hashes: dict[int, str]
    evidence: dict[int, Any] = field(default_factory=dict)
    decoded: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # every decodable delta
    suspects: dict[int, dict] = field(default_factory=dict)  # accepted for now, to be replayed: why
    loss_gains: Settled | None = None  # shared loss gains (lossgain.py), when checkers computed them
    salts: dict[int, str] = field(default_factory=dict)  # the salts of the senders that passed (hex)
    reveals: dict[int, str] = field(default_factory=dict)  # the reveals it examined (hex): the round records them
    # senders whose bundle of an earlier try of the round signed nothing, as this worker noted (round.keep_seen):
    # worker -> that bundle's store hash. Their commitments and salts stay out of the round's seed, and every
    # member that noted one it accepts replays it itself (replay.judge_unbound)
    unbound: dict[int, str] = field(default_factory=dict)
    # members of an elastic retry that were not in the round's first try whose salts went out, as this worker
    # learnt (round.keep_seen): every member replays them, and what the draw without them replays (replay.newcomer_audits)
    newcomers: list[int] = field(default_factory=list)
    # the ends of a copy of this round's packets (screen.copy_partners) that the run can replay: worker -> the
    # workers it copies or is copied by. Every member replays each whole itself (replay.judge_copy): the original
    # reproduces its packet, a copier does not. An end the screen holds nothing else against (screen.copied_only)
    # stays accepted until then; one it refuses on another flag too stays refused, and is convicted if its replay
    # fails (else a copier could dodge its replay by a second flag: the forty-third session's review)
    copies: dict[int, list[int]] = field(default_factory=dict)


def take_whole_workers(check: RoundCheck, accepted_by_stage: list[list[int]]) -> None:
    """A pipelined worker's update is taken whole or not at all. `accepted_by_stage`: the workers
    each stage of the round accepted (in stage order); a worker accepted in `check` (one stage's)
    that another stage rejected gets OTHER_STAGE here, so no slice of its update touches G and
    no stage samples it for replay differently (a worker must not get one slice in unreplayed by
    spoiling another)."""
    everywhere = set.intersection(*(set(a) for a in accepted_by_stage))
    for j in sorted(set(check.accepted) - everywhere):
        check.verdicts[j] = OTHER_STAGE
        check.evidence[j] = {"rejected_by_stages": [s for s, a in enumerate(accepted_by_stage) if j not in a]}
        check.accepted.pop(j)
        check.suspects.pop(j, None)


def pooled_copies(stages: Iterable[Mapping[int, list[int]]]) -> dict[int, list[int]]:
    """The ends of a copy any of a worker's stages found (each stage's RoundCheck.copies), each with
    every partner any of them named, in worker order: what its stages replay together (round.py
    and audit.py both pool with it)."""
    out: dict[int, set[int]] = {}
    for copies in stages:
        for j, of in copies.items():
            out.setdefault(j, set()).update(of)
    return {j: sorted(of) for j, of in sorted(out.items())}


SCREEN_ARGS = ("screen", "previous", "earlier", "loss_gain_of", "loss_gains_of", "loss_gain_action",
               "loss_gain_floor", "replay_copies")  # screen_checked's


def check_round(bundles: list[bytes] | dict[int, bytes], **checks: Any) -> RoundCheck:
    """Verdict per worker for this round's bundles (index = worker id; a dict when only some
    workers took part, as under elastic membership): `check_bundles` with the `checks` it takes
    (run id, round, base hash, keys, shapes, ...), then `screen_checked` with those it takes
    (SCREEN_ARGS). The loss-gain test: `loss_gain_of(w, delta, seed)` computes each gain here (on the
    batches lossgain.gain_steps draws from `seed`); or
    `loss_gains_of(decoded, seed)` settles them from the assigned checkers' reports (lossgain.py;
    `seed`: the round's commitments), and a checker whose report does not reproduce gets
    FALSE_REPORT. `loss_gain_action`: "reject" a delta that fails the loss-gain test, or "audit"
    it (RoundCheck.suspects). `replay_copies`: which ends of a copy of this round's packets
    can be replayed to tell the original (RoundCheck.copies); None where the run replays nothing:
    both ends are rejected."""
    screen = {k: checks.pop(k) for k in SCREEN_ARGS if k in checks}
    return screen_checked(check_bundles(bundles, **checks), base_hash=checks["base_hash"], **screen)


def check_bundles(
    bundles: list[bytes] | dict[int, bytes],
    *,
    run_id: str,
    round: int,
    base_hash: str,
    admitted_keys: dict[int, str],
    shapes: dict[str, tuple[int, ...]],
    max_packet_bytes: int,
    batch_root_of: Callable[[int], str],
    equivocation: EquivocationDetector,
    trace_entries: int | None = None,
    banned: set[int] | frozenset[int] = frozenset(),
    bundle_hashes: Mapping[int, str] | None = None,
    packet_hashes_known: Mapping[int, str] | None = None,
    consume: bool = False,
    reveals: Mapping[int, bytes | memoryview] | None = None,
    unsigned_reveal: str = "reject",
    unsigned_earlier: Mapping[int, str] | None = None,
    newcomers: Collection[int] = (),
    codecs: Collection[str] | None = None,
) -> RoundCheck:
    """Everything before the screen (check_round): bundle format, signature, commitment, packet
    hash, codecs, assigned data, trace shape, equivocation, decoding; `banned` workers are refused.
    `codecs`: the codec specs (canonical) the run's workers encode with; a packet under another is
    MALFORMED (no honest worker of the run makes one, and a codec a replay cannot re-encode would
    spare a copier its replay: the forty-third session's review).
    `decoded` holds the deltas that passed; they are ACCEPT so far, and `accepted` is empty until
    `screen_checked`. `bundle_hashes`: the sha256 of each bundle where the caller has it (the
    store's digest), so that a model-sized bundle is not hashed twice; a packet is hashed once.
    `packet_hashes_known`: the sha256 of the packet inside a bundle where the caller hashed it
    itself (its own bundle, the very bytes it built and sent: round.finish_round), not hashed
    again. `consume` (a dict of bundles): take each bundle out of it as it is checked, so that a
    caller holding them nowhere else has one bundle's bytes at a time beside the decoded deltas
    (which hold none of them), not all of them. `reveals`: each sender's signed reveal (the
    exchange's second step), when the run draws from the round's seed; each sender that passed
    the checks above must have sent one signed for its commitment (else WITHHELD) whose salt
    opens the commitment's `salt_hash` (else UNREVEALED, an offence). The salts of those that
    pass are the check's `salts`, which round_seed mixes in; `reveals` (hex) what was examined.
    `unsigned_reveal` = "replay" (the run replays): a sender without a signed reveal is not
    rejected but made a suspect, replayed whole this round whatever the draw, and the replay
    decides. Rejected (WITHHELD, no offence: the bytes are no one's word), it could keep its
    reveal whenever it saw that the draw would replay it, and be rejected, never convicted.
    `unsigned_earlier`: the senders whose bundle of this round in an earlier try (before a
    resume, a restart, an elastic retry) held no commitment they signed (round.keep_seen), each
    with that bundle's store hash. Bound by nothing, they received every salt of that try, which
    an honest redo reveals again, so the commitment such a sender signs now may be ground against
    the draw, and so its auditor and which others are replayed: such a sender is `unbound`,
    whatever its bundle now, and its commitment and salt stay out of the round's seed
    (round_seed: a second review's grinder chose, by its new commitment, a draw that left a
    colluder's skimmed update unreplayed). Where the run replays, every member that noted it
    replays its whole round itself and judges by its own number (round.replay_audits,
    replay.judge_unbound: no auditor for it to choose, no note that must be the same everywhere;
    a member without the note accepts it, and where the others convict it the round's agreement
    check stops the run); else it is rejected (WITHHELD: it withheld its commitment until it had
    seen the salts). `newcomers`: the members of an elastic retry that were not in the round's
    first try (round.keep_seen), the check's `newcomers` where they sent a bundle: the screen
    draws without their say (screen_checked), and replay.newcomer_audits adds replays."""
    verdicts: dict[int, str] = {}
    commitments: dict[int, SignedCommitment | None] = {}
    packet_hashes: dict[int, str] = {}
    decoded: dict[int, dict[str, torch.Tensor]] = {}
    evidence: dict[int, Any] = {}
    order = list(bundles) if isinstance(bundles, dict) else range(len(bundles))  # the keys, before any is taken out
    limit = header_limit(shapes)  # the most packet header bytes read, before any is parsed
    for w in order:
        data = bundles.pop(w) if consume and isinstance(bundles, dict) else bundles[w]
        commitments[w] = None
        try:
            raw_commitment, packet, extras = decode_bundle(data, view=True)  # the packet read in place
            packet_hashes[w] = (packet_hashes_known or {}).get(w) or sha256_hex(packet)
            signed = parse_signed_commitment(raw_commitment)
            gossip = [parse_signed_commitment(x) for x in extras]
        except (PacketError, CommitmentError) as e:
            if w not in packet_hashes:  # a bundle that is no bundle is known by its own hash
                packet_hashes[w] = (bundle_hashes or {}).get(w) or sha256_hex(data)
            if w in banned:
                verdicts[w] = BANNED
            else:
                verdicts[w], evidence[w] = MALFORMED, {"error": str(e)[:200]}
            continue
        commitments[w] = signed
        if w in banned:  # proven to cheat before: nothing it sends is looked at again
            verdicts[w] = BANNED
            continue
        c = signed.commitment
        reason = check_commitment(signed, admitted_keys, run_id=run_id, round=round, base_hash=base_hash)
        if reason is None and c.worker != w:
            reason = KEY_MISMATCH
        reason = reason or check_packet(signed, packet, packet_hashes[w], limit)
        if reason is None and codecs is not None:
            foreign = sorted(set(c.codec.values() if isinstance(c.codec, dict) else [c.codec]) - set(codecs))
            if foreign:
                reason, evidence[w] = MALFORMED, {"codec_not_the_runs": foreign[0][:80]}
        if reason is None and c.batch_root != batch_root_of(w):
            reason, evidence[w] = WRONG_DATA, {"committed": c.batch_root, "assigned": batch_root_of(w)}
        if reason is None and (not c.trace or c.trace_root != hex_root(list(c.trace))):
            reason = MALFORMED
        if reason is None and trace_entries is not None and len(c.trace) != trace_entries:
            # fewer state hashes than the round has segments: it did not do (or admit) the work
            reason, evidence[w] = MALFORMED, {"trace_entries": len(c.trace), "expected": trace_entries}
        # a second signed commitment for this round is evidence, whichever bundle carries it: gossip about a
        # sender checked earlier is settled after the loop
        for other in gossip:
            equivocation.observe(other)
        if reason is None:
            proof = equivocation.observe(signed)
            if proof is not None:
                reason, evidence[w] = EQUIVOCATION, proof
        if reason is None:
            try:
                decoded[w] = decode_packet(packet, shapes, max_packet_bytes)
            except PacketError as e:
                reason, evidence[w] = MALFORMED, {"error": str(e)[:200]}
        verdicts[w] = reason or ACCEPT
    for w in list(decoded):  # proven by a bundle checked after its own
        proof = equivocation.proof(run_id, round, w)
        if proof is not None:
            verdicts[w], evidence[w] = EQUIVOCATION, proof
            del decoded[w]
    salts: dict[int, str] = {}
    examined: dict[int, str] = {}
    suspects: dict[int, dict] = {}
    # (a run that reveals nothing had no salt to see)
    unbound = {w: h for w, h in sorted((unsigned_earlier or {}).items()) if w in verdicts} if reveals is not None else {}
    for w in sorted(decoded) if reveals is not None else ():  # the senders that passed so far
        signed, raw = commitments[w], bytes(reveals.get(w, b""))
        assert signed is not None
        if w in unbound and unsigned_reveal != "replay":
            verdicts[w], evidence[w] = WITHHELD, {"unsigned_earlier_bundle": unbound[w]}
            del decoded[w]
            continue
        examined[w] = raw.hex()
        salt = open_reveal(signed, raw, admitted_keys.get(w))
        if salt:
            salts[w] = salt
            continue
        if salt is None and unsigned_reveal == "replay":  # no draw to dodge: it is replayed whatever the draw
            suspects[w] = {"reveal": "none signed for its commitment"}
            continue
        if salt is None:  # no signed reveal: no one's word, so no offence (a recorder could write any bytes)
            verdicts[w], evidence[w] = WITHHELD, {"reveal": "none signed for its commitment"}
        else:
            verdicts[w], evidence[w] = UNREVEALED, {"reveal": raw.hex(), "salt_hash": signed.commitment.salt_hash}
        del decoded[w]
    return RoundCheck(dict(sorted(verdicts.items())), {}, commitments, packet_hashes, evidence, decoded,
                      suspects=suspects, salts=salts, reveals=examined, unbound=unbound,
                      newcomers=[j for j in sorted(set(newcomers)) if j in verdicts] if reveals is not None else [])


def binds(data: bytes | memoryview, *, run_id: str, round: int, worker: int, admitted_keys: Mapping[int, str]) -> bool:
    """Whether a bundle (bytes as received) holds a commitment that binds `worker` in this run
    and round: one that names them and that the worker's admitted key signed, which an
    equivocation detector would hold it to. A sender whose bundle does not is bound by nothing,
    and yet it receives the round's salts (check_bundles' unsigned_earlier)."""
    try:
        signed = parse_signed_commitment(decode_bundle(data, view=True)[0])
    except (PacketError, CommitmentError):
        return False
    return binds_commitment(signed, run_id=run_id, round=round, worker=worker, admitted_keys=admitted_keys)


def binds_commitment(signed: SignedCommitment, *, run_id: str, round: int, worker: int,
                     admitted_keys: Mapping[int, str]) -> bool:
    """`binds` of a bundle's commitment, parsed already."""
    c = signed.commitment
    return (c.run_id, c.round, c.worker) == (run_id, round, worker) and check_signature(signed, admitted_keys) is None


def round_seed(check: RoundCheck, base_hash: str, leave_out: Collection[int] = ()) -> str:
    """The seed of the round's draws (the replay sample and its auditors, the loss-gain batches
    and checkers): the base, every checked commitment's digest, and the revealed salts of the
    senders that passed the checks (check_bundles). The salts were revealed only after every
    commitment was in, so no sender could know the seed when it committed, however late it
    sent; a rejected sender's salt is left out, so none decides the draw by being rejected.
    An unbound sender's commitment and salt are left out too: it saw every other salt of the
    round before it first committed (check_bundles' unsigned_earlier). `leave_out`: more senders
    whose say to leave out (replay.newcomer_audits: the draw without a retry's newcomers)."""
    out = set(check.unbound) | set(leave_out)
    digests = "".join(sorted(c.digest for w, c in check.commitments.items() if c is not None and w not in out))
    return base_hash + digests + "".join(check.salts[w] for w in sorted(check.salts) if w not in out)


def screen_leaves_out(check: RoundCheck) -> list[int]:
    """Whose say the screen's draws (the batches each loss gain is measured on, its checkers) leave
    out: an elastic retry's newcomers, whose salt may have been ground against the others' (the
    second review of the forty-second session), while they are fewer than half the round's
    senders. A worker without a note of the round's first try learns the newcomers from the
    coordinator's key, which anyone can write: in a first try, a key that named the colluders
    alone would make every honest member a "newcomer", and leave every honest salt out of the
    screen's seed, which the colluders could then grind offline. Under an honest majority, a
    minority left out leaves an honest salt in."""
    return check.newcomers if 2 * len(check.newcomers) < len(check.verdicts) else []


def screen_checked(
    check: RoundCheck,
    *,
    base_hash: str,
    screen: bool = True,
    previous: tuple[dict[int, str], dict[int, dict[str, torch.Tensor]]] | None = None,
    loss_gain_of: Callable[[int, dict[str, torch.Tensor], str], LossGain] | None = None,
    loss_gains_of: Callable[[dict[int, dict[str, torch.Tensor]], str], Settled] | None = None,
    loss_gain_action: str = "reject",
    earlier: dict[int, dict[str, torch.Tensor]] | None = None,
    loss_gain_floor: float = FLOOR_SHARE,
    replay_copies: Callable[[SignedCommitment, dict[str, torch.Tensor]], bool] | None = None,
) -> RoundCheck:
    """The screen of `check_bundles`' decoded deltas (norm, cosine, duplicates, loss gains; see
    check_round), and the accepted deltas. `previous`: the previous round's decoded packet
    hashes and accepted deltas; `earlier`: the round before's accepted deltas (delay 1, a round
    late: what a worker holds when it sends; screen_round's earlier_deltas). `replay_copies`:
    whether a sender's replay could tell whether its packet is its own (its commitment, its
    delta); every end of a copy of this round for which it can is then replayed by every member
    (RoundCheck.copies), and one against which the screen holds nothing else
    (screen.copied_only) is kept in until then, rather than rejected with the other end: a
    sender that saw the round's packets before it committed (an elastic retry's newcomer, say)
    could otherwise copy an honest member's and have both refused, censoring that member."""
    verdicts, commitments, decoded = dict(check.verdicts), check.commitments, check.decoded
    packet_hashes, evidence, suspects = check.packet_hashes, dict(check.evidence), dict(check.suspects)
    copies: dict[int, list[int]] = {}
    settled = None
    if screen and decoded:
        prev_hashes, prev_deltas = previous or ({}, {})
        seed = round_seed(check, base_hash, screen_leaves_out(check))  # also draws each loss gain's batches, checkers
        if loss_gains_of is not None:
            settled = loss_gains_of(decoded, seed)
            gains: dict[int, LossGain] | None = settled.gains
        else:
            gains = {w: loss_gain_of(w, d, seed) for w, d in decoded.items()} if loss_gain_of else None
        # a delta must lower its own batches' loss by a fair share (loss_gain_floor) of what the
        # median delta does (with 3+ workers; with fewer, by more than nothing): noise gains ~0
        floor = gain_floor(gains, loss_gain_floor) if gains else 0.0
        screened = screen_round(
            decoded,
            packet_hashes={w: packet_hashes[w] for w in decoded},
            previous_packet_hashes=prev_hashes,
            previous_deltas=prev_deltas,
            earlier_deltas=earlier,
            loss_gains=gains,
            # only "no gain on its own batches" is decided here: own-vs-random advantage is too
            # noisy over a few batches to reject on without false positives (replay decides data)
            config=ScreenConfig(min_own_gain=floor, min_own_advantage=-1e9),
        )
        for w, v in screened.items():
            if v.accepted:
                continue
            of = copy_partners(v.evidence) if replay_copies is not None else []
            if of and replay_copies(commitments[w], decoded[w]):
                copies[w] = of
                if copied_only(v.evidence):  # the original, maybe: in until its replay tells
                    continue
            if loss_gain_action == "audit" and set(v.evidence["flags"]) <= {NO_LOSS_GAIN, WRONG_DATA}:
                suspects[w] = suspects.get(w, {}) | {"flags": v.evidence["flags"], "loss_gain": v.evidence.get("loss_gain")}
            else:
                verdicts[w], evidence[w] = v.reason, v.evidence
                suspects.pop(w, None)
        for c, ev in (settled.false_reports.items() if settled else ()):  # lied as a loss-gain checker
            if c in verdicts and verdicts[c] not in (*OFFENCES, BANNED):
                verdicts[c], evidence[c] = FALSE_REPORT, {"loss_gain": ev}
                suspects.pop(c, None)
    accepted = {w: d for w, d in decoded.items() if verdicts[w] == ACCEPT}
    return RoundCheck(dict(sorted(verdicts.items())), accepted, commitments, packet_hashes, evidence, decoded,
                      suspects, settled, check.salts, check.reveals, check.unbound, check.newcomers, copies)
