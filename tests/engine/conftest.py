"""Session fixtures shared by the engine tests: the embedded SmolLM2 model is loaded once."""
from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def loaded_model(on_gpu: bool) -> Any:
    """float32 on GPU too: compared with transformers. Missing model package: an error on CPU
    (CI installs it), a skip in GPU mode (the 98 MB GGUF cannot travel to a lent GPU machine)."""
    from minivllm_jax.loader import default_model_path, load_model

    try:
        default_model_path()
    except FileNotFoundError as e:
        if on_gpu:
            pytest.skip(str(e))
        raise
    return load_model(None, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(loaded_model: Any) -> Any:
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def backend(on_gpu: bool) -> str:
    return "pallas" if on_gpu else "xla"
