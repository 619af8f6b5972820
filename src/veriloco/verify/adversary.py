"""Adversaries: workers that attack, for tests, benchmarks and red teams.

An adversary is a plain class with hooks at the points where a worker could cheat; the default
of every hook is honest. `round.py` calls the hooks of the worker's adversary (if any):

    batch(r, step, inputs, targets) -> (inputs, targets)   the data it trains on
    inner_steps(r, steps) -> int                             how many inner steps it really does
    delta(r, delta, view) -> delta                           the update it encodes
    packet(r, packet, view) -> bytes                         the packet it commits to and sends
    commitment(r, commitment) -> commitment                  the commitment it signs (dict)
    bundle(r, bundle, view) -> bytes                         the bytes it puts on the wire
    reveal(r, salt) -> bytes                                 the salt it reveals once every bundle is in
    state(r, segment, tensors) -> tensors | None            the segment start state it sends its auditor
    audit_report(r, worker, score) -> score                  what it reports as another's auditor
    loss_gain_report(r, worker, gain) -> gain | None         what it reports as another's loss-gain checker

`view` (a `View`) holds what any worker legitimately knows at that point: the previous round's
accepted deltas of everyone, its own previous packet and delta, the global params.

Each built-in attacker does its best to pass the checks (a strawman would prove nothing):
lazy rescales its delta to the norm of an honest one, copy adds small noise, noise matches the
honest norm, ALIE and IPM follow their papers. Users load their own with
`--adversary.W=package.module:Class` (optionally `:key=value,...` parameters), so researchers can
red-team the checks with attacks nobody here thought of. A class that sets `PARAMS` (every
built-in does) has its parameters checked when the config is read: an unknown key or a bad value
is one line, exit 2, not an attack silently run with its defaults (a typo in `lazy:skp=0.25`).

References: ALIE, Baruch et al. 2019 ("A Little Is Enough", arXiv 1902.06156); IPM, Xie et al.
2019 ("Fall of Empires", arXiv 1903.03936); Proof-of-Learning spoofing, Fang et al. 2023.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .screen import LossGain

Delta = dict[str, torch.Tensor]


@dataclass
class View:
    """What a worker knows when it builds its update."""

    world: int
    previous_deltas: dict[int, Delta] = field(default_factory=dict)  # last round's accepted
    own_previous_packet: bytes | None = None
    own_previous_delta: Delta | None = None


def real(ok: Callable[[float], bool] = lambda x: True, what: str = "a number") -> Callable[[str], float]:
    """A parameter's check for `PARAMS`: a finite number for which `ok` holds (`what` says which)."""
    def check(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise ValueError(f"must be {what}, got {text!r}") from None
        if not (math.isfinite(x) and ok(x)):
            raise ValueError(f"must be {what}, got {x}")
        return x

    return check


def one_of(*choices: str) -> Callable[[str], str]:
    """A parameter's check for `PARAMS`: one of `choices`."""
    def check(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return check


FRACTION = real(lambda x: 0 <= x < 1, "in [0, 1)")


def _norm(d: Delta) -> float:
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in d.values())))


def _scaled_to(d: Delta, norm: float) -> Delta:
    n = _norm(d)
    return {k: v * (norm / n) for k, v in d.items()} if n > 0 else d


