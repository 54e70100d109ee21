"""The Valkey tier over TLS: ``rediss://`` with the deployment's CA works end to end; a server whose
certificate the CA did not sign, or a plain client against a TLS port, is an unavailable tier with a
counted event, never an exception and never a silent plaintext fallback.

The embedded ``valkey-server`` is built without TLS (see tests/services/tls_proxy.py), so a TLS
terminator with certificates made here stands in for the server side; kvtier's client side (URL
scheme, ``tls``, ``tls_ca_file``, verification) is what is tested. Cost: a few seconds.
"""

from __future__ import annotations

import pytest

from kvtier.config import ValkeyConfig
from kvtier.metrics import Telemetry
from kvtier.tiers.protocol import Deadline, Status
from kvtier.tiers.valkey import ValkeyTier
from kvtier.ports import free_port
from tests.services.chunks import NS, buffers, chain, items
from tests.services.fixtures import valkey_password_server  # noqa: F401
from tests.services.tls_proxy import Pki, TlsProxy
from kvtier.services.valkey_server import ValkeyServer, valkey_binary

pytestmark = pytest.mark.integration


def _tier(url: str, **kw) -> tuple[ValkeyTier, Telemetry]:
    tm = Telemetry()
    cfg = ValkeyConfig(url=url, lookup_timeout_s=2, io_timeout_s=5, probe_interval_s=0.2, **kw)
    return ValkeyTier.open(cfg, NS, tm), tm


def test_embedded_server_has_no_tls_so_a_terminator_stands_in(tmp_path):
    """Documents why the server side is a terminator: this valkey-server refuses --tls-port."""
    import subprocess

    r = subprocess.run([valkey_binary(), "--port", "0", "--bind", "127.0.0.1", "--tls-port", str(free_port()),
                        "--save", ""], capture_output=True, text=True, timeout=15, cwd=tmp_path)
    assert r.returncode != 0 and "Failed finding TLS support" in r.stdout + r.stderr, \
        "this valkey-server supports TLS now: test its --tls-port directly instead of the terminator"


def test_tls_with_password_round_trip_and_refusals(tmp_path, valkey_password_server: ValkeyServer):
    pki, other = Pki.create(tmp_path, "ours"), Pki.create(tmp_path, "theirs")
    proxy = TlsProxy.start(pki, valkey_password_server.port)
    try:
        url = f"rediss://127.0.0.1:{proxy.port}/0"
        tier, tm = _tier(url, password=valkey_password_server.password, tls_ca_file=pki.ca_file)
        try:
            chunks = chain(4)
            keys = [m.key for m, _ in chunks]
            assert tier.write(items(chunks)) == [True] * 4
            assert tier.longest_prefix(keys, Deadline.after(5)).num_chunks == 4
            outs = buffers(chunks)
            res = tier.read_into(keys, outs, Deadline.after(5))
            assert all(r.ok for r in res) and all(bytes(o) == p for o, (_, p) in zip(outs, chunks))
            assert not [k for k in tm.counts if k.startswith("events.")]
        finally:
            tier.close()
        assert valkey_password_server.client().dbsize() == 4          # it went through the terminator
        # ``tls: true`` with a redis:// URL is TLS too (the same CA): reads what the first client wrote
        tier, tm = _tier(f"redis://127.0.0.1:{proxy.port}/0", tls=True, password=valkey_password_server.password,
                         tls_ca_file=pki.ca_file)
        try:
            assert tier.longest_prefix(keys, Deadline.after(5)).num_chunks == 4
        finally:
            tier.close()

        # a CA that did not sign the server's certificate: the handshake fails, the tier is unavailable
        tier, tm = _tier(url, password=valkey_password_server.password, tls_ca_file=other.ca_file)
        try:
            assert tier.longest_prefix(keys, Deadline.after(5)).status is Status.UNAVAILABLE
            assert tier.write(items(chunks[:1])) == [False]
            assert sum(v for k, v in tm.counts.items() if k.startswith("events.")) >= 1
        finally:
            tier.close()
        assert proxy.handshakes_failed >= 1

        # a plain client against the TLS port: no answer it can parse, unavailable (never plaintext data)
        tier, tm = _tier(f"redis://127.0.0.1:{proxy.port}/0", password=valkey_password_server.password)
        try:
            assert tier.longest_prefix(keys, Deadline.after(5)).status is Status.UNAVAILABLE
        finally:
            tier.close()
    finally:
        proxy.stop()
