"""A process manager that stops the server by signalling its whole process group or cgroup (systemd
KillMode=control-group, `kill -TERM -PGID`, supervisord stopasgroup) reaches the engine core and its tensor-parallel
workers too: they serve on while the API drains its in-flight requests, and all of them exit once it is done."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import SPARE, Server, is_spare

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "Tell me about whales.", "max_tokens": 24, "ignore_eos": True, "stream": True}
TP = ["--tensor-parallel-size", "2", "--device", "cpu"]


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            found += [child, *descendants(child)]
    return found


def alive(pid: int) -> bool:
    """Not gone and not a zombie (a worker orphaned by its engine's exit waits for PID 1 to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, list[str]]:
    events = []
    async with client.stream("POST", "/v1/completions", json=BODY) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
        return r.status_code, events


@pytest.mark.parametrize("flags", [[], TP], ids=["engine", "tensor-parallel"])
def test_sigterm_to_the_whole_group_drains_in_flight_streams(tmp_path: Path, flags: list[str]):
    server = Server(tmp_path, SPARE, "--drain-timeout", "120", *flags, new_session=True)
    try:
        server.wait_healthy(timeout=300)
        processes = descendants(server.proc.pid)  # the engine core and, with TP, its worker; else its spare
        assert len([p for p in processes if not is_spare(p)]) == (2 if flags else 1), processes
        assert len([p for p in processes if is_spare(p)]) == (0 if flags else 1), processes

        async def scenario() -> list[tuple[int, list[str]]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(stream(client, event)) for event in started]
                for event in started:
                    await event.wait()
                os.killpg(server.proc.pid, signal.SIGTERM)  # launch.py's group: it and every process it started
                return await asyncio.wait_for(asyncio.gather(*streams), 120)

        for status, events in asyncio.run(scenario()):
            assert status == 200 and events[-1] == "[DONE]", events[-2:]
            assert '"finish_reason":"length"' in events[-2], (events[-2], server.log_text())
        assert server.proc.wait(timeout=60) == 0, server.log_text()
        assert not [p for p in processes if alive(p)], server.log_text()
        assert server.ipc_dirs() == []
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
