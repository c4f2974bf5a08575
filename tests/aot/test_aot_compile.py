"""`minivllm-jax compile` (docs/API.md §2b): every step program compiled ahead of time by
libtpu, the real TPU compiler, for a v5e topology on this CPU machine, from a model directory that
holds only a config.json (the tiny random Llama's, and SmolLM2-135M's shape).

Truths, each computed here from the model's config and not by the engine's code: the programs are
`step_layout.step_shapes`' forward and sampler keys; the KV cache's bytes are layers x block size
x 2 x kv heads x head_dim (padded to 128 lanes in the TPU kernel's layout) x 2 bytes per block;
the params' bytes are counted from the Llama shapes; v5e has 16 GiB of HBM per chip. XLA's memory
analysis of each forward must then show the cache and the params among its arguments and the
cache aliased to its output (donated, updated in place), and with the TPU kernel no temporary
near the cache's size (no copy of it).

Skipped without libtpu, or with another release than the jax in use pins (.ci/run installs
it; elsewhere: pip install "jax[tpu]==<the jax version>").
"""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minivllm_jax.aot import libtpu_problem

if libtpu_problem() is not None:  # .ci/run installs the one jax pins on x86-64 Linux
    pytest.skip(libtpu_problem(), allow_module_level=True)

import bench_common as bc  # noqa: E402  (scripts/)
from minivllm_jax.backends import ATTENTION_BACKENDS  # noqa: E402
from minivllm_jax.config import EngineConfig  # noqa: E402
from minivllm_jax.step_layout import StepShape, step_shapes  # noqa: E402

TOPOLOGY = "v5e:2x2"
V5E_HBM_GIB = 16
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)
# HuggingFaceTB/SmolLM2-135M's config.json (scripts/bench_common.py's shape)
SMOLLM2 = {**bc.build_hf_config("smollm2-135m").to_dict(), "torch_dtype": "bfloat16"}
PROGRAM_KEYS = {"program": str, "num_tokens": int, "num_sampled": int, "ok": bool,
                "error": (str, type(None)), "argument_bytes": int, "output_bytes": int,
                "alias_bytes": int, "temp_bytes": int, "generated_code_bytes": int,
                "flops": float, "bytes_accessed": float, "estimated_seconds": float,
                "kind": str, "control_flow": dict}
REPORT_KEYS = {"device_kind": str, "num_devices": int, "tensor_parallel_size": int,
               "hbm_bytes_per_device": int, "num_kv_blocks": int, "block_size": int,
               "max_model_len": int, "kv_cache_bytes_per_device": int,
               "weight_bytes_per_device": int, "quantization": (str, type(None)), "programs": list}
