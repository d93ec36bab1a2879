"""How our processes start each other (engine cores, tensor-parallel workers): `python -P -m <module>`, with this
checkout's root first on PYTHONPATH.

Without -P, `python -m` puts the working directory first on sys.path: a process started from inside another
checkout imported that checkout's engine, not ours (bench.alternate compared two commits' API processes over one
and the same engine that way).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def python_module(module: str, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line that runs `module` with this checkout's packages, and its environment (`env`, by default
    ours, with PYTHONPATH led by our root)."""
    base = dict(os.environ if env is None else env)
    path = os.pathsep.join(filter(None, [ROOT, base.get("PYTHONPATH")]))
    return [sys.executable, "-P", "-m", module], {**base, "PYTHONPATH": path}
