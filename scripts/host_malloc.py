"""glibc malloc settings that let XLA:CPU reuse each step's memory: an opt-in of scripts/bench.py
(`--cpu-malloc tuned`), never applied by the library, since they change the whole process.

XLA:CPU allocates each execution's temporaries afresh, tens of MB for a SmolLM2 step. glibc serves
requests that large with a fresh ``mmap`` and unmaps them on ``free``, so every step faults its
temporaries in again, page by page. With ``M_MMAP_MAX`` 0 (no mmap'd chunks) and ``M_TOP_PAD``
128 MiB (the heap keeps that much past its top when it shrinks) the same memory comes back from
the heap with no fault. The cost is memory kept rather than returned to the system. Figures:
docs/benchmarks.md ("Tried and left out").
"""
from __future__ import annotations

import ctypes
import sys

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
    return libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TOP_PAD, top_pad) == 1
