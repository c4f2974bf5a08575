"""The whole engine through the TPU kernel (attention_backend="pallas-tpu", Pallas' TPU interpret
mode on this CPU) on the embedded SmolLM2: greedy tokens and their logprobs against transformers',
on one device and under tensor parallelism over three virtual CPU devices (shard_map: one kv head
per device).

The interpreter simulates every DMA and semaphore, so a step costs seconds per layer: the engine
runs SmolLM2's first LAYERS layers (its real weights, head layout, vocabulary and tokenizer), and
transformers the same first LAYERS layers of its own load of the GGUF. Every layer's attention is
the same kernel call on its own slice of the cache, so two layers prove the per-layer cache
layout; so few layers make flatter logits, so each generated position's logprobs (value, rank,
top 5) are checked against transformers' log-softmax, not only the greedy token. 8-token steps:
the prompts' prefills are chunked (the second chunk attends to a cached prefix), decodes follow,
and every step meets the one 8-token bucket (one compilation of the interpreted kernel).

Truth: transformers' greedy generation and log-softmax on the same truncated model (float32).
This file run as a script is the tensor-parallel worker (one JSON line on stdout), given the
truncated model pickled.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minivllm_jax.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 4
LOGPROBS = 5
LAYERS = 2
ENGINE = dict(attention_backend="pallas-tpu", max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=8, num_kv_blocks=16)


def first_layers(model: Any, n: int = LAYERS) -> Any:
    """Our loaded model cut to its first ``n`` layers (stacked params: a slice of each leaf)."""
    import jax

    params = {**model.params, "layers": jax.tree.map(lambda x: x[:n], model.params["layers"])}
    return dataclasses.replace(model, params=params,
                               config=dataclasses.replace(model.config, num_hidden_layers=n))


def _generate(llm: Any) -> list[dict[str, Any]]:
    """Each prompt's prompt ids, greedy tokens and per-token logprobs
    ({token id: [logprob, rank, text]})."""
    from minivllm_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=LOGPROBS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [{"prompt": list(o.prompt_token_ids), "tokens": o.outputs[0].token_ids,
             "logprobs": [{str(t): [lp.logprob, lp.rank, lp.decoded_token] for t, lp in pos.items()}
                          for pos in o.outputs[0].logprobs]} for o in outs]


@pytest.fixture(scope="module")
def hf_truth(smollm2_hf: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """transformers on SmolLM2's first LAYERS layers: each prompt's greedy tokens, and the
    log-softmax rows [len, V] of prompt + tokens."""
    import copy

    import torch

    config = copy.deepcopy(smollm2_hf.config)
    config.num_hidden_layers = LAYERS
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(smollm2_hf)(config)
    state = {k: v for k, v in smollm2_hf.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < LAYERS}
    model.load_state_dict(state, strict=True)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
            tokens = gen[0, ids.shape[1]:].tolist()
            logits = model(gen).logits[0].double()
            out.append({"tokens": tokens, "rows": torch.log_softmax(logits, dim=-1).numpy()})
    return out


def _check(result: list[dict[str, Any]], truth: list[dict[str, Any]]) -> None:
    """Greedy tokens equal transformers'; every position's logprobs agree with its log-softmax."""
    # imported here: this file also runs as a script (`_worker`), where tests/helpers is not on
    # the path (pytest's `pythonpath` setting reaches the pytest process only)
    from engine_helpers import check_logprobs

    assert [r["tokens"] for r in result] == [t["tokens"] for t in truth]
    for r, t in zip(result, truth):
        rows = t["rows"][len(r["prompt"]) - 1:]
        assert len(r["logprobs"]) == MAX_TOKENS
        for tok, pos, want in zip(r["tokens"], r["logprobs"], rows):
            check_logprobs(pos, tok, want, LOGPROBS)


def pad_embedding_as_on_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines made from here on get the TPU platform's plan for the embedding table
    (`plan.make_plan`: rows zero-padded to a multiple of 128), on this CPU."""
    from minivllm_jax import engine_spec, plan

    assert plan.make_plan(EngineConfig(), "bfloat16", "tpu").model.embed_lanes == plan.TPU_LANES
    assert plan.make_plan(EngineConfig(), "bfloat16", "gpu").model.embed_lanes == 0

    def make_plan(*args: Any, **kwargs: Any) -> Any:
        made = plan.make_plan(*args, **kwargs)
        model = dataclasses.replace(made.model, embed_lanes=plan.TPU_LANES)
        return dataclasses.replace(made, model=model)

    monkeypatch.setattr(engine_spec, "make_plan", make_plan)


