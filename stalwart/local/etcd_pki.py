"""A throw-away certificate authority for the local etcd's TLS: a CA, a server certificate for loopback, and
client certificates, written as PEM files (``ca.crt``, ``server.crt``/``server.key``, ``tls.crt``/``tls.key``:
the names of a Kubernetes TLS Secret). For tests, development and the local cluster only.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertPair", "LocalCA"]

_VALID = datetime.timedelta(days=7)


@dataclass(frozen=True, slots=True)
class CertPair:
    cert: bytes
    key: bytes = field(repr=False)


#: The CN of the client certificate job pods present (issue 31): it must name no etcd user.
JOB_CLIENT_NAME = "stalwart-job-client"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class LocalCA:
    """A CA that signs server and client certificates. ``name`` goes into its subject, so that two CAs made
    for one test (the right one and a wrong one) are told apart in errors."""

    def __init__(self, name: str = "stalwart-local-ca") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256()))

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, *, server: bool, hosts: tuple[str, ...] = ()) -> CertPair:
        """A certificate for a server (``hosts``: DNS names or IP addresses it answers on) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
            else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self._cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return CertPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def write(self, directory: Path, *, hosts: tuple[str, ...], client_name: str = "stalwart-client") -> Path:
        """Write ``ca.crt``, ``server.crt``/``server.key`` for ``hosts``, ``tls.crt``/``tls.key`` (the operator's
        client certificate) and ``job-tls.crt``/``job-tls.key`` (the one job pods present) into ``directory``
        (keys readable by the owner only); returns ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        server = self.issue("stalwart-etcd", server=True, hosts=hosts)
        client = self.issue(client_name, server=False)
        job = self.issue(JOB_CLIENT_NAME, server=False)  # what job pods present: its CN is no etcd user
        files = {"ca.crt": self.cert_pem, "server.crt": server.cert, "server.key": server.key,
                 "tls.crt": client.cert, "tls.key": client.key, "job-tls.crt": job.cert, "job-tls.key": job.key}
        for name, data in files.items():
            path = directory / name
            path.write_bytes(data)
            path.chmod(0o600 if name.endswith(".key") else 0o644)
        return directory
