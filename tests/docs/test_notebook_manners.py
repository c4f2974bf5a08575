"""What a notebook user meets besides generate(): `repr(LLM)`, a second `LLM` of the same model
in the same process reusing the compiled programs, and a cell interrupted inside `generate` (a
KeyboardInterrupt from a timer) leaving the engine empty, its blocks free and ready for the next
cell. The notebook itself runs in test_readme.py."""
from __future__ import annotations

import _thread
import gc
import signal
import threading
from typing import Any

import jax
import pytest

from minivllm_jax import LLM, SamplingParams
from engine_helpers import BASE, GREEDY, TINY_PROMPTS, step_compiles, token_ids


def test_repr_names_the_model_and_its_sizes(tiny_model: Any, backend: str) -> None:
    """Where the model came from, its dtype, the platform and attention backend, the usable KV
    blocks (num_kv_blocks counts the null block) and block size, the length and sequence caps."""
    llm = LLM(tiny_model, attention_backend=backend, **BASE)
    assert repr(llm) == (f"LLM(model={tiny_model.source!r}, dtype=float32, "
                         f"platform={jax.default_backend()}, attention={backend}, kv_blocks=63x16, "
                         "max_model_len=128, max_num_seqs=8)")
    spec = LLM(tiny_model, attention_backend=backend, **BASE, block_size=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert repr(spec).endswith("kv_blocks=63x8, max_model_len=128, max_num_seqs=8, speculative=ngram)")


def test_a_second_llm_reuses_the_compiled_programs(tiny_model: Any, backend: str,
                                                  tiny_greedy: list[list[int]]) -> None:
    """The second engine of the same model and sizes compiles no step program: it loads those the
    first compiled (the compile cache on disk, on by default)."""
    first = LLM(tiny_model, attention_backend=backend, **BASE)
    assert token_ids(first.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)) == tiny_greedy
    with step_compiles() as compiled:
        second = LLM(tiny_model, attention_backend=backend, **BASE)
        outs = second.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)
    assert compiled == [] and token_ids(outs) == tiny_greedy
    with step_compiles() as control:  # the count sees compiles: a new shape compiles
        LLM(tiny_model, attention_backend=backend, **{**BASE, "max_num_seqs": 4}).generate(
            TINY_PROMPTS[:1], GREEDY, use_tqdm=False)
    assert "forward" in control


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_interrupted_generate_leaves_the_engine_ready(tiny_model: Any, backend: str,
                                                         tiny_greedy: list[list[int]],
                                                         async_scheduling: bool) -> None:
    """A KeyboardInterrupt raised in the main thread from a timer while `generate` runs (as
    Jupyter's interrupt does) propagates; the call's requests are aborted unreported, every KV
    block but the null one is free, nothing is unfinished, and the next call equals
    transformers."""
    llm = LLM(tiny_model, attention_backend=backend, async_scheduling=async_scheduling, **BASE)
    long = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    many = TINY_PROMPTS * 12  # 84 requests, 8 at a time: ~1,000 steps, seconds
    timer = threading.Timer(0.5, _thread.interrupt_main)
    # Python's own SIGINT handler, which interrupt_main needs: a process started in the
    # background of a non-interactive shell inherits SIGINT ignored, and keeps it so
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    # no garbage collection meanwhile: an interrupt that lands in a gc callback (jax has one)
    # is "ignored" there by Python, and the call would never see it
    gc.disable()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(many, long, use_tqdm=False)
    finally:
        timer.cancel()
        gc.enable()
        signal.signal(signal.SIGINT, handler)
    stats = llm.get_stats()
    assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1
    assert not llm.has_unfinished_requests() and llm.step() == []
    assert token_ids(llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)) == tiny_greedy
