"""python -m engine_core --input ADDR --output ADDR [engine flags]: one engine-core process."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import signal
import sys

from common import ipc
from common.config import EngineConfig, add_cli_args, from_cli_args
from common.model_source import ModelSourceError


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the process that started us dies, so no engine outlives its server."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_once(*_) -> None:
    """SIGTERM ends the busy loop like Ctrl+C; a second one during shutdown is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_core")
    parser.add_argument("--input", required=True, help="address of the frontend's input ROUTER")
    parser.add_argument("--output", required=True, help="address of the frontend's output PULL")
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    _die_with_parent()
    signal.signal(signal.SIGTERM, _stop_once)
    from engine_core.core import run_engine  # after argument parsing: importing torch takes a while

    try:
        return run_engine(from_cli_args(EngineConfig, args), ipc.Addresses(args.input, args.output))
    except ModelSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
