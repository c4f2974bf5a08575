"""Shared by the engine tests: one engine shape (BASE, so that engines share compiled programs),
greedy sampling, a count of the engine's own compilations, and the check of one position's
logprobs against a log-softmax row."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from minivllm_jax import SamplingParams
from minivllm_jax.outputs import Logprob

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


def check_logprobs(entry: dict[Any, Any], token: int, want: np.ndarray, k: int,
                   tol: float = 1e-3) -> None:
    """One position's logprobs dict (``{token id: Logprob}``, or its JSON form ``{"id": [logprob,
    rank, text]}``) against the model's log-softmax row ``want`` (transformers'): the chosen
    token's value and rank (ties within tol aside), and the k most likely ones."""
    entry = {int(t): lp if isinstance(lp, Logprob) else Logprob(*lp) for t, lp in entry.items()}
    assert token in entry and len(entry) in (k, k + 1)
    for tid, lp in entry.items():
        assert abs(lp.logprob - want[tid]) <= tol, (tid, lp.logprob, want[tid])
        assert isinstance(lp.decoded_token, str)
    got = entry[token]
    x = want[token]
    assert 1 + (want > x + tol).sum() <= got.rank <= 1 + (want > x - tol).sum()
    top = sorted((t for t in entry if t != token or entry[t].rank <= k), key=lambda t: entry[t].rank)
    kth = np.sort(want)[-k] if k else np.inf
    assert len(top) >= k and all(want[t] >= kth - tol for t in top[:k])
