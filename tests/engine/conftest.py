"""Session fixtures of the engine tests (the embedded model's are in tests/conftest.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # engine_helpers


@pytest.fixture(scope="session")
def backend(on_gpu: bool) -> str:
    return "pallas" if on_gpu else "xla"
