"""The cluster's PKI: the coordinator's CA and server certificate, and the node's pin check.

Like ``kubeadm join``: the coordinator creates a private CA on its first start and a server
certificate signed by it; both stay in its state dir (keys 0600) across restarts. A node
learns the CA's hash out of band (``tangramctl cluster join`` prints it) and, before it
sends anything secret, checks that

1. the CA the coordinator presents hashes to the pin (SHA-256 of its DER
   SubjectPublicKeyInfo, written ``sha256:<hex>`` as kubeadm does), and
2. the certificate the TLS handshake was made with is signed by that CA and valid now.

The TLS handshake proves that the peer holds the server certificate's key, so after both
checks the channel is bound to the coordinator that owns the CA: only then does the node
send its join token or credential.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_DAYS = 3650
SERVER_DAYS = 825


class PinMismatch(Exception):
    """The coordinator's CA does not hash to the pinned value."""

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(
            f"coordinator CA hash mismatch: expected {expected}, got {got} "
            "(wrong --ca-sha256, or not the coordinator you think)"
        )
        self.expected = expected
        self.got = got


class CertInvalid(Exception):
    """The server certificate is not signed by the pinned CA, or not valid now."""


@dataclass(frozen=True, slots=True)
class CoordinatorPki:
    """Paths of the coordinator's CA and server certificate (PEM) in its state dir."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    def ca_pem(self) -> bytes:
        return self.ca_cert.read_bytes()

    def ca_sha256(self) -> str:
        return ca_sha256(self.ca_pem())

    def server_context(self) -> ssl.SSLContext:
        """TLS server context: the server certificate; clients are not asked for one
        (nodes authenticate with their token or credential inside the channel)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.server_cert, self.server_key)
        return ctx


def ca_sha256(ca_pem: bytes) -> str:
    """``sha256:<hex>`` of the CA's DER SubjectPublicKeyInfo (the kubeadm pin format)."""
    cert = x509.load_pem_x509_certificate(ca_pem)
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def normalise_pin(pin: str) -> str:
    """``sha256:<hex>`` from a pin given with or without the prefix, any case."""
    pin = pin.strip().lower()
    return pin if pin.startswith("sha256:") else "sha256:" + pin


def verify_server(ca_pem: bytes, leaf_der: bytes, pin: str, now: datetime.datetime) -> None:
    """Raise PinMismatch or CertInvalid unless ``leaf_der`` is signed by the pinned CA."""
    expected, got = normalise_pin(pin), ca_sha256(ca_pem)
    if expected != got:
        raise PinMismatch(expected, got)
    ca = x509.load_pem_x509_certificate(ca_pem)
    leaf = x509.load_der_x509_certificate(leaf_der)
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise CertInvalid(f"server certificate is not signed by the pinned CA: {exc}") from None
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise CertInvalid(
            f"server certificate is not valid now (valid {leaf.not_valid_before_utc} "
            f"to {leaf.not_valid_after_utc})"
        )


def client_context() -> ssl.SSLContext:
    """TLS client context of a node: the chain is checked by :func:`verify_server` against
    the pin (there is no hostname to check: the coordinator is named by its CA)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def cert_sha256(der: bytes) -> str:
    """``sha256:<hex>`` of the SubjectPublicKeyInfo of a DER certificate (as a pin)."""
    spki = (
        x509.load_der_x509_certificate(der)
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def input_port_context(root: Path) -> tuple[ssl.SSLContext, str]:
    """A node's TLS server context for its input port and the pin other nodes check it by.

    A fresh key and a self-signed certificate each start (files in ``root``, 0600): the
    node tells the coordinator the pin over its authenticated link (``hello``'s
    ``input_pin``), and the coordinator tells the node that pulls (``run_exec``'s
    ``fetch``), so no CA is needed; the ticket the puller sends says who it is."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    key, cert = _self_signed("tangram node input port", now, SERVER_DAYS)
    cert_path, key_path = root / "input.pem", root / "input.key"
    _write_private(key_path, _key_pem(key))
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_path, key_path)
    return ctx, cert_sha256(cert.public_bytes(serialization.Encoding.DER))


# --------------------------------------------------------------------------- creation


def ensure_pki(state_dir: str | os.PathLike[str], hosts: list[str]) -> CoordinatorPki:
    """The coordinator's CA and server certificate, created on first start and kept.

    A server certificate is (re)issued by the kept CA when it is missing; the CA itself is
    never replaced (that would change the pin every node holds).
    """
    root = Path(state_dir) / "pki"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    pki = CoordinatorPki(root / "ca.pem", root / "ca.key", root / "server.pem", root / "server.key")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not (pki.ca_cert.exists() and pki.ca_key.exists()):
        key, cert = _self_signed("tangram cluster CA", now, CA_DAYS, ca=True)
        _write_private(pki.ca_key, _key_pem(key))
        _write_private(pki.ca_cert, cert.public_bytes(serialization.Encoding.PEM))
        pki.server_cert.unlink(missing_ok=True)
    if not (pki.server_cert.exists() and pki.server_key.exists()):
        _issue_server(pki, hosts, now)
    return pki


def _self_signed(
    common_name: str, now: datetime.datetime, days: int, *, ca: bool = False
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh P-256 key and a certificate it signs itself, valid from 5 minutes ago for
    ``days``; with ``ca``, a CA that signs certificates (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    if ca:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=0), critical=True
        ).add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
    return key, builder.sign(key, hashes.SHA256())


def _issue_server(pki: CoordinatorPki, hosts: list[str], now: datetime.datetime) -> None:
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey), "the CA key is an EC key"
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tangram coordinator")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(pki.server_key, _key_pem(key))
    _write_private(pki.server_cert, cert.public_bytes(serialization.Encoding.PEM))


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the start (never readable by others)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
