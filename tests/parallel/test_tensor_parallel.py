"""Tensor parallelism (minivllm_jax.parallel.sharding) against the single-device engine.

The pytest process has already initialised jax with one CPU device, so the multi-device checks run
in subprocesses with virtual devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): this
file run as a script is that worker, and prints one JSON line (arrays go to an .npz). One worker
run (module fixture) serves most tests; the multi-host test starts scripts/launch_multihost.py
with two jax.distributed processes on loopback. Models: conftest's tiny random Llama (8 q / 2 kv
heads: 4 devices need kv-head copies) and a second one with SmolLM2's head layout (9 q / 3 kv
heads, tied embeddings: 3 devices, vocab-split, no copies); with int8 weights, a third with 9 q
/ 1 kv heads and an untied (quantized, vocab-split) head, whose one kv head 3 devices copy.

Truths: greedy outputs and KV-cache contents of the unsharded engine (tensor_parallel_size=1,
itself checked against transformers by the engine tests); a brute-force GQA head map; the
compiled HLO's collectives.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# 4-token steps: every step (chunked prefills, mixed, decode) meets the one token and sample bucket,
# so each engine compiles one forward and one sampler
ENGINE = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=4, num_kv_blocks=32)
MAX_TOKENS = 8
TINY_PROMPTS = ["t5 t6 t7", "t9 t10", " ".join(f"t{i}" for i in range(40, 61))]  # 21 ids: chunked
# Upper bounds against hangs, not speed checks: on a loaded 2-core CI machine the multi-host run
# (two processes compiling side by side) took over 200 s where it takes ~13 s alone.
WORKER_TIMEOUT, MULTIHOST_TIMEOUT = 720, 480
TINY = dict(hidden_size=64, vocab_size=256, num_key_value_heads=2, head_dim=16)  # conftest's TINY_LLAMA
# SmolLM2-135M's layout (9 q / 3 kv heads, tied embeddings) at tiny size; at tp=3 the vocab and the
# intermediate size divide, so every weight SmolLM2 splits is split here too
TINY9 = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=9 * 16, intermediate_size=192,
             vocab_size=255, tie_word_embeddings=True)
# int8 weights under tp=3: its one kv head (k/v weights and scales) copied to 3, the untied
# quantized head (weight and scale) vocab-split
TINY9_INT8 = dict(TINY9, num_key_value_heads=1, tie_word_embeddings=False)


def _run(argv: list[str], devices: int, timeout: float, **env_vars: str) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **env_vars}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny9_checkpoint(make_tiny_llama: Callable[..., str],
                     tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny9_llama_tp"), **TINY9)


@pytest.fixture(scope="module")
def tiny9_int8_checkpoint(make_tiny_llama: Callable[..., str],
                          tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny9_int8_tp"), **TINY9_INT8)


@pytest.fixture(scope="module")
def worker(tiny_llama: str, tiny9_checkpoint: str, tiny9_int8_checkpoint: str,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arrays = tmp_path_factory.mktemp("tp_arrays") / "arrays.npz"
    result = _run([__file__, tiny_llama, tiny9_checkpoint, tiny9_int8_checkpoint, str(arrays)],
                  devices=4, timeout=WORKER_TIMEOUT)
    result["arrays"] = dict(np.load(arrays))
    return result


# ---- in-process: the layout rules ------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (8, 8), (12, 4), (6, 3), (16, 1), (32, 8)])
def test_kv_head_layout_serves_every_query_head_its_own_kv_head(heads: int, kv_heads: int) -> None:
    """Brute force: under the kernel's local GQA rule, every device's local query head reads a
    copy of the kv head the unsharded model gives it; nothing is copied when N divides KVH."""
    from minivllm_jax.parallel.sharding import KVHeadLayout

    group = heads // kv_heads
    for tp in (d for d in range(1, heads + 1) if heads % d == 0):
        layout = KVHeadLayout(heads, kv_heads, tp)
        kv_map = layout.kv_head_map()
        expanded = len(kv_map)
        assert expanded % tp == 0 and expanded <= heads
        local_q, local_kv = heads // tp, expanded // tp
        assert local_q % local_kv == 0
        for d in range(tp):
            for j in range(local_q):
                e = d * local_kv + j // (local_q // local_kv)  # the kernel's rule, locally
                assert kv_map[e] == (d * local_q + j) // group
        if kv_heads % tp == 0:
            assert list(kv_map) == list(range(kv_heads))
        assert expanded == tp * _fewest_local_kv_heads(heads, kv_heads, tp)


def _fewest_local_kv_heads(heads: int, kv_heads: int, tp: int) -> int:
    """Brute force: the fewest kv heads per device such that, on every device, each run of
    local_q // k consecutive query heads (the kernel's GQA rule) shares one original kv head."""
    local_q, group = heads // tp, heads // kv_heads
    for k in (k for k in range(1, local_q + 1) if local_q % k == 0):
        size = local_q // k
        if all(len({(d * local_q + j) // group for j in range(r * size, (r + 1) * size)}) == 1
               for d in range(tp) for r in range(k)):
            return k
    raise AssertionError("unreachable: one kv head per query head always works")


def test_param_specs_split_megatron_style() -> None:
    from jax.sharding import PartitionSpec as P

    import jax

    from tiny_configs import small_model_config
    from minivllm_jax.models.llama import param_shapes
    from minivllm_jax.parallel.sharding import MODEL_AXIS, param_spec

    config = small_model_config(architecture="Qwen2ForCausalLM", attention_bias=True,
                                attention_out_bias=True, qk_norm=True)
    specs = {jax.tree_util.keystr(path): param_spec(path, leaf.shape, 2)
             for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
    m = MODEL_AXIS
    expected = {
        "['embed_tokens']": P(m, None),  # 250 % 2 == 0: vocab-split
        "['lm_head']": P(m, None),
        "['layers']['self_attn']['q_proj']['weight']": P(None, m, None),
        "['layers']['self_attn']['q_proj']['bias']": P(None, m),
        "['layers']['self_attn']['k_proj']['weight']": P(None, m, None),
        "['layers']['self_attn']['v_proj']['bias']": P(None, m),
        "['layers']['self_attn']['o_proj']['weight']": P(None, None, m),
        "['layers']['self_attn']['o_proj']['bias']": P(),
        "['layers']['mlp']['gate_proj']['weight']": P(None, m, None),
        "['layers']['mlp']['up_proj']['weight']": P(None, m, None),
        "['layers']['mlp']['down_proj']['weight']": P(None, None, m),
        "['layers']['self_attn']['q_norm']['weight']": P(),
        "['layers']['input_layernorm']['weight']": P(),
        "['norm']['weight']": P(),
    }
    for key, spec in expected.items():
        assert specs[key] == spec, key
    odd = {jax.tree_util.keystr(p): param_spec(p, leaf.shape, 3)
           for p, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
    assert odd["['embed_tokens']"] == P() and odd["['lm_head']"] == P()  # 250 % 3: replicated
    assert odd["['layers']['mlp']['gate_proj']['weight']"] == P(None, m, None)  # 96 % 3 == 0


def test_param_specs_of_int8_weights_and_scales() -> None:
    """A quantized weight is split as its float one; its scale with the weight's output axis
    (q/k/v, gate/up, the untied head's vocab) or replicated (o/down); `replicate_kv_heads`
    copies k/v scales with their rows."""
    from jax.sharding import PartitionSpec as P

    import jax

    from tiny_configs import small_model_config
    from minivllm_jax.models.llama import param_shapes
    from minivllm_jax.parallel.sharding import MODEL_AXIS, KVHeadLayout, param_spec, replicate_kv_heads

    config = small_model_config(num_key_value_heads=1)
    shapes = param_shapes(config, "int8")
    specs = {jax.tree_util.keystr(path): param_spec(path, leaf.shape, 2)
             for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    m, attn, mlp = MODEL_AXIS, "['layers']['self_attn']", "['layers']['mlp']"
    expected = {
        "['lm_head']['weight']": P(m, None), "['lm_head']['scale']": P(m),
        f"{attn}['q_proj']['weight']": P(None, m, None), f"{attn}['q_proj']['scale']": P(None, m),
        f"{attn}['o_proj']['weight']": P(None, None, m), f"{attn}['o_proj']['scale']": P(),
        f"{mlp}['up_proj']['scale']": P(None, m), f"{mlp}['down_proj']['scale']": P(),
    }
    for key, spec in expected.items():
        assert specs[key] == spec, key
    host = jax.tree.map(lambda s: np.arange(np.prod(s.shape)).reshape(s.shape).astype(s.dtype),
                        shapes)
    copied = replicate_kv_heads(host, KVHeadLayout(4, 1, 2), 16)["layers"]["self_attn"]["k_proj"]
    original = host["layers"]["self_attn"]["k_proj"]
    assert copied["scale"].shape == (2, 32) and copied["weight"].shape == (2, 32, 64)
    np.testing.assert_array_equal(copied["scale"], np.tile(original["scale"], (1, 2)))

def test_bad_tensor_parallel_size_raises_in_process(tiny_llama: str) -> None:
    import jax

    from minivllm_jax import LLM
    from minivllm_jax.loader import load_model

    tiny = load_model(tiny_llama, use_cache=False)
    too_many = jax.device_count() + 1
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={too_many} exceeds .* expected at most"):
        LLM(tiny, tensor_parallel_size=too_many, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny, tensor_parallel_size=0, **ENGINE)


def test_load_on_host_keeps_params_in_host_memory(tiny_llama: str, tmp_path: Path) -> None:
    """What LLM(tensor_parallel_size > 1) loads with: numpy params, converted or from the param
    cache, equal to the device load."""
    import jax

    from minivllm_jax.loader import load_model

    on_device = load_model(tiny_llama, use_cache=False)
    converted = load_model(tiny_llama, cache_dir=str(tmp_path), on_host=True)
    cached = load_model(tiny_llama, cache_dir=str(tmp_path), on_host=True)
    assert not converted.from_cache and cached.from_cache
    for loaded in (converted, cached):
        leaves = jax.tree.leaves(loaded.params)
        assert all(type(leaf) is np.ndarray for leaf in leaves)
        for a, b in zip(jax.tree.leaves(on_device.params), leaves):
            np.testing.assert_array_equal(np.asarray(a), b)


# ---- subprocess: 4 virtual CPU devices -------------------------------------------------------
def test_tiny9_tp3_greedy_equals_single_device(worker: dict[str, Any]) -> None:
    """SmolLM2's head layout: 3 devices, 3 q heads and 1 kv head each, vocab-split tied head.
    Greedy with the sampling extras of test_tp3_sampling_parameters_equal_single_device (the
    first sample of each prompt)."""
    single, sharded = worker["tiny9"]["1"], worker["tiny9"]["3"]
    assert all(len(t) == MAX_TOKENS for t in single)
    assert sharded == single


def test_tp3_sampling_parameters_equal_single_device(worker: dict[str, Any]) -> None:
    """Penalties (device-side counts), n=2 shared-prompt samples, logprobs and prompt logprobs
    (the long prompt's over chunked prefill steps) under tensor parallelism: the same tokens
    and logprobs (<= 1e-4) as one device."""
    single, sharded = worker["extras"]["1"], worker["extras"]["3"]
    assert len(single) == len(sharded) == len(TINY_PROMPTS)
    for one, tp in zip(single, sharded):
        assert tp["tokens"] == one["tokens"] and len(one["tokens"]) == 2
        np.testing.assert_allclose(tp["logprobs"], one["logprobs"], atol=1e-4)
        np.testing.assert_allclose(tp["prompt"], one["prompt"], atol=1e-4)


def test_tp3_int8_logprobs_equal_single_device_int8(worker: dict[str, Any]) -> None:
    """int8 weights (loaded quantized) with an fp8 KV cache at tp=3, the kv head copied and the
    quantized head vocab-split: the same greedy tokens and top-3 logprobs (<= 1e-4) as int8 and
    fp8 on one device;
    every device holds 1/3 of each split weight and scale."""
    single, sharded = worker["int8"]["1"], worker["int8"]["3"]
    assert all(len(one["tokens"]) == MAX_TOKENS for one in single)
    for one, tp in zip(single, sharded):
        assert tp["tokens"] == one["tokens"] and tp["top"] == one["top"]
        np.testing.assert_allclose(tp["logprobs"], one["logprobs"], atol=1e-4)
    params = worker["shards"]["tiny9_int8"]["params"]
    attn = "['layers']['self_attn']"
    for name, axis in ((f"{attn}['k_proj']['scale']", 1), (f"{attn}['k_proj']['weight']", 1),
                       (f"{attn}['o_proj']['scale']", None), ("['lm_head']['weight']", 0),
                       ("['lm_head']['scale']", 0)):
        assert params[name]["axis"] == axis, name
        expect = list(params[name]["shape"])
        if axis is not None:
            expect[axis] //= 3
        assert params[name]["shard_shapes"] == [expect] * 3, name
    assert params[f"{attn}['k_proj']['scale']"]["shape"] == [2, 3 * 16]  # 1 kv head -> 3

def test_tp3_speculative_decoding_equals_single_device_greedy(worker: dict[str, Any]) -> None:
    """n-gram speculation at tp=3 (drafts verified in the replicated sampler, rejected ones rolled
    back in the sharded cache) emits plain tp=1 greedy's tokens; no block leaks."""
    assert worker["spec"]["3"] == worker["spec"]["1"]
    stats = worker["spec_stats"]
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1


def test_replicated_kv_heads_tp2_tp4_greedy_equal_single_device(worker: dict[str, Any]) -> None:
    tiny = worker["tiny"]
    assert all(len(t) == MAX_TOKENS for t in tiny["1"])
    assert tiny["2"] == tiny["1"]
    assert tiny["4"] == tiny["1"]
    assert tiny["2-pallas"] == tiny["1"]  # the Pallas kernel (interpret mode) under shard_map


def test_each_device_holds_one_nth_of_weights_and_kv_cache(worker: dict[str, Any]) -> None:
    for model, tp, kv_heads in (("tiny9", 3, 3), ("tiny", 4, 4)):  # kv heads after any copies
        info = worker["shards"][model]
        assert len(set(info["devices"])) == tp
        for name, leaf in info["params"].items():
            shape, axis = leaf["shape"], leaf["axis"]
            expect = list(shape)
            if axis is not None:
                expect[axis] //= tp
            assert leaf["shard_shapes"] == [expect] * tp, name
        assert info["params"]["['embed_tokens']"]["axis"] == 0  # N divides V: vocab-split
        assert all(info["params"][f"['layers']['{m}']['{p}']['weight']"]["axis"] is not None
                   for m, p in [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "down_proj")])
        cache = info["kv_cache"]
        assert cache["shape"][3] == 2 * kv_heads
        local = list(cache["shape"])
        local[3] //= tp
        assert cache["shard_shapes"] == [local] * tp and cache["shard_bytes"] * tp == cache["bytes"]


def test_sharded_kv_cache_holds_each_devices_heads(worker: dict[str, Any]) -> None:
    """tp=4 over 2 kv heads: device d's cache shard equals the unsharded cache's K/V pair of kv
    head d // 2 (so devices 0,1 and 2,3 hold identical copies), on every written slot."""
    a = worker["arrays"]
    single = a["tiny_cache_tp1"]  # [L, blocks, block_size, 2*2, D]
    assert np.abs(single).sum() > 0
    for d in range(4):
        shard = a[f"tiny_cache_tp4_dev{d}"]  # [L, blocks, block_size, 2, D]
        h = d // 2
        np.testing.assert_allclose(shard, single[:, :, :, 2 * h:2 * h + 2], rtol=1e-4, atol=1e-5)


def test_kv_head_replication_repeats_projection_rows(worker: dict[str, Any]) -> None:
    a = worker["arrays"]
    for proj in ("k_proj", "v_proj"):
        original = a[f"tiny_{proj}"].reshape(2, 2, 16, 64)  # [L, KVH, D, E]
        for d in range(4):
            np.testing.assert_array_equal(a[f"tiny_{proj}_tp4_dev{d}"], original[:, d // 2])


def test_one_all_reduce_per_attention_and_mlp_block(worker: dict[str, Any]) -> None:
    """Compiled tp=2 greedy step: inside the layer scan one all-reduce after o_proj and one after
    down_proj; the only other collectives are the embedding's all-reduce of [T, E] and the greedy
    sampler's two all-reduces of [S] (the vocab-split logits' max, then the first index holding
    it): no weight, KV cache or logits are ever gathered."""
    ops = worker["hlo_collectives"]
    in_layers = [op for op in ops if "/while/body/" in op["name"]]
    assert sorted(op["kind"] for op in in_layers) == ["all-reduce", "all-reduce"]
    assert any("o_proj" in op["name"] for op in in_layers)
    assert any("down_proj" in op["name"] for op in in_layers)
    tokens_x_hidden = worker["step_tokens"] * TINY["hidden_size"]
    for op in ops:
        assert op["kind"] == "all-reduce", op
        assert op["elements"] <= tokens_x_hidden, op
    sampler = [op for op in ops if "jit(sample_tokens)" in op["name"]]
    assert sorted(op["elements"] for op in sampler) == [worker["step_sampled"]] * 2, sampler


def test_greedy_over_split_logits_keeps_the_first_maximum(worker: dict[str, Any]) -> None:
    """Ties within and across the vocabulary shards resolve to the lowest index (numpy's
    argmax); an all -inf row gives 0; a NaN counts as +inf, as unsharded."""
    assert worker["greedy_ties"]["got"] == worker["greedy_ties"]["want"]


def test_kv_cache_sizing_is_per_device(worker: dict[str, Any]) -> None:
    """Auto-sized on CPU under a byte cap: the cap applies to each device's shard, so tp=2 and
    tp=4 fit more blocks than tp=1 (4 devices need kv-head copies: no more than tp=2)."""
    sizing = worker["sizing"]
    for tp, s in sizing["runs"].items():
        per_device_block = s["shard_bytes"] // s["num_blocks"]
        assert s["num_blocks"] - 1 == sizing["cap"] // per_device_block, tp
        assert s["shard_bytes"] <= sizing["cap"] + per_device_block
    assert sizing["runs"]["2"]["num_blocks"] > sizing["runs"]["1"]["num_blocks"]


def test_bad_tensor_parallel_size_raises_with_devices(worker: dict[str, Any]) -> None:
    errors = worker["errors"]
    assert "tensor_parallel_size=5" in errors["5"] and "expected at most 4" in errors["5"]
    assert "tensor_parallel_size=3" in errors["3"] and "num_attention_heads (8)" in errors["3"]


# ---- multi-host: two jax.distributed processes on loopback -----------------------------------
def test_multihost_two_processes_equal_single_device(worker: dict[str, Any], tiny_llama: str,
                                                    tmp_path: Path) -> None:
    """With async scheduling every process forwards the previous step's tokens on its own
    devices; the tokens must still be the single-device run's. Async only: the runner's
    multi-host protocol (broadcast header and buffer, followers' loop) is the same either way,
    and async runs both kinds of step (forwarded tokens and, first, none), so it covers the
    synchronous run's steps too; sync tensor parallelism is the worker's (CPU default)."""
    argv = [str(ROOT / "scripts" / "launch_multihost.py"), "--local-processes", "2",
            "--cpu-devices", "2", "--model", tiny_llama, "--max-tokens", str(MAX_TOKENS),
            "--ignore-eos", "--json", "--timeout", str(MULTIHOST_TIMEOUT), "--async-scheduling", "on",
            *(f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()),
            *(f"--prompt={p}" for p in TINY_PROMPTS)]
    out = _run(argv, devices=2, timeout=MULTIHOST_TIMEOUT + 60, MINIVLLM_JAX_CACHE=str(tmp_path))
    assert out["processes"] == 2 and out["devices"] == 4
    assert out["token_ids"] == worker["tiny"]["1"]


# ---- the worker --------------------------------------------------------------------------------
def _shard_info(runner: Any) -> dict[str, Any]:
    import jax

    from minivllm_jax.parallel.sharding import MODEL_AXIS

    params = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.params)[0]:
        spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        params[jax.tree_util.keystr(path)] = {
            "shape": list(leaf.shape), "axis": spec.index(MODEL_AXIS) if MODEL_AXIS in spec else None,
            "shard_shapes": [list(s.data.shape) for s in leaf.addressable_shards]}
    cache = runner.kv_cache
    shards = cache.addressable_shards
    return {"params": params, "devices": [str(s.device) for s in shards],
            "kv_cache": {"shape": list(cache.shape), "bytes": cache.nbytes,
                         "shard_shapes": [list(s.data.shape) for s in shards],
                         "shard_bytes": shards[0].data.nbytes}}


def _collectives(runner: Any) -> tuple[list[dict[str, Any]], Any]:
    """(kind, result elements, op name) of every collective in the compiled step (its forward
    and its sampler)."""
    import re

    shape = max(runner.shapes_used, key=lambda s: s.num_tokens)
    text = "\n".join(runner.programs.lower(key, runner.empty_args(key)).compile().as_text()
                     for key in (shape.forward, shape.sampler))
    kinds = "all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute"
    ops = []
    for line in text.splitlines():
        m = re.search(rf"= (.*?) ({kinds})(?:-start)?\(", line)
        if m is None:
            continue
        shapes = re.findall(r"\[([\d,]*)\]", m.group(1))
        name = re.search(r'op_name="([^"]*)"', line)
        ops.append({"kind": m.group(2), "name": name.group(1) if name else "",
                    "elements": sum(int(np.prod([int(x) for x in s.split(",") if x])) for s in shapes)})
    return ops, shape


def _worker(checkpoint: str, tiny9_checkpoint: str, tiny9_int8_checkpoint: str,
            arrays_path: str) -> None:
    import jax

    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax.loader import load_model

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result: dict[str, Any] = {"tiny9": {}, "tiny": {}, "shards": {}, "errors": {}}
    arrays: dict[str, np.ndarray] = {}

    def generate(llm: Any, prompts: list[Any]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    tiny = load_model(checkpoint, dtype="float32", use_cache=False)
    for tp in (1, 2, 4):
        llm = LLM(tiny, tensor_parallel_size=tp, **ENGINE)
        result["tiny"][str(tp)] = generate(llm, TINY_PROMPTS)
        runner = llm.engine.runner
        if tp == 1:
            arrays["tiny_cache_tp1"] = np.asarray(runner.kv_cache)
            for proj in ("k_proj", "v_proj"):
                arrays[f"tiny_{proj}"] = np.asarray(tiny.params["layers"]["self_attn"][proj]["weight"])
        if tp == 2:
            result["hlo_collectives"], shape = _collectives(runner)
            result["step_tokens"], result["step_sampled"] = shape.num_tokens, shape.num_sampled
        if tp == 4:
            result["shards"]["tiny"] = _shard_info(runner)
            for d, s in enumerate(runner.kv_cache.addressable_shards):
                arrays[f"tiny_cache_tp4_dev{d}"] = np.asarray(s.data)
            for proj in ("k_proj", "v_proj"):
                weight = runner.params["layers"]["self_attn"][proj]["weight"]
                for d, s in enumerate(weight.addressable_shards):
                    arrays[f"tiny_{proj}_tp4_dev{d}"] = np.asarray(s.data)
        del llm, runner
    llm = LLM(tiny, tensor_parallel_size=2, attention_backend="pallas", **ENGINE)  # interpret mode
    result["tiny"]["2-pallas"] = generate(llm, TINY_PROMPTS)
    del llm
    for tp in (5, 3):
        try:
            LLM(tiny, tensor_parallel_size=tp, **ENGINE)
            result["errors"][str(tp)] = "no error"
        except ValueError as e:
            result["errors"][str(tp)] = str(e)

    cap = 40 * 1024  # bytes per device
    runs = {}
    for tp in (1, 2, 4):
        runner = LLM(tiny, max_num_seqs=64, max_model_len=64, tensor_parallel_size=tp,
                     cpu_kv_cache_bytes=cap).engine.runner
        runs[str(tp)] = {"num_blocks": runner.num_blocks,
                         "shard_bytes": runner.kv_cache.addressable_shards[0].data.nbytes}
    result["sizing"] = {"cap": cap, "runs": runs}

    # tiny9: one greedy run per size, with the sampling extras on (so each engine compiles one
    # forward and one sampler, those of the extras, not a plain pair as well)
    tiny9 = load_model(tiny9_checkpoint, dtype="float32", use_cache=False)
    extras = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2,
                            repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3,
                            prompt_logprobs=2)
    result["extras"] = {}
    for tp in (1, 3):
        llm = LLM(tiny9, tensor_parallel_size=tp, **ENGINE)
        outs = llm.generate(TINY_PROMPTS, extras, use_tqdm=False)
        result["tiny9"][str(tp)] = [o.outputs[0].token_ids for o in outs]
        result["extras"][str(tp)] = [
            {"tokens": [c.token_ids for c in o.outputs],
             "logprobs": [[e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] for c in o.outputs],
             "prompt": [e[t].logprob for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]}
            for o in outs]
        if tp == 3:
            result["shards"]["tiny9"] = _shard_info(llm.engine.runner)
        del llm
    # speculative decoding at tp=3 against plain greedy at tp=1: prompts holding many distinct
    # ids, so 1-gram lookup finds drafts (accepted or rolled back under sharding alike)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
             "prompt_lookup_min": 1}
    spec_prompts = [list(range(3, 40)), list(range(100, 130))]
    result["spec"] = {}
    for tp, config in ((1, None), (3, ngram)):
        llm = LLM(tiny9, tensor_parallel_size=tp, **ENGINE, speculative_config=config)
        result["spec"][str(tp)] = generate(llm, spec_prompts)
        result["spec_stats"] = llm.get_stats()
        del llm
    result["int8"] = _int8_runs(tiny9_int8_checkpoint, result["shards"])
    result["greedy_ties"] = _greedy_ties()
    np.savez(arrays_path, **arrays)
    assert jax.device_count() == 4
    print(json.dumps(result))


def _greedy_ties() -> dict[str, list[int]]:
    """The greedy sampler's reduction (`sampler.first_argmax` of `sharding.vocab_split_logits`,
    as the sampler program runs it) over logits split on 4 devices, rows with the maximum tied
    within and across shards, a -inf row and a row with a NaN (counted as +inf), beside numpy's
    argmax."""
    import jax
    import jax.numpy as jnp

    from minivllm_jax.parallel import sharding
    from minivllm_jax.sampling.sampler import first_argmax

    mesh = sharding.make_mesh(4, 8)
    logits = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
    logits[0, [20, 50]] = 9.0  # tied across shards 1 and 3
    logits[1, [17, 18, 40]] = 9.0  # within shard 1, and in shard 2
    logits[2, [63, 0]] = 9.0  # the last and the first index
    logits[3] = -np.inf
    logits[4, [37, 5]] = [np.inf, np.nan]  # a NaN counts as +inf: the first of the two
    want = [int(i) for i in np.argmax(np.where(np.isnan(logits), np.inf, logits), axis=-1)]
    got = jax.jit(lambda x: sharding.replicate(first_argmax(sharding.vocab_split_logits(x, mesh)),
                                               mesh))(jnp.asarray(logits))
    return {"got": [int(i) for i in np.asarray(got)], "want": want}


def _int8_runs(checkpoint: str, shards: dict[str, Any]) -> dict[str, Any]:
    """Greedy tokens and top-3 logprobs of the int8 model with an fp8 cache at tp=1 and tp=3
    (its shard layout into ``shards``)."""
    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax.loader import load_model

    loaded = load_model(checkpoint, dtype="float32", use_cache=False, quantization="int8")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    runs = {}
    for tp in (1, 3):
        llm = LLM(loaded, tensor_parallel_size=tp, quantization="int8", kv_cache_dtype="fp8",
                  **ENGINE)
        outs = [o.outputs[0] for o in llm.generate(TINY_PROMPTS, params, use_tqdm=False)]
        runs[str(tp)] = [{"tokens": c.token_ids, "top": [sorted(e) for e in c.logprobs],
                          "logprobs": [[e[t].logprob for t in sorted(e)] for e in c.logprobs]}
                         for c in outs]
        if tp == 3:
            shards["tiny9_int8"] = _shard_info(llm.engine.runner)
        del llm
    return runs


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
