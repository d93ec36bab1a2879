"""API test fixtures: launch.py started as a user would (free port, own TMPDIR), stopped with SIGTERM."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if not torch.cuda.is_available():
    # Without CUDA, Triton kernels run only in Triton's interpreter. Triton 3.7 reads this flag when a @triton.jit
    # function is decorated (its own library's at its first import, which torch may trigger from any test module)
    # and again at launch, so it is set before any test module is imported, for the whole session.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Small KV cache and context: quick to allocate; still room for 64 concurrent requests. A generous ping
# timeout: the parts of a step that tick no attention layer (engine_core/pulse.py: sampling, the one-call decode
# stack) can take seconds on a busy 2-core machine, and that is not a hang. No warm spare engine process: its
# imports would cost each server 3 CPU seconds that only a restart pays back; the servers whose tests restart
# engines (crashes, data parallel, process cleanup, test_engine_spare) take `SPARE`.
SERVER_ARGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048", "--log-level", "warning",
               "--engine-ping-timeout", "120", "--no-engine-spare"]  # fmt: skip
SPARE = "--engine-spare"
# ROSEINFER_TEST_DP=2 runs the shared server (and test_api_client's direct client) with two data-parallel engines:
# `ROSEINFER_TEST_DP=2 pytest tests/test_api.py tests/test_api_client.py tests/test_api_streaming.py`.
TEST_DP = int(os.environ.get("ROSEINFER_TEST_DP", "1"))


def free_port() -> int:
    """A port that is free now, below the kernel's ephemeral range: a server binds it seconds later, and in between an
    outgoing connection of any test may take a port of that range as its own (a CI run lost its tool servers so, with
    EADDRINUSE at listen). Each port is handed out once per process."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    if first_ephemeral < 12000:  # little room below that range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    while True:
        port = random.randrange(10000, first_ephemeral)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


_HANDED_OUT: set[int] = set()


def dp_args(dp: int) -> list[str]:
    return ["--data-parallel-size", str(dp)] if dp > 1 else []


class Server:
    def __init__(self, tmp: Path, *extra: str, new_session: bool = False, env: dict[str, str] | None = None) -> None:
        """`new_session`: a process group of its own (with its engines), which a test may signal as a whole; `env`:
        variables set for it beside ours."""
        self.num_engines = int(extra[extra.index("--data-parallel-size") + 1]) if "--data-parallel-size" in extra else 1
        self.tmp = tmp  # the server's TMPDIR: its ipc run directory lives here
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = True  # what wait_healthy's client trusts (HTTPS: the server's certificate)
        self.log = tmp / "server.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp), **(env or {})}
        with open(self.log, "wb") as log:
            cmd = [sys.executable, "launch.py", "--port", str(self.port), *SERVER_ARGS, *extra]
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=new_session)  # fmt: skip
        self.engine_pids: list[int] = []

    def wait_healthy(self, timeout: float = 180.0, headers: dict[str, str] | None = None) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"launch.py exited with {self.proc.returncode}:\n{self.log_text()}"
            try:
                r = httpx.get(self.url + "/health", timeout=5, verify=self.verify)
                if r.status_code == 200 and all(e["state"] == "ready" for e in r.json()["engines"]):
                    children = engine_children(self)
                    assert len(children) == self.num_engines, children  # launch.py's children are its engine cores
                    self.engine_pids = children
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_text()}")

    @property
    def engine_pid(self) -> int | None:
        return self.engine_pids[0] if self.engine_pids else None

    @engine_pid.setter
    def engine_pid(self, pid: int | None) -> None:
        self.engine_pids = [pid] if pid is not None else []

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def ipc_dirs(self) -> list[str]:
        return [p.name for p in self.tmp.iterdir() if p.name.startswith("roseinfer-")]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, as a process manager would; returns launch.py's exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def assert_clean_exit(self) -> None:
        children = launch_children(self) if self.proc.poll() is None else []  # engine cores and spares
        code = self.stop()
        assert code == 0, self.log_text()
        assert self.engine_pids, "no engine core was ever seen"
        assert not any(Path(f"/proc/{pid}").exists() for pid in {*self.engine_pids, *children}), "engine process left"
        assert self.ipc_dirs() == [], "ipc files left behind"


