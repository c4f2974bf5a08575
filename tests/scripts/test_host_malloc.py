"""scripts/host_malloc.py (bench.py's `--cpu-malloc tuned`), judged by the kernel's count of the
process's minor page faults (getrusage) while a 48 MiB buffer is allocated, written and freed
over and over, as XLA:CPU does with each step's temporaries. Each setting runs in a fresh
process: the malloc settings are process-wide and stay until exit."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CHURN = """
import ctypes, resource
from host_malloc import tune_glibc_malloc
tuned = tune_glibc_malloc() if {tune} else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 48 << 20
def churn():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)  # touch every page, as a step's temporaries are
    libc.free(p)
churn()  # the first round faults in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    churn()
print(tuned, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 8)
"""


def _env() -> dict[str, str]:
    """This process's environment with scripts/ first on PYTHONPATH: the child processes import
    host_malloc by name (pytest's `pythonpath` setting reaches this process only)."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _is_glibc_linux() -> bool:  # read from the interpreter's binary, not as host_malloc asks
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _faults_per_round(tune: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN.format(tune=tune)],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    tuned, faults = out.stdout.split()
    return tuned, int(faults)


@pytest.mark.skipif(not _is_glibc_linux(), reason="glibc's malloc settings")
def test_tuned_malloc_reuses_freed_memory() -> None:
    tuned, default = _faults_per_round(False)
    assert tuned == "False" and default >= 10_000  # 48 MiB of 4 KiB pages faulted in each round
    tuned, faults = _faults_per_round(True)
    assert tuned == "True" and faults * 100 <= default, (faults, default)


def test_tune_glibc_malloc_reports_what_it_did() -> None:
    code = "from host_malloc import tune_glibc_malloc as t; print(t())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=_env()).stdout.strip()
    assert out == str(_is_glibc_linux())
