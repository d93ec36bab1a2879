"""python -m engine_core --input ADDR --output ADDR [--parent-pid PID --run-dir DIR] [--standby] [engine flags]: one
engine core."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import NoReturn

from common import ipc
from common.config import EngineConfig, add_cli_args, from_cli_args
from common.model_source import ModelSourceError
from common.python_command import STOP_SIGNAL, unblock_sigterm

log = logging.getLogger("roseinfer.engine")


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the thread that started us exits (its process dying included)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _name_process(name: bytes) -> None:
    """What top and ps -e show for us (and our threads, which inherit it): engine-core, or engine-spare until a
    spare is promoted (its command line keeps --standby)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(15, name)  # PR_SET_NAME, 15 bytes at most


def _exit_orphaned(parent_pid: int, run_dir: str | None) -> NoReturn:
    """The server is gone: nobody reads our outputs or removes the run's sockets. A clean shutdown would only
    wait (2 s of ZMQ linger on unsent outputs, then a second or more of interpreter teardown), so remove the run
    directory and exit now."""
    with contextlib.suppress(Exception):
        log.warning("server process %d is gone: exiting", parent_pid)
    ipc.remove_run_dir(run_dir)
    os._exit(0)


def _watch_parent(parent_pid: int, run_dir: str | None) -> None:
    """Exits with the parent, from a thread of its own: the SIGTERM handler runs in the main thread, so only once
    the model step it is in has finished."""
    pidfd: int | None = None
    with contextlib.suppress(OSError):  # already gone, or no pidfd here (old kernel, seccomp): poll then
        pidfd = os.pidfd_open(parent_pid)
    if os.getppid() != parent_pid:  # it died before we watched it, maybe before PR_SET_PDEATHSIG too
        _exit_orphaned(parent_pid, run_dir)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the parent process has exited
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        _exit_orphaned(parent_pid, run_dir)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _signal_handlers(parent_pid: int, run_dir: str | None, stop_on_sigterm: bool) -> None:
    """STOP_SIGNAL: the parent stops us. SIGTERM stops us only when we were started by hand (no --parent-pid):
    the API server's SIGTERM reaches us too when a process manager signals its whole group or cgroup, and the
    server drains its in-flight requests on us before it sends STOP_SIGNAL."""
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        if os.getppid() != parent_pid:  # PR_SET_PDEATHSIG: the parent died (the watcher may not have run yet)
            _exit_orphaned(parent_pid, run_dir)
        if not stopping:  # end the busy loop like Ctrl+C: run_engine shuts down and returns 0; only once
            stopping = True
            raise KeyboardInterrupt

    def on_sigterm(*args) -> None:
        if stop_on_sigterm or os.getppid() != parent_pid:  # stop() also sees an orphan out
            stop(*args)
        elif not stopping:
            log.info("SIGTERM ignored: the server drains its requests and then stops this engine core")

    signal.signal(STOP_SIGNAL, stop)
    signal.signal(signal.SIGTERM, on_sigterm)
    unblock_sigterm()  # held since our start (sigterm_held): one that came meanwhile is handled now


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_core")
    parser.add_argument("--input", required=True, help="address of the frontend's input ROUTER")
    parser.add_argument("--output", required=True, help="address of the frontend's output PULL")
    parser.add_argument("--parent-pid", type=int, help="pid of the process that started us (default: our parent)")
    parser.add_argument("--run-dir", help="the run's ipc directory, removed if the parent dies without doing it")
    parser.add_argument("--standby", action="store_true",
                        help="a spare: import and read the model's config, then start with the epoch read from stdin")
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    parent_pid = args.parent_pid or os.getppid()
    _name_process(b"engine-spare" if args.standby else b"engine-core")
    _die_with_parent()
    _signal_handlers(parent_pid, args.run_dir, stop_on_sigterm=args.parent_pid is None)
    _watch_parent(parent_pid, args.run_dir)  # after the prctl: no moment where a parent's death goes unnoticed
    config = from_cli_args(EngineConfig, args)
    if args.standby:
        from engine_core.standby import wait_for_epoch

        promoted = wait_for_epoch(config)
        if promoted is None:
            return 0
        _name_process(b"engine-core")
        config = promoted
    from engine_core.busy_loop import run_engine  # after argument parsing: importing torch takes a while

    try:
        code = run_engine(config, ipc.Addresses(args.input, args.output))
    except ModelSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The death signal can come while the parent's last threads still exit (getppid() unchanged in the handler);
    # once the watcher's thread is frozen by interpreter shutdown it could no longer remove the run directory.
    if os.getppid() != parent_pid:
        _exit_orphaned(parent_pid, args.run_dir)
    return code


def _exit_now(code: int) -> NoReturn:
    """run_engine has closed our sockets and said all it had to say: skip the interpreter's teardown, which frees
    torch's objects one by one (about a second on a CPU, for every stop and restart the API process waits on)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