@pytest.fixture(scope="session")
def server_started(tmp_path_factory: pytest.TempPathFactory):
    """The shared server, spawned but maybe still loading (other fixtures load in parallel with it)."""
    server = Server(tmp_path_factory.mktemp("server"), *dp_args(TEST_DP))
    yield server
    server.assert_clean_exit()


@pytest.fixture(scope="session")
def server(server_started: Server) -> Server:
    return server_started.wait_healthy()


@pytest.fixture(scope="session")
def tool_servers(tmp_path_factory: pytest.TempPathFactory):
    """For test_api_tools and test_api_responses, by --tool-call-parser (hermes; llama3_json with vLLM's
    --enable-auto-tool-choice, and --reasoning-parser deepseek_r1; mistral; pythonic; functiongemma), started
    together: a template that writes earlier calls and their results into the prompt."""
    template = str(REPO / "tests" / "data" / "tool_template.jinja")
    servers = {"hermes": Server(tmp_path_factory.mktemp("tools"), "--tool-call-parser", "hermes",
                                "--chat-template", template),
               "llama3_json": Server(tmp_path_factory.mktemp("tools_llama3"), "--tool-call-parser", "llama3_json",
                                     "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1",
                                     "--chat-template", template),
               "mistral": Server(tmp_path_factory.mktemp("tools_mistral"), "--tool-call-parser", "mistral",
                                 "--chat-template", template),
               "pythonic": Server(tmp_path_factory.mktemp("tools_pythonic"), "--tool-call-parser", "pythonic",
                                  "--chat-template", template),
               "functiongemma": Server(tmp_path_factory.mktemp("tools_functiongemma"), "--tool-call-parser",
                                       "functiongemma", "--chat-template", template)}  # fmt: skip
    try:
        healthy = {name: server.wait_healthy() for name, server in servers.items()}
    except BaseException:  # one that does not start takes the others down, rather than leaving them running
        for server in servers.values():
            server.stop()
        raise
    yield healthy
    for server in servers.values():
        server.assert_clean_exit()


@pytest.fixture(scope="session")
def hermes_server(tool_servers: dict[str, Server]) -> Server:
    """test_api_responses' server (hermes tool calls), which the stored-state tests share."""
    return tool_servers["hermes"]


@pytest.fixture(scope="session")
def hermes_client(hermes_server: Server):
    import openai  # only these tests need it at import

    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def launch_children(server: Server) -> list[int]:
    """Every live child of launch.py right now: its engine cores and their spares (not one killed and not yet
    reaped: its supervisor looks every 0.1 s)."""
    pid = server.proc.pid
    return [c for c in map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()) if not _zombie(c)]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # reaped meanwhile
        return True


def is_spare(pid: int) -> bool:
    """A warm spare engine process not (yet) promoted: started with --standby, renamed engine-core once promoted."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return b"--standby" in args and Path(f"/proc/{pid}/comm").read_text().strip() != "engine-core"
    except OSError:  # gone
        return False


def engine_children(server: Server) -> list[int]:
    """launch.py's engine-core children right now (a restart replaces one), spares left out."""
    return [pid for pid in launch_children(server) if not is_spare(pid)]


def spare_children(server: Server) -> list[int]:
    return [pid for pid in launch_children(server) if is_spare(pid)]


def engine_index_of(pid: int) -> int:
    """The data-parallel index an engine core was started with (0 when it was given none)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(args[args.index("--engine-index") + 1]) if "--engine-index" in args else 0


def engine_child(server: Server) -> int | None:
    """launch.py's engine-core child right now (a restart replaces it), or None between two of them."""
    children = engine_children(server)
    return children[0] if children else None
