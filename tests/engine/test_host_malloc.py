"""minivllm_jax/host_malloc.py, judged by the kernel's count of the process's minor page faults
(getrusage): SmolLM2's 32-row step, timed by scripts/bench_step.py in a fresh process for each
setting (the malloc settings are process-wide and stay until exit)."""
from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _is_glibc_linux() -> bool:  # read from the interpreter's binary, not as host_malloc asks
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _faults_per_step(cpu_malloc: str) -> int:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_step.py"), "--rows", "32",
                           "--layouts", "switched", "--forms", "fm", "--rounds", "4",
                           "--cpu-malloc", cpu_malloc], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (faults,) = re.findall(r"(\d+) minor page faults a step", proc.stdout)
    return int(faults)


@pytest.mark.skipif(not _is_glibc_linux(), reason="glibc's malloc settings")
def test_tuned_malloc_reuses_each_steps_memory(on_gpu: bool) -> None:
    if on_gpu:
        pytest.skip("the settings apply on the CPU backend")
    default = _faults_per_step("default")
    if default == 0:
        pytest.skip("this C library already reuses the step's memory")
    assert default >= 1000  # SmolLM2's step faults ~18 MB of temporaries in, every time
    tuned = _faults_per_step("tuned")
    assert tuned * 10 <= default, (tuned, default)  # measured: 0-148 against ~4,600


def test_tune_glibc_malloc_reports_what_it_did() -> None:
    # in a child: the settings would otherwise stay with this test process
    code = "from minivllm_jax.host_malloc import tune_glibc_malloc as t; print(t())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=SCRIPTS.parent).stdout.strip()
    assert out == str(_is_glibc_linux())
