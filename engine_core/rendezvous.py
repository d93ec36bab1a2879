"""How a tensor-parallel group forms: rank 0 hosts a TCPStore at --master-addr:--master-port (a free port on a
single node), names this generation of the group with a fresh id, and starts its node's workers; every worker
connects, claims its rank in that generation, and joins the process group under the id's prefix.

A restarted engine core is a new store and a new id, so nothing of the dead group's rendezvous can be read by the
new one; a worker that arrives while a stale group still holds its rank (its own predecessor was killed alone)
finds the rank claimed and exits, and its node agent retries until the new generation is up.
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


def claim(store: dist.TCPStore, rank: int) -> tuple[str, dict] | None:
    """(generation, info) with our rank claimed in it; None if that rank is taken in the current generation."""
    generation = store.get(GROUP_KEY).decode()
    if store.add(f"{generation}/claim/{rank}", 1) != 1:
        return None
    return generation, json.loads(store.get(f"{generation}/info"))


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
