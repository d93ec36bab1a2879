"""The kernel sources build and load for x86 targets other than this machine's: each `#if` branch of csrc/ must leave
every symbol it names defined, or ctypes refuses the library where that branch is compiled (a tile function named
outside its target's `#if` once broke every AVX-512 machine while this AVX2 one passed)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest

from engine_core.kernel_build import build_library

CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(platform.machine() != "x86_64" or CC is None, reason="x86-64 targets, built with a C compiler")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "skylake-avx512", "sapphirerapids"])
def test_kernels_build_and_load_for_each_x86_target(march) -> None:
    """Baseline x86-64 (no kernels), AVX2 + FMA, AVX-512 without and with AVX512-BF16. Loading runs none of their
    code, so a CPU without those instructions can check them all. Built into the kernel cache, where
    tests/test_avx2_kernels.py finds the AVX2 build."""
    assert CC is not None
    try:
        lib = build_library(CC, march)
    except subprocess.CalledProcessError as exc:
        pytest.fail(exc.stderr[-2000:])
    ctypes.CDLL(str(lib))  # resolves every symbol now: raises OSError naming one left undefined
