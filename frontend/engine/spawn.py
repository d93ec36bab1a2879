"""Starting an engine-core process: the command line, its parent pid and run directory, the import path, and
SIGTERM held back until it has set its handler. A spare (`standby`) reads its epoch from the pipe on its stdin."""

from __future__ import annotations

import os
import subprocess

from common import ipc
from common.config import EngineConfig, to_cli_args
from common.python_command import python_module, sigterm_held


class EngineStartError(RuntimeError):
    pass


def spawn_engine(config: EngineConfig, addresses: ipc.Addresses, env: dict[str, str] | None = None,
                 standby: bool = False) -> subprocess.Popen:  # fmt: skip
    cmd, full_env = python_module("engine_core", {**os.environ, **(env or {})})
    cmd += ["--input", addresses.input, "--output", addresses.output]
    # Our pid, not the engine's later getppid(): we may die before it looks. With the run directory, an engine
    # that outlives us removes it.
    cmd += ["--parent-pid", str(os.getpid())] + (["--run-dir", addresses.run_dir] if addresses.run_dir else [])
    cmd += ["--standby"] if standby else []
    with sigterm_held():  # the engine ignores SIGTERM while we live (we stop it with STOP_SIGNAL), once it started
        return subprocess.Popen(cmd + to_cli_args(config), env=full_env, stdin=subprocess.PIPE if standby else None)
