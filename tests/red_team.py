"""A user-defined attacker loaded by import path in tests (`--adversary.2=red_team:Halve`)."""

from veriloco.verify.adversary import Adversary, FalseAccuser, Skim, one_of, real
from veriloco.verify.screen import LossGain


class Halve(Adversary):
    """Trains honestly, then sends half its delta but claims nothing else: an easy one to catch
    by replay? No: replay checks the trace, not the packet; the screen sees a short delta."""

    kind = "halve"

    def delta(self, r, delta, view):
        return {k: v * float(self.params.get("factor", "0.5")) for k, v in delta.items()}


class Dies(Adversary):
    """Fault injection: the worker's process exits abruptly at round `at` (default 1), mid-round."""

    kind = "dies"

    def inner_steps(self, r, steps):
        if r == int(self.params.get("at", "1")):
            import os

            os._exit(9)
        return steps


class Jitter(Adversary):
    """Not an attacker: an honest worker whose delta does not reproduce from process to process
    (a GPU's nondeterministic kernels, say), by 1e-6 of noise from a fresh random seed. A redo of
    a round after a restart makes another packet than the one that went out."""

    kind = "jitter"

    def delta(self, r, delta, view):
        import os

        import torch

        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        return {k: v + 1e-6 * torch.randn(v.shape, generator=g) for k, v in delta.items()}


class Crashes(Adversary):
    """Fault injection: a bug, not a planned death: raises at round `at` (default 0), mid-round."""

    kind = "crashes"

    def inner_steps(self, r, steps):
        if r == int(self.params.get("at", "0")):
            raise ValueError(f"worker {self.worker} crashes in round {r} (red_team.Crashes)")
        return steps


class Whitewash(Adversary):
    """Trains honestly, but as an auditor reports every replay it is given as passing: covers
    for a cheating partner. The run cannot see it; the offline audit's replays name it."""

    kind = "whitewash"

    def audit_report(self, r, worker, score):
        return -1.0


class Vouch(Adversary):
    """Trains honestly, but as a loss-gain checker reports every delta it checks as a little
    better than it is (0.01 nats more gain): what covering for a partner whose delta barely
    passes looks like. A failing number would be recomputed by everyone; a passing one is taken.
    The offline audit recomputes every gain and names it."""

    kind = "vouch"

    def loss_gain_report(self, r, worker, gain):
        from veriloco.verify.screen import LossGain

        after = gain.own_after - 0.01
        return LossGain.on_own_batches(gain.own_before, after)


class Silent(Adversary):
    """Trains honestly, but as an auditor reports no number (NaN) for the replays it was given:
    until the forty-first session a missing number read as -1, a pass, so it covered for a
    cheating partner as Whitewash does; now each member replays the worker itself."""

    kind = "silent"

    def audit_report(self, r, worker, score):
        return float("nan")


class SilentStage1(Adversary):
    """Pipelined auditor that reports its number from its stage 0 and none (NaN) from its other
    stages: were each stage of a judge to act on its own stage's rows, one would replay and the
    other not, and the judge's pipeline would hang (round.pooled_reports)."""

    kind = "silent_stage1"

    def audit_report(self, r, worker, score):
        import torch.distributed as dist

        return score if dist.get_rank() % 2 == 0 else float("nan")  # stage 0 of 2 (ranks are worker-major)


class Mute(Adversary):
    """Trains honestly, but never reports a loss gain it was drawn to check."""

    kind = "mute"

    def loss_gain_report(self, r, worker, gain):
        return None