def _honest_norm(view: View, fallback: Delta) -> float:
    """The median norm of last round's accepted deltas (what an honest update looks like)."""
    norms = sorted(_norm(d) for d in view.previous_deltas.values())
    return norms[len(norms) // 2] if norms else _norm(fallback)


class Adversary:
    """Honest by default; subclasses override the hooks they attack through."""

    kind = "honest"
    # the parameters it takes, each with its check (`real`, `one_of`), or None: any, unchecked
    PARAMS: dict[str, Callable[[str], object]] | None = None

    def __init__(self, worker: int, seed: int, **params: str) -> None:
        known = type(self).PARAMS
        for key, value in params.items() if known is not None else ():
            if key not in known:
                owner = next(c for c in type(self).__mro__ if "PARAMS" in vars(c))
                hint = "" if owner is type(self) or type(self).__module__ == __name__ else (
                    f" ({type(self).__name__} inherits {owner.__name__}'s PARAMS: a subclass that takes more declares "
                    f"its own, e.g. PARAMS = {{**{owner.__name__}.PARAMS, {key!r}: real()}}, or None for any)")
                raise ValueError(f"{self.kind}: unknown parameter {key!r}; it takes "
                                 f"{', '.join(sorted(known)) or 'none'}{hint}")
            try:
                known[key](value)
            except ValueError as e:
                raise ValueError(f"{self.kind}: {key} {e}") from None
        self.worker, self.params, self.seed = worker, params, seed
        self.gen = torch.Generator().manual_seed(seed * 1009 + worker)  # one stream for the process's life

    def rng(self, r: int, use: int = 0) -> torch.Generator:
        """A generator for round r's draws (`use` tells a round's separate draws apart), so an
        attacker draws the same bits in round r whether or not its run was stopped and resumed."""
        return torch.Generator().manual_seed(((self.seed * 1009 + self.worker) * 100_003 + r) * 16 + use)

    def param(self, key: str, default: float) -> float:
        return float(self.params.get(key, default))

    def batch(self, r: int, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs, targets

    def inner_steps(self, r: int, steps: int) -> int:
        return steps

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        return delta

    def packet(self, r: int, packet: bytes, view: View) -> bytes:
        return packet

    def commitment(self, r: int, commitment: dict) -> dict:
        return commitment

    def bundle(self, r: int, bundle: bytes, view: View) -> bytes:
        return bundle

    def second_commitment(self, r: int, commitment: dict) -> dict | None:
        """A second commitment to sign for the same round (equivocation); None when honest."""
        return None

    def reveal(self, r: int, salt: bytes) -> bytes:
        """The salt it reveals for round r once it holds every bundle (`salt`: the one its
        commitment's `salt_hash` committed to; commitment.round_salt). The wire takes exactly
        SALT_BYTES: longer is cut, shorter padded with zeros."""
        return salt

    def state(self, r: int, segment: int, tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The start state of segment `segment` of round r it sends the auditor drawn to replay
        that segment (`[verify] replay_extent = "state"`; `tensors`: the state it really had
        there, None when it never reached it); None sends zeros."""
        return tensors

    def audit_report(self, r: int, worker: int, score: float) -> float:
        """The replay score it reports for `worker`, whose round it was drawn to audit (`score`:
        what its replay really gave; verify/replay.py: replay_score)."""
        return score

    def loss_gain_report(self, r: int, worker: int, gain: LossGain) -> LossGain | None:
        """The loss gain it reports for `worker`'s delta, which it was drawn to check (`gain`: what
        it really computed; verify/lossgain.py); None reports nothing."""
        return gain


class _SkipsWork(Adversary):
    """Base of the attackers that skip work: pads its trace with made-up state hashes (and its
    losses with plausible numbers) so the commitment has the shape of an honest one."""

    PARAMS = {}

    def commitment(self, r: int, commitment: dict) -> dict:
        c = dict(commitment)
        want = int(self.params.get("_trace_entries", 0))
        trace, losses = list(c["trace"]), list(c["losses"])
        gen = self.rng(r, 0)
        while want and len(trace) < want:
            trace.append(bytes(torch.randint(0, 256, (32,), generator=gen, dtype=torch.uint8).tolist()).hex())
            losses.append(losses[-1] * 0.98 if losses else 2.0)
        from .check import hex_root

        c["trace"], c["losses"], c["trace_root"] = trace, losses[: max(len(trace) - 1, 1)], hex_root(trace)
        return c


class Noop(_SkipsWork):
    """Does no work and sends the zero update."""

    kind = "noop"

    def inner_steps(self, r: int, steps: int) -> int:
        return 0


class Noise(_SkipsWork):
    """Sends Gaussian noise scaled to an honest norm (no training)."""

    kind = "noise"

    def inner_steps(self, r: int, steps: int) -> int:
        return 0

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        gen = self.rng(r, 1)
        noise = {k: torch.randn(delta[k].shape, generator=gen) for k in sorted(delta)}
        return _scaled_to(noise, _honest_norm(view, {k: torch.ones_like(v) * 1e-3 for k, v in delta.items()}))


class Scaled(Adversary):
    """Trains honestly, then multiplies its delta by `factor` (default 10) to dominate the mean."""

    kind = "scaled"
    PARAMS = {"factor": real()}

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        f = self.param("factor", 10.0)
        return {k: v * f for k, v in delta.items()}


class SignFlip(Adversary):
    """Trains honestly and sends the negated delta (pushes the model uphill)."""

    kind = "sign_flip"
    PARAMS = {}

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        return {k: -v for k, v in delta.items()}


class Stale(_SkipsWork):
    """Skips training and resubmits last round's average update as if it were fresh work."""

    kind = "stale"

    def inner_steps(self, r: int, steps: int) -> int:
        return 0 if r > 0 else steps

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        if r == 0 or not view.previous_deltas:
            return delta
        ds = list(view.previous_deltas.values())
        return {k: sum(d[k] for d in ds) / len(ds) for k in delta}


class Replay(_SkipsWork):
    """Resends its previous round's packet unchanged (no training)."""

    kind = "replay"

    def inner_steps(self, r: int, steps: int) -> int:
        return 0 if r > 0 else steps

    def packet(self, r: int, packet: bytes, view: View) -> bytes:
        return view.own_previous_packet if view.own_previous_packet is not None else packet


class Copy(_SkipsWork):
    """Copies another worker's latest accepted delta, plus small noise to dodge exact matching."""

    kind = "copy"
    PARAMS = {"noise": real(lambda x: x >= 0, "a number >= 0")}

    def inner_steps(self, r: int, steps: int) -> int:
        return 0 if r > 0 else steps

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        others = {w: d for w, d in view.previous_deltas.items() if w != self.worker}
        if not others:
            return delta
        src = others[min(others)]
        eps = self.param("noise", 0.01)
        gen = self.rng(r, 2)  # drawn in name order: a delta decoded from the store lists its tensors in another
        return {k: src[k] + eps * src[k].abs().mean() * torch.randn(src[k].shape, generator=gen) for k in sorted(src)}


class Lazy(_SkipsWork):
    """Does the first (1 - skip) of its inner steps honestly, skips the rest (default skip 0.5),
    fakes the trace of what it skipped, and disguises its short delta (`scale`):
    "previous" (the default) rescales it to the median norm of last round's accepted deltas, an
    honest norm; "steps" to its own norm / (1 - skip), what the skipped steps would have added at
    the same pace; "none" sends it as it is. Only a replay of a skipped segment can tell for
    sure; the loss-gain screen sees it when the drawn batch was one it skipped."""

    kind = "lazy"
    SCALES = ("previous", "steps", "none")
    PARAMS = {"skip": FRACTION, "scale": one_of(*SCALES)}

    def inner_steps(self, r: int, steps: int) -> int:
        return max(1, round(steps * (1 - self.param("skip", 0.5))))

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        scale, skip = self.params.get("scale", "previous"), self.param("skip", 0.5)
        if scale == "none":
            return delta
        if scale == "previous" and view.previous_deltas:
            return _scaled_to(delta, _honest_norm(view, delta))
        return _scaled_to(delta, _norm(delta) / (1 - skip))


class Skim(Adversary):
    """Lazy without skipping a step: trains every inner step on only the first (1 - skip) of its
    batch's sequences (default skip 0.5), so it saves that share of the compute, while its delta
    is trained on part of every batch it was assigned: the loss-gain screen sees a delta that
    helps its own batches, and its norm and direction look honest. Its trace hashes the states
    it really reached; only a replay, on the whole batches, tells them apart."""

    kind = "skim"
    PARAMS = {"skip": FRACTION}

    def batch(self, r: int, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = max(1, round(inputs.shape[0] * (1 - self.param("skip", 0.5))))
        return inputs[:keep], targets[:keep]


class WrongData(Adversary):
    """Trains on other data than assigned (its sequences reversed: the same bytes, another
    distribution, so norms and losses look ordinary) but commits the root of its assigned
    batches, as if it had trained on them."""

    kind = "wrong_data"
    PARAMS = {}

    def batch(self, r: int, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.cat([inputs, targets[:, -1:]], dim=1).flip(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class Alie(Adversary):
    """A Little Is Enough: mean - z * std of the honest deltas (estimated from last round)."""

    kind = "alie"
    PARAMS = {"z": real()}

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        ds = list(view.previous_deltas.values())
        if len(ds) < 2:
            return delta
        z = self.param("z", 1.0)
        out = {}
        for k in delta:
            stack = torch.stack([d[k] for d in ds])
            out[k] = stack.mean(0) - z * stack.std(0)
        return out


class Ipm(Adversary):
    """Inner Product Manipulation: -epsilon times the mean of the honest deltas."""

    kind = "ipm"
    PARAMS = {"epsilon": real()}

    def delta(self, r: int, delta: Delta, view: View) -> Delta:
        ds = list(view.previous_deltas.values()) or [delta]
        eps = self.param("epsilon", 0.5)
        return {k: -eps * sum(d[k] for d in ds) / len(ds) for k in delta}


class Malformed(Adversary):
    """Sends bytes that are not a valid bundle (truncated and corrupted)."""

    kind = "malformed"
    PARAMS = {}

    def bundle(self, r: int, bundle: bytes, view: View) -> bytes:
        b = bytearray(bundle[: max(len(bundle) // 2, 9)])
        b[8] ^= 0xFF
        return bytes(b)


class ForgedSignature(Adversary):
    """Sends a signature its key did not produce (what a forger without the key can do: here
    its own signature with one bit flipped, on an otherwise honest commitment and packet)."""

    kind = "forged_signature"
    PARAMS = {}

    def bundle(self, r: int, bundle: bytes, view: View) -> bytes:
        from ..packet import decode_bundle, encode_bundle

        commitment, packet, _ = decode_bundle(bundle)
        signed = json.loads(commitment)
        sig = bytearray(bytes.fromhex(signed["signature"]))
        sig[0] ^= 0x01  # a signature nobody's key produced
        signed["signature"] = sig.hex()
        from ..hashing import canonical_json

        return encode_bundle(canonical_json(signed), packet)


class Equivocate(Adversary):
    """Signs two different commitments for the same round (a second one claiming other losses)
    and lets both circulate: the second rides in its bundle's extras slot, as gossip would."""

    kind = "equivocate"
    PARAMS = {}

    def second_commitment(self, r: int, commitment: dict) -> dict | None:
        c = dict(commitment)
        c["losses"] = [x * 0.9 for x in c["losses"]]
        return c


class FalseAccuser(Adversary):
    """Trains honestly, but as an auditor reports every replay it is given as failed, to get
    honest workers rejected (and banned): exact mode, a mismatch at the first trace entry;
    distance mode, a distance of 1 (the whole delta). As a loss-gain checker it reports every
    delta it checks as raising the loss by a nat."""

    kind = "false_accuser"
    PARAMS = {}

    def audit_report(self, r: int, worker: int, score: float) -> float:
        return 0.0 if score < 0 else 1.0

    def loss_gain_report(self, r: int, worker: int, gain: LossGain) -> LossGain | None:
        worse = gain.own_before + 1.0  # the delta "raised" the loss by a nat
        return LossGain.on_own_batches(gain.own_before, worse)


BUILTIN: dict[str, type[Adversary]] = {
    cls.kind: cls
    for cls in (Noop, Noise, Scaled, SignFlip, Stale, Replay, Copy, Lazy, Skim, WrongData, Alie, Ipm,
                Malformed, ForgedSignature, Equivocate, FalseAccuser)
}


def load_adversary(spec: str, worker: int, seed: int) -> Adversary:
    """`kind`, `kind:key=value,...`, or `package.module:Class[:key=value,...]`."""
    parts = spec.split(":")
    if parts[0] in BUILTIN:
        cls, rest = BUILTIN[parts[0]], parts[1:]
    elif len(parts) >= 2:
        try:
            cls = getattr(importlib.import_module(parts[0]), parts[1])
        except (ImportError, AttributeError) as e:
            raise ValueError(f"adversary {spec!r}: cannot load {parts[0]}:{parts[1]} ({e})") from None
        if not (isinstance(cls, type) and issubclass(cls, Adversary)):
            raise ValueError(f"adversary {spec!r}: {parts[1]} is not a veriloco.verify.adversary.Adversary subclass")
        rest = parts[2:]
    else:
        raise ValueError(f"unknown adversary {spec!r}; built-in kinds: {', '.join(sorted(BUILTIN))}, or package.module:Class")
    params: dict[str, str] = {}
    for item in ",".join(rest).split(",") if rest else []:
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise ValueError(f"adversary {spec!r}: parameters look like key=value")
        params[k] = v
    return cls(worker, seed, **params)
