"""``models.llama.project``: both forms of ``x @ weight^T`` (and their ``[out, T]`` results)
against a float64 numpy product, and the form each (dtype, rows) takes, read off the lowered
program."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.models.llama import project


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-4), (jnp.bfloat16, 6e-2)])
@pytest.mark.parametrize("rows", [1, 4, 8, 9, 64])
def test_project_matches_float64(dtype, atol: float, rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    w = rng.standard_normal((40, 96)).astype(np.float32) * 0.1
    xd, wd = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    want = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64).T
    for feature_major_rows in (0, 8):
        f = jax.jit(lambda a, b, fm=feature_major_rows: project(a, b, fm))
        got = f(xd, wd)
        assert got.shape == (rows, 40) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=1e-2)
        feature_major = dtype == jnp.float32 and rows <= feature_major_rows
        assert ("optimization_barrier" in f.lower(xd, wd).as_text()) is feature_major
        out_major = jax.jit(lambda a, b, fm=feature_major_rows: project(a, b, fm, out_major=True))
        got_t = out_major(xd, wd)
        assert got_t.shape == (40, rows) and got_t.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got_t), want.T, atol=atol, rtol=1e-2)