class SpoilStage0(Adversary):
    """Pipelined worker that trains honestly but spoils the packet of its stage 0 (the slice with
    the embedding): what a worker would do to get its other slices in without being replayed, if
    stages judged slices apart."""

    kind = "spoil_stage0"

    def bundle(self, r, bundle, view):
        return bundle[: len(bundle) // 2] if b"tok_emb" in bundle else bundle


class SplitReports(Adversary):
    """Pipelined loss-gain checker that reports the truth from its stage 0 and a failing gain from
    its other stages: if each stage of an honest worker settled from the reports it gathered
    itself, that worker's stages would recompute different gains, run different pipelines and
    hang."""

    kind = "split_reports"

    def loss_gain_report(self, r, worker, gain):
        import torch.distributed as dist

        if dist.get_rank() % 2 == 0:  # stage 0 of 2 (ranks are worker-major)
            return gain
        return LossGain.on_own_batches(gain.own_before, gain.own_before + 1.0)


class FalseChecker(FalseAccuser):
    """The false accuser's lie as a loss-gain checker only: it replays honestly as an auditor, so
    whatever convicts it is the loss-gain path."""

    kind = "false_checker"

    def audit_report(self, r, worker, score):
        return score


class Withholds(Adversary):
    """Trains honestly but never sends the start state an auditor asks for (replay_extent "state")."""

    kind = "withholds"

    def state(self, r, segment, tensors):
        return None


class Framer(Adversary):
    """Trains honestly, sends its auditor a wrong start state in private, then the right one when
    every member asks: it tries to get an honest auditor convicted of a false report."""

    kind = "framer"

    def __init__(self, worker, seed, **params):
        super().__init__(worker, seed, **params)
        self.asked = set()

    def state(self, r, segment, tensors):
        if (r, segment) in self.asked or tensors is None:
            return tensors
        self.asked.add((r, segment))
        return {k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()}


class ScoreForger(Adversary):
    """Trains and audits honestly, but in the collective that spreads the auditors' replay scores
    (round.replay_audits) it writes a failure, 1e6, into every other audit's slot of what it sends:
    with a MAX all-reduce every member read that as the auditor's report, replayed, saw the replay
    pass, and convicted the honest auditor of a false report (a review's find, thirty-eighth session).
    Its rows are signed now (round.signed_gather): it forges the scores before it signs them."""

    kind = "score_forger"

    def __init__(self, worker, seed, **params):
        super().__init__(worker, seed, **params)
        import torch
        import torch.distributed as dist

        from veriloco.membership import GroupComm

        self.mine: set[int] = set()
        me, all_reduce, all_gather = self, GroupComm.all_reduce, GroupComm.all_gather

        def forged(t):
            if t.dtype == torch.float64 and t.dim() == 1 and t.numel() == 4:  # the scores: one slot a worker
                for j in range(t.numel()):
                    if j != me.worker and j not in me.mine:
                        t[j] = 1e6
                me.mine = set()

        def forge_reduce(comm, t, op=dist.ReduceOp.SUM):
            if op == dist.ReduceOp.MAX:
                forged(t)
            return all_reduce(comm, t, op)

        def forge_gather(comm, out, t):
            forged(t)
            return all_gather(comm, out, t)

        GroupComm.all_reduce, GroupComm.all_gather = forge_reduce, forge_gather  # this worker's process only
        from veriloco import round

        signed_gather = getattr(round, "signed_gather", None)
        if signed_gather is not None:
            def forge_signed(w, part, r, purpose, t):
                if purpose == "replay scores":
                    forged(t)
                return signed_gather(w, part, r, purpose, t)

            round.signed_gather = forge_signed

    def audit_report(self, r, worker, score):
        self.mine.add(worker)
        return score


class InTransit(Adversary):
    """An honest worker whose incoming replay scores are rewritten on their way (what a member
    that relays them, running a modified gloo, can do: gloo's all-gather is a ring): in its
    process, the first other member's row it receives gets a failure, 1e6, in every slot, with the
    signature left as it came. Unsigned, it read the honest auditors' reports as failures.
    `what=figures`: the round's figures instead (round.finish_round's gather: 32 float64s), the
    first byte of another member's row flipped (unsigned: its train loss raised by 1)."""

    kind = "in_transit"
    PARAMS = {"what": one_of("scores", "figures")}

    def __init__(self, worker, seed, **params):
        super().__init__(worker, seed, **params)
        figures = self.params.get("what") == "figures"
        import struct

        import torch

        from veriloco.membership import GroupComm, PgComm

        all_gather, all_gather_start, pg_all_gather = GroupComm.all_gather, GroupComm.all_gather_start, PgComm.all_gather

        class Altered:  # the figures' gather in flight (round.Finishing): altered once it lands
            def __init__(self, work, comm, out, t):
                self.work, self.then = work, lambda: alter(comm, out, t)

            def is_completed(self):
                return self.work.is_completed()

            def wait(self):
                self.work.wait()
                self.then()

        def altered(comm, out, t):
            all_gather(comm, out, t)
            alter(comm, out, t)

        def altered_start(comm, out, t):
            return Altered(all_gather_start(comm, out, t), comm, out, t)

        def altered_pg(comm, out, t):  # an elastic quorum's group
            pg_all_gather(comm, out, t)
            alter(comm, out, t)

        def alter(comm, out, t):
            j, n = next(i for i in range(len(out)) if i != comm.rank), len(out)  # (every worker a member)
            if figures:
                if t.dtype == torch.uint8 and t.numel() == 32 * 8 + 64:
                    out[j][0] ^= 1
                elif t.dtype == torch.float64 and t.numel() == 32:  # the same, unsigned: its train loss + 1
                    out[j][0] += 1.0
            elif t.dtype == torch.uint8 and t.numel() == n * 8 + 64:  # n workers' float64 scores and a signature
                out[j][:n * 8] = torch.frombuffer(bytearray(struct.pack(f"<{n}d", *[1e6] * n)), dtype=torch.uint8)
            elif t.dtype == torch.float64 and t.numel() == n:  # the same, unsigned (before round.signed_gather)
                out[j][:] = 1e6

        GroupComm.all_gather, GroupComm.all_gather_start = altered, altered_start  # this worker's process only
        PgComm.all_gather = altered_pg


class StateLiar(Adversary):
    """Trains honestly; as an auditor it always says the start state it was sent in private did not
    hash to the trace (entry 0 at the latest), a report no one can pin on it the first time: it
    tries to make the workers it audits send their states to every member, round after round."""

    kind = "state_liar"

    def audit_report(self, r, worker, score):
        return 0.0


class ReplicaCrashes(Adversary):
    """Fault injection on a worker of `[topology] replicas` under elastic membership: its replica 1
    (a child of the worker's process, whose default group is the worker's replicas) raises at
    round `at` (default 1), once: the first to get there writes the file `once`."""

    kind = "replica_crashes"

    def batch(self, r, step, inputs, targets):
        import torch.distributed as dist

        if r == int(self.params.get("at", "1")) and dist.is_initialized() and dist.get_rank() == 1:
            from pathlib import Path

            once = Path(self.params["once"])
            if not once.exists():
                once.write_text("crashed")
                raise RuntimeError(f"replica 1 of worker {self.worker} crashes in round {r} (red_team.ReplicaCrashes)")
        return inputs, targets


class SlowSend(Adversary):
    """Honest, but its send work of round `round` (default 2) takes `seconds` more (default 1): a
    sleep where it hands its packet over, after the round's inner steps (test_engine's round_s
    test: under delay 1 that is the round's own time, not the round before it's)."""

    kind = "slow_send"

    def packet(self, r, packet, view):
        if r == int(self.params.get("round", "2")):
            import time

            time.sleep(float(self.params.get("seconds", "1")))
        return packet


class SlowRounds(Adversary):
    """Honest, but slow in every other round: sleeps `seconds` (default 1) in its first inner step
    of each round r with r % 2 == `parity` (default 0). Two of them with parities 0 and 1 make a
    straggler that changes every round (test_engine's deferred figures test)."""

    kind = "slow_rounds"

    def batch(self, r, step, inputs, targets):
        if step == 0 and r % 2 == int(self.params.get("parity", "0")):
            import time

            time.sleep(float(self.params.get("seconds", "1")))
        return inputs, targets


class WrongSalt(Adversary):
    """Honest but for the salt it reveals in round `round` (all ones, not the one its commitment
    hashed): what a worker that withholds its reveal to dodge the round's draw can do at best."""

    kind = "wrong_salt"
    PARAMS = {"round": real(lambda x: x >= 0 and x == int(x), "a round")}

    def reveal(self, r, salt):
        return b"\xff" * len(salt) if r == int(self.param("round", 0)) else salt


class _PatchingSkim(Skim):
    """`skim` whose process patches veriloco (`_patch`, the attack) once, at its first batch: the
    worker's own process, set up by then."""

    def batch(self, r, step, inputs, targets):
        if not type(self).__dict__.get("_patched", False):
            type(self)._patched = True
            self._patch()
        return super().batch(r, step, inputs, targets)

    def _patch(self):
        raise NotImplementedError


class GrindSkim(_PatchingSkim):
    """`skim` (trains on half of each batch: only a replay catches it) that also tries to grind the
    replay sample: its exchange receives every other bundle before it sends its own (nothing
    orders the exchange), then re-signs its commitment with its last loss nudged (no check reads
    it) until the base and every commitment's digest draw no replay of it. It signs one commitment
    a round, so it does not equivocate. Before the commit-reveal that was the round's whole seed
    and it was never sampled; now the seed also holds every worker's salt, which no one reveals
    before it holds every bundle, so its grinding predicts nothing (tests/test_commit_reveal.py;
    it signs its reveal for the commitment it sent). Params: p (the run's replay_probability),
    segments, workers."""

    kind = "grind_skim"
    PARAMS = None  # any: p, segments and workers, as floats and ints

    def _patch(self):
        import struct

        import torch
        import torch.distributed as dist

        from veriloco import exchange, round
        from veriloco.hashing import canonical_json
        from veriloco.verify import commitment
        from veriloco.verify.commitment import Commitment, parse_signed_commitment, sign_commitment
        from veriloco.verify.replay import plan_audits

        reveal_bytes = getattr(commitment, "REVEAL_BYTES", None)  # None: before the commit-reveal (bench/grind.py)
        sent = {}  # the digest of the commitment it sent this round

        me, p = self, float(self.params["p"])
        segments, workers = int(self.params["segments"]), int(self.params["workers"])
        keys, sign = {}, round.sign_commitment

        def keep_key(c, key):  # its own key, which signs its commitment anyway
            keys["mine"] = key
            return sign(c, key)

        def commitment_of(data: bytes) -> tuple[bytes, int]:
            (n,) = struct.unpack(">I", data[4:8])
            return bytes(data[8:8 + n]), n

        original = exchange.Exchange._transfer

        def transfer(ex, own, bufs):
            if own is not None and own.numel() == reveal_bytes:  # the reveal: the others' salts come only now
                salt = bytes(own[:32].numpy())  # signed again, for the commitment it sent (in place: its own copy too)
                own[:] = torch.frombuffer(bytearray(commitment.sign_reveal(keys["mine"], sent["digest"], salt)),
                                          dtype=torch.uint8)
                return original(ex, own, bufs)
            ops = [dist.P2POp(dist.irecv, buf, ex._ranks[r], group=ex.group) for r, buf in bufs.items()]
            for w in dist.batch_isend_irecv(ops) if ops else []:  # everyone's bundle first
                w.wait()
            others = [parse_signed_commitment(commitment_of(bytes(b.numpy()))[0]).digest for b in bufs.values()]
            raw, n = commitment_of(bytes(own.numpy()))
            d = parse_signed_commitment(raw).commitment.to_dict()
            for nonce in range(1, 100000):
                d2 = {**d, "losses": [*d["losses"][:-1], float(d["losses"][-1]) * (1 + nonce * 1e-12)]}
                new = canonical_json(sign_commitment(Commitment.from_dict(d2), keys["mine"]))
                if len(new) != n:
                    continue
                seed = d["base_hash"] + "".join(sorted([*others, parse_signed_commitment(new).digest]))
                if me.worker not in [a.worker for a in plan_audits(seed, list(range(workers)), list(range(workers)),
                                                                  segments, p)]:
                    own[8:8 + n] = torch.frombuffer(bytearray(new), dtype=torch.uint8)  # its own copy too
                    break
            sent["digest"] = parse_signed_commitment(commitment_of(bytes(own.numpy()))[0]).digest
            ops = [dist.P2POp(dist.isend, own, ex._ranks[r], group=ex.group) for r in range(ex.size) if r != ex.rank]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        round.sign_commitment, exchange.Exchange._transfer = keep_key, transfer  # this worker's process only


class AbortRegrind(_PatchingSkim):
    """`skim` that dodges the draw by failing a try of an elastic round (the review of the
    commit-reveal, thirty-ninth session): in the reveal it receives every other salt before it
    sends its own; when the draw would replay it, it sends nothing and gives the round up (no wrong
    salt, so no `unrevealed`); the retry brings the same honest salts (they are deterministic), so
    it then signs a new commitment with a salt of its choosing, tried until the draw leaves it
    out. Before elastic._pin it was never replayed in 8 rounds at p = 0.5; now its second
    commitment for the round is an equivocation. Params: p, segments."""

    kind = "abort_regrind"
    PARAMS = None

    def _patch(self):
        import hashlib
        import struct

        import torch

        from veriloco import exchange, round
        from veriloco.hashing import canonical_json, sha256_hex
        from veriloco.verify.commitment import (
            REVEAL_BYTES,
            SALT_BYTES,
            Commitment,
            parse_signed_commitment,
            sign_commitment,
            sign_reveal,
        )
        from veriloco.verify.replay import plan_audits

        me, p, segments, adv = self.worker, float(self.params["p"]), int(self.params["segments"]), self
        keys, sign = {}, round.sign_commitment
        state = {"known": {}, "cur": None}  # known[r]: the salts of round r it saw in a failed try

        def keep_key(c, key):
            keys["mine"] = key
            return sign(c, key)

        def commitment_of(data):
            (n,) = struct.unpack(">I", data[4:8])
            return bytes(data[8:8 + n]), n

        def post(ex, own, bufs, send=True, recv=True):
            peers = [q for q in range(ex.size) if q != ex.rank]
            works = [ex.comm.irecv(b, q) for q, b in bufs.items()] if recv else []
            works += [ex.comm.isend(own, q) for q in peers] if send else []
            for w in works:
                ex.comm.wait(w)

        def sampled(seed, workers):  # a draw it does not want
            return adv._unwanted(plan_audits(seed, workers, workers, segments, p, whole=adv.params.get("whole") == "1"))

        def transfer(ex, own, bufs):
            cur = state["cur"]
            if own is not None and own.numel() == REVEAL_BYTES and cur is not None:
                r = cur["round"]
                if cur["chosen"] is not None:  # signed for the commitment it sent (in place: its own copy too)
                    own[:] = torch.frombuffer(bytearray(sign_reveal(keys["mine"], cur["digest"], cur["chosen"])),
                                              dtype=torch.uint8)
                post(ex, own, bufs, send=False)  # everyone's salt first
                salts = {cur["workers"][q]: bytes(b[:SALT_BYTES].numpy()).hex() for q, b in bufs.items()}
                salts[me] = bytes(own[:SALT_BYTES].numpy()).hex()
                state["known"][r] = {w: x for w, x in salts.items() if w != me}
                seed = cur["base"] + "".join(sorted(cur["digests"])) + "".join(salts[w] for w in sorted(salts))
                if sampled(seed, sorted(salts)) and cur["chosen"] is None and adv._aborts:
                    raise RuntimeError(f"abort_regrind: round {r} would replay it; giving the round up")
                post(ex, own, {}, recv=False)
                return
            post(ex, None, bufs, send=False)  # everyone's bundle first
            workers, others = {ex.rank: me}, []
            for q, b in bufs.items():
                c = parse_signed_commitment(commitment_of(bytes(b.numpy()))[0])
                others.append(c.digest)
                workers[q] = c.commitment.worker
            raw, n = commitment_of(bytes(own.numpy()))
            d = parse_signed_commitment(raw).commitment.to_dict()
            r = d["round"]
            cur = {"round": r, "base": d["base_hash"], "workers": workers, "chosen": None,
                   "digest": parse_signed_commitment(raw).digest, "digests": [*others, parse_signed_commitment(raw).digest]}
            known = adv._salts_known(r) or state["known"].get(r)
            known = {w: x for w, x in (known or {}).items() if w in workers.values() and w != me}
            if known and len(known) == len(others):
                for nonce in range(100000):
                    salt = hashlib.sha256(b"grind %d %d" % (r, nonce)).digest()
                    new = canonical_json(sign_commitment(Commitment.from_dict({**d, "salt_hash": sha256_hex(salt)}),
                                                         keys["mine"]))
                    digest = parse_signed_commitment(new).digest
                    salts = {**known, me: salt.hex()}
                    seed = d["base_hash"] + "".join(sorted([*others, digest])) + "".join(salts[w] for w in sorted(salts))
                    if len(new) == n and not sampled(seed, sorted(salts)):
                        own[8:8 + n] = torch.frombuffer(bytearray(new), dtype=torch.uint8)
                        cur |= {"chosen": salt, "digest": digest, "digests": [*others, digest]}
                        break
            state["cur"] = cur
            post(ex, own, {}, recv=False)

        finish = round.start_finish

        def start_finish(w, sent, *a, **k):  # its own store and record name the bytes it really sent
            if sent.bundle is not None:
                sent.handle.wait()
                sent.bundle_hash = w.store.put(bytes(sent.bundle))
            return finish(w, sent, *a, **k)

        round.sign_commitment, exchange.Exchange._transfer, round.start_finish = keep_key, transfer, start_finish


    _aborts = True  # gives a try up when its draw would replay it

    def _unwanted(self, audits):
        """Whether a draw (plan_audits) is one it grinds away from: one that replays it."""
        return self.worker in [a.worker for a in audits]

    def _salts_known(self, r):
        """Round r's salts of the others known from elsewhere than its own failed try: none."""
        return None


class PassSalts(Adversary):
    """Trains honestly, but colludes with red_team.LateGrind (the third review of the junk-first
    fix, forty-first session): in the first try of round `at` of an elastic run it receives every
    other salt before it sends its own, writes them with its own to the file `salts` and gives
    the try up; it asks for the retry's quorum only once its colluder is ready (the file `ready`),
    so that the colluder is in it. `key`: what it writes as the coordinator's key of the round's
    first try (Membership.first_try) before that try forms ("_" for " "), so that its members learn
    from it whom the first try had; `leave=1`: its process ends once it has passed the salts on.
    Params: at, salts, ready, key, leave."""

    kind = "pass_salts"
    PARAMS = None

    def delta(self, r, delta, view):
        if not getattr(self, "_patched", False):
            self._patched = True
            self._patch()
        return delta

    def _patch(self):
        import json
        import os
        import struct
        import time
        from pathlib import Path

        from veriloco import exchange, membership
        from veriloco.verify.commitment import REVEAL_BYTES, SALT_BYTES, parse_signed_commitment

        at, salts, ready, me = int(self.params["at"]), Path(self.params["salts"]), Path(self.params["ready"]), self.worker
        key = self.params.get("key")  # written as the coordinator's first/AT before its first try, "_" for " "
        leave = self.params.get("leave") == "1"
        state = {"round": None, "workers": {}}
        transfer_, quorum_ = exchange.Exchange._transfer, membership.Membership.quorum

        def worker_of(b):
            (n,) = struct.unpack(">I", bytes(b[4:8].numpy()))
            return parse_signed_commitment(bytes(b[8:8 + n].numpy())).commitment

        def transfer(ex, own, bufs):
            if own is not None and own.numel() == REVEAL_BYTES:
                if state["round"] != at or salts.exists():
                    return transfer_(ex, own, bufs)
                for w in [ex.comm.irecv(b, q) for q, b in bufs.items()]:  # every other salt first
                    ex.comm.wait(w)
                out = {state["workers"][q]: bytes(b[:SALT_BYTES].numpy()).hex() for q, b in bufs.items()}
                out[me] = bytes(own[:SALT_BYTES].numpy()).hex()
                salts.with_name(salts.name + ".tmp").write_text(json.dumps(out))
                salts.with_name(salts.name + ".tmp").rename(salts)
                if leave:  # its process ends: the retry is its colluder's and the others'
                    os._exit(3)
                raise RuntimeError(f"pass_salts: round {at}'s salts passed on; giving the try up")
            transfer_(ex, own, bufs)
            state["round"] = worker_of(own).round
            state["workers"] = {q: worker_of(b).worker for q, b in bufs.items()}

        def quorum(members, round):
            if round == at and key is not None:
                members.store.compare_set(f"first/{at}", "", key.replace("_", " "))
            if round == at and salts.exists() and not ready.exists():  # the retry: once the colluder asks too
                deadline = time.monotonic() + 60
                while not ready.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(1.0)
            return quorum_(members, round)

        exchange.Exchange._transfer, membership.Membership.quorum = transfer, quorum  # this worker's process only


class LateGrind(AbortRegrind):
    """`abort_regrind`'s grind from a colluder's salts (red_team.PassSalts; the third review of the
    junk-first fix, forty-first session): it stays out of the first try of round `at` of an
    elastic run (it waits, heartbeating, until the colluder has written that try's salts to the
    file `salts`, so that the quorum forms without it), joins the retry, and signs its one
    commitment of the round with a salt ground against those salts until the draw leaves it out.
    It skims round `at` only. Until the forty-second session it went in unreplayed: bound by
    that commitment, no note held anything of it; now every member knows it for a newcomer to
    the round (round.keep_seen) and replays it itself. Params: at, salts, ready, p, segments."""

    kind = "late_grind"
    _aborts = False

    def _salts_known(self, r):
        import json
        from pathlib import Path

        path = Path(self.params["salts"])
        if r != int(self.params["at"]) or not path.exists():
            return None
        return {int(k): v for k, v in json.loads(path.read_text()).items()}

    def batch(self, r, step, inputs, targets):
        import time
        from pathlib import Path

        at, salts = int(self.params["at"]), Path(self.params["salts"])
        if r == at and step == 0:  # out of the first try: until its colluder has that try's salts
            deadline = time.monotonic() + 60
            while not salts.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        skimmed = super().batch(r, step, inputs, targets)
        return skimmed if r == at else (inputs, targets)

    def bundle(self, r, bundle, view):
        from pathlib import Path

        if r == int(self.params["at"]):
            Path(self.params["ready"]).write_text("1")
        return bundle


class SteerGrind(LateGrind):
    """LateGrind that trains honestly and grinds its commitment for a colluder of the first try
    (`target`, red_team.LateSkim) instead: until the retry's draw replays the colluder only to a
    segment before `cut`, where it has skimmed nothing yet (the review of the forty-second
    session: newcomer_audits replayed only what the draw without the newcomers sampled and the
    round's draw did not, so a worker both drew kept the auditor and segment the newcomer chose).
    Params: at, salts, ready, p, segments, target, cut."""

    kind = "steer_grind"

    def _unwanted(self, audits):
        drawn = [a for a in audits if a.worker == int(self.params["target"])]
        return not (drawn and drawn[0].segment < int(self.params["cut"]))

    def batch(self, r, step, inputs, targets):
        super().batch(r, step, inputs, targets)
        return inputs, targets


class LateSkim(Skim):
    """Honest but in round `at`, where it trains from inner step `cut` on only half of each batch
    (red_team.SteerGrind's colluder). Params: at, cut."""

    kind = "late_skim"
    PARAMS = None

    def batch(self, r, step, inputs, targets):
        if r == int(self.params["at"]) and step >= int(self.params["cut"]):
            return super().batch(r, step, inputs, targets)
        return inputs, targets


class SelfFramer(Adversary):
    """Trains honestly; sends its auditor the right start state in private, and none (zeros) when
    asked to send it to every member (the review of the forty-second session: the offline audit
    replayed from the private copy and failed a run that had convicted it rightly)."""

    kind = "self_framer"

    def state(self, r, segment, tensors):
        asked = self.__dict__.setdefault("asked", set())
        if (r, segment) in asked:
            return None
        asked.add((r, segment))
        return tensors


class WithholdSkim(_PatchingSkim):
    """`skim` that keeps its reveal whenever the draw would replay it (the third review of the
    commit-reveal, thirty-ninth session): in a static run's reveal it receives every other signed
    reveal first, computes the round's draw from the base, the digests and every salt, and when
    the draw would replay it sends its salt with a zeroed signature, no one's word. Rejected as
    `withheld` (no offence) it was never convicted, and 4 of its 6 skimmed updates went in at
    p = 0.5; now a sender without a signed reveal is replayed whole that round whatever the draw.
    Params: p, segments, workers."""

    kind = "withhold_skim"
    PARAMS = None

    def _patch(self):
        import struct

        import torch.distributed as dist

        from veriloco import exchange
        from veriloco.verify.commitment import REVEAL_BYTES, SALT_BYTES, parse_signed_commitment
        from veriloco.verify.replay import plan_audits

        me, p = self.worker, float(self.params["p"])
        segments, workers = int(self.params["segments"]), int(self.params["workers"])
        cur, original = {}, exchange.Exchange._transfer

        def commitment_of(data):
            (n,) = struct.unpack(">I", data[4:8])
            return bytes(data[8:8 + n])

        def transfer(ex, own, bufs):
            if own is None or own.numel() != REVEAL_BYTES:
                original(ex, own, bufs)
                digests = [parse_signed_commitment(commitment_of(bytes(b.numpy()))).digest for b in bufs.values()]
                mine = parse_signed_commitment(commitment_of(bytes(own.numpy())))
                cur.update(base=mine.commitment.base_hash, digests=[*digests, mine.digest])
                return
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, ex._ranks[q], group=ex.group)
                                             for q, b in bufs.items()]):
                w.wait()  # every other salt first
            salts = {q: bytes(b[:SALT_BYTES].numpy()).hex() for q, b in bufs.items()} | \
                {ex.rank: bytes(own[:SALT_BYTES].numpy()).hex()}
            seed = cur["base"] + "".join(sorted(cur["digests"])) + "".join(salts[q] for q in sorted(salts))
            if me in [a.worker for a in plan_audits(seed, list(range(workers)), list(range(workers)), segments, p)]:
                own[SALT_BYTES:] = 0  # in place: its own copy of its reveal too
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, own, ex._ranks[q], group=ex.group)
                                             for q in range(ex.size) if q != ex.rank]):
                w.wait()

        exchange.Exchange._transfer = transfer


