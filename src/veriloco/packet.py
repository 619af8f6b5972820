"""Packets: one worker's encoded delta for one round, as safetensors bytes.

Layout: tensors named `<param>/<part>` (the codec's parts), and ONE safetensors metadata key,
`veriloco.packet` = canonical JSON {"format": "1", "codecs": {param: codec spec},
"shapes": {param: [dims]}}. One key, because safetensors writes metadata from a hash map whose
order varies between runs: with several keys the same delta would give different bytes. Equal
deltas give equal packets, and a packet's sha256 is its name in the store.
Decoding never unpickles, checks the size before parsing, and checks every name, spec and
shape against what the receiver expects; anything else is a `PacketError`. It reads the tensors
in place (`_parts`: views of the packet's own memory, validated as the safetensors library
validates a buffer), so a model-sized fp32 packet is copied once, into the delta, not three times
(the bundle's slice, safetensors' per-tensor bytes, the codec's copy).
"""

from __future__ import annotations

import copy
import json
import struct
import warnings

import torch

from .compress import Codec, CodecError, codec_from_spec
from .compress._common import all_finite
from .hashing import canonical_json
from .tensorfile import NAMES, header_entry

FORMAT = "1"


class PacketError(ValueError):
    """A packet is malformed, oversized, or does not match the model it claims to update."""


def encode_packet(delta: dict[str, torch.Tensor], codecs: dict[str, Codec]) -> bytes:
    """Encode every tensor of `delta` with its codec from `codecs` into safetensors bytes."""
    tensors: dict[str, torch.Tensor] = {}
    for key in sorted(delta):
        for part, t in codecs[key].encode(key, delta[key]).items():
            tensors[f"{key}/{part}"] = t.contiguous()
    meta = {
        "format": FORMAT,
        "codecs": {k: codecs[k].spec() for k in sorted(delta)},
        "shapes": {k: list(delta[k].shape) for k in sorted(delta)},
    }
    return save_bytes(tensors, {"veriloco.packet": canonical_json(meta).decode()})


def header_share(key: str, codec: Codec, shape: tuple[int, ...], offset_digits: int = 20) -> int:
    """At most the bytes tensor `key`, encoded with `codec`, adds to a packet beyond its payload:
    its parts' safetensors header entries (offsets counted at `offset_digits` digits: 20 holds any;
    the digits of a bound on the packet's payload are enough, `round.DeltaEncoder`), a comma each) and its
    codec and shape in the metadata (escaped, as the header holds it). The parts are those of a
    zero tensor of `shape` (a copy of `codec` encodes it: a stateful codec's state is not touched),
    which have the names, dtypes and shapes any tensor of it has. `HEADER_FIXED_BYTES` plus these
    bound a packet's bytes beyond `estimate_bytes` (tests/test_compress.py)."""
    parts = copy.deepcopy(codec).encode(key, torch.zeros(shape))
    entries = {f"{key}/{part}": {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [10 ** (offset_digits - 1)] * 2}
               for part, t in parts.items()}
    n = len(json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()) - 2 + 1
    meta = canonical_json({key: codec.spec()})[1:-1] + b"," + canonical_json({key: list(shape)})[1:-1] + b","
    return n + len(json.dumps(meta.decode(), ensure_ascii=False).encode()) - 2


# safetensors' dtypes, in the order `safetensors.torch.save` puts tensors in a file (its Dtype enum,
# last first); tensors of one dtype go by name (tests/test_packet_inplace.py checks it against save)
SAVE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


def save_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """`safetensors.torch.save(tensors, metadata=metadata)`, byte for byte, with one copy of the
    tensors' bytes: joined from views of the tensors (save copies each tensor into bytes of its own,
    then all of them into the file's bytes, and those into the bytes it returns)."""
    rank = {name: i for i, name in enumerate(SAVE_ORDER)}
    header: dict = {"__metadata__": metadata} if metadata else {}
    views: list[memoryview] = []
    offset = 0
    for name in sorted(tensors, key=lambda k: (rank[NAMES[tensors[k].dtype]], k)):
        t = tensors[name].detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if nbytes:
            views.append(t.reshape(-1).view(torch.uint8).numpy().data)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return b"".join([len(raw).to_bytes(8, "little"), raw, *views])


# a packet's bytes beyond its tensors' header shares: the length, the header's braces and metadata key, and
# the padding to 8 bytes
HEADER_FIXED_BYTES = len(save_bytes({}, {"veriloco.packet": canonical_json(
    {"format": FORMAT, "codecs": {}, "shapes": {}}).decode()})) + 8


