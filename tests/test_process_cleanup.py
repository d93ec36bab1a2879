"""launch.py SIGKILLed: its engine core and the engine's spare exit at once, can be reaped and remove the ipc
directory; stale run directories of dead servers are swept when a new one starts."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from common import ipc
from tests.conftest import REPO, SPARE, Server, spare_children

PR_SET_CHILD_SUBREAPER = 36


def _stream_until_killed(url: str, started: threading.Event) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me about whales.", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
    except httpx.HTTPError:
        pass  # the server is SIGKILLed mid-stream


def _kill_server_scenario(tmp: Path) -> dict:
    """Runs in a process of its own: the child-subreaper flag makes it adopt every orphan below it, which pytest
    must not do (it would collect other tests' orphans as zombies)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    server = Server(tmp, SPARE)
    try:
        server.wait_healthy()
        assert server.engine_pid is not None
        (spare,) = spare_children(server)
        ipc_dirs = server.ipc_dirs()
        started = threading.Event()
        # Killed mid-generation: the engine's main thread is in a model step, not waiting on its input queue.
        threading.Thread(target=_stream_until_killed, args=(server.url, started), daemon=True).start()
        assert started.wait(60), server.log_text()
    finally:  # the SIGKILL under test; also no server left behind when the start failed
        server.proc.kill()
        server.proc.wait()
    killed = time.monotonic()
    exited_after = {pid: _exited_after(pid, killed) for pid in (server.engine_pid, spare)}
    return {"ipc_dirs_before": ipc_dirs, "ipc_dirs_after": server.ipc_dirs(), "log": server.log_text(),
            "engine_exited_after": exited_after[server.engine_pid], "spare_exited_after": exited_after[spare]}


def _exited_after(pid: int, killed: float) -> float | None:
    """Seconds from the kill until `pid` (ours now that we are the subreaper) exited, reaped here; None: it did not
    within 10 s, and is killed so as not to be left running."""
    while time.monotonic() - killed < 10:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return time.monotonic() - killed
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_sigkilled_server_takes_its_engine_and_ipc_dir_along(tmp_path: Path):
    cmd = [sys.executable, "-m", "tests.test_process_cleanup", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert len(result["ipc_dirs_before"]) == 1, result
    for process in ("engine", "spare"):
        assert result[f"{process}_exited_after"] is not None and result[f"{process}_exited_after"] < 3, result
    assert result["ipc_dirs_after"] == [], result["log"]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_run_dirs_are_swept(tmp_path: Path):
    def run_dir(name: str, owner: int | None = None, age: float = 0.0) -> Path:
        path = tmp_path / name
        path.mkdir()
        if owner is not None:
            ipc.write_owner(str(path), owner)
        if age:
            then = time.time() - age
            os.utime(path, (then, then))
        return path

    dead = run_dir("roseinfer-dead", _dead_pid())
    live = run_dir("roseinfer-live", os.getpid())
    old_live = run_dir("roseinfer-old-live", os.getpid(), age=7 * 86400)
    legacy_old = run_dir("roseinfer-legacy-old", age=2 * 86400)  # no owner file: judged by age
    legacy_new = run_dir("roseinfer-legacy-new")
    foreign = run_dir("roseinfer-foreign")  # a dead pid, but of another pid namespace: means nothing here
    (foreign / ipc.OWNER_FILE).write_text(f"{_dead_pid()} pid:[1]\n")
    other = run_dir("other-dead", _dead_pid())
    assert sorted(ipc.sweep_stale_run_dirs(str(tmp_path))) == sorted([str(dead), str(legacy_old)])
    assert not dead.exists() and not legacy_old.exists()
    assert live.exists() and old_live.exists() and legacy_new.exists() and foreign.exists() and other.exists()


def test_new_ipc_records_its_owner_and_sweeps(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / "roseinfer-stale"
    stale.mkdir()
    ipc.write_owner(str(stale), _dead_pid())
    addresses = ipc.Addresses.new_ipc()
    try:
        assert not stale.exists()
        assert addresses.run_dir is not None and Path(addresses.run_dir).parent == tmp_path
        assert (Path(addresses.run_dir) / ipc.OWNER_FILE).read_text().split()[0] == str(os.getpid())
        assert ipc.sweep_stale_run_dirs(str(tmp_path)) == []  # its own directory: a live owner
    finally:
        addresses.cleanup()
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":  # the scenario's own process, for test_sigkilled_server_takes_its_engine_and_ipc_dir_along
    print(json.dumps(_kill_server_scenario(Path(sys.argv[1]))))
