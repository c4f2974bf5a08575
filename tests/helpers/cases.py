"""Random ragged paged-attention batches with hostile cache contents, and a float64 numpy oracle.

Every cache slot that no sequence owns holds NaN: unused blocks, the tail of each sequence's last
block, and the blocks that garbage block-table entries (past a sequence's used blocks) point at.
Block ids are a random permutation, so sequences' pages are scattered.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Batch:
    q: np.ndarray            # [T, Hq, D]
    kv_cache: np.ndarray     # [NB, BS, 2*Hkv, D]
    kv_lens: np.ndarray      # int32 [S]
    block_tables: np.ndarray  # int32 [S, MB]
    cu_q_lens: np.ndarray    # int32 [S+1]
    num_seqs: np.ndarray     # int32 [1]

    def args(self, dtype) -> tuple:
        return (jnp.asarray(self.q, dtype), jnp.asarray(self.kv_cache, dtype),
                jnp.asarray(self.kv_lens), jnp.asarray(self.block_tables),
                jnp.asarray(self.cu_q_lens), jnp.asarray(self.num_seqs))


def make_batch(rng: np.random.Generator, seqs: list[tuple[int, int]], *, num_kv_heads: int,
               group: int, head_dim: int, block_size: int, max_num_seqs: int | None = None,
               num_tokens: int | None = None, extra_blocks: int = 3,
               max_blocks: int | None = None, num_blocks: int | None = None) -> Batch:
    """``seqs``: (q_len, kv_len) per live sequence, q_len <= kv_len. ``max_blocks`` and
    ``num_blocks`` pin the table width and pool size (so that batches share compiled shapes)."""
    max_num_seqs = max_num_seqs or len(seqs)
    total_q = sum(q for q, _ in seqs)
    num_tokens = num_tokens or total_q
    used = [math.ceil(kv / block_size) for _, kv in seqs]
    max_blocks = max_blocks or max(used) + 2
    num_blocks = num_blocks or sum(used) + extra_blocks + 1
    assert max(used) <= max_blocks and sum(used) < num_blocks, "pool too small for the batch"
    ids = rng.permutation(num_blocks)
    nan_blocks = ids[sum(used):]
    cache = np.full((num_blocks, block_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    tables = np.zeros((max_num_seqs, max_blocks), np.int32)
    tables[:] = rng.choice(nan_blocks, size=tables.shape)   # garbage everywhere not used
    cursor = 0
    for s, (_, kv) in enumerate(seqs):
        mine = ids[cursor:cursor + used[s]]
        cursor += used[s]
        tables[s, :used[s]] = mine
        for p in range(kv):
            cache[mine[p // block_size], p % block_size] = rng.standard_normal((2 * num_kv_heads, head_dim))
    kv_lens = rng.integers(0, 1000, max_num_seqs).astype(np.int32)   # garbage for dead slots
    kv_lens[:len(seqs)] = [kv for _, kv in seqs]
    cu = np.full(max_num_seqs + 1, total_q, np.int32)
    cu[:len(seqs) + 1] = np.concatenate([[0], np.cumsum([q for q, _ in seqs])])
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    return Batch(q, cache, kv_lens, tables, cu, np.array([len(seqs)], np.int32))


def random_seqs(rng: np.random.Generator, n: int, kind: str, max_kv: int = 80) -> list[tuple[int, int]]:
    """kind: decode (q=1), prefill (q=kv), chunked (q<kv), mixed (any of these)."""
    out = []
    for _ in range(n):
        k = kind if kind != "mixed" else rng.choice(["decode", "prefill", "chunked"])
        kv = int(rng.integers(2, max_kv))
        q = {"decode": 1, "prefill": kv, "chunked": int(rng.integers(1, kv))}[k]
        out.append((q, kv))
    return out


def oracle(b: Batch, *, sm_scale: float, sliding_window: int | None = None,
           soft_cap: float | None = None, q_dtype=None, cache=None) -> np.ndarray:
    """Plain float64 softmax attention, one sequence at a time (all its query rows and heads at
    once; a row's scores of keys it may not see are -inf)."""
    q = np.asarray(b.q if q_dtype is None else q_dtype, np.float64)
    cache = np.asarray(b.kv_cache if cache is None else cache, np.float64)
    num_tokens, hq, d = q.shape
    block_size = cache.shape[1]
    hkv = cache.shape[2] // 2
    group = hq // hkv
    out = np.zeros((num_tokens, hq, d))
    for s in range(int(b.num_seqs[0])):
        kv_len = int(b.kv_lens[s])
        lo, hi = int(b.cu_q_lens[s]), int(b.cu_q_lens[s + 1])
        p = np.arange(kv_len)
        keys = cache[b.block_tables[s][p // block_size], p % block_size]     # [kv, 2*hkv, D]
        k = np.repeat(keys[:, 0::2], group, axis=1).transpose(1, 2, 0)      # [hq, D, kv]
        v = np.repeat(keys[:, 1::2], group, axis=1).transpose(1, 0, 2)      # [hq, kv, D]
        pos = kv_len - (hi - lo) + np.arange(hi - lo)                          # [rows]
        visible = p[None, :] <= pos[:, None]                                   # [rows, kv]
        if sliding_window is not None:
            visible &= p[None, :] > pos[:, None] - sliding_window
        sc = sm_scale * (q[lo:hi].transpose(1, 0, 2) @ k)                     # [hq, rows, kv]
        if soft_cap is not None:
            sc = soft_cap * np.tanh(sc / soft_cap)
        sc = np.where(visible, sc, -np.inf)
        w = np.exp(sc - sc.max(-1, keepdims=True))
        out[lo:hi] = ((w / w.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2)
    return out


# (kind, live seqs, max_num_seqs, padding rows, kv heads, group, head_dim, block, window, soft cap, dtype)
CASES = {
    "decode_gqa4_d64_b16": ("decode", 5, 7, 3, 2, 4, 64, 16, None, None, jnp.float32),
    "prefill_mha_d64_b8": ("prefill", 3, 3, 0, 2, 1, 64, 8, None, None, jnp.float32),
    "mixed_gqa3_d128_b32": ("mixed", 4, 6, 5, 2, 3, 128, 32, None, None, jnp.float32),
    "chunked_gqa8_d64_b16": ("chunked", 3, 4, 2, 1, 8, 64, 16, None, None, jnp.float32),
    "mixed_window_b8": ("mixed", 4, 5, 4, 2, 2, 64, 8, 13, None, jnp.float32),
    "mixed_softcap_b16": ("mixed", 4, 4, 1, 2, 4, 64, 16, None, 5.0, jnp.float32),
    "mixed_window_softcap_bf16": ("mixed", 4, 6, 3, 2, 4, 128, 16, 20, 30.0, jnp.bfloat16),
    "decode_gqa8_bf16_d128": ("decode", 6, 8, 2, 2, 8, 128, 32, None, None, jnp.bfloat16),
    "prefill_gqa3_bf16_b8": ("prefill", 2, 3, 0, 1, 3, 64, 8, None, None, jnp.bfloat16),
    "mixed_gqa3_b64": ("mixed", 3, 4, 2, 3, 3, 64, 64, None, None, jnp.float32),
}


# Cases whose cache is layer `layer` of `num_layers` (layer, num_layers) viewed as one cache, the
# model's flat view of its stacked cache (`stacked_cache`): the backends read it through
# block_offset = layer * num_blocks with the case's own block table, so every test of these cases
# checks that the offset addresses that layer alone (the others are NaN) against the oracle of the
# layer's own cache. One mixed case for a middle layer, one decode case for the last layer.
LAYERED = {"mixed_window_b8": (1, 3), "decode_gqa8_bf16_d128": (2, 3)}


def stacked_cache(cache, layer: int, num_layers: int):
    """``cache [num_blocks, ...]`` as layer ``layer`` of ``num_layers`` caches viewed as one,
    ``[num_layers * num_blocks, ...]``, every other layer's slots NaN."""
    flat = jnp.full((num_layers,) + cache.shape, jnp.nan, cache.dtype).at[layer].set(cache)
    return flat.reshape(num_layers * cache.shape[0], *cache.shape[1:])


def run_case(name: str, seed: int = 0, *, kv_dtype=None) -> tuple:
    """CASES[name] drawn: (kernel args in the case's dtype, the oracle's output, the options,
    the number of live rows, the dtype). ``kv_dtype`` (e.g. float8_e4m3fn): the cache is cast to
    it instead (NaN poison stays NaN) and the oracle reads that cache dequantized; the dtype
    returned stays q's. A LAYERED case's cache is its `stacked_cache` and its options hold the
    ``block_offset`` (an int32 scalar) of its layer; the oracle's is the layer's own cache."""
    kind, n, max_seqs, pad, hkv, group, d, bs, window, cap, dtype = CASES[name]
    rng = np.random.default_rng(seed + sum(map(ord, name)))
    seqs = random_seqs(rng, n, kind, max_kv=70)
    total = sum(q for q, _ in seqs)
    b = make_batch(rng, seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                   max_num_seqs=max_seqs, num_tokens=total + pad)
    args = b.args(dtype)
    if kv_dtype is not None:
        args = (args[0], jnp.asarray(b.kv_cache).astype(kv_dtype), *args[2:])
    scale = 1.0 / np.sqrt(d)
    truth = oracle(b, sm_scale=scale, sliding_window=window, soft_cap=cap,
                   q_dtype=np.asarray(args[0].astype(jnp.float32)),
                   cache=np.asarray(args[1].astype(jnp.float32)))
    kw = dict(sm_scale=scale, sliding_window=window, soft_cap=cap)
    if name in LAYERED:
        layer, num_layers = LAYERED[name]
        kw["block_offset"] = jnp.int32(layer * args[1].shape[0])
        args = (args[0], stacked_cache(args[1], layer, num_layers), *args[2:])
    return args, truth, kw, total, dtype
