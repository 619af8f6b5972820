"""Packets are read in place (packet._parts): the same tensors as safetensors' own reader, the same
buffers refused, and a decoded delta that never shares memory with the bytes it came from, so a
round may let the received bundles go once they are decoded. Packets are written as
safetensors.torch.save writes them (packet.save_bytes)."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from fuzz_targets import SHAPES, _delta, mutate, valid_packets
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from veriloco.compress import CodecError, build_codecs, codec_from_spec
from veriloco.compress._common import all_finite
from veriloco.compress.identity import IdentityCodec
from veriloco.hashing import canonical_json, sha256_hex
from veriloco.packet import (
    PacketError,
    _meta,
    decode_bundle,
    decode_packet,
    encode_bundle,
    encode_packet,
    packet_codecs,
    save_bytes,
)
from veriloco.tensorfile import DTYPES


def reference_decode(packet: bytes) -> dict[str, torch.Tensor]:
    """What decode_packet returned before it read in place: safetensors' load, then each codec."""
    codecs = packet_codecs(packet)
    grouped: dict[str, dict[str, torch.Tensor]] = {k: {} for k in codecs}
    for name, t in st_load(packet).items():
        key, _, part = name.rpartition("/")
        grouped[key][part] = t
    return {k: codec_from_spec(codecs[k]).decode(parts, SHAPES[k]) for k, parts in grouped.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("index", range(len(valid_packets())))
def test_in_place_read_matches_safetensors_and_owns_its_memory(index: int) -> None:
    packet = valid_packets()[index]
    want = reference_decode(packet)
    digest = sha256_hex(packet)
    got = decode_packet(packet, SHAPES, len(packet))
    assert same(got, want)
    # out of a bundle, as a memoryview whose first byte is at no particular alignment
    for commitment in (b"{}", b"{ }", b"{  }", b"{   }"):
        _, view, _ = decode_bundle(encode_bundle(commitment, packet), view=True)
        assert isinstance(view, memoryview) and bytes(view) == packet
        assert same(decode_packet(view, SHAPES, len(packet)), want)
    for t in got.values():  # writing to the delta leaves the received bytes as they were
        t.add_(1.0)
    assert sha256_hex(packet) == digest
    assert same(decode_packet(packet, SHAPES, len(packet)), want)


def test_a_codec_that_returns_its_part_gets_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    packet = valid_packets()[0]  # fp32
    monkeypatch.setattr(IdentityCodec, "decode", lambda self, parts, shape: parts["v"].reshape(shape))
    got = decode_packet(packet, SHAPES, len(packet))
    assert same(got, {k: v.to(torch.float32) for k, v in _delta().items()})
    digest = sha256_hex(packet)
    for t in got.values():
        t.mul_(-3.0)
    assert sha256_hex(packet) == digest


def _buffer(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _packet(entries: dict[str, dict], data: bytes) -> bytes:
    """A packet of SHAPES' names with fp32 codecs, whose tensor entries are `entries`."""
    meta = {"format": "1", "codecs": dict.fromkeys(SHAPES, "fp32"), "shapes": {k: list(v) for k, v in SHAPES.items()}}
    return _buffer({"__metadata__": {"veriloco.packet": json.dumps(meta)}, **entries}, data)


A, B = 4 * 128, 4 * 16  # bytes of a.weight/v and b.bias/v
GOOD = {"a.weight/v": {"dtype": "F32", "shape": [128], "data_offsets": [0, A]},
        "b.bias/v": {"dtype": "F32", "shape": [16], "data_offsets": [A, A + B]}}


def with_entry(name: str, **change: object) -> dict[str, dict]:
    return {**GOOD, name: {**GOOD[name], **change}}


HOSTILE = {
    "gap": (with_entry("b.bias/v", data_offsets=[A + 4, A + B + 4]), A + B + 4),
    "overlap": (with_entry("b.bias/v", data_offsets=[A - 4, A + B - 4]), A + B),
    "trailing bytes": (GOOD, A + B + 4),
    "cut short": (GOOD, A + B - 4),
    "past the end": (with_entry("b.bias/v", data_offsets=[A, A + B + 8], shape=[18]), A + B),
    "size not the shape's": (with_entry("b.bias/v", shape=[15]), A + B),
    "unknown dtype": (with_entry("b.bias/v", dtype="F33"), A + B),
    "negative dim": (with_entry("b.bias/v", shape=[-16]), A + B),
    "offsets reversed": (with_entry("b.bias/v", data_offsets=[A + B, A]), A + B),
    "a dim that is not an int": (with_entry("b.bias/v", shape=[16.0]), A + B),
    "no offsets": ({**GOOD, "b.bias/v": {"dtype": "F32", "shape": [16]}}, A + B),
    "not an object": ({**GOOD, "b.bias/v": [1, 2]}, A + B),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_buffers_safetensors_refuses_are_refused(case: str) -> None:
    entries, size = HOSTILE[case]
    packet = _packet(entries, bytes(size))
    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own types
        st_load(packet)
    with pytest.raises(PacketError):
        decode_packet(packet, SHAPES, len(packet))


def test_the_good_buffer_of_those_cases_decodes() -> None:
    packet = _packet(GOOD, bytes(A + B))
    assert same(decode_packet(packet, SHAPES, len(packet)), {k: torch.zeros(s) for k, s in SHAPES.items()})
    assert same(reference_decode(packet), decode_packet(packet, SHAPES, len(packet)))


def test_a_key_named_twice_is_refused() -> None:
    meta = json.dumps({"format": "1", "codecs": dict.fromkeys(SHAPES, "fp32"),
                       "shapes": {k: list(v) for k, v in SHAPES.items()}})
    def entry(begin: int) -> str:
        return json.dumps({"dtype": "F32", "shape": [16], "data_offsets": [begin, begin + B]})

    first = json.dumps({"dtype": "F32", "shape": [128], "data_offsets": [0, A]})
    raw = (f'{{"__metadata__":{{"veriloco.packet":{json.dumps(meta)}}},"a.weight/v":{first},'
           f'"b.bias/v":{entry(A)},"b.bias/v":{entry(A + B)}}}').encode()
    packet = struct.pack("<Q", len(raw)) + raw + bytes(A + 2 * B)
    with pytest.raises(PacketError, match="twice"):
        decode_packet(packet, SHAPES, len(packet))


def old_decode(data: bytes) -> dict[str, torch.Tensor]:
    """decode_packet as it was before it read in place (8b459e1): safetensors' own reader."""
    meta = _meta(data)
    codecs = meta["codecs"]
    want = {k: list(v) for k, v in SHAPES.items()}
    if set(codecs) != set(want) or meta["shapes"] != want:
        raise PacketError("packet does not match the model")
    try:
        tensors = st_load(data)
    except Exception as e:  # noqa: BLE001 - what the old decoder caught
        raise PacketError(str(e)) from None
    grouped: dict[str, dict[str, torch.Tensor]] = {k: {} for k in want}
    for name, t in tensors.items():
        key, _, part = name.rpartition("/")
        if key not in grouped or not part:
            raise PacketError("a tensor that belongs to no parameter")
        grouped[key][part] = t
    out = {}
    for key, parts in grouped.items():
        try:
            value = codec_from_spec(codecs[key]).decode(parts, tuple(want[key]))
        except CodecError as e:
            raise PacketError(str(e)) from None
        if not all_finite(value):
            raise PacketError("non-finite")
        out[key] = value
    return out


def test_mutated_packets_decode_as_safetensors_decoded_them() -> None:
    """Differential: for mutated valid packets, the in-place reader and safetensors' refuse the
    same ones and decode the rest to the same tensors (a header naming a key twice aside, which
    only the in-place reader refuses)."""
    seeds = valid_packets()
    rnd = random.Random(1)
    outcomes = {"both refuse": 0, "same tensors": 0}
    for k in range(1500):
        seed = seeds[k % len(seeds)]
        if k % 3:
            data = mutate(seed, rnd)
        else:  # bytes of the tensors changed, the header intact: decoded, or refused by a codec or as non-finite
            data = bytearray(seed)
            start = 8 + struct.unpack("<Q", seed[:8])[0]
            for _ in range(rnd.randint(1, 4)):
                data[rnd.randrange(start, len(data))] = rnd.randrange(256)
            data = bytes(data)
        try:
            want = old_decode(data)
        except PacketError:
            want = None
        try:
            got = decode_packet(data, SHAPES, len(data) + 1)
        except PacketError as e:
            assert want is None or "twice" in str(e), (k, str(e))
            outcomes["both refuse"] += 1
            continue
        assert want is not None and same(got, want), k
        outcomes["same tensors"] += 1
    assert min(outcomes.values()) > 50, outcomes  # both sides of the comparison were exercised


def test_save_bytes_are_safetensors_save() -> None:
    """packet.save_bytes (what encode_packet writes) against safetensors.torch.save, byte for byte:
    every codec's packet, and mixes of every dtype a packet may hold, empty and 0-d tensors, a
    non-ASCII name and metadata, with and without metadata."""
    for codecs in ("fp32", "fp16", "bf16", "int8:block=16", "int4:block=16", "topk:bits=8,density=0.1", "lowrank:rank=2"):
        tensors = {}
        for key, codec in build_codecs(codecs, SHAPES).items():
            tensors |= {f"{key}/{part}": t.contiguous() for part, t in codec.encode(key, _delta()[key]).items()}
        meta = {"veriloco.packet": '{"format":"1"}'}
        assert save_bytes(tensors, meta) == st_save(tensors, metadata=meta), codecs
    rnd = random.Random(3)
    dtypes = list(DTYPES.values())
    for _ in range(60):
        tensors = {}
        for i in range(rnd.randint(1, 7)):
            shape = rnd.choice([(), (0,), (3,), (2, 5), (1, 0, 4), (7, 3)])
            dtype = rnd.choice(dtypes)
            name = rnd.choice(["w", "b", "é.weight", "layer.0", "z/v", "a"]) + str(i)
            tensors[name] = (torch.rand(shape) * 100).to(dtype)
        meta = rnd.choice([None, {"k": "v\"é\n"}])
        assert save_bytes(tensors, meta) == st_save(tensors, metadata=meta), sorted((k, v.dtype) for k, v in tensors.items())


def test_check_round_consumes_the_bundles_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """round.start_finish holds the received bundles in one dict and lets check_round take each out
    as it checks it (`consume`): when a packet is decoded, the bundles not yet checked are all that
    is left of them, and the verdicts, evidence, hashes and deltas are those of a check that kept them."""
    import importlib

    from veriloco.verify.commitment import Commitment, EquivocationDetector, sign_commitment
    from veriloco.verify.identity import derive_worker_key, public_key_hex

    check = importlib.import_module("veriloco.verify.check")
    shapes = {"a.weight": (64, 32), "b.bias": (32,)}
    run, base = "ab" * 32, "cd" * 32
    g = torch.Generator().manual_seed(5)
    common = {k: torch.randn(s, generator=g) for k, s in shapes.items()}

    def bundle(w: int) -> bytes:
        delta = {k: common[k] + 0.5 * torch.randn(s, generator=g) for k, s in shapes.items()}
        packet = encode_packet(delta, build_codecs("int8:block=32" if w == 1 else "fp32", shapes))
        c = Commitment(run_id=run, round=1, worker=w, base_hash=base, batch_root=sha256_hex(b"%d" % w),
                       trace_root=check.hex_root(["ef" * 32]), trace=("ef" * 32,), losses=(2.5,),
                       packet_hash=sha256_hex(packet), packet_bytes=len(packet),
                       codec=packet_codecs(packet)["a.weight"], salt_hash=sha256_hex(b"salt %d" % w))
        return encode_bundle(canonical_json(sign_commitment(c, derive_worker_key(0, w))), packet)

    bundles = {w: bundle(w) for w in (2, 0, 3, 1)}  # an elastic round's members need not come sorted
    keys = {w: public_key_hex(derive_worker_key(0, w)) for w in range(4)}

    def run_check(given: dict[int, bytes], consume: bool) -> check.RoundCheck:
        return check.check_round(given, consume=consume, run_id=run, round=1, base_hash=base, admitted_keys=keys,
                                 shapes=shapes, max_packet_bytes=1 << 20, batch_root_of=lambda w: sha256_hex(b"%d" % w),
                                 equivocation=EquivocationDetector(keys))

    kept = run_check(dict(bundles), consume=False)
    assert sorted(kept.accepted) == [0, 1, 2, 3]
    held = dict(bundles)
    left: list[list[int]] = []
    decode = check.decode_packet
    monkeypatch.setattr(check, "decode_packet", lambda *a, **k: (left.append(list(held)), decode(*a, **k))[1])
    got = run_check(held, consume=True)
    assert left == [[0, 3, 1], [3, 1], [1], []] and not held
    assert (got.verdicts, got.evidence, got.packet_hashes) == (kept.verdicts, kept.evidence, kept.packet_hashes)
    assert all(same(got.decoded[w], kept.decoded[w]) for w in kept.decoded)
