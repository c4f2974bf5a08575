"""The model with the Pallas kernel (interpret mode on CPU, compiled in GPU mode) and with the
tuned XLA attention gives the same logits as with the plain-jnp reference attention, on a tiny GQA model: a mixed step (one sequence
prefilling, one decoding) with padding rows, then a decode step."""
from __future__ import annotations

import numpy as np

from minivllm_jax.loader import load_model
from paged_harness import PagedRunner


def test_pallas_backend_matches_reference(tiny_checkpoint, tmp_path, interpret: bool) -> None:
    ckpt, _ = tiny_checkpoint("llama3")
    loaded = load_model(ckpt, dtype="float32", cache_dir=str(tmp_path), use_cache=False)
    steps = [[(0, [5, 17, 99, 3, 42])], [(0, [7]), (1, [9, 8, 7, 6, 250, 11])], [(1, [4]), (0, [2])]]
    outs = {}
    for backend in ("reference", "xla", "pallas"):
        runner = PagedRunner(loaded.config, loaded.params, backend=backend, interpret=interpret,
                             block_size=4, num_blocks=16, max_num_seqs=2, max_blocks_per_seq=4)
        outs[backend] = [np.concatenate(runner.run(chunks, pad_to=16)) for chunks in steps]
    for backend in ("xla", "pallas"):
        for ref, got in zip(outs["reference"], outs[backend]):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, ref, atol=5e-4, rtol=1e-4)
