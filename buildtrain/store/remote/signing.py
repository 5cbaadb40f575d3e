"""Signed statements: Ed25519 keys, key ids, and DSSE envelopes around in-toto statements.

An attestation on a remote is a DSSE envelope (https://github.com/secure-systems-lab/dsse):
`{"payloadType", "payload" (base64), "signatures": [{"keyid", "sig"}]}`, each signature an
Ed25519 signature over DSSE's pre-authentication encoding (PAE) of the payload type and the
payload's bytes, so a signature over one type can never be replayed as another. The payload here
is always an in-toto Statement v1 (`attest.py` writes and reads it). Nothing here knows where keys
live (`keyring.py`) or what a statement says (`attest.py`). `cryptography` is imported here only,
and this module only when a remote attests or counts attestations.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

import attrs

from buildtrain.canonical import canonical_bytes
from buildtrain.errors import UsageError

try:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
except ImportError:  # one line, not a traceback: a remote's attestations are signed
    raise UsageError(
        "attestations are signed with Ed25519 keys, which need cryptography: pip install 'buildtrain[remote]'"
    ) from None

PAYLOAD_TYPE = "application/vnd.in-toto+json"


def key_id(public: bytes) -> str:
    """A key's id: the sha256 of its 32 raw public bytes, in hex (what a keyring and a signature
    name it by; never trusted on its own: the signature is checked with the keyring's key)."""
    return hashlib.sha256(public).hexdigest()


def raw_public(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_pem(public: bytes) -> str:
    """A raw public key as the PEM (SubjectPublicKeyInfo) that `bt keys export` prints and
    OpenSSL, `bt keys trust` and model-signing read."""
    key = Ed25519PublicKey.from_public_bytes(public)
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem.decode("ascii")


def parse_public_pem(text: str) -> bytes:
    """The raw bytes of an Ed25519 public key in PEM; ValueError for anything else."""
    try:
        key = serialization.load_pem_public_key(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError, TypeError):
        raise ValueError("not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"a {type(key).__name__.removeprefix('_')} key, not an Ed25519 one")
    return raw_public(key)


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed (lengths are ASCII decimal)."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def envelope(statement: dict[str, Any], private: Ed25519PrivateKey) -> dict[str, Any]:
    """The statement (canonical JSON: the same statement is the same bytes) signed by one key."""
    payload = canonical_bytes(statement)
    signature = private.sign(pae(PAYLOAD_TYPE, payload))
    return {
        "payload": base64.b64encode(payload).decode("ascii"),
        "payloadType": PAYLOAD_TYPE,
        "signatures": [{"keyid": key_id(raw_public(private)), "sig": base64.b64encode(signature).decode()}],
    }


@attrs.frozen(kw_only=True)
class Opened:
    """An envelope's statement and the key ids whose signature verified over it."""

    statement: dict[str, Any]
    signers: frozenset[str]
    """Key ids (among those given) whose signature verifies."""
    claimed: frozenset[str]
    """Every key id a signature names, verified or not."""


def open_envelope(envelope_body: Any, trusted: dict[str, bytes]) -> Opened:
    """Decode an envelope and check each signature that names a key in `trusted` (key id ->
    raw public key). ValueError when it is not a well-formed in-toto DSSE envelope."""
    if not isinstance(envelope_body, dict) or envelope_body.get("payloadType") != PAYLOAD_TYPE:
        raise ValueError("not a DSSE envelope of an in-toto statement")
    signatures = envelope_body.get("signatures")
    if not isinstance(signatures, list) or not all(isinstance(s, dict) for s in signatures):
        raise ValueError("envelope signatures are not a list")
    try:
        payload = base64.b64decode(str(envelope_body.get("payload")), validate=True)
        statement = json.loads(payload)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"envelope payload does not decode ({exc})") from None
    if not isinstance(statement, dict):
        raise ValueError("envelope payload is not a JSON object")
    message, signers = pae(PAYLOAD_TYPE, payload), set()
    for entry in signatures:
        keyid = entry.get("keyid")
        if keyid in trusted and _verifies(trusted[keyid], message, entry.get("sig")):
            signers.add(keyid)
    claimed = frozenset(str(entry.get("keyid")) for entry in signatures)
    return Opened(statement=statement, signers=frozenset(signers), claimed=claimed)


def _verifies(public: bytes, message: bytes, sig: Any) -> bool:
    try:
        signature = base64.b64decode(str(sig), validate=True)
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (binascii.Error, ValueError, InvalidSignature):
        return False
    return True
