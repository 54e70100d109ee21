"""Valkey / Mooncake config (no servers): secrets stay secret, URL credentials move out of the URL;
fault bursts are counted and logged once."""

from __future__ import annotations

import logging

import pytest

from kvtier.config import ConfigError, MooncakeConfig, ValkeyConfig, load_config
from kvtier.metrics import Telemetry
from kvtier.tiers.bursts import Bursts


def test_password_is_secret_everywhere():
    c = ValkeyConfig(url="redis://127.0.0.1:6379/0", password="hunter2-secret")
    assert "hunter2" not in repr(c) and "hunter2" not in str(c) and "hunter2" not in c.model_dump_json()
    assert c.password is not None and c.password.get_secret_value() == "hunter2-secret"


@pytest.mark.parametrize("url,user,pw,clean", [
    ("redis://:s3cret@10.0.0.1:6379/0", None, "s3cret", "redis://10.0.0.1:6379/0"),
    ("rediss://bob:p%40ss@cache.example:6380/2", "bob", "p@ss", "rediss://cache.example:6380/2"),
    ("redis://127.0.0.1:6379/0", None, None, "redis://127.0.0.1:6379/0"),
])
def test_url_credentials_move_out_of_the_url(url, user, pw, clean):
    c = ValkeyConfig(url=url)
    assert c.url == clean and c.username == user
    assert (c.password.get_secret_value() if c.password else None) == pw
    if pw:
        assert pw not in repr(c)


def test_password_from_environment():
    cfg = load_config(env={"KVTIER_STORE__SHARED__KIND": "valkey", "KVTIER_STORE__SHARED__PASSWORD": "envsecret1",
                           "KVTIER_STORE__SHARED__CLUSTER": "true"}).store.shared
    assert isinstance(cfg, ValkeyConfig) and cfg.cluster and cfg.password.get_secret_value() == "envsecret1"
    assert "envsecret1" not in repr(cfg)


def test_bad_values_are_one_line_errors():
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVTIER_STORE__SHARED__KIND": "mooncake", "KVTIER_STORE__SHARED__PROTOCOL": "udp"})
    assert "\n" not in str(e.value)
    assert MooncakeConfig().segment_bytes == 0


def test_bursts_count_every_fault_and_log_once_until_the_backend_answers(caplog):
    tm = Telemetry()
    b = Bursts(tm, "valkey")
    with caplog.at_level(logging.WARNING, logger="kvtier.store"):
        for _ in range(5):
            b.fault("down", "x")
        b.fault("full", "y", n=3)
        assert tm.counts["events.down"] == 5 and b.suppressed["down"] == 4     # every one counted
        assert tm.counts["events.full"] == 3 and b.suppressed["full"] == 2
        assert [r.getMessage() for r in caplog.records] == ["kvtier down event on valkey tier: x",
                                                            "kvtier full event on valkey tier: y"]
        b.ok()                      # the server answered: a new "down" burst logs again, "full" does not
        b.fault("down", "x")
        b.fault("full", "y")
        assert tm.counts["events.down"] == 6 and tm.counts["events.full"] == 4
        assert b.suppressed["down"] == 4 and b.suppressed["full"] == 3
        assert caplog.records[-1].getMessage() == "kvtier down event on valkey tier: x (+4 more since the last warning)"
        assert len(caplog.records) == 3