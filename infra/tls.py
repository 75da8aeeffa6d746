"""A private CA and a server certificate for the local broker's SASL_SSL listener (127.0.0.1 and localhost), made
once with the `cryptography` package. A broker elsewhere brings its own certificates (docs/security.md)."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_ca_and_server(directory: Path, days: int = 825) -> dict[str, Path]:
    """ca.pem (the CA certificate clients trust) and server.pem (the broker's PKCS#8 key and certificate chain, the
    PEM keystore Kafka reads). Kept when present."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_path, key_path = directory / "ca.pem", directory / "server.pem"
    if ca_path.exists() and key_path.exists():
        return {"ca": ca_path, "key": key_path}
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("gpupool local CA")).issuer_name(_name("gpupool local CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    _write(ca_path, ca.public_bytes(pem))
    _write(key_path, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
           + cert.public_bytes(pem) + ca.public_bytes(pem))
    return {"ca": ca_path, "key": key_path}
