"""python -m engine_core.worker --rank R [--cpus 2,3] [--parent-pid PID] [engine flags]: one tensor-parallel rank
other than 0. It joins rank 0's group (engine_core/rendezvous.py), loads its slice of the model and its slice of
the KV cache, then runs every forward and logits computation rank 0 broadcasts, until the group ends. Started by
rank 0 for its own node, and by `launch.py --node-rank k` (tp_procs.run_node_agent) on the others.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
from typing import NoReturn

from common.config import EngineConfig, add_cli_args, from_cli_args
from common.python_command import unblock_sigterm

log = logging.getLogger("roseinfer.tp")


def _die_with(parent_pid: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: nothing to clean up
    if os.getppid() != parent_pid:  # it died before the prctl
        os._exit(1)


def serve(runner) -> NoReturn:
    """Follows rank 0's broadcasts until the group ends (rank 0 never sends a stop: its death ends us)."""
    import torch

    from engine_core import distributed

    with torch.inference_mode():
        while True:
            try:
                op, args = distributed.receive(runner.block_size)
            except RuntimeError as exc:  # rank 0 went away (its death signal or store watch ends us as well)
                log.warning("the group ended: %s", str(exc).splitlines()[0][:200])
                logging.shutdown()
                os._exit(1)  # not a normal exit: gloo's threads abort the interpreter's teardown
            if op == distributed.OP_STEP:
                runner.model(*args)
            else:
                runner.model.compute_logits(*args)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_core.worker")
    parser.add_argument("--rank", type=int, required=True, help="this worker's rank in the group (> 0)")
    parser.add_argument("--cpus", help="cores this rank runs on (comma-separated; CPU only)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process does")
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker {args.rank} %(levelname)s %(message)s")
    if args.parent_pid:
        _die_with(args.parent_pid)
        # Our parent ends us (SIGKILL, or its death): a SIGTERM for the whole process group (a process manager
        # stopping the server) would break the group under requests the server still drains.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    unblock_sigterm()  # held since our start (sigterm_held)
    config = from_cli_args(EngineConfig, args)

    import torch.distributed as dist

    from common.model_source import parse_hf_overrides, resolve_model
    from engine_core import distributed, rendezvous
    from engine_core.device import pick_device, pick_dtype
    from engine_core.model_runner import ModelRunner
    from engine_core.tp_procs import layout

    shape = layout(config)
    if not 0 < args.rank < shape.size:
        parser.error(f"--rank must be in [1, {shape.size})")
    assert config.master_port is not None, "workers need --master-port"
    store, generation, info = rendezvous.claim_rank(config.master_addr, config.master_port, args.rank)
    rendezvous.exit_with_leader(config.master_addr, config.master_port, generation)
    if info["size"] != shape.size:
        raise SystemExit(f"rank 0 runs {info['size']} ranks, this node was started for {shape.size}")
    config = dataclasses.replace(config, dtype=info["dtype"], block_size=info["block_size"])
    device = pick_device(config.device)
    if device.type == "cpu" and args.cpus:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    distributed.join(dist.PrefixStore(generation, store), args.rank, shape.size, shape.local_rank(args.rank), device,
                     pick_dtype(config.dtype, device))  # fmt: skip
    source = resolve_model(config.model, overrides=parse_hf_overrides(config.hf_overrides), tokenizer=config.tokenizer)
    runner = ModelRunner(config, source, info["max_model_len"])
    log.info("rank %d of %d ready", args.rank, shape.size)
    serve(runner)


if __name__ == "__main__":
    sys.exit(main())
