"""HAProxy config generation for the cluster demo's balancer (kvtier.services.haproxy)."""

from __future__ import annotations

import shutil

import pytest

from kvtier.services.haproxy import (CONVERSATION_HEADER, SERVED_BY_HEADER, Backend, BalancerSpec, HaproxyError,
                                     check_config, render_config)

BACKENDS = (Backend("r0", 18001), Backend("r1", 18002))


def _backend_section(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("backend replicas")
    return [x.strip() for x in lines[start + 1:] if x.strip()]


def test_roundrobin_config_lists_every_replica_with_health_checks():
    text = render_config(BalancerSpec(port=18000, mode="roundrobin", backends=BACKENDS))
    body = _backend_section(text)
    assert "balance roundrobin" in body
    assert not any(x.startswith("hash-type") for x in body)
    servers = [x for x in body if x.startswith("server ")]
    assert servers == ["server r0 127.0.0.1:18001 check inter 1000ms fall 2 rise 1",
                       "server r1 127.0.0.1:18002 check inter 1000ms fall 2 rise 1"]
    assert "option httpchk GET /health" in body
    assert f"http-response set-header {SERVED_BY_HEADER} %s" in body
    assert "bind 127.0.0.1:18000" in text
    assert "option redispatch" in text


def test_sticky_config_hashes_the_conversation_header_consistently():
    body = _backend_section(render_config(BalancerSpec(port=18000, mode="sticky", backends=BACKENDS)))
    assert f"balance hdr({CONVERSATION_HEADER})" in body
    assert "hash-type consistent" in body


@pytest.mark.parametrize("spec, message", [
    (BalancerSpec(port=18000, mode="random", backends=BACKENDS), "unknown balance mode"),
    (BalancerSpec(port=18000, mode="sticky", backends=()), "at least one replica"),
    (BalancerSpec(port=18000, mode="sticky", backends=(Backend("r0", 1), Backend("r0", 2))), "distinct"),
    (BalancerSpec(port=0, mode="sticky", backends=BACKENDS), "balancer port"),
    (BalancerSpec(port=18000, mode="sticky", backends=(Backend("r 0", 1),)), "letters"),
    (BalancerSpec(port=18000, mode="sticky", backends=BACKENDS, header="X Bad"), "header"),
])
def test_bad_settings_are_one_line_errors(spec, message):
    with pytest.raises(HaproxyError, match=message) as e:
        render_config(spec)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/setup.sh installs it)")
@pytest.mark.parametrize("mode", ["roundrobin", "sticky"])
def test_haproxy_accepts_the_written_config(tmp_path, mode):
    path = tmp_path / f"{mode}.cfg"
    path.write_text(render_config(BalancerSpec(port=18000, mode=mode, backends=BACKENDS)))
    check_config(path)           # raises HaproxyError with HAProxy's complaint otherwise


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/setup.sh installs it)")
def test_haproxy_refusal_is_reported(tmp_path):
    path = tmp_path / "bad.cfg"
    path.write_text("backend x\n    balance nonsense\n")
    with pytest.raises(HaproxyError, match="haproxy refused"):
        check_config(path)