def test_engine_on_tpu_kernel_matches_transformers(loaded_model: Any, hf_truth: list[dict[str, Any]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With the TPU plan's padded embedding: SmolLM2's tied [49152, 576] table held as
    [49152, 640], the padding zeros."""
    import numpy as np

    from minivllm_jax import LLM

    pad_embedding_as_on_tpu(monkeypatch)
    llm = LLM(first_layers(loaded_model), **ENGINE)
    assert llm.engine.runner.plan.model.attention_backend == "pallas-tpu"
    table = np.asarray(llm.engine.runner.params["embed_tokens"])
    assert table.shape == (49152, 640) and not table[:, 576:].any()
    np.testing.assert_array_equal(table[:, :576], np.asarray(loaded_model.params["embed_tokens"]))
    _check(_generate(llm), hf_truth)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1   # all but the null block
    steps = llm.engine.runner.shapes_used
    assert {s.num_tokens for s in steps} == {8}  # chunked prefills and decodes: one bucket


@pytest.mark.parametrize("tied", [True, False])
def test_padded_embedding_changes_no_logit(make_tiny_llama: Any, tmp_path: Path, tied: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama (hidden 64) with its embedding padded to 128 columns, tied head or not:
    greedy tokens, their top-5 logprobs and the prompt's logprobs are bit for bit the unpadded
    engine's (the padding is dropped by the lookup and meets zeros in the tied head)."""
    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax.loader import load_model

    model = load_model(make_tiny_llama(tmp_path, tie_word_embeddings=tied), dtype="float32",
                       use_cache=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    prompts = [{"prompt_token_ids": [5, 9, 13, 200, 7]}, {"prompt_token_ids": [3, 3, 40]}]
    tiny = dict(attention_backend="xla", max_num_seqs=4, max_model_len=64,
                max_num_batched_tokens=16, num_kv_blocks=16)

    def run() -> tuple[Any, ...]:
        llm = LLM(model, **tiny)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.engine.runner.params["embed_tokens"].shape, [
            (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()}
                                      for pos in o.outputs[0].logprobs + o.prompt_logprobs[1:]])
            for o in outs]

    shape, want = run()
    pad_embedding_as_on_tpu(monkeypatch)
    padded_shape, got = run()
    assert (shape, padded_shape) == ((256, 64), (256, 128))
    assert got == want


def test_tensor_parallel_on_tpu_kernel_matches_transformers(loaded_model: Any, tmp_path: Path,
                                                            hf_truth: list[dict[str, Any]]) -> None:
    """The worker gets this process's cut model (its first LAYERS layers, host arrays, and the
    tokenizer), pickled: the model the one-device test runs, without the seconds a process
    takes to load all of SmolLM2 for two of its layers.

    PJRT_NPROC: the interpreter's device threads wait on each other at barriers while its
    callbacks need a thread of the CPU client's pool (as many threads as cores, 2 on CI) to copy
    their operands; more threads than devices, or the run deadlocks."""
    import pickle

    import jax
    import numpy as np

    cut = first_layers(loaded_model)
    model = tmp_path / "model.pkl"
    with open(model, "wb") as f:
        pickle.dump(dataclasses.replace(cut, params=jax.tree.map(np.asarray, cut.params)), f,
                    protocol=pickle.HIGHEST_PROTOCOL)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PJRT_NPROC": "8",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    proc = subprocess.run([sys.executable, __file__, str(model)], capture_output=True,
                          text=True, env=env, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert result["devices"] == 3 and result["backend"] == "pallas-tpu"
    assert result["kv_heads_per_device"] == 1
    _check(result["outputs"], hf_truth)
    assert result["free_blocks"] == result["num_blocks"] - 1


def _worker(path: str) -> None:
    """``path``: a pickled LoadedModel (SmolLM2's first LAYERS layers, host arrays)."""
    import pickle

    import jax

    from minivllm_jax import LLM

    with open(path, "rb") as f:
        model = pickle.load(f)
    assert model.config.num_hidden_layers == LAYERS
    llm = LLM(model, tensor_parallel_size=3, **ENGINE)
    outputs = _generate(llm)
    runner = llm.engine.runner
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    print(json.dumps({"devices": jax.device_count(), "outputs": outputs,
                      "backend": runner.plan.model.attention_backend,
                      "kv_heads_per_device": runner.kv_cache.addressable_shards[0].data.shape[3] // 2,
                      "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_blocks}))


if __name__ == "__main__":
    _worker(sys.argv[1])
