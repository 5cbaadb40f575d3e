"""`bt keys`: this builder's signing key and the keyring of builders this user trusts (see
`store/remote/keyring.py`). A thin layer: each subcommand is one call and one print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from buildtrain.cli.common import err
from buildtrain.errors import ExitCode, UsageError


def cmd_keys(args: argparse.Namespace) -> int:
    from buildtrain.store.remote import keyring, signing

    if args.action == "generate":
        key = keyring.generate()
        err(f"builder key written to {keyring.folder() / keyring.BUILDER} (mode 0600), trusted as 'self'")
        print(signing.key_id(signing.raw_public(key)))
    elif args.action == "export":
        print(signing.public_pem(signing.raw_public(keyring.builder_key())), end="")
    elif args.action == "trust":
        keyid = keyring.trust(_public_key(args.key), args.name)
        err(f"trusted {args.name!r}: its signatures now count toward --min-attestations")
        print(keyid)
    elif args.action == "untrust":
        keyring.untrust(args.name)
        err(f"{args.name!r} no longer trusted: its attestations count 0")
    else:
        ring = keyring.load_keyring()
        if not ring.names:
            err(f"no trusted keys in {keyring.folder() / keyring.TRUSTED} (bt keys generate, bt keys trust)")
        for keyid, name in sorted(ring.names.items(), key=lambda item: item[1]):
            print(f"{keyid}  {name}")
    return ExitCode.OK


def _public_key(given: str) -> bytes:
    """A public key from a PEM file, '-' (stdin), or the PEM text itself."""
    from buildtrain.store.remote import signing

    if given.lstrip().startswith("-----BEGIN"):
        text, where = given, "the key given"
    elif given == "-":
        text, where = sys.stdin.read(), "stdin"
    else:
        try:
            text, where = Path(given).read_text(encoding="ascii"), given
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(
                f"bt keys trust: cannot read {given} ({exc}); give the file bt keys export wrote"
            ) from None
    try:
        return signing.parse_public_pem(text)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}; give the PEM that bt keys export prints") from None
