"""Codecs: how a delta tensor becomes bytes on the wire, and back.

A codec is three methods (encode, decode, estimate_bytes), after hivemind's compression module.
`codec_from_spec("name:key=value,...")` builds one from the string recorded in a packet, so a
receiver decodes with nothing but the packet itself.
"""

from .base import Codec, CodecError, codec_from_spec, register_codec
from .identity import IdentityCodec

__all__ = ["Codec", "CodecError", "IdentityCodec", "codec_from_spec", "register_codec"]
