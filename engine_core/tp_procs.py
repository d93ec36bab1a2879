"""Tensor-parallel processes, without torch (launch.py imports this): which ranks run on which node, CPU shares,
starting worker processes, and the agent that keeps a non-zero node's workers running.

Ranks split evenly over nodes: node k runs ranks [k * per_node, (k + 1) * per_node). Node 0's rank 0 is the engine
core, which starts node 0's other ranks itself; on every other node `python launch.py --node-rank k ...` runs
`run_node_agent`, which starts that node's workers and starts fresh ones whenever they exit (the group broke: an
engine core died and its replacement opens a new group at the same rendezvous).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.config import EngineConfig, to_cli_args
from common.model_errors import ConfigError
from common.python_command import python_module, sigterm_held

log = logging.getLogger("roseinfer.tp")


@dataclass(frozen=True)
class Layout:
    size: int
    nnodes: int

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    def node_ranks(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def local_rank(self, rank: int) -> int:
        return rank % self.per_node


def layout(config: EngineConfig) -> Layout:
    """The group's shape from the flags; ValueError on flags that cannot describe one."""
    size, nnodes = config.tensor_parallel_size, config.nnodes
    if size < 1 or nnodes < 1 or size % nnodes:
        raise ConfigError(f"--tensor-parallel-size {size} must be a positive multiple of --nnodes {nnodes}")
    if not 0 <= config.node_rank < nnodes:
        raise ConfigError(f"--node-rank {config.node_rank} is not in [0, {nnodes})")
    if nnodes > 1 and not config.master_port:
        raise ConfigError("--nnodes > 1 needs --master-port (and --master-addr: node 0's address)")
    return Layout(size, nnodes)


def cpu_shares(count: int) -> list[list[int]] | None:
    """This process's cores split into `count` disjoint shares, one per local rank; None with fewer cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return None
    base, extra = divmod(len(cores), count)
    shares, start = [], 0
    for i in range(count):
        end = start + base + (i < extra)
        shares.append(cores[start:end])
        start = end
    return shares


def spawn_worker(config: EngineConfig, rank: int, port: int, cpus: list[int] | None) -> subprocess.Popen:
    """One worker rank; it dies with us (PR_SET_PDEATHSIG, and it checks our pid)."""
    cmd, env = python_module("engine_core.worker")
    cmd += ["--rank", str(rank), "--parent-pid", str(os.getpid())]
    cmd += ["--cpus", ",".join(map(str, cpus))] if cpus else []
    config = dataclasses.replace(config, master_port=port)
    with sigterm_held():  # it ignores SIGTERM (ours to handle), once it has started
        return subprocess.Popen(cmd + to_cli_args(config), env=env)


def watch_workers(procs: list[subprocess.Popen], on_exit: Callable[[int, int], None]) -> None:
    """Calls on_exit(pid, code) from a thread when the first worker exits."""

    def watch(proc: subprocess.Popen) -> None:
        on_exit(proc.pid, proc.wait())

    for proc in procs:
        threading.Thread(target=watch, args=(proc,), name=f"tp-worker-{proc.pid}", daemon=True).start()


def stop_workers(procs: list[subprocess.Popen], timeout: float = 5.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # a worker holds no state worth a clean exit
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("worker %d did not exit", proc.pid)


def run_node_agent(config: EngineConfig) -> int:
    """A node other than 0: keeps its workers running until SIGTERM / SIGINT. Fresh workers wait at the
    rendezvous for node 0's engine core (at start, and after every restart of the group)."""
    group = layout(config)
    ranks = list(group.node_ranks(config.node_rank))
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    shares = cpu_shares(len(ranks)) if config.device != "cuda" else None
    while not stopping.is_set():
        log.info("node %d: starting ranks %s (rendezvous %s:%s)", config.node_rank, ranks, config.master_addr,
                 config.master_port)  # fmt: skip
        assert config.master_port is not None
        procs = [spawn_worker(config, r, config.master_port, shares[i] if shares else None) for i, r in
                 enumerate(ranks)]  # fmt: skip
        while not stopping.is_set() and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        stop_workers(procs)
        if not stopping.is_set():
            log.warning("node %d: a worker exited (the group broke); starting fresh ones", config.node_rank)
            stopping.wait(1.0)  # a pause, so that a permanent failure does not spin
    return 0
