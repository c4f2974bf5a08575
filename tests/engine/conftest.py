"""Session fixtures shared by the engine tests: the embedded SmolLM2 model is loaded once."""
from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def loaded_model() -> Any:
    from minivllm_jax.loader import load_model

    return load_model(None, dtype="float32")  # float32 on GPU too: compared with transformers


@pytest.fixture(scope="session")
def tokenizer(loaded_model: Any) -> Any:
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def backend(on_gpu: bool) -> str:
    return "pallas" if on_gpu else "reference"
