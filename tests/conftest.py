"""Test modes: CPU (default; Pallas kernels run with interpret=True) and GPU (`--gpu` or
MINIVLLM_TEST_GPU=1; kernels compiled for the GPU through Pallas' Triton lowering).

Tests marked `gpu` run only in GPU mode. The `interpret` fixture is what every kernel test passes
to `ragged_paged_attention(..., interpret=...)`; `on_gpu` tells engine tests which backend to use.
`lower_for_cuda` lowers a traced jit for CUDA on any machine, counting its Triton kernel calls.
"""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

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


class CudaLowering(NamedTuple):
    text: str           # the lowered StableHLO module
    triton_calls: int   # Pallas kernels compiled through Triton (not interpret mode)


@pytest.fixture(scope="session")
def lower_for_cuda() -> Callable[[Any], CudaLowering]:
    """``lower_for_cuda(jitted.trace(...))``: lowering needs no device, so Triton-lowering errors
    show on a CPU-only machine. jaxlib > 0.10.2 also compiles the Triton module while lowering,
    which needs a GPU: there, on CPU, the test is skipped."""
    import jax

    def lower(traced: Any) -> CudaLowering:
        try:
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        except Exception as err:
            if jax.default_backend() == "cpu" and jax.__version_info__ > (0, 10, 2):
                pytest.skip(f"Triton compilation at lowering time needs a GPU here: {err}")
            raise
        calls = text.count("@__gpu$xla.gpu.triton") + text.count("@triton_kernel_call_ffi")
        return CudaLowering(text, calls)

    return lower
