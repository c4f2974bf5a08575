"""glibc malloc settings that let XLA:CPU reuse its per-step memory (Linux with glibc only).

XLA:CPU allocates each execution's temporaries afresh, tens of MB for a SmolLM2 step. glibc
serves requests that large with a fresh ``mmap`` and unmaps them on ``free``, so every step
faults its temporaries in again, page by page: ~4,600 minor page faults (~18 MB) in every
32-row decode step, ~8 ms of ~80 on an AVX2 EPYC. With ``M_MMAP_MAX`` 0 (no mmap'd chunks) and
``M_TOP_PAD`` 128 MiB (the heap keeps that much past its top when it shrinks), the same memory
comes back from the heap every step with no fault at all (docs/benchmarks-log.md, "Page faults
in every step").

These are settings of the process's C library, not of the engine: they stay for the life of the
process and apply to every allocation in it. The cost is memory kept rather than returned to the
system: up to ``M_TOP_PAD`` past the heap's top, and freed blocks below it, which later
allocations reuse. ``EngineConfig.tune_cpu_malloc`` (on by default) applies them when an engine
runs on the CPU; they change no computed value.
"""
from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

M_TOP_PAD, M_MMAP_MAX = -2, -4  # <malloc.h>
TOP_PAD_BYTES = 128 << 20


def tune_glibc_malloc(top_pad: int = TOP_PAD_BYTES) -> bool:
    """Turn off mmap'd chunks and keep ``top_pad`` bytes past the heap's top; True when glibc
    took both settings, False elsewhere (another C library or OS: nothing is changed)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # e.g. musl, whose mallopt is a stub
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TOP_PAD, top_pad) == 1
    logger.info("glibc malloc: no mmap'd chunks, %d MiB kept past the heap's top%s",
                top_pad >> 20, "" if ok else " (refused)")
    return ok
