"""Inconsistent shapes and dtypes are rejected at trace time with errors naming the field, by every
attention backend (each calls ``validate_attention_inputs``)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (ragged_paged_attention, ragged_paged_attention_reference,
                            ragged_paged_attention_xla, validate_attention_inputs)

BACKENDS = [ragged_paged_attention, ragged_paged_attention_xla, ragged_paged_attention_reference]


def _good() -> dict:
    s, mb = 3, 4
    return dict(q=jnp.zeros((8, 4, 16)), kv_cache=jnp.zeros((6, 8, 4, 16)),
                kv_lens=jnp.zeros((s,), jnp.int32), block_tables=jnp.zeros((s, mb), jnp.int32),
                cu_q_lens=jnp.zeros((s + 1,), jnp.int32), num_seqs=jnp.zeros((1,), jnp.int32))


BAD = [
    ("q", jnp.zeros((8, 3, 16)), ValueError, "multiple of num_kv_heads"),
    ("kv_cache", jnp.zeros((6, 8, 3, 16)), ValueError, "odd"),
    ("kv_cache", jnp.zeros((6, 8, 4, 32)), ValueError, "head_dim"),
    ("kv_cache", jnp.zeros((6, 8, 4, 16), jnp.bfloat16), TypeError, "dtype"),
    ("kv_cache", jnp.zeros((6, 8, 4, 16), jnp.float8_e5m2), TypeError, "dtype"),  # fp8: e4m3fn
    ("q", jnp.zeros((8, 4)), ValueError, "q must be"),
    ("kv_lens", jnp.zeros((3,), jnp.float32), TypeError, "kv_lens"),
    ("kv_lens", jnp.zeros((4,), jnp.int32), ValueError, "block_tables"),
    ("block_tables", jnp.zeros((3,), jnp.int32), ValueError, "block_tables"),
    ("cu_q_lens", jnp.zeros((3,), jnp.int32), ValueError, "cu_q_lens"),
    ("num_seqs", jnp.zeros((2,), jnp.int32), ValueError, "num_seqs"),
    ("num_seqs", jnp.zeros((1,), jnp.uint32), TypeError, "num_seqs"),
    ("block_offset", jnp.zeros((1,), jnp.int32), ValueError, "block_offset must be a scalar"),
    ("block_offset", 1.0, TypeError, "block_offset must be an integer"),
]


@pytest.mark.parametrize("fn", BACKENDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("field,value,err,match", BAD)
def test_rejects(fn, field, value, err, match, interpret: bool) -> None:
    args = _good()
    args[field] = value
    with pytest.raises(err, match=match):
        fn(**args, sm_scale=0.25, interpret=interpret)


@pytest.mark.parametrize("fn", BACKENDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("opt", [dict(sm_scale=0.0), dict(sm_scale=0.25, sliding_window=0),
                                 dict(sm_scale=0.25, soft_cap=-1.0)])
def test_rejects_bad_options(fn, opt, interpret: bool) -> None:
    with pytest.raises(ValueError):
        fn(**_good(), **opt, interpret=interpret)


def test_validator_accepts_good_inputs() -> None:
    validate_attention_inputs(**_good(), sm_scale=0.25, sliding_window=3, soft_cap=5.0)


@pytest.mark.parametrize("fn", BACKENDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fp8_cache_accepted_with_any_float_q(fn, q_dtype, interpret: bool) -> None:
    """A float8_e4m3fn cache is valid with q of any float dtype; the output takes q's dtype
    (traced only)."""
    args = _good()
    args["q"] = args["q"].astype(q_dtype)
    args["kv_cache"] = args["kv_cache"].astype(jnp.float8_e4m3fn)
    out = jax.eval_shape(functools.partial(fn, sm_scale=0.25, interpret=interpret), **args)
    assert out.shape == args["q"].shape and out.dtype == q_dtype


def test_kernel_rejects_non_power_of_two_head_dim(interpret: bool) -> None:
    args = _good()
    args["q"], args["kv_cache"] = jnp.zeros((8, 4, 24)), jnp.zeros((6, 8, 4, 24))
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(**args, sm_scale=0.25, interpret=interpret)
