"""Shared by the engine tests: one engine shape (BASE, so that engines share compiled programs),
greedy sampling, and a count of the engine's own compilations."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minivllm_jax import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_common import CompileWatch  # noqa: E402

MAX_TOKENS = 16
BASE = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@contextlib.contextmanager
def step_compiles() -> Iterator[list[str]]:
    """The XLA compilations of the engine's two programs ("forward", "sample_tokens") inside the
    block, from JAX's own backend-compile events (`CompileWatch`); the list fills on exit."""
    seen: list[str] = []
    with CompileWatch().install() as watch:
        yield seen
    seen.extend(name for name in watch.names if name in ("forward", "sample_tokens"))


def token_ids(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


