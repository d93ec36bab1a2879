"""A probe run's target and settings, its HTTP clients, and the API process's resident memory."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Probe:
    args: argparse.Namespace
    url: str
    pid: int | None  # the API process (launch.py), for its RSS
    model: str = ""

    def client(self, **kw: Any) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no client-side queueing
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        timeout = httpx.Timeout(self.args.request_timeout, connect=30.0)
        return httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout, headers=headers, **kw)


def rss_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 1)


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a local process from /proc (None when unknown: no pid, gone, or not Linux)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None
