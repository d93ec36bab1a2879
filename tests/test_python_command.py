"""Engine cores and tensor-parallel workers import this checkout's packages whatever directory they start in, and
take torch's large buffers in huge pages."""

from __future__ import annotations

import subprocess
from pathlib import Path

from common.python_command import ROOT, python_module


def test_a_started_module_imports_this_checkout_not_the_working_directory(tmp_path: Path) -> None:
    # Another checkout's `common` package in the working directory: importing it fails loudly.
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("raise SystemExit('imported the working directory')\n")
    cmd, env = python_module("common.python_command")
    assert env["PYTHONPATH"].split(":")[0] == ROOT
    ours = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0, ours.stderr
    # What -P prevents: plain `python -m` puts the working directory ahead of PYTHONPATH.
    plain = subprocess.run([c for c in cmd if c != "-P"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert plain.returncode != 0 and "imported the working directory" in plain.stderr


def test_children_take_huge_pages_unless_told_otherwise() -> None:
    assert python_module("engine_core", {})[1]["THP_MEM_ALLOC_ENABLE"] == "1"
    assert python_module("engine_core", {"THP_MEM_ALLOC_ENABLE": "0"})[1]["THP_MEM_ALLOC_ENABLE"] == "0"
