"""The vLLM launcher's process logic, exercised with a fake server command (no vLLM)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtier.server import ServerError, ServerSpec, VllmServer, build_command, kv_transfer_config

FAKE = str(Path(__file__).with_name("fake_openai_server.py"))
ROOT = str(Path(__file__).resolve().parents[2])


def fake_cmd(*extra: str) -> list[str]:
    return [sys.executable, FAKE, "--port", "{port}", *extra]


def fake_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT}


def spec(**kw) -> ServerSpec:
    return ServerSpec(name="t", model="/models/m", **kw)


def test_build_command_for_plain_vllm():
    cmd = build_command(spec(max_model_len=2048, max_num_batched_tokens=512, dtype="float32",
                             extra_args=("--max-num-seqs", "8")), port=8123)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    s = " ".join(cmd)
    for part in ("--model /models/m", "--enforce-eager", "--port 8123", "--host 127.0.0.1",
                 "--max-model-len 2048", "--max-num-batched-tokens 512", "--dtype float32",
                 "--enable-prompt-tokens-details", "--enable-prefix-caching", "--max-num-seqs 8"):
        assert part in s
    assert "--kv-transfer-config" not in cmd
    assert "--no-enable-prefix-caching" in build_command(spec(enable_prefix_caching=False), port=1)


def test_build_command_always_names_the_dtype(monkeypatch):
    from kvtier.compute import choose_dtype

    monkeypatch.delenv("KVTIER_DTYPE", raising=False)
    auto = choose_dtype("auto").dtype
    for d in ("auto", None):
        cmd = build_command(spec(dtype=d), port=1)
        assert cmd[cmd.index("--dtype") + 1] == auto
    monkeypatch.setenv("KVTIER_DTYPE", "float16")
    cmd = build_command(spec(), port=1)
    assert cmd[cmd.index("--dtype") + 1] == "float16"


def test_build_command_with_kvtier_connector():
    cfg = {"store": {"chunk_size": 256}}
    cmd = build_command(spec(kvtier_config=cfg), port=9000)
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc == kv_transfer_config(cfg) == {
        "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"kvtier_config": cfg}}


def test_build_command_needs_a_port():
    with pytest.raises(ValueError, match="port"):
        build_command(spec())


@pytest.mark.timeout(240)
def test_start_waits_for_health_and_stop_kills_the_group(tmp_path):
    log = tmp_path / "server.log"
    # 90 s: the fake server (python + uvicorn imports) took 28 s to answer on a niced run beside busy cores
    server = VllmServer.start(spec(), log, command=fake_cmd("--startup-delay", "1.0"), env=fake_env(),
                              ready_timeout_s=90)
    with server:
        assert server.running
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert "vllm:prefix_cache_hits_total" in server.metrics_text()
    assert not server.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.base_url}/health", timeout=2)
    assert "fake server on port" in log.read_text()


def test_port_busy_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match="port busy"):
            VllmServer.start(spec(port=port), tmp_path / "log", command=fake_cmd(), env=fake_env())


def test_a_chosen_port_taken_before_the_launch_is_replaced(tmp_path, monkeypatch):
    import kvtier.server as server_mod

    with socket.socket() as held:                 # another process's server on the port chosen first
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = server_mod.free_port
        chosen = iter([taken])
        monkeypatch.setattr(server_mod, "free_port", lambda count=1: next(chosen, None) or real(count))
        with VllmServer.start(spec(), tmp_path / "log", command=fake_cmd(), env=fake_env(),
                              ready_timeout_s=90) as server:
            assert server.port != taken and httpx.get(f"{server.base_url}/health").status_code == 200


# exits as a server does when its port was bound by another process after the check, the first time
LOSES_ITS_PORT_ONCE = """
import os, sys
port, marker, fake = sys.argv[1:4]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("OSError: [Errno 98] Address already in use", flush=True)
    sys.exit(1)
