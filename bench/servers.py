"""Servers a benchmark starts and stops itself: a free port, a process group per server, /health polling."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(cmd: list[str], port: int, log_path: Path, timeout: float = 600.0, cwd: Path = REPO) -> Iterator[str]:
    """Starts a server in a process group of its own, yields its base URL once /health answers 200; afterwards
    SIGTERMs it (launch.py and vLLM both drain and stop their engine processes on SIGTERM), then SIGKILLs whatever
    of its group is left, so no engine process outlives the benchmark."""
    url = f"http://127.0.0.1:{port}"
    words = [w for w in cmd if not w.startswith("-")]  # the script or module a python command runs names it
    name = Path(words[1] if Path(cmd[0]).name.startswith("python") else cmd[0]).name
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # never reach for the network
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; log: {log_path}\n{tail(log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy after {timeout:.0f} s; log: {log_path}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is empty once all have exited
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


def served_model(url: str) -> str:
    """The first model name the server lists: each server names the same weights its own way."""
    resp = httpx.get(url + "/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
