"""Session fixtures of the engine tests (the embedded model's are in tests/conftest.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # engine_helpers


@pytest.fixture(scope="session")
def backend(on_gpu: bool) -> str:
    return "pallas" if on_gpu else "xla"


@pytest.fixture(scope="session")
def tiny_model(tiny_llama: str) -> Any:
    """Our float32 load of the tiny random Llama (tests/conftest.py's `tiny_llama`)."""
    from minivllm_jax.loader import load_model

    return load_model(tiny_llama, dtype="float32")


@pytest.fixture(scope="session")
def tiny_hf(tiny_llama: str) -> Any:
    """transformers' load of the same checkpoint, float32: the oracle."""
    pytest.importorskip("transformers")
    from engine_helpers import hf_float32

    return hf_float32(tiny_llama)


@pytest.fixture(scope="session")
def tiny_greedy(tiny_hf: Any) -> list[list[int]]:
    """transformers' greedy continuation (MAX_TOKENS) of each of engine_helpers.TINY_PROMPTS, one
    prompt at a time (no padding)."""
    from engine_helpers import MAX_TOKENS, TINY_PROMPTS, hf_greedy_ids

    return [hf_greedy_ids(tiny_hf, p, MAX_TOKENS) for p in TINY_PROMPTS]
