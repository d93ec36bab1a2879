"""launch.py started for a probe run, and stopped the way a process manager would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port

REPO = Path(__file__).resolve().parent.parent.parent


class LaunchedServer:
    """launch.py on a free loopback port, its output in a log file; stopped with SIGTERM like a process manager."""

    def __init__(self, server_args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "launch.py", "--host", "127.0.0.1", "--port", str(self.port), *server_args]
        fd, log = tempfile.mkstemp(prefix="roseinfer-reliability-", suffix=".log")
        self.log = Path(log)
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # never reach for the network
        with os.fdopen(fd, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"launch.py exited with {self.proc.returncode}; log {self.log}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise SystemExit(f"launch.py not healthy after {timeout:.0f} s; log {self.log}:\n{self.tail()}")

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        start = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # only our own child, by its pid
            self.proc.wait()
            code = None
        lines = self.log.read_text(errors="replace").splitlines()
        return {"exit_code": code, "stop_s": round(time.perf_counter() - start, 2), "log": str(self.log),
                "log_tracebacks": sum(line.startswith("Traceback (most recent call last)") for line in lines),
                "log_error_lines": sum(" ERROR " in line or line.startswith("ERROR") for line in lines)}  # fmt: skip

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]
