"""Would an int8 x int8 MXU path pay? Two measurements, no TPU needed (docs/benchmarks.md,
"Quantization: int8 weights and an fp8 KV cache"):

    python scripts/int8_matmul_probe.py compile    # libtpu: v5e and v6e
    python scripts/int8_matmul_probe.py accuracy   # SmolLM2 on this machine's CPU

`compile`: one projection ``x [T, 4096] bf16 @ w [14336, 4096]^T`` (Llama-3.1-8B's gate/up) with
int8 weights and a float32 scale per output channel, two ways, compiled by libtpu for one chip of
each generation: "w8a16", the engine's (`models.llama.project`: the weight converted to bf16
inside the dot); "w8a8", the activations quantized per token (absmax / 127, round half even) and
an s8 x s8 -> s32 dot, both scales applied to its result. Prints XLA's optimal seconds and the
dot's HLO operand types for T in (16, 256, 2048).

`accuracy`: the engine's `project` patched to the w8a8 rule above for every quantized projection,
then SmolLM2's perplexity of tests/data/heldout.txt's first 256 tokens and greedy agreement on
tests/engine/test_quantized.py's 16 prompts (16 tokens each), against the unquantized engine.
The patch runs in this process only, under a fresh executable cache.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# libtpu on a machine without a TPU (as `minivllm-jax compile` sets them): before jax starts
for _name, _value in {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1",
                      "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
    os.environ.setdefault(_name, _value)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

INV_127 = np.float32(1 / 127)


def w8a16(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y * s


def w8a8(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xs = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) * INV_127
    xq = jnp.round(xf / jnp.where(xs == 0, 1, xs)).astype(jnp.int8)
    y = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return y.astype(jnp.float32) * xs * s


def compile_probe() -> None:
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    for topo in ("v5e:2x2", "v6e:2x2"):
        device = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices[0]
        sh = SingleDeviceSharding(device)
        for t in (16, 256, 2048):
            args = (jax.ShapeDtypeStruct((t, 4096), jnp.bfloat16, sharding=sh),
                    jax.ShapeDtypeStruct((14336, 4096), jnp.int8, sharding=sh),
                    jax.ShapeDtypeStruct((14336,), jnp.float32, sharding=sh))
            for fn in (w8a16, w8a8):
                with jax.default_device(device):
                    compiled = jax.jit(fn).lower(*args).compile()
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                dot = next(line.split("=")[1].split("{")[0].strip()
                           for line in compiled.as_text().splitlines() if "convolution(" in line)
                print(f"{topo} T={t:5d} {fn.__name__:6s} optimal {cost['optimal_seconds'] * 1e3:7.3f} ms"
                      f"  flops {cost['flops']:.3e}  dot result {dot}")


def accuracy_probe() -> None:
    os.environ["MINIVLLM_JAX_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="w8a8-")
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("engine", "helpers")]
    import test_quantized as tq

    from minivllm_jax import LLM
    from minivllm_jax.loader import default_model_path, load_model
    from minivllm_jax.models import llama

    model = load_model(default_model_path(), dtype="float32")
    ids = model.tokenizer.encode(tq.HELDOUT)[:tq.TEXT_TOKENS]
    prompts = [{"prompt_token_ids": model.tokenizer.encode(p)[:tq.PROMPT_TOKENS]} for p in tq.PROMPTS]

    def run(**kw: object) -> tuple[float, list[list[int]]]:
        llm = LLM(model, **tq.ENGINE, **kw)
        outs = llm.generate(prompts, tq.GREEDY, use_tqdm=False)
        return tq.perplexity(llm, ids), [list(o.outputs[0].token_ids) for o in outs]

    base_ppl, base = run()
    plain = llama.project

    def project(x, weight, feature_major_rows=0, out_major=False, scale=None):  # noqa: ANN001
        if scale is None:
            return plain(x, weight, feature_major_rows, out_major, scale)
        y = w8a8(x, weight, scale.astype(jnp.float32))
        return y.T if out_major else y

    llama.project = project
    for kv in ("auto", "fp8"):
        ppl, got = run(quantization="int8", kv_cache_dtype=kv)
        same = sum(g == w for g, w in zip(got, base))
        print(f"w8a8, kv_cache_dtype={kv}: perplexity {ppl:.4f} against {base_ppl:.4f} "
              f"({100 * (ppl / base_ppl - 1):+.2f} %), greedy {same} / {len(base)} prompts")


if __name__ == "__main__":
    what = sys.argv[1:] or ["compile"]
    if not set(what) <= {"compile", "accuracy"}:
        sys.exit("usage: python scripts/int8_matmul_probe.py [compile] [accuracy]")
    for job in what:
        {"compile": compile_probe, "accuracy": accuracy_probe}[job]()
