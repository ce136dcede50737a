"""The coordinator's CA and server certificate, and the node's pin check."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tangramd.cluster.pki import (
    CertInvalid,
    PinMismatch,
    ca_sha256,
    ensure_pki,
    normalise_pin,
    verify_server,
)


def _now() -> datetime.datetime:
    """Now, when the test runs (a module-level time went stale: certificates made more
    than their 5 minutes of back-dating after the module's import were 'not valid now')."""
    return datetime.datetime.now(datetime.timezone.utc)


def _leaf_der(pki_dir: Path) -> bytes:
    pem = (pki_dir / "pki" / "server.pem").read_bytes()
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


def test_created_once_private_and_kept(tmp_path: Path) -> None:
    """First start creates CA and server cert with 0600 keys; a restart keeps the CA."""
    first = ensure_pki(tmp_path, ["127.0.0.1"])
    for path in (first.ca_key, first.server_key, first.ca_cert, first.server_cert):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    pin = first.ca_sha256()
    first.server_cert.unlink()  # a lost server certificate is reissued by the same CA
    second = ensure_pki(tmp_path, ["127.0.0.1"])
    assert second.ca_sha256() == pin and second.server_cert.exists()
    verify_server(second.ca_pem(), _leaf_der(tmp_path), pin, _now())


def test_pin_mismatch_names_both_hashes(tmp_path: Path) -> None:
    """A pin for another CA fails, saying which hash was expected and which was found."""
    pki = ensure_pki(tmp_path, [])
    wrong = "sha256:" + "ab" * 32
    with pytest.raises(PinMismatch) as info:
        verify_server(pki.ca_pem(), _leaf_der(tmp_path), wrong, _now())
    assert f"expected {wrong}" in str(info.value) and f"got {pki.ca_sha256()}" in str(info.value)


def test_server_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    """The right CA with a server certificate it did not sign (a man in the middle) fails."""
    ours = ensure_pki(tmp_path / "ours", [])
    ensure_pki(tmp_path / "theirs", [])
    with pytest.raises(CertInvalid, match="not signed by the pinned CA"):
        verify_server(ours.ca_pem(), _leaf_der(tmp_path / "theirs"), ours.ca_sha256(), _now())


def test_expired_server_certificate_is_refused(tmp_path: Path) -> None:
    """Outside its validity window the server certificate is refused."""
    pki = ensure_pki(tmp_path, [])
    later = _now() + datetime.timedelta(days=10_000)
    with pytest.raises(CertInvalid, match="not valid now"):
        verify_server(pki.ca_pem(), _leaf_der(tmp_path), pki.ca_sha256(), later)


def test_pin_format() -> None:
    """Pins are compared as sha256:<lowercase hex>, prefix optional on input."""
    assert normalise_pin("ABCD") == "sha256:abcd"
    assert normalise_pin(" sha256:abcd ") == "sha256:abcd"


def test_hash_is_of_the_public_key(tmp_path: Path) -> None:
    """The pin is 64 hex digits after sha256: (kubeadm's discovery-token-ca-cert-hash)."""
    digest = ca_sha256(ensure_pki(tmp_path, []).ca_pem())
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    int(digest[7:], 16)
