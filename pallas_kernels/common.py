"""Pieces shared by the attention backends: input validation, Pallas backend selection, static
facts, and the kernels' online-softmax loop over paged KV tiles.

Invariant of ``attend_blocks``: a key at position ``>= kv_hi`` (past the valid length) never
contributes, whatever its cache slot holds (NaN included): its K/V rows are zeroed before the dots
and its probability is masked to 0.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # jax 0.10 / 0.11: the Triton compiler params live here.
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton backend
    pltriton = None

NEG = -1e30

# Step kinds: what the host knows about a batch's query runs, a static argument of the kernels so
# that a step program never picks a kernel at run time. MIXED: any batch. DECODE: every live
# sequence has exactly one query row. PREFILL: the XLA path's long-run layout applies (see
# xla_attention). A kernel that does not specialise treats every kind as MIXED; a specialised
# kind is the caller's promise about the batch.
MIXED, DECODE, PREFILL = "mixed", "decode", "prefill"
STEP_KINDS = (MIXED, DECODE, PREFILL)
# Whole-array operands (metadata, block tables, the cache) and squeezed block dims, spelled so that
# jax 0.10 and 0.11 both accept them.
WHOLE = getattr(pl, "no_block_spec", None) or pl.BlockSpec()
SQ = getattr(pl, "squeezed", None)


def idiv(a: jax.Array, b: int) -> jax.Array:
    """Truncating division for the non-negative ints of the kernels (cheaper than floor division)."""
    return jax.lax.div(a, jnp.int32(b))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def triton_compiler_params(num_warps: int, num_stages: int) -> object | None:
    """The Triton backend selector for pallas_call (None if this jax has no Triton module)."""
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams", None)
    return None if cls is None else cls(num_warps=num_warps, num_stages=num_stages)


def resolve_interpret(interpret: bool | None, native: str = "gpu") -> bool:
    """A kernel's interpret mode: as given, or (None, for direct callers; the engine's plan
    always gives it) interpreted anywhere but on the kernel's `native` platform: that of the
    default device when one is set (`jax.default_device`, e.g. a TPU topology's device while
    compiling ahead of time), else of the default backend."""
    if interpret is not None:
        return bool(interpret)
    device = jax.config.jax_default_device
    platform = device.platform if isinstance(device, jax.Device) else jax.default_backend()
    return platform != native


# 8-bit cache dtypes a kernel reads with queries of any float dtype: values are stored as cast
# (scale 1, vLLM's default for an uncalibrated fp8 cache) and read back upcast to q's dtype.
# uint8 is a float8_e4m3fn cache kept as its bytes, for the XLA and reference paths on the CPU
# (XLA:CPU has no float8 scatter: it would convert the whole cache at every write)
FP8_BYTES = jnp.dtype(jnp.uint8)
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), FP8_BYTES)


def kv_values(x: jax.Array) -> jax.Array:
    """Cache values as their dtype: a `FP8_BYTES` cache's bytes as float8_e4m3fn, any other as
    it is."""
    if x.dtype == FP8_BYTES:
        return jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    return x


def check_kind(kind: str) -> str:
    """``kind`` if it is one of STEP_KINDS, else ValueError."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
    return kind


def block_offset_scalar(block_offset: jax.Array | int) -> jax.Array:
    """``block_offset`` (the kernels' shift of every block id they read) as an int32 scalar;
    ValueError unless it is a scalar, TypeError unless it is an integer."""
    offset = jnp.asarray(block_offset)
    if offset.ndim:
        raise ValueError(f"block_offset must be a scalar, got shape {offset.shape}")
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"block_offset must be an integer, got {offset.dtype}")
    return offset.astype(jnp.int32)


