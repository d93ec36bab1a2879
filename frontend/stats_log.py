"""vLLM's periodic stats line, which operators read in the server's log: every 10 s (ROSEINFER_LOG_STATS_INTERVAL
seconds), at INFO, one line per engine core while it has work and once more when it falls idle; off with
--disable-log-stats. The figures come from the Prometheus series (frontend/metrics.py), so the line and /metrics
never disagree."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from frontend.metrics import EngineTotals, Metrics

log = logging.getLogger("roseinfer.stats")
INTERVAL_ENV = "ROSEINFER_LOG_STATS_INTERVAL"


def stats_line(engine: int, before: EngineTotals, now: EngineTotals, seconds: float) -> str:
    """What vLLM writes (`Avg generation throughput` is what people grep for), with the rates over `seconds`; the
    prefix-cache hit rate over the server's life, and the draft acceptance where speculative decoding drafted."""
    hit_rate = now.prefix_hits / now.prefix_queries if now.prefix_queries else 0.0
    line = (f"Engine {engine:03d}: Avg prompt throughput: {(now.prompt_tokens - before.prompt_tokens) / seconds:.1f} "
            f"tokens/s, Avg generation throughput: {(now.generation_tokens - before.generation_tokens) / seconds:.1f} "
            f"tokens/s, Running: {now.running} reqs, Waiting: {now.waiting} reqs, KV cache usage: "
            f"{100 * now.kv_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")  # fmt: skip
    if drafted := now.draft_tokens - before.draft_tokens:
        line += f", Draft acceptance rate: {100 * (now.accepted_tokens - before.accepted_tokens) / drafted:.1f}%"
    return line


def interval_from_env() -> float:
    text = os.environ.get(INTERVAL_ENV, "10")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # NaN too
        log.warning("%s=%r is not a positive number of seconds: 10 s it is", INTERVAL_ENV, text)
        return 10.0
    return seconds


def busy(before: EngineTotals, now: EngineTotals) -> bool:
    moved = now.prompt_tokens != before.prompt_tokens or now.generation_tokens != before.generation_tokens
    return moved or now.running > 0 or now.waiting > 0


class StatsLog:
    def __init__(self, metrics: Metrics, num_engines: int, refresh: Callable[[], Awaitable[None]],
                 interval: float | None = None) -> None:  # fmt: skip
        """`refresh`: brings the scheduler gauges up to date (an idle engine runs no step that would report them)."""
        self.metrics = metrics
        self.refresh = refresh
        self.interval = interval if interval is not None else interval_from_env()
        self.last = [metrics.engine_totals(i) for i in range(num_engines)]
        self.was_busy = [False] * num_engines
        self.last_time = time.monotonic()

    def lines(self, now_time: float) -> list[str]:
        """The lines due now, and the totals they were taken from kept for the next."""
        seconds = max(now_time - self.last_time, 1e-9)
        lines = []
        for i, before in enumerate(self.last):
            now = self.metrics.engine_totals(i)
            is_busy = busy(before, now)
            if is_busy or self.was_busy[i]:  # the line after the last busy one shows the engine idle
                lines.append(stats_line(i, before, now, seconds))
            self.last[i], self.was_busy[i] = now, is_busy
        self.last_time = now_time
        return lines

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
                for line in self.lines(time.monotonic()):
                    log.info(line)
            except Exception:  # a log line is never worth the task: say why and go on
                log.exception("the stats line failed")
