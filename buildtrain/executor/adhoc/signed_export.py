"""`bt export --sign KEY`: sign an export package in the OpenSSF model-signing format, so anyone
can check it with a standard tool (`model_signing verify key PACKAGE --signature PACKAGE.sig
--public_key KEY.pub`) without buildtrain.

Private-key mode (an elliptic-curve key, the kind model-signing's `key` method takes), offline:
no certificate authority and no transparency log are contacted. `model-signing` (and pyOpenSSL,
which it imports without declaring it) are imported here only, so `bt plan`, a null build and an
unsigned export never load them.
"""

from __future__ import annotations

from pathlib import Path

from buildtrain.errors import UsageError


def signature_path(package: Path) -> Path:
    """Beside the package, not inside it: the package stays exactly what the store exported."""
    return package.with_name(f"{package.name}.sig")


def sign_export(package: Path, private_key: Path) -> Path:
    """Sign every file of `package` with `private_key` (PEM); the signature's path."""
    try:
        import model_signing
    except ImportError as exc:
        raise UsageError(
            f"bt export --sign needs model-signing and pyOpenSSL ({exc}): pip install 'buildtrain[sign]'"
        ) from None
    signature = signature_path(package)
    if signature.exists():
        raise UsageError(f"{signature} exists: move it away, or export to another destination")
    if not private_key.is_file():
        raise UsageError(f"--sign {private_key}: no such key file (an elliptic-curve private key in PEM)")
    try:
        model_signing.signing.Config().use_elliptic_key_signer(private_key=private_key).sign(
            package, signature
        )
    except (ValueError, TypeError) as exc:
        signature.unlink(missing_ok=True)
        raise UsageError(
            f"--sign {private_key}: not usable ({exc}); give an elliptic-curve (P-256) private key in PEM, "
            "e.g. openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt"
        ) from None
    return signature
