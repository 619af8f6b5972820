"""Keys and signatures: round trips, key files, and a verifier that never raises."""

from __future__ import annotations

import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from veriloco.verify.identity import (
    IdentityError,
    derive_worker_key,
    generate_key,
    load_private_key,
    load_public_key,
    public_key_hex,
    save_private_key,
    sign,
    verify_signature,
)


def test_sign_verify_round_trip_and_tamper():
    private, public = generate_key()
    pub = public_key_hex(public)
    assert pub == public_key_hex(private) and len(pub) == 64
    sig = sign(private, b"hello round 3")
    assert len(sig) == 128
    assert verify_signature(pub, b"hello round 3", sig)
    assert not verify_signature(pub, b"hello round 4", sig)
    flipped = sig[:10] + ("0" if sig[10] != "0" else "1") + sig[11:]
    assert not verify_signature(pub, b"hello round 3", flipped)
    other = public_key_hex(generate_key()[1])
    assert not verify_signature(other, b"hello round 3", sig)


def test_signature_spellings_are_unique():
    private, _ = generate_key()
    pub, sig = public_key_hex(private), sign(private, b"m")
    assert not verify_signature(pub.upper(), b"m", sig)  # only lowercase hex is accepted
    assert not verify_signature(pub, b"m", sig.upper())
    assert not verify_signature(pub + "\n", b"m", sig)
    assert not verify_signature(pub, b"m", " " + sig)


@pytest.mark.parametrize(
    "args",
    [
        (None, b"m", None),
        (123, b"m", "00" * 64),
        ("zz" * 32, b"m", "00" * 64),
        ("00" * 32, b"m", "00" * 64),  # not a valid curve point / not a valid signature
        ("00" * 32, "text, not bytes", "00" * 64),
        ("00" * 31, b"m", "00" * 64),
        (b"\x00" * 32, b"m", b"\x00" * 64),
        ("ff" * 32, b"m", "ff" * 64),
        (["list"], {"dict": 1}, 3.5),
    ],
)
def test_verify_signature_garbage_returns_false(args):
    assert verify_signature(*args) is False


@settings(max_examples=300, deadline=None)
@given(
    pub=st.one_of(st.text(max_size=70), st.binary(max_size=40), st.none(), st.integers()),
    msg=st.one_of(st.binary(max_size=64), st.text(max_size=10), st.none()),
    sig=st.one_of(st.text(max_size=140), st.binary(max_size=70), st.none(), st.floats()),
)
def test_verify_signature_never_raises(pub, msg, sig):
    assert verify_signature(pub, msg, sig) is False


def test_derive_worker_key_is_deterministic_and_distinct():
    a = public_key_hex(derive_worker_key(7, 0))
    assert a == public_key_hex(derive_worker_key(7, 0))
    assert a != public_key_hex(derive_worker_key(7, 1))
    assert a != public_key_hex(derive_worker_key(8, 0))
    with pytest.raises(ValueError, match="worker must be >= 0"):
        derive_worker_key(7, -1)
    with pytest.raises(TypeError):
        derive_worker_key(7, True)


@pytest.mark.parametrize("fmt", ["pem", "hex"])
def test_key_file_round_trip_mode_0600(tmp_path, fmt):
    private, _ = generate_key()
    path = save_private_key(tmp_path / "w0.key", private, fmt=fmt)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert public_key_hex(load_private_key(path)) == public_key_hex(private)
    assert [p.name for p in tmp_path.iterdir()] == ["w0.key"]  # no temporary left behind
    with pytest.raises(IdentityError, match="already exists"):
        save_private_key(path, generate_key()[0], fmt=fmt)
    other, _ = generate_key()
    save_private_key(path, other, fmt=fmt, overwrite=True)
    assert public_key_hex(load_private_key(path)) == public_key_hex(other)


def test_load_private_key_errors_are_one_line(tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "nope.key"
    (tmp_path / "junk.key").write_text("not a key at all\n")
    cases["junk"] = tmp_path / "junk.key"
    (tmp_path / "big.key").write_bytes(b"0" * 5000)
    cases["big"] = tmp_path / "big.key"
    (tmp_path / "badpem.key").write_text(
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    )
    cases["badpem"] = tmp_path / "badpem.key"
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cases["ec"] = tmp_path / "ec.key"
    private, _ = generate_key()
    (tmp_path / "enc.key").write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    cases["enc"] = tmp_path / "enc.key"
    cases["dir"] = tmp_path
    expect = {
        "missing": "does not exist",
        "junk": "neither a PEM key nor 64 hex",
        "big": "not a key file",
        "badpem": "not a valid PEM",
        "ec": "not an Ed25519 key",
        "enc": "password-protected",
        "dir": "is a directory",
    }
    for name, path in cases.items():
        with pytest.raises(IdentityError) as info:
            load_private_key(path)
        msg = str(info.value)
        assert "\n" not in msg and expect[name] in msg and str(path) in msg, (name, msg)


def test_load_public_key_hex_and_pem():
    private, public = generate_key()
    pub = public_key_hex(public)
    assert public_key_hex(load_public_key(pub)) == pub
    assert public_key_hex(load_public_key(pub.upper() + "\n")) == pub
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert public_key_hex(load_public_key(pem)) == pub
    assert public_key_hex(load_public_key(pem.decode())) == pub
    for bad, match in [
        ("abc", "neither 64 hex"),
        ("é" * 64, "non-ASCII"),
        (42, "must be text"),
        ("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----", "not a valid PEM"),
    ]:
        with pytest.raises(IdentityError, match=match):
            load_public_key(bad, source="manifest worker 3")
    with pytest.raises(IdentityError, match="manifest worker 3"):
        load_public_key("xyz", source="manifest worker 3")