def validate_attention_inputs(q: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
                              block_tables: jax.Array, cu_q_lens: jax.Array,
                              num_seqs: jax.Array, sm_scale: float,
                              sliding_window: int | None, soft_cap: float | None) -> None:
    """Raise ValueError/TypeError for inconsistent static shapes and dtypes (trace time only)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if kv_cache.ndim != 4:
        raise ValueError("kv_cache must be [num_blocks, block_size, 2 * num_kv_heads, head_dim], "
                         f"got shape {kv_cache.shape}")
    _, num_q_heads, head_dim = q.shape
    _, _, combined, cache_head_dim = kv_cache.shape
    if combined % 2:
        raise ValueError(f"kv_cache axis 2 holds 2 * num_kv_heads (K and V interleaved); got odd {combined}")
    num_kv_heads = combined // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim != cache_head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_cache has {cache_head_dim}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q and kv_cache must be floating point, got {q.dtype}")
    if q.dtype != kv_cache.dtype and jnp.dtype(kv_cache.dtype) not in QUANTIZED_KV_DTYPES:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must be q's ({q.dtype}) or one of "
                        f"{[d.name for d in QUANTIZED_KV_DTYPES]}")
    for name, arr, ndim in (("kv_lens", kv_lens, 1), ("block_tables", block_tables, 2),
                            ("cu_q_lens", cu_q_lens, 1), ("num_seqs", num_seqs, 1)):
        if arr.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {arr.dtype}")
        if arr.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    max_num_seqs = kv_lens.shape[0]
    if block_tables.shape[0] != max_num_seqs:
        raise ValueError(f"block_tables must be [max_num_seqs={max_num_seqs}, max_blocks_per_seq], "
                         f"got {block_tables.shape}")
    if cu_q_lens.shape[0] != max_num_seqs + 1:
        raise ValueError(f"cu_q_lens must be [max_num_seqs + 1 = {max_num_seqs + 1}], got {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must have shape (1,), got {num_seqs.shape}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or > 0, got {soft_cap}")


@dataclasses.dataclass(frozen=True)
class AttnStatics:
    """Static shape facts and options shared by the mixed and the decode kernels."""
    group: int
    block_kv: int
    block_size: int
    num_blocks: int
    num_kv_heads: int
    max_blocks: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


def attend_blocks(q: jax.Array, q_pos: jax.Array, row_ok: jax.Array, seq: jax.Array, h: jax.Array,
                  kv_hi: jax.Array, lo_blk: jax.Array | int, hi_blk: jax.Array, bt_ref: Any,
                  block_offset: jax.Array, cache_ref: Any,
                  st: AttnStatics) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online softmax of query rows ``q [R, D]`` (positions ``q_pos``, live where ``row_ok``) over
    KV tiles ``lo_blk <= j < hi_blk`` of sequence ``seq``, kv head ``h``; keys at ``>= kv_hi`` are
    zeroed and masked; page ids are ``bt_ref``'s plus ``block_offset``. Returns the running max
    ``m [R]``, sum ``l [R]`` and unnormalised ``acc``.
    K/V tiles load in the cache's dtype and are upcast to q's before anything reads them (an
    fp8 cache, `QUANTIZED_KV_DTYPES`: its bytes count in the tile budget, its values in q's)."""
    rows, head_dim = q.shape

    Carry = tuple[jax.Array, jax.Array, jax.Array]

    def step(j: jax.Array, carry: Carry) -> Carry:
        m, l, acc = carry
        kpos = j * st.block_kv + jax.lax.broadcasted_iota(jnp.int32, (st.block_kv,), 0)
        col = jnp.minimum(idiv(kpos, st.block_size), st.max_blocks - 1)
        page = jnp.clip(bt_ref[seq, col] + block_offset, 0, st.num_blocks - 1)
        slot = page * st.block_size + jax.lax.rem(kpos, jnp.int32(st.block_size))
        k_row = slot * (2 * st.num_kv_heads) + 2 * h            # V of kv head h is the next row
        key_ok = kpos < kv_hi
        k = jnp.where(key_ok[:, None], kv_values(cache_ref[k_row, :]).astype(q.dtype), 0)
        v = jnp.where(key_ok[:, None], kv_values(cache_ref[k_row + 1, :]).astype(q.dtype), 0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32) * st.sm_scale
        if st.soft_cap is not None:
            s = st.soft_cap * jnp.tanh(s / st.soft_cap)
        mask = row_ok[:, None] & key_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if st.sliding_window is not None:
            mask &= kpos[None, :] > q_pos[:, None] - st.sliding_window
        s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        return m_new, l, alpha[:, None] * acc + pv

    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    return jax.lax.fori_loop(lo_blk, hi_blk, step, init)
