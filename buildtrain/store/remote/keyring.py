"""This user's builder key and the keyring of public keys they trust, in their config folder:

    $BT_KEYS, else $XDG_CONFIG_HOME/buildtrain/keys, else ~/.config/buildtrain/keys
        builder.pem          this builder's Ed25519 private key (PKCS#8 PEM, mode 0600)
        trusted/<name>.pem   one trusted public key each (SubjectPublicKeyInfo PEM)

Only what the user puts in `trusted/` (`bt keys trust`, or `bt keys generate` for their own key)
counts toward `--min-attestations`: a remote never adds a key. A private key readable by others is
refused rather than used. Nothing here touches a remote.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs

from buildtrain.errors import UsageError
from buildtrain.store.remote import keys, signing

# Through signing.py, which turns a missing cryptography into one line.
Ed25519PrivateKey, serialization = signing.Ed25519PrivateKey, signing.serialization

ENVIRONMENT = "BT_KEYS"
BUILDER = "builder.pem"
TRUSTED = "trusted"
SELF = "self"  # the name `bt keys generate` trusts this builder's own key under


def folder() -> Path:
    """Where this user's keys live (see the module docstring)."""
    if os.environ.get(ENVIRONMENT):
        return Path(os.environ[ENVIRONMENT])
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "buildtrain" / "keys"


@attrs.frozen(kw_only=True)
class Keyring:
    """The trusted public keys: key id -> (name, raw public key)."""

    names: dict[str, str]
    public: dict[str, bytes]

    def name(self, keyid: str) -> str:
        return self.names.get(keyid, f"untrusted {keyid[:12]}")


def load_keyring(root: Path | None = None) -> Keyring:
    """Every key in `trusted/`; a file that is not an Ed25519 PEM key fails closed (exit 2)."""
    trusted = (root or folder()) / TRUSTED
    names, public = {}, {}
    for path in sorted(trusted.glob("*.pem")) if trusted.is_dir() else ():
        raw = _read_public(path)
        keyid = signing.key_id(raw)
        names[keyid], public[keyid] = path.stem, raw
    return Keyring(names=names, public=public)


def _read_public(path: Path) -> bytes:
    try:
        return signing.parse_public_pem(path.read_text(encoding="ascii"))
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{path}: not a trusted key ({exc}); remove it, or bt keys trust FILE again"
        ) from None


def builder_key(root: Path | None = None, *, create: bool = False) -> Ed25519PrivateKey:
    """This builder's private key; with `create`, made (and trusted as 'self') when there is none."""
    path = (root or folder()) / BUILDER
    if not path.exists():
        if not create:
            raise UsageError(f"no builder key at {path}: run bt keys generate")
        return generate(root)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise UsageError(f"{path} is readable by others (mode {mode:o}): chmod 600 it, or generate a new key")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(
            f"{path}: not a private key ({exc}); move it away and run bt keys generate"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"{path}: not an Ed25519 key; move it away and run bt keys generate")
    return key


def generate(root: Path | None = None) -> Ed25519PrivateKey:
    """A new builder key, written create-only with mode 0600, and trusted as 'self'."""
    base = root or folder()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        # Created 0600 in one call, never widened: no moment where another user could read it.
        handle = os.open(base / BUILDER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(
            f"{base / BUILDER} exists: this builder already has a key (bt keys export)"
        ) from None
    with os.fdopen(handle, "wb") as out:
        out.write(pem)
        out.flush()
        os.fsync(out.fileno())
    trust(signing.raw_public(key), SELF, base)
    return key


def trust(public: bytes, name: str, root: Path | None = None) -> str:
    """Add a public key to the keyring under `name`; its key id. A name or key already there is
    an error naming it (untrust it first)."""
    if not keys.NAME.match(name):
        raise UsageError(f"key name {name!r}: use letters, digits, '.', '_' and '-', not starting with '.'")
    keyid, ring = signing.key_id(public), load_keyring(root)
    if keyid in ring.names:
        raise UsageError(f"key {keyid[:16]} is already trusted as {ring.names[keyid]!r}")
    trusted = (root or folder()) / TRUSTED
    trusted.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        with open(trusted / f"{name}.pem", "x", encoding="ascii") as out:
            out.write(signing.public_pem(public))
    except FileExistsError:
        raise UsageError(f"a key named {name!r} is already trusted: bt keys untrust {name} first") from None
    return keyid


def untrust(name: str, root: Path | None = None) -> None:
    path = (root or folder()) / TRUSTED / f"{name}.pem"
    if not keys.NAME.match(name) or not path.is_file():
        raise UsageError(f"no trusted key named {name!r} (bt keys ls lists them)")
    path.unlink()
