"""Builds our CPU kernels (csrc/*.c) once per machine with the system C compiler into one shared library, cached
under ~/.cache/roseinfer/kernels by the sources and the CPU's flags; engine_core/cpu_kernels.py loads and calls it."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("roseinfer.kernels")
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (or the processor's name where there is none)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def compile_command(cc: str, march: str, out: str) -> list[str]:
    return [cc, "-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-shared", "-fPIC", *map(str, SOURCES), "-lm",
            "-o", out]  # fmt: skip


def build_library(cc: str, march: str = "native") -> Path:
    """The kernels compiled for -march=`march`, from the cache when they are there; raises
    subprocess.CalledProcessError (with the compiler's stderr) or OSError when they cannot be built. Keyed by the
    sources and, for "native", the CPU's flags: a different machine compiles its own."""
    files = sorted([*SOURCES, *CSRC.glob("*.h")])
    target = cpu_flags() if march == "native" else march
    key = hashlib.sha256(b"".join(f.read_bytes() for f in files) + target.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ROSEINFER_CACHE_DIR", Path.home() / ".cache" / "roseinfer")) / "kernels"
    lib = cache / f"roseinfer_kernels-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run(compile_command(cc, march, tmp), check=True, capture_output=True, text=True, timeout=180)
            os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
        finally:
            Path(tmp).unlink(missing_ok=True)
    return lib


def build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None or os.environ.get("ROSEINFER_NO_KERNELS"):
        return None
    # ROSEINFER_KERNEL_MARCH: another target this CPU runs (x86-64-v3: the AVX2 kernels on an AVX-512 CPU).
    try:
        lib = build_library(cc, os.environ.get("ROSEINFER_KERNEL_MARCH", "native"))
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("CPU kernels not built (%s); using the torch paths", exc)
        return None
    try:
        return ctypes.CDLL(str(lib))  # every symbol resolved now (RTLD_NOW), not at the first call
    except OSError as exc:
        log.warning("CPU kernels not loaded (%s); using the torch paths", exc)
        return None