def _die_once_after_exchange(once, carried):
    """Patch ExchangeHandle.wait in this process: once an exchange whose packets satisfy
    `carried(packets)` has returned (every member holds this worker's bundle and reveal), kill -9
    this process, the first time only (the file `once` marks that it did)."""
    from veriloco.exchange import ExchangeHandle

    original = ExchangeHandle.wait

    def wait(handle):
        import os
        import signal
        from pathlib import Path

        out = original(handle)
        if carried(out) and not Path(once).exists():
            Path(once).write_text("died")
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    ExchangeHandle.wait = wait


class DiesOnceSent(Jitter):
    """Fault injection that old and new code both take (bench/restart_redo.py; the fault
    `die:W@R.sent` is new): kill -9 of the worker once its round-`at` exchange returned (every
    member holds its bundle and reveal), the first time only (the file `once`), by a patch of
    ExchangeHandle.wait in its process. `jitter=1`: its delta does not reproduce either (Jitter).
    `recommit=RUN`: an attacker, not a fault: started again (a resumed static run, an elastic
    restart), it deletes its note of the bundle it sent (RUN/workers/W/sent-AT.json, which an
    honest redo sends again) and commits anew for round `at`, having seen every salt of the
    first try, as a grinder would (its last loss nudged: the draw is not what this tests)."""

    kind = "dies_once_sent"

    def _again(self, r):
        from pathlib import Path

        return r == int(self.params.get("at", "2")) and "recommit" in self.params and Path(self.params["once"]).exists()

    def inner_steps(self, r, steps):
        if self._again(r):
            from pathlib import Path

            (Path(self.params["recommit"]) / "workers" / str(self.worker) / f"sent-{r}.json").unlink(missing_ok=True)
        return steps

    def commitment(self, r, c):
        if self._again(r):
            return {**c, "losses": [*c["losses"][:-1], c["losses"][-1] + 1e-3]}
        return c

    def delta(self, r, delta, view):
        if not getattr(self, "_patched", False):
            self._patched = True
            _die_once_after_exchange(self.params["once"], lambda out: self._round == int(self.params.get("at", "2")))
        self._round = r
        return super().delta(r, delta, view) if self.params.get("jitter", "0") == "1" else delta


