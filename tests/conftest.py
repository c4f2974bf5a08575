"""Test modes: CPU (default; Pallas kernels run with interpret=True) and GPU (`--gpu` or
MINIVLLM_TEST_GPU=1; kernels compiled for the GPU through Pallas' Triton lowering).

Tests marked `gpu` run only in GPU mode. The `interpret` fixture is what every kernel test passes
to `ragged_paged_attention(..., interpret=...)`; `on_gpu` tells engine tests which backend to use.
`lower_for_cuda` traces and lowers a jit for CUDA on any machine, counting its Triton kernel calls.
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


# caches the library and the scripts would keep under ~/.cache (param conversions, JAX's compiled
# programs, the benchmarks' random checkpoints): tests keep them in one temporary directory,
# shared with their subprocesses through the environment
CACHE_ENV = ("MINIVLLM_JAX_CACHE", "MINIVLLM_JAX_COMPILE_CACHE", "MINIVLLM_BENCH_CACHE")


def pytest_configure(config: pytest.Config) -> None:
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="minivllm_jax_tests_")
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    for name in CACHE_ENV:
        os.environ[name] = os.path.join(root, name.lower())
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
def lower_for_cuda() -> Callable[..., CudaLowering]:
    """``lower_for_cuda(jitted, *args, **kwargs)`` traces and lowers ``jitted`` for CUDA on any
    machine, so errors in Pallas' Triton lowering show on a CPU-only one. Both run under an
    abstract H100 mesh: jaxlib > 0.10.2 reads the target's compute capability while lowering,
    from that mesh's device where no GPU is present. Triton's own compilation to PTX happens only
    when a GPU compiles the executable."""
    import jax

    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), (jax.sharding.AxisType.Explicit,), abstract_device=h100)

    def lower(jitted: Any, *args: Any, **kwargs: Any) -> CudaLowering:
        with jax.sharding.use_abstract_mesh(mesh):
            text = jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
        calls = text.count("@__gpu$xla.gpu.triton") + text.count("@triton_kernel_call_ffi")
        return CudaLowering(text, calls)

    return lower
