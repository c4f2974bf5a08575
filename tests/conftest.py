"""Test modes: CPU (default; Pallas kernels run with interpret=True) and GPU (`--gpu` or
MINIVLLM_TEST_GPU=1; kernels compiled for the GPU through Pallas' Triton lowering).

Tests marked `gpu` run only in GPU mode. The `interpret` fixture is what every kernel test passes
to `ragged_paged_attention(..., interpret=...)`; `on_gpu` tells engine tests which backend to use.
`lower_for_cuda` traces and lowers a jit for CUDA on any machine, counting its Triton kernel calls.

The fixtures of more than one test folder are here too (the embedded model and its transformers
oracle, the tiny random Llama, the engine tests' backend and tiny-model loads, the model and
loader tests' tiny checkpoints); the modules they share are in tests/helpers/, importable by name
(pyproject.toml's `pythonpath`, with scripts/).
"""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", default=False,
                     help="run kernels and the engine compiled for the GPU (needs one)")


def _gpu_mode(config: pytest.Config) -> bool:
    return bool(config.getoption("--gpu")) or os.environ.get("MINIVLLM_TEST_GPU", "") not in ("", "0")


# caches the library and the scripts would keep under ~/.cache (param conversions, JAX's compiled
# programs, the benchmarks' random checkpoints, matplotlib's fonts): tests keep them in one
# temporary directory, shared with their subprocesses through the environment
CACHE_ENV = ("MINIVLLM_JAX_CACHE", "MINIVLLM_JAX_COMPILE_CACHE", "MINIVLLM_BENCH_CACHE",
             "MPLCONFIGDIR")


def pytest_configure(config: pytest.Config) -> None:
    import shutil
    import tempfile

    if not hasattr(config, "workerinput"):  # pytest-xdist workers inherit the controller's
        root = tempfile.mkdtemp(prefix="minivllm_jax_tests_")
        config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
        for name in CACHE_ENV:
            os.environ[name] = os.path.join(root, name.lower())
    # torch's intra-op pool would take the core XLA runs on: a tiny model's generate() takes ~1 s
    # with 2 threads on the 2-core CI machine, ~10 ms with 1 (read when torch is imported)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not _gpu_mode(config):
        # with libtpu installed (.ci/run's: the TPU compiler, for ahead-of-time compiles),
        # jax would probe for a TPU at start-up and log to stderr in every process; topologies
        # for those compiles are available on the CPU platform too
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # the tests compile far more than they run (tiny models, interpreted kernels, many
        # shapes): XLA:CPU's LLVM backend at -O0 compiles them ~1/3 faster (the same programs,
        # less optimised machine code; no fast-math at either level)
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_backend_optimization_level" not in flags:
            flags = f"{flags} --xla_backend_optimization_level=0".strip()
        # two workers (and their subprocesses) share two cores: each matmul on one thread, not
        # two workers' pools of two fighting over them
        if "xla_cpu_multi_thread_eigen" not in flags:
            flags = f"{flags} --xla_cpu_multi_thread_eigen=false"
        os.environ["XLA_FLAGS"] = flags
    if _gpu_mode(config):
        import jax

        if jax.default_backend() != "gpu":
            raise pytest.UsageError(f"--gpu given but jax's default backend is {jax.default_backend()!r}")


# The schedule under pytest-xdist (`-n 2`; pyproject.toml adds `--dist loadfile
# --no-loadscope-reorder`): a test file is a work unit, run on one worker (its module fixtures, a
# server, a subprocess's results, compiled engines, are built once), and the units are handed out
# in collection order as workers free up. The files below come first, longest first, so that the
# short files are the last ones handed out and both workers finish together. Paths are relative to
# tests/; one that names no file stops the session at collection (`_check_longest_first`), so a
# moved or renamed file cannot silently drop out of this order.
LONGEST_FIRST = [
    "engine/test_llm.py",
    # not the server's file second: it would wait for the first to convert SmolLM2's params
    "kernels/test_tpu_attention.py",
    "serving/test_serve.py",
    "kernels/test_ragged_paged_attention.py",
    "parallel/test_tensor_parallel.py",
    "cli/test_cli.py",
    "docs/test_readme.py",  # after test_cli.py, whose SmolLM2 run compiles its programs
    "structured_output/test_structured_outputs.py",
    "engine/test_quantized.py",
    "aot/test_tpu_fit.py",
    "engine/test_spec_decode.py",
    "scripts/test_bench_script.py",
    "aot/test_aot_compile.py",
    "engine/test_engine_mechanics.py",
    "models/test_families.py",
    "engine/test_tpu_backend.py",
    "models/test_smollm2.py",
    "worker/test_compile_cache_devices.py",
    "loader/test_loader.py",
    "sampling/test_sampler.py",
    "serving/test_serve_faults.py",
    "models/test_layer_layouts.py",
    "aot/test_step_lowering.py",
    "engine/test_hardening.py",
]


TESTS = os.path.dirname(os.path.abspath(__file__))


def _check_longest_first() -> None:
    missing = [path for path in LONGEST_FIRST if not os.path.isfile(os.path.join(TESTS, path))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's LONGEST_FIRST names files that do not exist "
                                f"under tests/: {', '.join(missing)}")


