"""Test modes: CPU (default; Pallas kernels run with interpret=True) and GPU (`--gpu` or
MINIVLLM_TEST_GPU=1; kernels compiled for the GPU through Pallas' Triton lowering).

Tests marked `gpu` run only in GPU mode. The `interpret` fixture is what every kernel test passes
to `ragged_paged_attention(..., interpret=...)`; `on_gpu` tells engine tests which backend to use.
"""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", default=False,
                     help="run kernels and the engine compiled for the GPU (needs one)")


def _gpu_mode(config: pytest.Config) -> bool:
    return bool(config.getoption("--gpu")) or os.environ.get("MINIVLLM_TEST_GPU", "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    if _gpu_mode(config):
        import jax

        if jax.default_backend() != "gpu":
            raise pytest.UsageError(f"--gpu given but jax's default backend is {jax.default_backend()!r}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_mode(config):
        return
    skip = pytest.mark.skip(reason="GPU mode only (pass --gpu on a machine with a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def on_gpu(request: pytest.FixtureRequest) -> bool:
    return _gpu_mode(request.config)


@pytest.fixture(scope="session")
def interpret(on_gpu: bool) -> bool:
    """Pallas interpret mode: True on CPU, False (compiled) in GPU mode."""
    return not on_gpu
