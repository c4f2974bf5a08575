"""Shared by the engine tests: one engine shape (BASE, so that engines share compiled programs),
greedy sampling, a count of the engine's own compilations, the check that an engine holds no
block, and the check of one position's logprobs against a log-softmax row; and transformers as
the oracle (a float32 load, its greedy continuation, its logits), for the model tests too."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from minivllm_jax import SamplingParams
from minivllm_jax.worker.compile_watch import CompileWatch
from minivllm_jax.outputs import Logprob

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


def no_leaks(llm: Any) -> None:
    """Every KV block of ``llm`` (an LLM) is free again, all but the null block."""
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1  # all but the null block


# token-id prompts for the tiny random Llama (tests/conftest.py's `tiny_llama`): the token lengths
# of test_llm.py's SmolLM2 prompts (~107 tokens in all, so BASE's 64-token steps chunk them), two
# of them (33 and 32 tokens) sharing a 27-token prefix, so the pools and buckets behave alike
_rng = np.random.default_rng(0)
_SHARED = _rng.integers(3, 256, size=27).tolist()
TINY_PROMPTS = [_rng.integers(3, 256, size=n).tolist() for n in (5, 5, 6, 6, 5, 19, 7)]
TINY_PROMPTS[2], TINY_PROMPTS[4] = _SHARED + TINY_PROMPTS[2], _SHARED + TINY_PROMPTS[4]


def hf_float32(path: str) -> Any:
    """transformers' float32 load of a checkpoint directory, in eval mode: the oracle."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()


def hf_greedy_ids(model: Any, ids: list[int], max_new_tokens: int, eos: int = 2) -> list[int]:
    """transformers' greedy continuation of one prompt's ids (no padding; eos: the tiny Llama's)."""
    import torch

    with torch.no_grad():
        t = torch.tensor([ids])
        gen = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    return gen[0, t.shape[1]:].tolist()


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits ``[len(ids), vocab]`` of one sequence (no padding)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


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