os.execv(sys.executable, [sys.executable, fake, "--port", port])
"""


# exits as a server does when its port is always taken
ALWAYS_LOSES_ITS_PORT = "print('OSError: [Errno 98] Address already in use', flush=True); raise SystemExit(1)"


def test_a_server_that_loses_its_chosen_port_starts_again_on_another(tmp_path):
    marker = tmp_path / "lost-once"
    cmd = [sys.executable, "-c", LOSES_ITS_PORT_ONCE, "{port}", str(marker), FAKE]
    with VllmServer.start(spec(), tmp_path / "log", command=cmd, env=fake_env(), ready_timeout_s=90) as server:
        assert marker.exists() and httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_given_port_lost_at_startup_is_a_port_busy_error_without_retries(tmp_path):
    from kvtier.ports import free_port
    from kvtier.server import PortTaken

    cmd = [sys.executable, "-c", ALWAYS_LOSES_ITS_PORT]
    port = free_port()
    with pytest.raises(PortTaken, match=f"port busy: server 't' could not bind 127.0.0.1:{port}"):
        VllmServer.start(spec(port=port), tmp_path / "log", command=cmd, ready_timeout_s=60)


def test_ports_lost_every_time_give_up_after_the_tries(tmp_path, monkeypatch):
    import kvtier.server as server_mod

    launched = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: launched.append(a[0]) or real_popen(*a, **kw))
    cmd = [sys.executable, "-c", ALWAYS_LOSES_ITS_PORT]
    with pytest.raises(server_mod.PortTaken, match="port busy"):
        VllmServer.start(spec(), tmp_path / "log", command=cmd, ready_timeout_s=60)
    assert len(launched) == server_mod.PORT_TRIES


def test_process_dying_at_startup_fails_fast_with_log_tail(tmp_path):
    t0 = time.monotonic()
    cmd = [sys.executable, "-c", "import sys; print('model weights missing: boom', flush=True); sys.exit(3)"]
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*model weights missing: boom"):
        VllmServer.start(spec(), tmp_path / "log", command=cmd, ready_timeout_s=60)
    assert time.monotonic() - t0 < 15


def test_readiness_timeout_kills_the_process(tmp_path, monkeypatch):
    # the launched pid, recorded at Popen (a marker file written by the child may not exist yet when a
    # loaded machine has not run the child's interpreter within the 1.5 s)
    pids = []
    real_popen = subprocess.Popen

    def popen(*a, **kw):
        proc = real_popen(*a, **kw)
        pids.append(proc.pid)
        return proc
    monkeypatch.setattr(subprocess, "Popen", popen)
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(ServerError, match="not ready after"):
        VllmServer.start(spec(), tmp_path / "log", command=cmd, ready_timeout_s=1.5)
    monkeypatch.undo()
    (pid,) = pids
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_launch_env_pins_the_cpu_reservation_with_and_without_a_connector(monkeypatch):
    from kvtier.server import launch_env
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    plain, kv = launch_env(spec(kv_cache_space_gib=2)), launch_env(spec(kvtier_config={}))
    assert plain["VLLM_CPU_NUM_OF_RESERVED_CPU"] == kv["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert plain["VLLM_CPU_KVCACHE_SPACE"] == "2"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert launch_env(spec())["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


@pytest.mark.timeout(240)
def test_server_dies_with_a_killed_launcher(tmp_path):
    """A demo/benchmark/test killed by SIGKILL must not leave its server running."""
    launcher = (
        "import sys, time\n"
        "from kvtier.server import ServerSpec, VllmServer\n"
        f"s = VllmServer.start(ServerSpec(name='t', model='/m'), {str(tmp_path / 'server.log')!r},\n"
        f"                     command={fake_cmd()!r}, ready_timeout_s=90)\n"
        "print(s.process.pid, s.port, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=fake_env())
    try:
        pid, port = map(int, proc.stdout.readline().split())
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 60       # SIGTERM -> uvicorn's shutdown, on a niced run beside busy cores
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the server outlived its killed launcher")


@pytest.mark.parametrize("change,needle", [
    (dict(name=""), "name must be non-empty"),
    (dict(name="a/b"), "folder name"),
    (dict(port=70000), "port 70000"),
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(max_num_batched_tokens="2048"), "max_num_batched_tokens must be a positive integer"),
    (dict(kv_cache_space_gib=0), "kv_cache_space_gib must be > 0"),
    (dict(dtype="floaat32"), "floaat32"),
    (dict(kvtier_config={"store": {"chunk_sise": 256}}), "kvtier.store.chunk_sise"),
    (dict(kvtier_config={"store": {"memory": {"capacity": "lots"}}}), "kvtier.store.memory.capacity"),
    (dict(extra_args=("--port", "9")), "extra_args sets --port"),
    (dict(extra_args=("--dtype=half",)), "extra_args sets --dtype"),
])
def test_check_spec_names_the_problem_in_one_line(tmp_path, change, needle) -> None:
    from dataclasses import replace

    from kvtier.server import ServerError, ServerSpec, check_spec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    good = ServerSpec(name="s", model=str(model), dtype="float32")
    check_spec(good)
    with pytest.raises(ServerError, match=needle) as e:
        check_spec(replace(good, **change))
    assert "\n" not in str(e.value) and str(e.value).startswith("server ")


def test_check_spec_refuses_a_model_folder_without_config(tmp_path) -> None:
    from kvtier.server import ServerError, ServerSpec, VllmServer, check_spec

    spec = ServerSpec(name="s", model=str(tmp_path / "nope"), dtype="float32")
    with pytest.raises(ServerError, match="has no config.json"):
        check_spec(spec)
    with pytest.raises(ServerError, match="has no config.json"):     # start checks before launching
        VllmServer.start(spec, tmp_path / "log")
    assert not (tmp_path / "log").exists()


def test_secrets_of_a_kvtier_server_travel_in_its_environment_never_its_argv(monkeypatch):
    """A lab server's Valkey password and signing key are not on vLLM's command line (ps, vLLM's
    "non-default args" log line) but in its environment, where the connector's loader reads them."""
    from kvtier.integrations.vllm.extra_config import config_from_extra
    from kvtier.server import launch_env

    cfg = {"store": {"signing_key": "k" * 32,
                     "shared": {"kind": "valkey", "url": "redis://127.0.0.1:1/0", "password": "pw-7f3a9c-secret"}}}
    s = spec(kvtier_config=cfg)
    argv = " ".join(build_command(s, port=9000))
    assert "pw-7f3a9c-secret" not in argv and "k" * 32 not in argv
    assert "redis://127.0.0.1:1/0" in argv                  # the rest of the config is still passed
    env = launch_env(s)
    assert env["KVTIER_STORE__SHARED__PASSWORD"] == "pw-7f3a9c-secret"
    assert env["KVTIER_STORE__SIGNING_KEY"] == "k" * 32
    assert cfg["store"]["shared"]["password"] == "pw-7f3a9c-secret"   # the caller's dict is untouched
    # the vLLM side: the public config + that environment give back the full config
    extra = json.loads(argv.split("--kv-transfer-config ", 1)[1].split(" --")[0])["kv_connector_extra_config"]
    for k, v in env.items():
        if k.startswith("KVTIER_STORE__"):
            monkeypatch.setenv(k, v)
    loaded = config_from_extra(extra)
    assert loaded.store.shared.password.get_secret_value() == "pw-7f3a9c-secret"
    assert loaded.store.signing_key.get_secret_value() == "k" * 32


def test_free_ports_are_below_the_ephemeral_range_free_and_never_handed_out_twice():
    from kvtier.ports import ephemeral_range, free_port, port_is_free

    lo, _ = ephemeral_range()
    seen: set[int] = set()
    for _ in range(100):
        p = free_port(2)
        span = {p, p + 1}
        assert p + 1 < lo or lo - 12000 < 1024, f"{p} is in the ephemeral range from {lo}"
        assert not span & seen, f"{p} handed out twice"
        assert all(port_is_free(q) for q in span)
        seen |= span
    held = socket.socket()
    held.bind(("127.0.0.1", 0))            # a port the kernel gives is never handed out while held
    try:
        assert held.getsockname()[1] not in {free_port() for _ in range(50)}
    finally:
        held.close()
