"""TLS material for the OTLP exporters' tests, made with the openssl command: self-signed
certificates (each its own CA) and an encrypted key."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_OPENSSL_TIMEOUT_S = 30


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl command not available to make test TLS material")
    subprocess.run([openssl, *args], check=True, capture_output=True, timeout=_OPENSSL_TIMEOUT_S)


def make_certificate(
    directory: Path, name: str, *, subject_alt_name: str = "DNS:localhost,IP:127.0.0.1"
) -> tuple[str, str]:
    """A self-signed EC certificate for ``subject_alt_name`` and its unencrypted key, as
    ``directory/name.pem`` and ``directory/name.key``: (certificate file, key file)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-days", "1", "-subj", f"/CN={name}"),
        *("-addext", f"subjectAltName={subject_alt_name}"),
        *("-keyout", str(key), "-out", str(cert)),
    )
    return str(cert), str(key)


def make_encrypted_key(directory: Path) -> str:
    """A passphrase-protected PKCS#8 EC private key (``ENCRYPTED PRIVATE KEY``)."""
    key = directory / "encrypted.key"
    _openssl(
        *("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-aes256", "-pass", "pass:secret", "-out", str(key)),
    )
    return str(key)
