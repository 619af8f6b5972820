"""Decoders of everything a peer can send, each paired with the only exception it may raise.

Shared by tests/test_fuzz.py (a few hundred inputs per decoder on every CI run) and
bench/fuzz.py (100,000 inputs, with timing and peak memory).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from veriloco.compress import build_codecs
from veriloco.hashing import canonical_json
from veriloco.ledger.entry import LedgerError, make_entry, parse_entry
from veriloco.packet import PacketError, decode_bundle, decode_packet, encode_bundle, encode_packet
from veriloco.records import RunDir, RunDirError
from veriloco.store import LocalStore, StoreError
from veriloco.tensorfile import TensorFile
from veriloco.verify.commitment import (
    Commitment,
    CommitmentError,
    parse_signed_commitment,
    sign_commitment,
)
from veriloco.verify.identity import derive_worker_key

SHAPES = {"a.weight": (8, 16), "b.bias": (16,)}
MAX_PACKET = 1 << 16


def _delta() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def valid_packets() -> list[bytes]:
    """One valid packet per codec family: seeds for mutation."""
    out = []
    for spec in ("fp32", "fp16", "bf16", "int8:block=16", "int4:block=16", "topk:bits=8,density=0.1", "lowrank:rank=2"):
        out.append(encode_packet(_delta(), build_codecs(spec, SHAPES)))
    return out


def valid_commitment() -> bytes:
    c = Commitment(run_id="ab" * 32, round=3, worker=1, base_hash="cd" * 32, batch_root="ef" * 32,
                   trace_root="01" * 32, trace=("23" * 32,), losses=(2.5,), packet_hash="45" * 32,
                   packet_bytes=100, codec="fp32", salt_hash="67" * 32)
    return canonical_json(sign_commitment(c, derive_worker_key(0, 1)))


def valid_entry() -> bytes:
    e = make_entry(run_id="ab" * 32, round=0, prev_entry_hash="00" * 32, checkpoint="cd" * 32,
                   commitments=[{"worker": 0, "verdict": "accept"}], aggregate_hash="ef" * 32,
                   codecs=[{"fp32": 2}], eval_loss=2.5)
    return canonical_json(e)


def valid_record() -> bytes:
    return (json.dumps({"round": 0, "eval_loss": 2.5}) + "\n").encode()


def decode_packet_target(data: bytes) -> None:
    decode_packet(data, SHAPES, MAX_PACKET)


def decode_bundle_target(data: bytes) -> None:
    c, p, extras = decode_bundle(data, view=True)  # as check_bundles reads it: the packet in place
    decode_packet(p, SHAPES, MAX_PACKET)
    parse_signed_commitment(c)
    for x in extras:
        parse_signed_commitment(x)


def commitment_target(data: bytes) -> None:
    parse_signed_commitment(data)


def entry_target(data: bytes) -> None:
    parse_entry(data)


_TMP = Path(tempfile.mkdtemp(prefix="veriloco-fuzz-"))


def records_target(data: bytes) -> None:
    run = RunDir(_TMP)
    run.rounds_path.write_bytes(data)
    run.rounds()


def store_target(data: bytes) -> None:
    """A blob whose bytes were replaced by a peer: the hash check must catch it."""
    store = LocalStore(_TMP / "store")
    digest = store.put(b"the real blob")
    store.path_of(digest).write_bytes(data)
    if data != b"the real blob":
        try:
            store.get(digest, max_bytes=1 << 20)
        except StoreError:
            return
        raise AssertionError("a replaced blob was returned as data")


def valid_tensor_file() -> bytes:
    from safetensors.torch import save

    return save({"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(4, dtype=torch.bfloat16),
                 "n": torch.arange(3)}, metadata={"format": "pt"})


def tensor_file_target(data: bytes) -> None:
    """A checkpoint or G_0 blob from outside: its header is validated, then every tensor read."""
    path = _TMP / "t.safetensors"
    path.write_bytes(data)
    f = TensorFile(path, "t")
    for name in f:
        f[name]


TARGETS = {
    # name: (decoder, exceptions it may raise, seed inputs)
    "packet": (decode_packet_target, (PacketError,), valid_packets()),
    "bundle": (decode_bundle_target, (PacketError, CommitmentError),
               [encode_bundle(valid_commitment(), p) for p in valid_packets()[:2]]),
    "commitment": (commitment_target, (CommitmentError,), [valid_commitment()]),
    "ledger_entry": (entry_target, (LedgerError,), [valid_entry()]),
    "round_record": (records_target, (RunDirError,), [valid_record()]),
    "store_blob": (store_target, (StoreError,), [b"the real blob"]),
    "tensor_file": (tensor_file_target, (ValueError,), [valid_tensor_file()]),
}


# values a hostile peer writes into a JSON field: parsing them must not be another exception than the
# decoder's own (a review found nesting past the stack, ints past Python's 4300 digits and zero-sized shapes
# with dims past int64 each stopping a worker, none of which a flipped byte makes)
HOSTILE_VALUES = (
    "DEEP", "BIGINT", [0, 2**63], [0, 2**62, 4], [1] * 100, [0] * 70, -1, 2**64, 1e308, None, True, "x" * 5000,
    {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}, [], {}, "",
)


def _hostile(rnd) -> str:
    """The JSON text of one HOSTILE_VALUES entry."""
    v = rnd.choice(HOSTILE_VALUES)
    if v == "DEEP":
        depth = rnd.choice((100, 5000))
        return "[" * depth + "]" * depth
    if v == "BIGINT":
        return "9" * rnd.choice((20, 5000))
    return json.dumps(v)


def _replace_one(obj, rnd):
    """`obj` (parsed JSON) as JSON text with one value (of any depth, or a new key) hostile."""
    paths = []

    def walk(x, path):
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, (*path, i))

    walk(obj, ())
    path = rnd.choice(paths)
    marker = "\u0000HOSTILE\u0000"
    if path and isinstance(obj, dict) and rnd.random() < 0.2:  # a new key beside the others
        obj[f"{path[0]}/z"] = marker
    elif path:
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = marker
    text = json.dumps(obj, separators=(",", ":"))
    return text.replace(json.dumps(marker), _hostile(rnd)) if path else _hostile(rnd)


def mutate_structure(seed: bytes, rnd) -> bytes | None:
    """`seed` with one field of its JSON made hostile: a safetensors header (and a packet's metadata
    string inside it), or a whole JSON input (a commitment, an entry, a record line); None if it has
    neither."""
    n = int.from_bytes(seed[:8], "little") if len(seed) >= 8 else 0
    if 2 <= n <= len(seed) - 8:
        try:
            header = json.loads(seed[8 : 8 + n])
        except ValueError:
            header = None
        if isinstance(header, dict):
            meta = header.get("__metadata__", {}).get("veriloco.packet")
            if isinstance(meta, str) and rnd.random() < 0.4:
                header["__metadata__"]["veriloco.packet"] = _replace_one(json.loads(meta), rnd)
                raw = json.dumps(header, separators=(",", ":")).encode()
            else:
                raw = _replace_one(header, rnd).encode()
            raw += b" " * (-len(raw) % 8)
            return len(raw).to_bytes(8, "little") + raw + seed[8 + n :]
    try:
        obj = json.loads(seed)
    except ValueError:
        return None
    return (_replace_one(obj, rnd) + ("\n" if seed.endswith(b"\n") else "")).encode()


def mutate(seed: bytes, rnd) -> bytes:
    """Flip, insert, delete or truncate a few bytes of a valid input (rnd: random.Random), or, one
    time in three, make one field of its JSON hostile (`mutate_structure`)."""
    if rnd.random() < 1 / 3 and (structured := mutate_structure(seed, rnd)) is not None:
        return structured
    b = bytearray(seed)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(4)
        i = rnd.randrange(max(len(b), 1))
        if op == 0 and b:
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1:
            b[i:i] = bytes([rnd.randrange(256)])
        elif op == 2 and b:
            del b[i]
        else:
            b = b[:i]
    return bytes(b)