# SmolLM2's attention and hidden shape, 2 of its layers and a 2,048-word vocabulary: the layer
# count does not change the compiled programs (one scan body), and its 49,152-word sampler adds
# ~13 s of compiling without touching the cache
SMOLLM2_HEADS = {**SMOLLM2, "num_hidden_layers": 2, "vocab_size": 2048}


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama's config.json alone (8 query / 2 kv heads, head_dim 16, 2 layers)."""
    out = tmp_path_factory.mktemp("tiny_config")
    shutil.copy(Path(tiny_llama) / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2_config")
    (out / "config.json").write_text(json.dumps(SMOLLM2_HEADS))
    return out


def _config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def cache_bytes_per_block(cfg: dict[str, Any], backend: str, block_size: int = 16) -> int:
    """One block of K and V over all layers in bfloat16: head_dim padded to 128 lanes in the TPU
    kernel's layout, as is in the others'."""
    d = cfg["head_dim"]
    if ATTENTION_BACKENDS[backend].cache_layout != "combined-heads":
        d = -(-d // 128) * 128
    return cfg["num_hidden_layers"] * block_size * 2 * cfg["num_key_value_heads"] * d * 2


def layer_params(cfg: dict[str, Any]) -> int:
    """The weights of one Llama layer's projections (no norms, no biases)."""
    e, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return 2 * h * d * e + 2 * kvh * d * e + 3 * e * i


def param_bytes(cfg: dict[str, Any]) -> int:
    """A Llama's weights in bfloat16 (no biases)."""
    e, v = cfg["hidden_size"], cfg["vocab_size"]
    layer = layer_params(cfg) + 2 * e
    tables = v * e * (1 if cfg["tie_word_embeddings"] else 2)
    return 2 * (cfg["num_hidden_layers"] * layer + tables + e)


def expected_programs(backend: str, engine: dict[str, int], block_size: int = 16) -> set[tuple]:
    """The TPU backend's: a forward per token bucket (one kernel serves every attention kind),
    a sampler per sample bucket and sampling kind."""
    blocks = -(-engine["max_model_len"] // block_size)
    shapes = step_shapes(engine["max_num_batched_tokens"], engine["max_num_seqs"], blocks,
                         ATTENTION_BACKENDS[backend].min_buckets)
    return ({("forward", s.num_tokens, 0, "mixed") for s in shapes}
            | {("sampler", 0, s.num_sampled, kind) for s in shapes
               for kind in ("greedy", "random", "filtered")})


def check_report(report: dict[str, Any], cfg: dict[str, Any], backend: str, tp: int,
                 engine: dict[str, int]) -> None:
    """The invariants every report of a config that fits must show (see the module docstring)."""
    assert report["device_kind"] == "TPU v5 lite" and report["num_devices"] == 4
    assert abs(report["hbm_bytes_per_device"] / 2**30 - V5E_HBM_GIB) < 0.1
    assert report["tensor_parallel_size"] == tp and report["attention_backend"] == backend
    assert {(p["program"], p["num_tokens"], p["num_sampled"], p["kind"])
            for p in report["programs"]} == expected_programs(backend, engine)
    assert len(report["programs"]) == len(expected_programs(backend, engine))
    assert not [(p["program"], p["num_tokens"], p["error"])
                for p in report["programs"] if not p["ok"]]
    cache = report["num_kv_blocks"] * cache_bytes_per_block(cfg, backend) // tp
    assert report["kv_cache_bytes_per_device"] == cache
    params = param_bytes(cfg)
    assert cache + params // tp <= report["hbm_bytes_per_device"]
    for p in report["programs"]:
        assert p["flops"] > 0 and p["bytes_accessed"] > 0 and p["estimated_seconds"] > 0
        # no step program branches; a forward's one loop is its layers' (XLA may unroll it)
        flow = p["control_flow"]
        assert flow["conditional"] == 0 and flow["while"] <= (p["program"] == "forward"), p
        if p["program"] == "forward":  # the cache and the params in, the cache out in place
            assert p["argument_bytes"] >= cache + params // tp, p
            # every layer counted: its weights read, its matmuls done for every token row
            layers = cfg["num_hidden_layers"] * layer_params(cfg)
            assert p["bytes_accessed"] >= 2 * layers // tp, p
            assert p["flops"] >= 2 * p["num_tokens"] * layers // tp, p
            assert p["alias_bytes"] >= cache, p
            assert p["output_bytes"] >= p["alias_bytes"], p
        else:  # the LM head only
            assert p["argument_bytes"] < params and p["alias_bytes"] == 0, p


def _compile(model_dir: Path, backend: str, tp: int = 1, **engine: Any) -> dict[str, Any]:
    from minivllm_jax.aot import compile_for_topology

    config = EngineConfig(attention_backend=backend, tensor_parallel_size=tp, compile_cache=False,
                          **{**ENGINE, **engine})
    return compile_for_topology(model_dir, TOPOLOGY, config)


def test_tpu_kernel_sized_from_hbm_compiles_without_copying_the_cache(tiny_dir: Path) -> None:
    """The TPU's own backend, the cache sized from v5e's HBM as the engine sizes it: every
    program compiles and fits, the cache takes most of the HBM, and no temporary copies it."""
    report = _compile(tiny_dir, "pallas-tpu")
    cfg = _config(tiny_dir)
    check_report(report, cfg, "pallas-tpu", 1, ENGINE)
    cache, hbm = report["kv_cache_bytes_per_device"], report["hbm_bytes_per_device"]
    assert 0.8 * hbm < cache <= 0.9 * hbm  # gpu_memory_utilization 0.9, less weights and peaks
    for p in report["programs"]:
        assert p["temp_bytes"] < cache / 100, p
    assert report["max_model_len"] == ENGINE["max_model_len"] and report["block_size"] == 16


def test_tensor_parallel_two_chips(tiny_dir: Path) -> None:
    """Tensor parallelism over 2 of the topology's 4 chips, a given number of blocks: 2 kv heads,
    one per chip, so each holds half of every block and of the split weights, and the TPU
    kernel's shard_map splits the cache on its head axis without copying it."""
    report = _compile(tiny_dir, "pallas-tpu", tp=2, num_kv_blocks=4096)
    assert report["num_kv_blocks"] == 4096
    check_report(report, _config(tiny_dir), "pallas-tpu", 2, ENGINE)
    for p in report["programs"]:  # ~1 MiB of tiles and metadata beside a 64 MiB cache
        assert p["temp_bytes"] < report["kv_cache_bytes_per_device"] / 10, p


def test_abstract_arguments_are_a_runners(tiny_llama: str) -> None:
    """`aot.StepArgs` builds, for every program, the argument tree, shapes and dtypes a real
    runner passes (`ModelRunner.empty_args`), here for the CPU plan (switched layers)."""
    import jax

    from minivllm_jax.aot import StepArgs, program_keys
    from minivllm_jax.engine_spec import draft_spec, sized_spec
    from minivllm_jax.loader import load_model
    from minivllm_jax.worker.runner import ModelRunner, place_params

    loaded = load_model(tiny_llama, platform="cpu")
    config = EngineConfig(compile_cache=False, num_kv_blocks=32, **ENGINE)
    spec = sized_spec(draft_spec(loaded.config, config, loaded.dtype, "cpu"))
    runner = ModelRunner(spec, place_params(spec, loaded.config, loaded.params))
    state = StepArgs.build(spec, loaded.dtype, jax.devices()[0])
    assert spec.plan.model.layer_layout == "switched"
    keys = program_keys(spec)
    assert set(keys) == {k for s in runner.spec.step_shapes() for k in (s.forward, s.sampler)}
    for key in keys:
        real, abstract = runner.empty_args(key), state.args(key)
        assert jax.tree.structure(real) == jax.tree.structure(abstract), key
        assert ([(x.shape, x.dtype) for x in jax.tree.leaves(real)]
                == [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]), key


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`minivllm-jax compile ARGS` in a fresh process, with none of the libtpu environment set
    (the command sets it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    code = "import sys; from minivllm_jax.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "compile", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_cli_smollm2_writes_the_report(smollm2_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's shape (3 kv heads of head_dim 64: the TPU layout pads them to 128 lanes) with
    the default (TPU) backend: exit 0, a table, and a JSON report of docs/API.md §2b's keys and
    types; the forward updates the cache in place."""
    engine = dict(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=256)
    out = tmp_path / "report.json"
    r = _cli("--model", str(smollm2_dir), "--topology", TOPOLOGY, "--num-kv-blocks", "1024",
             *(f"--{k.replace('_', '-')}={v}" for k, v in engine.items()), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and "forward" in r.stdout and "KV cache: 1024 blocks" in r.stdout
    report = json.loads(out.read_text())
    for key, kind in REPORT_KEYS.items():
        assert isinstance(report[key], kind), key
    for p in report["programs"]:
        assert set(p) == set(PROGRAM_KEYS)
        assert all(isinstance(p[k], kind) for k, kind in PROGRAM_KEYS.items()), p
    check_report(report, SMOLLM2_HEADS, "pallas-tpu", 1, engine)
    for p in report["programs"]:
        assert p["temp_bytes"] < report["kv_cache_bytes_per_device"] / 2, p


def test_cli_bad_topology_is_one_line(tiny_dir: Path) -> None:
    r = _cli("--model", str(tiny_dir), "--topology", "v5e:9x9x9")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --topology"), r.stderr
    assert "v5e:2x4" in lines[0] and "Traceback" not in r.stderr


def test_cli_cache_too_large_for_hbm_is_one_line(tiny_dir: Path) -> None:
    """A given cache larger than a v5e chip's HBM: exit 1, the table (FAIL), and one line naming
    the program and the memory."""
    blocks = 2 * V5E_HBM_GIB * 2**30 // cache_bytes_per_block(_config(tiny_dir), "pallas-tpu")
    r = _cli("--model", str(tiny_dir), "--topology", TOPOLOGY, "--num-kv-blocks", str(blocks),
             "--max-num-seqs", "8", "--max-num-batched-tokens", "8", "--max-model-len", "256")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: forward (8 tokens): does not fit"), r.stderr
    assert "HBM" in lines[0] and "FAIL" in r.stdout


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b"])
def test_tpu_census_and_costs_of_whole_models(name: str, tmp_path: Path) -> None:
    """The census for the TPU (docs/API.md §2b): the forward of a decode-sized and of a
    mixed bucket of SmolLM2 and of a Qwen3-0.6B-shaped model, all layers, compiled by libtpu:
    no conditional, one while (the layer loop); one kernel serves both kinds on the TPU. The
    decode bucket's costs count every layer: at least each layer's projection weights read
    once and their matmuls done for each row, and the time at least those bytes over v5e's
    819 GB/s. The decode forward never copies the embedding table whole: SmolLM2's [49152, 576]
    table, unpadded, took a column-major layout and was copied row-major in every forward to
    gather its rows (the TPU plan pads it to 640 columns: `plan.ModelPlan.embed_lanes`)."""
    import dataclasses as dc

    import jax

    from minivllm_jax import aot
    from minivllm_jax.engine_spec import draft_spec, sized_spec
    from minivllm_jax.worker.step_programs import StepPrograms

    cfg = SMOLLM2 if name == "smollm2-135m" else bc.build_hf_config(name).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    devices = aot.topology_devices(TOPOLOGY)
    config = EngineConfig(compile_cache=False, num_kv_blocks=256, **ENGINE)
    model, dtype = aot.read_model(tmp_path, config, "tpu")
    spec = sized_spec(draft_spec(model, config, dtype, "tpu", devices))
    programs = StepPrograms(spec.model_config, spec.plan.model, spec.mesh)
    state = aot.StepArgs.build(spec, dtype, devices[0])
    hbm = aot.hbm_bytes_per_device(devices[0])
    decode = StepShape(8, 0, 8, spec.config.max_blocks_per_seq)
    reports = [aot.compile_program(programs, key, state, hbm, costs)
               for key, costs in ((decode, True), (dc.replace(decode, num_tokens=16), False))]
    for report in reports:
        assert report.ok, report.error
        assert report.control_flow == {"conditional": 0, "while": 1}, report
    with jax.default_device(devices[0]):
        text = programs.lower(decode, state.args(decode)).compile().as_text()
    table_copies = re.findall(rf"= \w+\[{cfg['vocab_size']},\d+\]\S* copy\(", text)
    assert "embed_tokens" in text and table_copies == [], table_copies
    layers = cfg["num_hidden_layers"] * layer_params(cfg)
    report = reports[0]
    assert report.bytes_accessed >= 2 * layers and report.flops >= 2 * 8 * layers, report
    assert report.estimated_seconds >= 2 * layers / 819e9, report
