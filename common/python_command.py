"""How our processes start and stop each other (engine cores, tensor-parallel workers): `python -P -m <module>`, with
this checkout's root first on PYTHONPATH and torch's large buffers in huge pages, and SIGTERM held back while a child
starts.

Without -P, `python -m` puts the working directory first on sys.path: a process started from inside another
checkout imported that checkout's engine, not ours (bench.alternate compared two commits' API processes over one
and the same engine that way).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
# How a parent stops the engine core it started. Not SIGTERM: a process manager sends that to the whole process
# group or cgroup (systemd, `kill -TERM -PGID`), and the API must drain its in-flight requests on the engines first.
STOP_SIGNAL = signal.SIGUSR1
# torch's CPU buffers of 2 MB and more (packed weights, the KV cache) in 2 MB pages, where the kernel allows it: a
# decode step streams the weights, and with 4 KB pages TLB misses cost up to a quarter of a big model's step
# (OLMoE-1B-7B's shape, one stream: 101 -> 73 ms and 115 -> 99; Llama 1B: 62 -> 51; the default model unchanged).
# torch reads it once, at its first allocation: in the child's environment from the start. 0 opts out.
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}


def python_module(module: str, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line that runs `module` with this checkout's packages, and its environment (`env`, by default
    ours, with PYTHONPATH led by our root, and HUGE_PAGES unless it says otherwise)."""
    base = {**HUGE_PAGES, **(os.environ if env is None else env)}
    path = os.pathsep.join(filter(None, [ROOT, base.get("PYTHONPATH")]))
    return [sys.executable, "-P", "-m", module], {**base, "PYTHONPATH": path}


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Around starting a child that ignores a SIGTERM meant for its parent: SIGTERM is blocked in this thread, and
    so in the child through fork and exec, where it stays pending until the child has set its own handler
    (unblock_sigterm); no SIGTERM kills the child while it starts. Ours is not lost: another thread takes it, or it
    comes when unblocked here."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_sigterm() -> None:
    """In a child started under sigterm_held, once its SIGTERM handler is set."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
