"""How our processes start and stop each other (engine cores, tensor-parallel workers): `python -P -m <module>`, with
this checkout's root first on PYTHONPATH, and SIGTERM held back while a child starts.

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


def python_module(module: str, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line that runs `module` with this checkout's packages, and its environment (`env`, by default
    ours, with PYTHONPATH led by our root)."""
    base = dict(os.environ if env is None else env)
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
