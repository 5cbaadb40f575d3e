"""`bt export --sign` (issue 45, item 4): the package signed in the OpenSSF model-signing format is
accepted by model-signing's own verifier, and a flipped byte is rejected; nothing of it is
loaded by `bt plan`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO, Reference, run_bt

model_signing = pytest.importorskip("model_signing")
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402


def keypair(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / "export-key.pem", folder / "export-key.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def verify(package: Path, signature: Path, public: Path) -> None:
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(package, signature)


def test_a_signed_export_verifies_with_model_signing_and_a_flipped_byte_does_not(
    micro_built: Reference, tmp_path: Path
) -> None:
    store, plan, _ = micro_built
    private, public = keypair(tmp_path)
    destination = tmp_path / "package"
    done = run_bt("export", plan, str(destination), "--sign", str(private), store=store)
    assert done.returncode == 0, done.stderr
    signature = tmp_path / "package.sig"
    assert "model-signing format" in done.stderr and signature.is_file()
    verify(destination, signature, public)
    (tmp_path / "other").mkdir()
    other_public = keypair(tmp_path / "other")[1]
    with pytest.raises(ValueError):
        verify(destination, signature, other_public)
    copy = tmp_path / "flipped"
    shutil.copytree(destination, copy)
    weights = max((p for p in copy.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="mismatch"):
        verify(copy, signature, public)
    again = run_bt("export", plan, str(tmp_path / "p2"), "--sign", str(tmp_path / "missing.pem"), store=store)
    assert again.returncode == 2 and "no such key file" in again.stderr and "Traceback" not in again.stderr


def test_bt_plan_never_loads_model_signing(tmp_path: Path) -> None:
    env = {**os.environ, "BT_STORE": str(tmp_path / ".bt"), "BT_EXPERIMENTS": str(tmp_path / "experiments")}
    argv = [sys.executable, "-X", "importtime", "-m", "buildtrain", "plan", str(MICRO)]
    stderr = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stderr
    assert "model_signing" not in stderr and "OpenSSL" not in stderr