def _meta(data: bytes | memoryview, header: dict | None = None) -> dict:
    """The packet's own metadata object (format, codecs, shapes), validated for shape."""
    raw = (header or _header(data))["__metadata__"].get("veriloco.packet")
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):  # not JSON, an int past Python's 4300 digits; nested past the stack
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PacketError(f"packet metadata is not veriloco packet format {FORMAT}")
    codecs, shapes = meta.get("codecs"), meta.get("shapes")
    if not isinstance(codecs, dict) or not all(isinstance(v, str) for v in codecs.values()):
        raise PacketError("packet metadata 'codecs' must map names to spec strings")
    if not isinstance(shapes, dict) or not all(
        isinstance(v, list) and all(isinstance(d, int) and d >= 0 for d in v) for v in shapes.values()
    ):
        raise PacketError("packet metadata 'shapes' must map names to lists of dimensions")
    return meta


def _unique(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: an object that names a key twice is not one safetensors reads."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise PacketError("packet header names a key twice")
    return out


MAX_HEADER = 16 << 20  # bytes of a packet's header at most, whatever the model (decode_packet caps it by the model)


def header_limit(shapes: dict[str, tuple[int, ...]]) -> int:
    """The most header bytes a packet for a model of `shapes` may have: generous for any codec's
    parts (an honest header is 300-400 bytes a tensor), so that a peer cannot make the receiver
    parse a 16 MiB header (about 25x that in Python objects) for a small model."""
    return min(MAX_HEADER, (64 << 10) + sum(4096 + 16 * len(k) for k in shapes))


def _header(data: bytes | memoryview, limit: int = MAX_HEADER) -> dict:
    if len(data) < 8:
        raise PacketError(f"packet of {len(data)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise PacketError(f"packet header claims {n} bytes, packet has {len(data) - 8}")
    if n > limit:
        raise PacketError(f"packet header is {n} bytes, over the limit of {limit}")
    try:
        header = json.loads(bytes(data[8 : 8 + n]), object_pairs_hook=_unique)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, a 5000-digit int; deep nesting
        raise PacketError(f"packet header is not JSON: {str(e)[:100]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise PacketError("packet header has no __metadata__")
    return header


def _parts(data: bytes | memoryview, header: dict) -> tuple[dict[str, torch.Tensor], range]:
    """(name -> tensor, the addresses of `data`'s memory) of a packet whose header is `header`:
    each tensor reads `data`'s memory in place, not a copy, so nothing may write to it.
    Checked as `safetensors.torch.load` checks a buffer: a known dtype, a shape of non-negative
    ints, a byte count equal to the shape's, and offsets that tile the data after the header
    exactly, from its first byte to its last, without a gap or an overlap."""
    start = 8 + struct.unpack("<Q", data[:8])[0]
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        got = header_entry(entry)
        if got is None:
            raise PacketError(f"packet tensor {name!r:.60} has a malformed dtype, shape or offsets")
        dtype, shape, begin, end = got
        entries.append((begin, end, name, dtype, shape))
    at = 0
    for begin, end, name, _, _ in sorted(entries, key=lambda e: (e[0], e[1])):
        if begin != at:
            raise PacketError(f"packet tensor {name!r:.60} starts at byte {begin} of the data, not {at}: "
                              "tensors overlap or leave a gap")
        at = end
    if at != len(data) - start:
        raise PacketError(f"packet has {len(data) - start} bytes of tensor data, its tensors {at}")
    out = {}
    with warnings.catch_warnings():  # read only: a packet's bytes are immutable, and no view is written
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        first = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
        for begin, end, name, dtype, shape in entries:  # at any alignment (a packet inside a bundle has none)
            out[name] = (torch.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
                         .reshape(shape) if end > begin else torch.empty(shape, dtype=dtype))
    return out, range(first, first + len(data))


def packet_codecs(data: bytes | memoryview, max_header: int = MAX_HEADER) -> dict[str, str]:
    """{param: codec spec} of a packet, read from its header (of at most `max_header` bytes:
    `header_limit`) without decoding tensors."""
    return _meta(data, _header(data, max_header))["codecs"]


def decode_packet(
    data: bytes | memoryview, expected_shapes: dict[str, tuple[int, ...]], max_bytes: int
) -> dict[str, torch.Tensor]:
    """Decode a peer's packet into fp32 tensors of exactly `expected_shapes`, each of its own
    memory (none is a view of `data`)."""
    if isinstance(data, bytearray):  # mutable: the tensors below would see a later write
        data = bytes(data)
    if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1):
        data = data.cast("B")
    if not isinstance(data, (bytes, memoryview)):
        raise PacketError("packet is not bytes")
    if len(data) > max_bytes:
        raise PacketError(f"packet is {len(data)} bytes, over the limit of {max_bytes}")
    header = _header(data, header_limit(expected_shapes))
    meta = _meta(data, header)
    codecs, shapes = meta["codecs"], meta["shapes"]
    want = {k: list(v) for k, v in expected_shapes.items()}
    if set(codecs) != set(want) or shapes != want:
        missing = sorted(set(want) - set(codecs))
        extra = sorted(set(codecs) - set(want))
        raise PacketError(
            f"packet does not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
            if missing or extra
            else "packet shapes do not match the model"
        )
    tensors, memory = _parts(data, header)
    grouped: dict[str, dict[str, torch.Tensor]] = {k: {} for k in want}
    for name, t in tensors.items():
        key, _, part = name.rpartition("/")
        if key not in grouped or not part:
            raise PacketError(f"packet has a tensor {name!r:.80} that belongs to no parameter")
        grouped[key][part] = t
    out: dict[str, torch.Tensor] = {}
    for key, parts in grouped.items():
        try:
            value = codec_from_spec(codecs[key]).decode(parts, tuple(want[key]))
        except CodecError as e:
            raise PacketError(f"tensor {key}: {e}") from None
        if not all_finite(value):
            raise PacketError(f"tensor {key} decodes to non-finite values")
        if value.untyped_storage().data_ptr() in memory:
            value = value.clone()  # a codec that returned its part as it is: the delta gets memory of its own
        out[key] = value
    return out


# -- bundles: what a worker actually sends in an exchange --------------------------------------
BUNDLE_MAGIC = b"VLB1"
MAX_EXTRAS = 4


def encode_bundle(signed_commitment: bytes, packet: bytes, extras: tuple[bytes, ...] = ()) -> bytes:
    """`VLB1`, u32 commitment length, signed commitment JSON, u64 packet length, packet, then
    zero or more (u32 length, signed commitment) extras. An honest worker sends no extras; the
    slot exists so that a second commitment a worker signed for the same round (gossip, an
    equivocation) reaches everyone as evidence, in the same bytes."""
    out = [BUNDLE_MAGIC, struct.pack(">I", len(signed_commitment)), signed_commitment,
           struct.pack(">Q", len(packet)), packet]
    for extra in extras:
        out += [struct.pack(">I", len(extra)), extra]
    return b"".join(out)


def decode_bundle(data: bytes | memoryview, max_commitment_bytes: int = 1 << 20, *,
                  view: bool = False) -> tuple[bytes, bytes | memoryview, list[bytes]]:
    """(signed commitment, packet, extras) of a peer's bundle (bytes, or a read-only memoryview as
    the exchange hands it on); PacketError if malformed. `view`: the packet as a memoryview of
    `data`, not a copy of the model-sized part."""
    if len(data) < 16 or data[:4] != BUNDLE_MAGIC:
        raise PacketError("bundle does not start with VLB1")
    (n,) = struct.unpack(">I", data[4:8])
    if n > max_commitment_bytes or 8 + n + 8 > len(data):
        raise PacketError(f"bundle claims a commitment of {n} bytes, bundle has {len(data) - 8}")
    commitment, pos = bytes(data[8 : 8 + n]), 8 + n
    (m,) = struct.unpack(">Q", data[pos : pos + 8])
    pos += 8
    if m > len(data) - pos:
        raise PacketError(f"bundle claims a packet of {m} bytes, bundle has {len(data) - pos}")
    packet, pos = (memoryview(data)[pos : pos + m] if view else data[pos : pos + m]), pos + m
    extras = []
    while pos < len(data):
        if len(extras) >= MAX_EXTRAS or pos + 4 > len(data):
            raise PacketError("bundle has trailing bytes that are not commitments")
        (k,) = struct.unpack(">I", data[pos : pos + 4])
        if k > max_commitment_bytes or pos + 4 + k > len(data):
            raise PacketError(f"bundle extra claims {k} bytes, bundle has {len(data) - pos - 4}")
        extras.append(bytes(data[pos + 4 : pos + 4 + k]))
        pos += 4 + k
    return commitment, packet, extras
