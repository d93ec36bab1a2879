"""Data parallel against one engine, alternating in one run: launch.py with its defaults (one engine, all cores'
threads) and with --data-parallel-size N --num-threads 1 (or what --dp-args says), the same workload against each,
bench.serve's streaming client in this process beside the server.

python -m bench.data_parallel [--pairs 2] [--num-prompts 64 --input-len 128 --output-len 128] [--dtype bfloat16]
    [--dp-size 2] [--dp-args "--num-threads 1"] [--result-json bench/results/data_parallel.json]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

if not __package__:  # run as a file (python bench/x.py), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.alternate import add_args, alternate  # noqa: E402
from bench.servers import REPO  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--dp-args", default="--num-threads 1", help="extra launch.py flags of the DP server")
    args = parser.parse_args()
    common = ["--dtype", args.dtype, "--log-level", "warning"]
    dp = [*common, "--data-parallel-size", str(args.dp_size), *shlex.split(args.dp_args)]
    alternate({"dp1": (REPO, common), f"dp{args.dp_size}": (REPO, dp)}, args)


if __name__ == "__main__":
    main()
