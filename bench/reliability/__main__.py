"""Entry point of `python -m bench.reliability` (and of `python bench/reliability`)."""

import os
import sys

if not __package__:  # run as a directory (python bench/reliability), not with -m: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.reliability.cli import main  # noqa: E402

sys.exit(main())
