"""The warm spare engine process (frontend/engine/supervisor.py, engine_core/standby.py): a restart starts from it and
a new one follows; a dead spare is replaced once per engine epoch, and a restart without one is cold; none is kept
where no restart would use it; a spare told nothing exits."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from common import ipc
from common.config import EngineConfig
from frontend.engine.spawn import spawn_engine
from frontend.engine.supervisor import EngineSupervisor
from tests.conftest import SPARE, Server, engine_child, is_spare, spare_children

BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # Spares warm up at once (not 10 s after their engine's start): the kills below find them warm or warming.
    env = {"ROSEINFER_SPARE_WARM_UP_AFTER": "0"}
    server = Server(tmp_path_factory.mktemp("spare"), SPARE, env=env).wait_healthy()
    yield server
    server.engine_pid = engine_child(server)
    server.assert_clean_exit()  # no engine core and no spare left


def engine_entry(server: Server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()["engines"][0]


def kill_and_wait_for_the_next(server: Server) -> dict:
    """SIGKILLs the engine core; returns /health's entry once the next epoch is ready."""
    before = engine_entry(server)
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (now := engine_entry(server))["epoch"] == before["epoch"] or now["state"] != "ready":
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.05)
    return now


def complete(server: Server) -> str:
    r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_restart_starts_from_the_spare_and_a_new_spare_follows(server: Server):
    reference = complete(server)
    (spare,) = spare_children(server)  # started when the engine was ready, before /health said so
    now = kill_and_wait_for_the_next(server)
    assert now["pid"] == spare == engine_child(server), server.log_text()
    assert not is_spare(spare) and Path(f"/proc/{spare}/comm").read_text().strip() == "engine-core"
    assert spare_children(server) not in ([], [spare])  # its own spare, for the next restart
    assert complete(server) == reference


def wait_for_a_spare(server: Server, not_this: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while not (spares := [p for p in spare_children(server) if p != not_this]):
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.05)
    (spare,) = spares
    return spare


def test_a_dead_spare_is_replaced_once_then_the_restart_is_cold(server: Server):
    """Killed while its engine serves, a spare is replaced (and /health names the new one); killed again in the same
    epoch, it is only reaped: the restart is cold, and the next epoch gets its spare."""
    (spare,) = spare_children(server)
    assert engine_entry(server)["spare_pid"] == spare
    os.kill(spare, signal.SIGKILL)
    replacement = wait_for_a_spare(server, not_this=spare)
    assert engine_entry(server)["spare_pid"] == replacement
    os.kill(replacement, signal.SIGKILL)
    time.sleep(1.0)  # ten process checks: reaped, not replaced
    assert not Path(f"/proc/{replacement}").exists() and spare_children(server) == [], server.log_text()
    assert "spare_pid" not in engine_entry(server)
    reference = complete(server)
    engine = engine_child(server)
    now = kill_and_wait_for_the_next(server)
    assert now["pid"] not in (spare, replacement, engine) and not is_spare(now["pid"])
    wait_for_a_spare(server, not_this=replacement)  # the new epoch's
    assert complete(server) == reference


def test_no_spare_where_no_restart_would_use_it(tmp_path: Path):
    flags = {"off": [SPARE, "--no-engine-spare"], "no-restarts": [SPARE, "--max-engine-restarts", "0"]}
    for name in flags:
        (tmp_path / name).mkdir()
    servers = [Server(tmp_path / name, *args) for name, args in flags.items()]
    try:
        for server in servers:
            server.wait_healthy(timeout=300)
            assert spare_children(server) == [], server.log_text()
    finally:
        for server in servers:
            server.stop()
    # Tensor parallel: the workers would still start cold (test_tensor_parallel counts the processes too).
    tp = EngineSupervisor(EngineConfig(tensor_parallel_size=2), ipc.Addresses("ipc://x", "ipc://y"), keep_spare=True)
    assert not tp.keep_spare and EngineSupervisor(EngineConfig(), tp.addresses, keep_spare=True).keep_spare


def test_a_spare_told_nothing_exits():
    """Its server closed the pipe (it stopped, or died): the spare exits 0 without starting an engine."""
    addresses = ipc.Addresses.new_ipc()
    try:
        spare = spawn_engine(EngineConfig(), addresses, standby=True)
        assert spare.stdin is not None
        spare.stdin.close()
        assert spare.wait(timeout=120) == 0
    except subprocess.TimeoutExpired:
        spare.kill()
        raise
    finally:
        addresses.cleanup()


def test_the_spare_warms_up_at_the_lowest_priority_and_starts_the_engine_at_its_own(monkeypatch) -> None:
    """The warm-up (imports, the model's config) runs in a thread of its own at nice 19, so that it takes only cores
    the serving engine leaves idle (at normal priority it slowed the server's first burst by a fifth on 2 cores);
    the main thread, which starts the promoted engine, keeps the process's priority."""
    import threading

    from engine_core import standby

    seen: dict[str, int] = {}
    done = threading.Event()

    def fake_warm_up(config: EngineConfig) -> None:
        seen["warm_up"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        done.set()

    monkeypatch.setattr(standby, "warm_up", fake_warm_up)
    monkeypatch.setattr(standby, "WARM_UP_AFTER_S", 0.0)
    main_nice = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's
    read, write = os.pipe()
    with os.fdopen(read) as stdin:
        monkeypatch.setattr("sys.stdin", stdin)
        threading.Timer(0.5, lambda: os.write(write, b"7\n")).start()  # the server's epoch, once warming
        promoted = standby.wait_for_epoch(EngineConfig())
    os.close(write)
    assert done.wait(10) and seen["warm_up"] == 19
    assert promoted is not None and promoted.epoch == 7
    assert os.getpriority(os.PRIO_PROCESS, 0) == main_nice
