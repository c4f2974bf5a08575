"""write_kv_cache vs a numpy scatter; negative slots skipped; donation under jit; slot formula;
an fp8 cache stores numpy's (ml_dtypes') cast of the values clipped to +-448."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention_reference, slot_of, write_kv_cache


def _numpy_write(cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> np.ndarray:
    out = cache.copy()
    bs = cache.shape[1]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for h in range(k.shape[1]):
            out[slot // bs, slot % bs, 2 * h] = k[t, h]
            out[slot // bs, slot % bs, 2 * h + 1] = v[t, h]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_matches_numpy_scatter(dtype) -> None:
    rng = np.random.default_rng(0)
    nb, bs, hkv, d, t = 6, 8, 3, 16, 20
    cache = rng.standard_normal((nb, bs, 2 * hkv, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[[3, 7, 19]] = -1                                     # padding tokens
    out = write_kv_cache(jnp.asarray(cache, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                         jnp.asarray(slots))
    assert out.dtype == dtype and out.shape == cache.shape
    want = _numpy_write(np.asarray(jnp.asarray(cache, dtype).astype(jnp.float32)),
                        np.asarray(jnp.asarray(k, dtype).astype(jnp.float32)),
                        np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)), slots)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
    # the same write into blocks 2.. of a cache two blocks longer (`block_offset`): slot s lands
    # at 2 * bs + s, blocks 0 and 1 untouched
    longer = np.concatenate([np.full((2, bs, 2 * hkv, d), 7.0, np.float32), cache])
    shifted = write_kv_cache(jnp.asarray(longer, dtype), jnp.asarray(k, dtype),
                             jnp.asarray(v, dtype), jnp.asarray(slots), jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(shifted.astype(jnp.float32))[2:], want)
    assert (np.asarray(shifted[:2].astype(jnp.float32)) == 7.0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_into_fp8_cache_saturates(dtype) -> None:
    """K/V of ``dtype`` written into a float8_e4m3fn cache: at each non-negative slot, numpy's cast
    of the value clipped to +-448 (values beyond saturate, infinities too; a plain cast would
    store NaN), NaN kept; negative slots skipped and every other slot untouched (NaN)."""
    fp8 = ml_dtypes.float8_e4m3fn
    assert np.isnan(np.float32(500).astype(fp8)) and float(ml_dtypes.finfo(fp8).max) == 448
    rng = np.random.default_rng(4)
    nb, bs, hkv, d, t = 5, 4, 2, 16, 12
    k, v = (rng.standard_normal((2, t, hkv, d)) * np.exp(rng.uniform(-8, 7, (2, t, hkv, d))))
    k[0, 0, :6] = [448, 449, 463, 464, 1e4, np.inf]          # edge of the range, beyond it
    v[1, 0, :6] = [-448, -449, -463, -464, -1e4, -np.inf]
    k[1, 0, 0] = np.nan
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[[2, 9]] = -1                                          # padding tokens
    k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (k, v))
    cache = np.full((nb, bs, 2 * hkv, d), np.nan, np.float32)
    out = write_kv_cache(jnp.asarray(cache, jnp.float8_e4m3fn), jnp.asarray(k, dtype),
                         jnp.asarray(v, dtype), jnp.asarray(slots))
    assert out.dtype == jnp.float8_e4m3fn and out.shape == cache.shape
    cast = lambda x: np.clip(x, -448, 448).astype(fp8).astype(np.float32)  # noqa: E731
    want = _numpy_write(cache, cast(k), cast(v), slots)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
    got = np.asarray(out.astype(jnp.float32)).reshape(nb * bs, 2 * hkv, d)
    np.testing.assert_array_equal(got[slots[0], 0, :6], [448] * 6)      # K, head 0, token 0
    np.testing.assert_array_equal(got[slots[1], 1, :6], [-448] * 6)     # V, head 0, token 1
    assert np.isnan(got[slots[1], 0, 0])                                # NaN stays NaN


def test_donated_write_in_jit_and_read_back_by_attention() -> None:
    """A jitted, donated write followed by attention over the written slots sees exactly them."""
    rng = np.random.default_rng(1)
    nb, bs, hkv, group, d = 5, 4, 2, 2, 16
    cache = jnp.full((nb, bs, 2 * hkv, d), jnp.nan, jnp.float32)
    step = jax.jit(write_kv_cache, donate_argnums=0)
    blocks = [3, 1]                                            # sequence's pages, out of order
    kv_len = 6
    slots = np.array([slot_of(blocks[p // bs], p % bs, bs) for p in range(kv_len)], np.int32)
    k = rng.standard_normal((kv_len, hkv, d)).astype(np.float32)
    v = rng.standard_normal((kv_len, hkv, d)).astype(np.float32)
    cache = step(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    q = rng.standard_normal((1, hkv * group, d)).astype(np.float32)
    out = ragged_paged_attention_reference(
        jnp.asarray(q), cache, jnp.array([kv_len], jnp.int32), jnp.array([blocks], jnp.int32),
        jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32), sm_scale=0.25)
    for h in range(hkv * group):
        kh, vh = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
        w = np.exp(0.25 * kh @ q[0, h] - (0.25 * kh @ q[0, h]).max())
        np.testing.assert_allclose(np.asarray(out[0, h]), (w / w.sum()) @ vh, atol=1e-5, rtol=1e-5)


def test_slot_of_formula() -> None:
    assert slot_of(3, 5, 16) == 53
    np.testing.assert_array_equal(slot_of(np.array([0, 2]), np.array([1, 7]), 8), [1, 23])


@pytest.mark.parametrize("k_shape,v_shape,slots_shape,err", [
    ((4, 3, 16), (4, 2, 16), (4,), ValueError),   # v differs from k
    ((4, 2, 8), (4, 2, 8), (4,), ValueError),     # head_dim mismatch with cache
    ((4, 3, 16), (4, 3, 16), (4,), ValueError),   # wrong number of kv heads
    ((4, 2, 16), (4, 2, 16), (5,), ValueError),   # slot_mapping length
])
def test_write_rejects_bad_shapes(k_shape, v_shape, slots_shape, err) -> None:
    cache = jnp.zeros((2, 4, 4, 16))
    with pytest.raises(err):
        write_kv_cache(cache, jnp.zeros(k_shape), jnp.zeros(v_shape), jnp.zeros(slots_shape, jnp.int32))
    with pytest.raises(TypeError):
        write_kv_cache(cache, jnp.zeros((4, 2, 16)), jnp.zeros((4, 2, 16)), jnp.zeros((4,)))
