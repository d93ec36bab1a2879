"""Starting an engine-core process: the command line, its parent pid and run directory, and the import path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common import ipc
from common.config import EngineConfig, to_cli_args

REPO_ROOT = str(Path(__file__).resolve().parents[2])


class EngineStartError(RuntimeError):
    pass


def spawn_engine(config: EngineConfig, addresses: ipc.Addresses, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine_core", "--input", addresses.input, "--output", addresses.output]
    # Our pid, not the engine's later getppid(): we may die before it looks. With the run directory, an engine
    # that outlives us removes it.
    cmd += ["--parent-pid", str(os.getpid())] + (["--run-dir", addresses.run_dir] if addresses.run_dir else [])
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    return subprocess.Popen(cmd + to_cli_args(config), env=env)
