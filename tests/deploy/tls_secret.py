"""A TLS Secret's files as cert-manager writes them (tls.crt, tls.key, ca.crt), made with a throwaway CA: one ECDSA
identity for server and client auth listing the given names, as the chart's Certificate asks for."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _certificate(subject: str, issuer: str, public_key, signing_key, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def write_tls_secret(directory: Path, names: list[str]) -> Path:
    """``directory`` holding tls.crt, tls.key and ca.crt; ``names``: DNS names or IP addresses the leaf lists."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("splitserve test CA", "splitserve test CA", ca_key.public_key(), ca_key,
                      [(x509.BasicConstraints(ca=True, path_length=None), True)])
    alt_names = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    leaf = _certificate(names[0], "splitserve test CA", key.public_key(), ca_key, [
        (x509.SubjectAlternativeName(alt_names), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (directory / "tls.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory
