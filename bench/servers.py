"""Servers a benchmark starts and stops itself: a free port, a process group per server, /health polling."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
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


def one_at_a_time(servers: dict[str, list[str]], tag: str) -> Iterator[tuple[str, str]]:
    """Each server started in turn, its name and URL yielded while it runs, stopped before the next starts, so that
    neither takes memory or CPU from the other. "roseinfer" is launch.py and takes --port; any other is a peer's
    script that takes the port as its last argument. Logs: /tmp/bench_{tag}_{name}.log."""
    for name, cmd in servers.items():
        port = free_port()
        cmd = [*cmd, "--port", str(port)] if name == "roseinfer" else [*cmd, str(port)]
        with launched(cmd, port, Path(f"/tmp/bench_{tag}_{name}.log")) as url:
            yield name, url


def run_record(settings: dict, pairs: list[dict]) -> dict:
    """A benchmark's result file: its settings, what each pair measured, and the machine and day it ran on."""
    import torch  # here: the servers' side of a benchmark needs none

    machine = {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine(),
               "torch": torch.__version__}  # fmt: skip
    return {**settings, "pairs": pairs, "machine": machine, "date": time.strftime("%Y-%m-%d %H:%M")}


async def post_all(url: str, path: str, bodies: list[dict], concurrency: int) -> tuple[float, list[dict]]:
    """POSTs every body to `path`, `concurrency` requests in flight (the client beside the server, as a batch job
    runs): the seconds from the first request sent to the last answer read, and each answer's JSON in body order."""

    answers: list[dict] = [{} for _ in bodies]
    queue = list(range(len(bodies)))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                k = queue.pop(0)
                r = await client.post(path, json=bodies[k])
                r.raise_for_status()
                answers[k] = r.json()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, answers


def add_pair_flags(parser, peer: str) -> None:
    """The flags of a benchmark that alternates our server, a peer's and transformers in pairs. `peer`: what the
    peer's script serves."""
    parser.add_argument("--concurrency", type=int, default=4, help="HTTP requests in flight")
    parser.add_argument("--hf-batch-sizes", default="8,32")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--roseinfer-args", default="", help="more launch.py flags")
    parser.add_argument("--vllm-serve", type=Path, help=f"a script run as SCRIPT MODEL_DIR PORT that serves {peer} "
                        "with vLLM: measured too, started after ours in each pair")  # fmt: skip
    parser.add_argument("--result-json", type=Path)


def servers_to_compare(args, *launch_flags: str) -> dict[str, list[str]]:
    """From add_pair_flags' arguments: launch.py on args.model in args.dtype (with `launch_flags` and
    --roseinfer-args), then the peer's --vllm-serve script if one was given."""
    ours = [sys.executable, "launch.py", "--model", str(args.model), "--dtype", args.dtype, "--log-level", "warning",
            *launch_flags, *args.roseinfer_args.split()]  # fmt: skip
    peer = {"vLLM": ["bash", str(args.vllm_serve.resolve()), str(args.model)]} if args.vllm_serve else {}
    return {"roseinfer": ours, **peer}
