"""Signed commitments: round trip, tampering, strict parsing of hostile bytes, equivocation."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veriloco.compress import IdentityCodec
from veriloco.hashing import canonical_json, sha256_hex
from veriloco.packet import encode_packet
from veriloco.verify import (
    BAD_SIGNATURE,
    EQUIVOCATION,
    KEY_MISMATCH,
    LATE,
    MALFORMED,
    STALE_BASE,
    UNKNOWN_WORKER,
)
from veriloco.verify.commitment import (
    MAX_TRACE,
    Commitment,
    CommitmentError,
    EquivocationDetector,
    SignedCommitment,
    check_commitment,
    check_packet,
    check_signature,
    commitment_bytes,
    parse_signed_commitment,
    sign_commitment,
    verify_equivocation_evidence,
)
from veriloco.verify.identity import derive_worker_key, public_key_hex

RUN = sha256_hex(b"run manifest")
BASE = sha256_hex(b"G_r")
KEYS = {w: derive_worker_key(1234, w) for w in range(3)}
ADMITTED = {w: public_key_hex(k) for w, k in KEYS.items()}


def make(worker: int = 0, **overrides) -> Commitment:
    fields = dict(
        run_id=RUN,
        round=3,
        worker=worker,
        base_hash=BASE,
        batch_root=sha256_hex(b"batches %d" % worker),
        trace_root=sha256_hex(b"trace root %d" % worker),
        trace=[sha256_hex(b"state %d %d" % (worker, i)) for i in range(3)],
        losses=[2.5, 2.25, 2.125],
        packet_hash=sha256_hex(b"packet %d" % worker),
        packet_bytes=1234,
        codec="fp32",
        salt_hash=sha256_hex(b"salt %d" % worker),
    )
    fields.update(overrides)
    return Commitment(**fields)


def wire(worker: int = 0, **overrides) -> bytes:
    return canonical_json(sign_commitment(make(worker, **overrides), KEYS[worker]))


def test_round_trip_and_signature():
    data = wire(1, codec={"w": "fp32", "b": "int8:block=64"})
    signed = parse_signed_commitment(data)
    assert signed.to_bytes() == data
    assert signed.commitment == make(1, codec={"w": "fp32", "b": "int8:block=64"})
    assert signed.digest == sha256_hex(commitment_bytes(signed.commitment))
    assert check_signature(signed, ADMITTED) is None
    assert check_signature(json.loads(data), ADMITTED) is None  # a dict works too
    assert signed.commitment.codec_for("b") == "int8:block=64"


def test_tampered_commitment_fails_signature():
    good = json.loads(wire(0))
    for field, value in [
        ("losses", [2.5, 2.25, 2.0]),
        ("packet_hash", sha256_hex(b"another packet")),
        ("round", 4),
        ("packet_bytes", 1235),
        ("codec", "int8"),
    ]:
        bad = json.loads(json.dumps(good))
        bad["commitment"][field] = value
        signed = parse_signed_commitment(canonical_json(bad))  # still well-formed ...
        assert check_signature(signed, ADMITTED) == BAD_SIGNATURE, field  # ... but not signed


def test_signature_reason_codes():
    signed = parse_signed_commitment(wire(2))
    assert check_signature(signed, {0: ADMITTED[0], 1: ADMITTED[1]}) == UNKNOWN_WORKER
    # worker 2's commitment signed with worker 1's key, embedding worker 1's key
    forged = sign_commitment(make(2), KEYS[1])
    assert check_signature(forged, ADMITTED) == KEY_MISMATCH
    # right key embedded, wrong signer
    forged["public_key"] = ADMITTED[2]
    assert check_signature(forged, ADMITTED) == BAD_SIGNATURE
    assert check_signature(signed, {**ADMITTED, 2: ADMITTED[2].upper()}) is None


def test_check_commitment_context():
    signed = parse_signed_commitment(wire(0))
    ctx = dict(run_id=RUN, round=3, base_hash=BASE)
    assert check_commitment(signed, ADMITTED, **ctx) is None
    assert check_commitment(signed, ADMITTED, **{**ctx, "round": 4}) == LATE
    assert check_commitment(signed, ADMITTED, **{**ctx, "round": 2}) == MALFORMED
    assert check_commitment(signed, ADMITTED, **{**ctx, "run_id": BASE}) == MALFORMED
    assert check_commitment(signed, ADMITTED, **{**ctx, "base_hash": RUN}) == STALE_BASE
    assert check_commitment(signed, {}, **ctx) == UNKNOWN_WORKER


def test_check_packet():
    delta = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    packet = encode_packet(delta, {"w": IdentityCodec(), "b": IdentityCodec()})
    c = make(0, packet_hash=sha256_hex(packet), packet_bytes=len(packet), codec="fp32")
    signed = sign_commitment(c, KEYS[0])
    assert check_packet(signed, packet) is None
    per_param = sign_commitment(
        make(
            0,
            packet_hash=sha256_hex(packet),
            packet_bytes=len(packet),
            codec={"w": "fp32", "b": "fp32"},
        ),
        KEYS[0],
    )
    assert check_packet(per_param, packet) is None
    assert check_packet(signed, packet + b"\x00") == MALFORMED
    assert check_packet(signed, packet[:-1] + bytes([packet[-1] ^ 1])) == MALFORMED
    wrong_codec = sign_commitment(
        make(0, packet_hash=sha256_hex(packet), packet_bytes=len(packet), codec="int8"), KEYS[0]
    )
    assert check_packet(wrong_codec, packet) == MALFORMED


def _set(data: bytes, field: str, value) -> bytes:
    obj = json.loads(data)
    obj["commitment"][field] = value
    return canonical_json(obj)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.replace(b'"round":3', b'"round":true'), "must be an int"),
        (lambda s: s.replace(b'"round":3', b'"round":3.0'), "must be an int"),
        (lambda s: s.replace(b'"round":3', b'"round":-1'), "outside"),
        (lambda s: s.replace(b'"losses":[2.5', b'"losses":[NaN'), "NaN"),
        (lambda s: s.replace(b'"losses":[2.5', b'"losses":[Infinity'), "Infinity"),
        (lambda s: s.replace(b'"losses":[2.5', b'"losses":[1e400'), "not finite"),
        (lambda s: s.replace(b'"losses":[2.5', b'"losses":["2.5"'), "must be a float"),
        (lambda s: s.replace(b'"losses":[2.5', b'"losses":[2'), "canonical"),
        (lambda s: s.replace(b'"round":3', b'"round":3,"round":3'), "duplicate key"),
        (lambda s: s.replace(b'"round":3', b'"round": 3'), "canonical"),
        (lambda s: s.replace(b'"round":3', b'"round":3,"extra":1'), "unexpected"),
        (lambda s: s.replace(b'"round":3,', b""), "missing"),
        (lambda s: s.replace(b'"codec":"fp32"', b'"codec":"fp 32"'), "printable"),
        (lambda s: s.replace(b'"codec":"fp32"', b'"codec":{}'), "entries"),
        (lambda s: s.replace(b'"codec":"fp32"', b'"codec":7'), "spec string or a map"),
        (lambda s: _set(s, "trace", sha256_hex(b"x")), "JSON arrays"),
        (lambda s: _set(s, "trace", [1]), "lowercase hex"),
        (lambda s: _set(s, "codec", {"w": "fp32", "b": 3}), "not a spec string"),
        (lambda s: _set(s, "worker", 2**31), "outside"),
        (lambda s: _set(s, "packet_bytes", 2**41), "outside"),
        (lambda s: s.replace(RUN.encode(), RUN.upper().encode()), "lowercase hex"),
        (lambda s: s.replace(BASE.encode(), BASE[:-2].encode()), "lowercase hex"),
        (lambda s: "\ufeff".encode() + s, "not JSON"),
        (lambda s: s.decode().encode("utf-16"), "not UTF-8"),
        (lambda s: b"\xff" + s, "not UTF-8"),
        (lambda s: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (lambda s: b"9" * 5000, "not JSON"),
        (lambda s: b"[]", "must be a JSON object"),
        (lambda s: s + b" ", "canonical"),
    ],
)
def test_parse_rejects(mutate, match):
    data = mutate(wire(0))
    with pytest.raises(CommitmentError, match=match) as info:
        parse_signed_commitment(data, max_bytes=1 << 20)
    assert "\n" not in str(info.value)


def test_parse_size_limit_comes_first():
    data = wire(0)
    with pytest.raises(CommitmentError, match=f"{len(data)} bytes, over the limit 100"):
        parse_signed_commitment(data, max_bytes=100)
    with pytest.raises(CommitmentError, match="over the limit"):
        parse_signed_commitment(b"\xff" * 200, max_bytes=100)  # not even decoded
    with pytest.raises(CommitmentError, match="must be bytes"):
        parse_signed_commitment("text")


def test_list_limits():
    big = [sha256_hex(b"%d" % i) for i in range(MAX_TRACE + 1)]
    with pytest.raises(CommitmentError, match="at most"):
        make(0, trace=big)
    ok = make(0, trace=big[:MAX_TRACE])
    data = canonical_json(sign_commitment(ok, KEYS[0]))
    assert parse_signed_commitment(data, max_bytes=len(data)).commitment.trace == tuple(big[:-1])
    with pytest.raises(CommitmentError, match="at most"):
        make(0, losses=[1.0] * (MAX_TRACE + 1))


# ---- fuzz: every input is either a valid canonical commitment or a CommitmentError ----

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=70),
    st.sampled_from([RUN, "fp32", "00" * 64, 3, 3.0, -0.0]),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = [*make().to_dict(), "commitment", "signature", "public_key", "extra"]


@st.composite
def mutated_signed(draw):
    """A valid signed commitment with one structural change, encoded one of several ways."""
    obj = json.loads(wire(draw(st.integers(0, 2))))
    target = obj["commitment"] if draw(st.booleans()) else obj
    key = draw(st.sampled_from(FIELD_NAMES))
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete":
        target.pop(key, None)
    else:
        target[key] = draw(json_value)
    encoding = draw(st.sampled_from(["canonical", "pretty", "ascii"]))
    if encoding == "canonical":
        try:
            return canonical_json(obj)
        except (ValueError, UnicodeEncodeError):  # lone surrogates from st.text
            return json.dumps(obj).encode()
    if encoding == "pretty":
        return json.dumps(obj, indent=1).encode()
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@st.composite
def byte_mutated(draw):
    data = bytearray(wire(draw(st.integers(0, 2))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "delete", "insert"]))
        if op == "flip":
            data[i] ^= draw(st.integers(1, 255))
        elif op == "delete":
            del data[i]
        else:
            data.insert(i, draw(st.integers(0, 255)))
    return bytes(data)


hostile = st.one_of(
    st.binary(max_size=300),
    json_value.map(lambda v: json.dumps(v).encode()),
    mutated_signed(),
    byte_mutated(),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile)
def test_fuzz_parse_signed_commitment(data):
    try:
        signed = parse_signed_commitment(data, max_bytes=4096)
    except CommitmentError as e:
        assert "\n" not in str(e)
        return
    # whatever got through is a well-formed, canonical commitment
    assert isinstance(signed, SignedCommitment)
    assert signed.to_bytes() == data


# ---- equivocation ----


def test_equivocation_detected_with_evidence():
    det = EquivocationDetector(ADMITTED)
    a = sign_commitment(make(1), KEYS[1])
    b = sign_commitment(make(1, packet_hash=sha256_hex(b"a different packet")), KEYS[1])
    assert det.observe(a) is None
    assert det.observe(a) is None  # a re-send is not equivocation
    assert det.observe(sign_commitment(make(0), KEYS[0])) is None
    evidence = det.observe(b)
    assert evidence is not None and evidence["reason"] == EQUIVOCATION
    assert (evidence["worker"], evidence["round"], evidence["run_id"]) == (1, 3, RUN)
    assert det.equivocators(RUN, 3) == [1]
    assert det.observe(a) is evidence  # later messages from an equivocator keep the flag
    # JSON-serialisable and order-independent, and checkable offline
    text = canonical_json(evidence)
    det2 = EquivocationDetector()
    det2.observe(b)
    assert canonical_json(det2.observe(a)) == text
    assert verify_equivocation_evidence(json.loads(text), ADMITTED)
    assert verify_equivocation_evidence(json.loads(text))
    assert not verify_equivocation_evidence(json.loads(text), {1: ADMITTED[0]})
    tampered = json.loads(text)
    tampered["commitments"][0]["commitment"]["losses"] = [0.0]
    assert not verify_equivocation_evidence(tampered)
    same = json.loads(text)
    same["commitments"][1] = same["commitments"][0]
    assert not verify_equivocation_evidence(same)
    assert not verify_equivocation_evidence("garbage")
    assert det.evidence == [evidence]


def test_forged_commitment_cannot_frame_a_worker():
    det = EquivocationDetector(ADMITTED)
    det.observe(sign_commitment(make(1), KEYS[1]))
    forged = sign_commitment(make(1, losses=[9.0]), KEYS[2])  # worker 2 signs in 1's name
    assert det.observe(forged) is None
    forged["public_key"] = ADMITTED[1]
    assert det.observe(forged) is None
    assert det.observe({"not": "a commitment"}) is None
    # without admitted keys a different embedded key is not evidence either
    open_det = EquivocationDetector()
    open_det.observe(sign_commitment(make(1), KEYS[1]))
    assert open_det.observe(sign_commitment(make(1, losses=[9.0]), KEYS[2])) is None
    assert open_det.equivocators(RUN, 3) == []


def test_different_rounds_are_not_equivocation():
    det = EquivocationDetector(ADMITTED)
    assert det.observe(sign_commitment(make(0, round=3), KEYS[0])) is None
    assert det.observe(sign_commitment(make(0, round=4, losses=[1.0]), KEYS[0])) is None
    det.forget_before(4)
    assert det.observe(sign_commitment(make(0, round=4, losses=[1.0]), KEYS[0])) is None


def test_equivocation_proven_by_a_later_bundle_rejects_the_earlier_sender():
    """Worker 1's second signed commitment rides in worker 2's bundle: worker 1, checked first,
    is still refused (EQUIVOCATION), as when worker 2 equivocates and worker 1 carries it."""
    from veriloco.compress import build_codecs
    from veriloco.packet import encode_bundle, packet_codecs
    from veriloco.verify.check import check_bundles, hex_root

    shapes = {"a": (8,)}

    def signed(w: int, losses: tuple[float, ...]) -> tuple[bytes, bytes]:
        delta = {"a": torch.randn(8, generator=torch.Generator().manual_seed(w))}
        packet = encode_packet(delta, build_codecs("fp32", shapes))
        c = make(w, round=1, trace=[sha256_hex(b"s")], trace_root=hex_root([sha256_hex(b"s")]), losses=list(losses),
                 packet_hash=sha256_hex(packet), packet_bytes=len(packet), codec=packet_codecs(packet)["a"])
        return canonical_json(sign_commitment(c, KEYS[w])), packet

    for equivocator, carrier in ((2, 1), (1, 2)):
        bundles = {}
        for w in range(3):
            s, p = signed(w, (2.5,))
            extras = (signed(equivocator, (2.0,))[0],) if w == carrier else ()
            bundles[w] = encode_bundle(s, p, extras)
        check = check_bundles(
            bundles, run_id=RUN, round=1, base_hash=BASE, admitted_keys=ADMITTED, shapes=shapes,
            max_packet_bytes=1 << 20, batch_root_of=lambda w: sha256_hex(b"batches %d" % w),
            equivocation=EquivocationDetector(ADMITTED))
        assert check.verdicts == {w: EQUIVOCATION if w == equivocator else "accept" for w in range(3)}
        assert set(check.decoded) == {0, carrier}
        assert check.evidence[equivocator]["worker"] == equivocator