class JunkFirst(Skim):
    """`skim` (only a replay catches it) that sends junk as its first bundle of round `at` and so
    signs nothing, yet receives every salt, since the reveal waits for every bundle to arrive,
    not to verify (the second review of the seen notes, fortieth session). Once its exchange
    has returned it kills its own process (the static run stops; the file `once` marks that it
    did), and in the resume it deletes its notes of what it sent (RUN/workers/*/sent-AT.json
    that name its junk, under `recommit=RUN`: an honest redo would send the noted bundle again)
    and commits for the first time, free to choose its salt against the salts it saw (with a
    replay probability near 0 the draw passes it over anyway). Until the forty-first session
    nobody had a first commitment of it and it went in unreplayed; now every member that noted
    the junk (round.keep_seen) replays it itself, or rejects it (`withheld`) where the run does
    not replay."""

    kind = "junk_first"
    PARAMS = None  # at, once, recommit, skip

    def _first(self, r):
        from pathlib import Path

        return r == int(self.params.get("at", "2")) and not Path(self.params["once"]).exists()

    def inner_steps(self, r, steps):
        import json
        from pathlib import Path

        if r == int(self.params.get("at", "2")) and not self._first(r):
            junk = Path(self.params["once"] + ".junk").read_text().split()
            for note in (Path(self.params["recommit"]) / "workers").glob(f"*/sent-{r}.json"):
                if json.loads(note.read_text())["bundle"] in junk:
                    note.unlink()
        return steps

    def bundle(self, r, bundle, view):
        if not self._first(r):
            return bundle
        import hashlib

        junk = bytes(len(bundle))  # no bundle at all
        with open(self.params["once"] + ".junk", "a") as f:  # (each of its processes, where it has pipeline stages)
            f.write(hashlib.sha256(junk).hexdigest() + "\n")
        # every salt of the exchange that carried its junk in (with delay 1, not the round before's): die
        _die_once_after_exchange(self.params["once"], lambda out: any(p is junk for p in out))
        return junk


