"""The package cache's local certificate authority (``cryptography``).

The CA's key is generated on the host, written ``0600`` in a ``0700`` directory of
the server's cache dir (``<cache>/package-cache-ca/``, beside, never inside, what
is mounted into containers) and never leaves the host process: containers get
only the CA's certificate (read-only), the proxy terminates TLS of a CONNECT
tunnel with a leaf certificate for the tunnel's host signed by this CA (one EC
key for every leaf; leaves kept in memory), and re-encrypts to the upstream with
full verification.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import secrets
import ssl
import stat
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CA_CERT", "CA_KEY", "LocalCA"]

CA_KEY: Final = "ca-key.pem"
CA_CERT: Final = "ca-cert.pem"
_CA_NAME: Final = "harbor-exec package cache CA"
_LEAF_DAYS: Final = 30
_CA_DAYS: Final = 3650
_MAX_LEAVES: Final = 1024


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class LocalCA:
    """A CA loaded from (or created in) ``directory``, minting per-host TLS contexts."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
        key_path, cert_path = directory / CA_KEY, directory / CA_CERT
        if not (key_path.exists() and cert_path.exists()):
            # Several processes may start at once: one creates, the others read it.
            lock = directory.with_name(f".{directory.name}.lock")
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not (key_path.exists() and cert_path.exists()):
                    self._create(key_path, cert_path)
            finally:
                os.close(fd)
        mode = stat.S_IMODE(key_path.stat().st_mode)
        if mode & 0o077:
            raise PermissionError(
                f"the package cache CA key {key_path} is readable by others (mode {mode:o}); "
                "it must be 0600"
            )
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an EC private key")
        self._key = key
        self.cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        self.cert_path = cert_path
        self.cert_pem = cert_path.read_bytes()
        # One key for every leaf (generated per process, never written out).
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _create(key_path: Path, cert_path: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        # A name of its own (so a hash of its own in a system store's directory: no
        # other CA's file, another machine's cache CA included, is ever shadowed).
        unique = f"{_CA_NAME} {secrets.token_hex(4)}"
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, unique)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # 0600 from the first byte: created with O_EXCL and the mode, never chmod'ed later.
        tmp_key = key_path.with_name(f".{key_path.name}.{os.getpid()}")
        fd = os.open(tmp_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        os.replace(tmp_key, key_path)
        tmp_cert = cert_path.with_name(f".{cert_path.name}.{os.getpid()}")
        tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        os.chmod(tmp_cert, 0o644)
        os.replace(tmp_cert, cert_path)

    def leaf_pem(self, host: str) -> bytes:
        """A certificate for ``host`` (a name or an address literal), PEM."""
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, host: str) -> ssl.SSLContext:
        """The server-side TLS context presenting ``host``'s leaf (kept, bounded LRU)."""
        host = host.lower().strip("[]")
        with self._lock:
            context = self._contexts.get(host)
            if context is not None:
                self._contexts.move_to_end(host)
                return context
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # load_cert_chain reads files only: a private 0600 temporary file in the CA's
        # 0700 directory, removed at once.
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=".leaf-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(self.leaf_pem(host) + self.cert_pem + key_pem)
            context.load_cert_chain(name)
        finally:
            os.unlink(name)
        with self._lock:
            self._contexts[host] = context
            while len(self._contexts) > _MAX_LEAVES:
                self._contexts.popitem(last=False)
        return context
