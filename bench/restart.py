"""How long open streams stall when the engine core is killed: launch.py with its warm spare engine process (the
default) against --no-engine-spare, alternating in one run.

python -m bench.restart [--pairs 2] [--kills 3] [--streams 8] [--max-tokens 96] [--settle 20]
    [--server-args "--dtype bfloat16"] [--result-json bench/results/restart.json]

Each kill: `--streams` greedy streamed completions start; once every one has streamed 8 tokens the engine gets
SIGKILL (its pid from /health); the stall is the time from the kill to the first token after it, the largest over
the streams, and `ready_s` the time until /health says the next epoch is ready. Every stream must still end with exactly
`--max-tokens` tokens. Between kills the server gets `--settle` seconds, as a crash rarely follows a start: a spare
starts once its engine is ready, waits 10 s (engine_core/standby.py) and takes a few seconds to warm.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.servers import REPO, free_port, launched, served_model  # noqa: E402

VARIANTS = {"spare": [], "cold": ["--no-engine-spare"]}


async def stream(session: aiohttp.ClientSession, model: str, i: int, max_tokens: int, times: list[float]) -> int:
    """One greedy stream; appends the arrival time of each token event to `times`; returns its token count."""
    body = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with session.post("/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.monotonic())
    return tokens


async def engine(session: aiohttp.ClientSession) -> dict[str, Any]:
    """/health's entry for the (first) engine core: its pid, epoch and state."""
    async with session.get("/health") as resp:
        return (await resp.json())["engines"][0]


async def until_replaced(session: aiohttp.ClientSession, epoch: int, since: float, timeout: float = 120.0) -> float:
    """Seconds from `since` until an engine of a later epoch is ready."""
    while time.monotonic() - since < timeout:
        now = await engine(session)
        if now["epoch"] > epoch and now["state"] == "ready":
            return time.monotonic() - since
        await asyncio.sleep(0.02)
    raise TimeoutError("the server did not come back")


async def one_kill(session: aiohttp.ClientSession, model: str, args: argparse.Namespace) -> dict[str, float]:
    before = await engine(session)
    times: list[list[float]] = [[] for _ in range(args.streams)]
    tasks = [asyncio.create_task(stream(session, model, i, args.max_tokens, times[i])) for i in range(args.streams)]
    while min(len(t) for t in times) < 8:
        if failed := [t for t in tasks if t.done()]:
            await failed[0]  # raises what ended it early
            raise RuntimeError("a stream ended before the kill")
        await asyncio.sleep(0.005)
    killed = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    ready_s = await until_replaced(session, before["epoch"], killed)
    counts = await asyncio.gather(*tasks)
    if any(c != args.max_tokens for c in counts):
        raise RuntimeError(f"a stream lost tokens across the restart: {counts}")
    stall = max(next(t for t in ts if t > killed) - killed for ts in times)
    return {"stall_s": round(stall, 3), "ready_s": round(ready_s, 3)}


async def kills(url: str, args: argparse.Namespace) -> list[dict[str, float]]:
    model = served_model(url)
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=600)) as session:
        results = []
        for _ in range(args.kills):
            await asyncio.sleep(args.settle)
            results.append(await one_kill(session, model, args))
            print(f"  {results[-1]}", flush=True)
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3, help="engine kills per server")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds before each kill")
    parser.add_argument("--server-args", default="", help="launch.py flags for both")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="roseinfer-restart-"))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for rnd in range(args.pairs):
        for name, flags in VARIANTS.items():
            port = free_port()
            cmd = [sys.executable, "launch.py", "--port", str(port), *shlex.split(args.server_args), *flags]
            print(f"--- round {rnd + 1}, {name}: {' '.join(cmd[1:])}", flush=True)
            with launched(cmd, port, logs / f"{name}-{rnd}.log") as url:
                runs[name] += asyncio.run(kills(url, args))
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in ("stall_s", "ready_s")}
               for name, rs in runs.items()}  # fmt: skip
    ratio = medians["cold"]["stall_s"] / medians["spare"]["stall_s"]
    for name, m in medians.items():
        print(f"{name}: stall median {m['stall_s']:.2f} s, back to /health 200 in {m['ready_s']:.2f} s")
    print(f"cold stall / spare stall: {ratio:.2f}x")
    if args.result_json:
        record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor()
                  or platform.machine(), "cpus": os.cpu_count(), "settings": vars(args), "runs": runs,
                  "medians": medians, "cold_over_spare": round(ratio, 2), "repo": str(REPO)}  # fmt: skip
        Path(args.result_json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