def _wait_for(path, timeout_s: float = 60.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.02)
    return path


def _write_atomically(path, data: bytes) -> None:
    path.with_name(path.name + ".tmp").write_bytes(data)
    path.with_name(path.name + ".tmp").rename(path)


def _slice_tag(delta: dict) -> str:
    """Which slice of the model a process's delta is (a pipeline stage's names, or all of them):
    the leak files of each stage process of red_team.Leaks are its own, read by the same stage of
    red_team.Twin (until the forty-fourth session both stages wrote one file, and a pipelined run crashed)."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(delta)).encode()).hexdigest()[:12]


class Leaks(Adversary):
    """Not an attacker: an honest worker whose round a colluder sees before it commits (as an
    elastic retry's newcomer sees the first try's packets): each round it writes its delta and
    packet to files under `dir` for red_team.Twin, a pair per pipeline stage. What it sends is its
    honest packet."""

    kind = "leaks"
    PARAMS = None  # dir

    def delta(self, r, delta, view):
        from pathlib import Path

        from safetensors.torch import save

        self._tag = _slice_tag(delta)
        _write_atomically(Path(self.params["dir"]) / f"delta-{r}-{self._tag}",
                          save({k: v.contiguous() for k, v in delta.items()}))
        return delta

    def packet(self, r, packet, view):
        from pathlib import Path

        _write_atomically(Path(self.params["dir"]) / f"packet-{r}-{self._tag}", bytes(packet))
        return packet


def _one_codec(commitment: dict) -> dict:
    """The commitment with its codec named as one spec for every tensor, where the packet has one:
    a form check_packet accepts (an honest worker sends the per-tensor map)."""
    specs = set(commitment["codec"].values()) if isinstance(commitment["codec"], dict) else {commitment["codec"]}
    return commitment | {"codec": specs.pop()} if len(specs) == 1 else commitment


class OneCodec(Adversary):
    """Trains honestly (a clean trace), sends its delta times `scale` (default 2.5: within the
    screen's norm band), and names its packet's codec as one spec. Until the forty-third session's
    review a replay read such a commitment as having no codecs to re-encode with, so an exact
    replay checked the trace alone, and the scaled delta went in. Params: scale."""

    kind = "one_codec"
    PARAMS = {"scale": real(lambda x: x > 0, "a number > 0")}

    def delta(self, r, delta, view):
        return {k: v * self.param("scale", 2.5) for k, v in delta.items()}

    def commitment(self, r, commitment):
        return _one_codec(commitment)


class Twin(Adversary):
    """Trains honestly, then sends as its own, from round `at` on, the update of red_team.Leaks (its
    files under `dir`): its packet byte for byte (`noise` 0 and `scale` 1, the defaults), or its
    delta plus `noise` times each tensor's mean magnitude of Gaussian noise, times `scale`: a near
    copy (a scaled one is a norm outlier too). `one_codec=1`: its commitment names its codec as
    one spec (red_team.OneCodec). The screen flags both ends and cannot tell which is the
    original; until the forty-third session both were rejected, so a sender that saw an honest
    member's packet before it committed could censor it. Params: dir, at, noise, scale, one_codec."""

    kind = "twin"
    PARAMS = None

    def _copies(self, r):
        return r >= int(self.params.get("at", "1"))

    def _exact(self):
        return float(self.params.get("noise", "0")) == 0 and float(self.params.get("scale", "1")) == 1

    def delta(self, r, delta, view):
        from pathlib import Path

        import torch
        from safetensors.torch import load

        self._tag = _slice_tag(delta)
        if not self._copies(r) or self._exact():
            return delta
        noise, scale = float(self.params.get("noise", "0")), float(self.params.get("scale", "1"))
        src = load(_wait_for(Path(self.params["dir"]) / f"delta-{r}-{self._tag}").read_bytes())
        gen = self.rng(r, 3)
        return {k: scale * (src[k] + noise * src[k].abs().mean() * torch.randn(src[k].shape, generator=gen))
                for k in sorted(src)}

    def packet(self, r, packet, view):
        from pathlib import Path

        if not self._copies(r) or not self._exact():
            return packet
        return _wait_for(Path(self.params["dir"]) / f"packet-{r}-{self._tag}").read_bytes()

    def commitment(self, r, commitment):
        return _one_codec(commitment) if self._copies(r) and self.params.get("one_codec") == "1" else commitment


class ForeignCodec(Adversary):
    """Trains honestly and sends its delta under a codec the run does not use (`spec`, a name with
    its defaults: lowrank, PowerSGD at rank 4, which a replay cannot re-encode), committed as such. Such an end of a copy could not be replayed, so it would be refused without a
    conviction while the original was replayed every round (the forty-third session's review);
    now the check refuses the codec itself. Params: spec."""

    kind = "foreign_codec"
    PARAMS = None

    def delta(self, r, delta, view):
        self._delta = delta
        return delta

    def packet(self, r, packet, view):
        from veriloco.compress import codec_from_spec
        from veriloco.packet import encode_packet

        spec = self.params.get("spec", "lowrank")
        return encode_packet(self._delta, {k: codec_from_spec(spec) for k in self._delta})


class LowRankCover(Adversary):
    """Trains honestly (a clean trace) and sends its delta times `scale` (default 2.5: within the
    screen's norm band) in an adaptive run, every tensor under a rung of the run's ladder:
    `lowrank:rank=16` for the first matrix alone (`all=0`, the default: the rest as fp32) or for
    every tensor (`all=1`). Until the forty-fourth session one tensor under PowerSGD, whose warm
    start a replay cannot know, turned the exact replay's packet check off for the whole packet;
    and a low-rank tensor was never checked. Params: scale, all."""

    kind = "lowrank_cover"
    PARAMS = {"scale": real(lambda x: x > 0, "a number > 0"), "all": one_of("0", "1")}

    def delta(self, r, delta, view):
        self._delta = {k: v * self.param("scale", 2.5) for k, v in delta.items()}
        return self._delta

    def packet(self, r, packet, view):
        from veriloco.compress import codec_from_spec
        from veriloco.packet import encode_packet

        every = self.params.get("all", "0") == "1"
        first = next(k for k, v in self._delta.items() if v.ndim >= 2)
        specs = {k: "lowrank:rank=16" if every or k == first else "fp32" for k in self._delta}
        return encode_packet(self._delta, {k: codec_from_spec(s) for k, s in specs.items()})