@pytest.hookimpl(tryfirst=True)  # under xdist, before its controller's hook (which collects nothing)
def pytest_collection(session: pytest.Session) -> None:
    """Collection's first step, in every process (the xdist controller and each worker):
    LONGEST_FIRST must name existing files."""
    _check_longest_first()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {os.path.join(TESTS, module): i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: file order within
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
def tpu_topology() -> Callable[[str], Any]:
    """A TPU topology's name ("v5e:2x2", "v4:2x2x1", ...) -> its first device, from libtpu's
    ahead-of-time compiler: programs compile for it with no TPU attached (skips without the
    libtpu this jax pins: .ci/run installs it)."""
    from minivllm_jax.aot import libtpu_problem

    if (problem := libtpu_problem()) is not None:  # missing, or not the release this jax pins
        pytest.skip(problem)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask here
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # both test workers load libtpu
    from jax.experimental import topologies

    return functools.cache(lambda name: topologies.get_topology_desc(
        platform="tpu", topology_name=name).devices[0])


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


# ---- the embedded model, ours and transformers' (the oracle), loaded once per session -----------
@pytest.fixture(scope="session")
def smollm2_path(on_gpu: bool) -> str:
    """The embedded SmolLM2 GGUF. Missing: an error on CPU (CI installs it), a skip in GPU mode
    (the 98 MB file cannot travel to a lent GPU machine)."""
    from minivllm_jax.loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        if on_gpu:
            pytest.skip(str(e))
        raise


def session_dir() -> str:
    """The session's temporary directory (the parent of CACHE_ENV's caches), shared by the
    pytest-xdist workers and every subprocess."""
    return os.path.dirname(os.environ[CACHE_ENV[0]])


@contextlib.contextmanager
def session_lock(name: str) -> Iterator[None]:
    """An exclusive lock, across the session's xdist workers, on ``name`` (a file in
    session_dir()): what one worker makes under it, the others find made."""
    import fcntl

    os.makedirs(session_dir(), exist_ok=True)
    with open(os.path.join(session_dir(), f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture(scope="session")
def loaded_model(smollm2_path: str) -> Any:
    """Our load of the embedded model, float32 on GPU too (compared with transformers). One
    worker converts the GGUF into the session's param cache (~25 s) while the others wait, then
    load that entry (~2 s)."""
    from minivllm_jax.loader import load_model

    with session_lock("smollm2_params"):
        return load_model(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(loaded_model: Any) -> Any:
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: str) -> Any:
    """transformers' own load of the same GGUF, float32: the oracle. Reading the GGUF takes
    transformers ~30 s, so the first worker to get here saves the model it loaded (its config
    and its float32 tensors, as safetensors) in the session directory, and the others load that
    copy with transformers (<1 s): the same weights, bit for bit. torch runs one thread: the
    2-core CI machine's second core is XLA's, and two torch threads oversubscribe it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    saved = os.path.join(session_dir(), "smollm2_hf")
    with session_lock("smollm2_hf"):
        if os.path.isfile(os.path.join(saved, "model.safetensors")):
            model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
            return model.eval()
        import copy

        from safetensors.torch import save_model

        path = os.path.abspath(smollm2_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # GGUF's: the saved tensors are plain float32
            del config.quantization_config
        config.save_pretrained(saved)
        model.generation_config.save_pretrained(saved)
        save_model(model, os.path.join(saved, "model.tmp"))
        os.replace(os.path.join(saved, "model.tmp"), os.path.join(saved, "model.safetensors"))
        return model.eval()


# ---- a tiny random Llama with a word-level tokenizer, for tests where SmolLM2 is not the point ----
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)


def save_tiny_llama(out: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """A random-weight Llama checkpoint (``TINY_LLAMA`` with ``overrides``) and a word-level
    tokenizer (``"t5 t6"`` -> ``[5, 6]``; t1 is bos, t2 eos) saved in ``out``. Its weights are large
    enough that greedy logits are far from ties."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = {**TINY_LLAMA, **overrides}
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def make_tiny_llama() -> Callable[..., str]:
    """``save_tiny_llama`` (conftest modules are not importable by name)."""
    return save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The directory of a ``save_tiny_llama`` checkpoint (8 query / 2 kv heads, 2 layers)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


# ---- the engine tests': the attention backend, the tiny Llama loaded by us and by transformers ----
@pytest.fixture(scope="session")
def backend(on_gpu: bool) -> str:
    return "pallas" if on_gpu else "xla"


@pytest.fixture(scope="session")
def tiny_model(tiny_llama: str) -> Any:
    """Our float32 load of the tiny random Llama (`tiny_llama`)."""
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


# ---- the model and loader tests': the embedded model under its model-test name, and a factory of
# tiny random-weight Hugging Face checkpoints (tiny_configs.FAMILIES) saved with save_pretrained
@pytest.fixture(scope="session")
def smollm2(loaded_model: Any) -> Any:
    """Our load of the embedded GGUF in float32 (the session's `loaded_model`)."""
    return loaded_model


def _randomize(model: Any, seed: int) -> None:
    """Weights large enough that logits are peaked (greedy parity is then meaningful)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """``make(family, max_shard_size=None) -> (checkpoint dir, the torch model)``, memoised. A
    family's weights depend only on the family (not on which test, on which xdist worker, made
    a checkpoint first): seed = its index in sorted(FAMILIES), the order of a serial run."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)  # the 2-core CI machine's second core is XLA's (see pytest_configure)
    from tiny_configs import FAMILIES, TINY

    made: dict[tuple[str, Any], tuple[Path, Any]] = {}

    def make(family: str, max_shard_size: str | None = None) -> tuple[Path, Any]:
        key = (family, max_shard_size)
        if key not in made:
            cls_name, extra = FAMILIES[family]
            config = getattr(transformers, cls_name)(**TINY, **extra)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _randomize(model, seed=sorted(FAMILIES).index(family))
            out = tmp_path_factory.mktemp(f"tiny_{family}")
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            model.save_pretrained(out, **kwargs)
            made[key] = (out, model)
        return made[key]

    return make
