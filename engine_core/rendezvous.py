"""How a tensor-parallel group forms: rank 0 hosts a TCPStore at --master-addr:--master-port (a free port on a
single node), names this generation of the group with a fresh id, and starts its node's workers; every worker
connects, claims its rank in that generation, and joins the process group under the id's prefix.

A restarted engine core is a new store and a new id, so nothing of the dead group's rendezvous can be read by the
new one; a worker that arrives while a stale group still holds its rank (its own predecessor was killed alone)
finds the rank claimed, reports the group broken (rank 0 exits and is restarted) and waits for the next generation.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
import uuid

import torch
import torch.distributed as dist

from common.config import EngineConfig
from engine_core import distributed
from engine_core.tp_procs import cpu_shares, layout, spawn_worker, watch_workers

log = logging.getLogger("roseinfer.tp")
GROUP_KEY = "roseinfer/group"
STORE_TIMEOUT = datetime.timedelta(seconds=600)  # how long a rendezvous step may wait for the other ranks
_leader_store: list[dist.TCPStore] = []  # kept alive for the life of the engine core


def start_leader(config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int):
    """Rank 0: opens the rendezvous, starts this node's workers (they load the model while we do), joins."""
    shape = layout(config)
    # One node: always a free port, so that neither a restarted group nor another engine core (data parallel)
    # can meet a group that is not its own. Several nodes: the agreed port; a restart rebinds it.
    port = config.master_port if shape.nnodes > 1 else 0
    store = dist.TCPStore(config.master_addr, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    _leader_store.append(store)
    generation = uuid.uuid4().hex
    # What the workers must agree on with us; the rest comes from their own flags (the same on every node).
    info = {"dtype": str(dtype).removeprefix("torch."), "block_size": config.block_size,
            "max_model_len": max_model_len, "size": shape.size}  # fmt: skip
    store.set(f"{generation}/info", json.dumps(info))
    store.set(GROUP_KEY, generation)
    shares = cpu_shares(shape.per_node) if device.type == "cpu" else None
    procs = [spawn_worker(config, r, store.port, shares[r] if shares else None) for r in range(1, shape.per_node)]

    def worker_exited(pid: int, code: int) -> None:
        # The group cannot go on without it: exit, so that the supervisor restarts all of it.
        log.error("tensor-parallel worker %d exited with code %d: the engine core exits", pid, code)
        os._exit(1)

    watch_workers(procs, worker_exited)
    if shape.nnodes > 1:
        _exit_when_broken(config.master_addr, store.port, generation)
    if shares:
        os.sched_setaffinity(0, shares[0])
    log.info("tensor parallel: %d ranks over %d node(s), rendezvous port %d", shape.size, shape.nnodes, store.port)
    return distributed.join(dist.PrefixStore(generation, store), 0, shape.size, 0, device, dtype)


def connect(addr: str, port: int) -> dist.TCPStore:
    """A client of rank 0's store, waiting for it as long as it takes (node agents start before node 0)."""
    while True:
        try:
            return dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        except RuntimeError as exc:  # not up yet, or restarting (DistNetworkError is one)
            log.debug("rendezvous %s:%d not reachable (%s); retrying", addr, port, exc)
            time.sleep(0.5)


def claim_rank(addr: str, port: int, rank: int) -> tuple[dist.TCPStore, str, dict]:
    """(store, generation, info) once our rank is claimed in the current generation. If it is held there, its
    holder died (we are its replacement) or this node was started twice: we tell rank 0 the group is broken,
    so that it restarts now rather than at its next step, and wait for the next generation."""
    store = connect(addr, port)
    reported = None
    while True:
        try:
            generation = store.get(GROUP_KEY).decode()
            if store.add(f"{generation}/claim/{rank}", 1) == 1:
                return store, generation, json.loads(store.get(f"{generation}/info"))
            if reported != generation:
                log.warning("rank %d is held in the current group: reporting it broken, waiting for the next", rank)
                store.set(f"{generation}/broken", str(rank))
                reported = generation
            time.sleep(0.5)
        except RuntimeError:  # the store went away with its engine core: wait for the next one
            store = connect(addr, port)


def _exit_when_broken(addr: str, port: int, generation: str) -> None:
    """Rank 0 of a multi-node group: a worker on another node died and its replacement says so; exit, and the
    supervisor restarts the whole group (we would only notice at our next step otherwise)."""
    watcher = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=10))

    def watch() -> None:
        while not watcher.check([f"{generation}/broken"]):
            time.sleep(0.5)
        log.error("a worker of the group died (its replacement reported it): the engine core exits")
        os._exit(1)

    threading.Thread(target=watch, name="group-watch", daemon=True).start()


def exit_with_leader(addr: str, port: int, generation: str) -> None:
    """Workers: exit once rank 0's store is gone or names another generation (the engine core died). Its own
    connection: a blocked broadcast on the main thread could wait for a very long time."""
    watcher = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=10))

    def watch() -> None:
        try:
            while watcher.get(GROUP_KEY).decode() == generation:
                time.sleep(0.5)
            log.warning("a new tensor-parallel group has started: exiting")
        except Exception:  # the store went away with rank 0
            log.warning("rank 0 is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="leader-watch", daemon=True).start()
