"""`sampling_fields.SAMPLING_FIELDS` is the one source of the per-request sampling fields: the
persistent batch's columns, the packed buffer's fields, the empty step and `SamplingTensors` all
follow it, and a request's values reach the sampler's part of the buffer unchanged (truth: the
SamplingParams itself)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.config import EngineConfig
from minivllm_jax.worker.input_batch import InputBatch, build_step_arrays
from minivllm_jax.sampling.sampler import SamplingTensors
from minivllm_jax.sampling.sampling_fields import SAMPLING_FIELDS, fields_of
from minivllm_jax.step_layout import StepShape
from scheduler import SamplingParams

# a value off its neutral one for every row of the table (a new row needs one here)
NON_NEUTRAL = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25)


def test_every_row_is_a_batch_column_a_buffer_field_and_a_sampler_field() -> None:
    batch = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_seq=2)
    assert set(batch.sampling) == {f.name for f in SAMPLING_FIELDS}
    tensors = {f.name: f for f in dataclasses.fields(SamplingTensors)}
    for f in SAMPLING_FIELDS:
        column = batch.sampling[f.name]
        assert column.dtype == f.dtype and column.shape == (4,), f.name
        assert (column == np.asarray(f.neutral, f.dtype)).all(), f.name
        # "always" rows are required sampler inputs; the others are None when their group is off
        assert f.name in tensors, f.name
        required = tensors[f.name].default is dataclasses.MISSING
        assert required == (f.group == "always"), f.name
    for penalties in (False, True):
        shape = StepShape(8, 4, 4, 2, penalties=penalties)
        names = [name for part in ("sampler", "extra") for name, _ in shape.part_fields(part)]
        want = fields_of("always") + (fields_of("penalties") if penalties else ())
        assert shape.sampling_fields == want
        assert [name for name in names if name in batch.sampling] == [f.name for f in want]


@pytest.mark.parametrize("penalties", [False, True])
def test_empty_step_holds_the_neutral_values(penalties: bool) -> None:
    shape = StepShape(8, 4, 4, 2, penalties=penalties)
    out = shape.unpack(jnp.asarray(shape.empty_step()))
    for f in shape.sampling_fields:
        assert out[f.name].dtype == f.dtype, f.name
        np.testing.assert_array_equal(np.asarray(out[f.name]), np.full(4, f.neutral, f.dtype))
    assert penalties == all(f.name in out for f in fields_of("penalties"))
    if penalties:
        assert (np.asarray(out["batch_row"]) == 4).all()
    hot = shape.unpack(jnp.asarray(shape.empty_step(temperature=1.0)))
    assert (np.asarray(hot["temperature"]) == 1.0).all()


def test_params_reach_the_sampler_unchanged() -> None:
    """InputBatch.add -> build_step_arrays -> pack -> the sampler's part unpacked: the sampled
    row holds the request's own values, the padding rows the neutral ones; and the same fields
    with a greedy request hold temperature 0."""
    for f in SAMPLING_FIELDS:
        assert getattr(NON_NEUTRAL, f.name) != f.neutral, f"NON_NEUTRAL leaves {f.name} neutral"
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, block_size=4,
                       num_kv_blocks=16).resolve(1024)
    for sp, temperature in ((NON_NEUTRAL, NON_NEUTRAL.temperature),
                            (dataclasses.replace(NON_NEUTRAL, temperature=0.0), 0.0)):
        batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len, cfg.max_blocks_per_seq)
        batch.add("r", [5, 6, 7], 3, [1], 0, sp, seed=3)
        shape, arrays, sampled, _ = build_step_arrays(batch, ["r"], [3], cfg, (4, 4))
        assert sampled == ["r"] and shape.penalties and shape.num_sampled == 4
        buf = shape.pack(arrays)
        main, extra = shape.split(buf)
        out = {**shape.sampler.unpack(jnp.asarray(main[shape.sampler_offset:]), "sampler"),
               **shape.sampler.unpack(jnp.asarray(extra), "extra")}
        every = shape.unpack(jnp.asarray(buf))
        for f in SAMPLING_FIELDS:
            want = np.array([temperature if f.name == "temperature" else getattr(sp, f.name)]
                            + [f.neutral] * 3, f.dtype)
            for unpacked in (out, every):
                assert unpacked[f.name].dtype == f.dtype, f.name
                np.testing.assert_array_equal(np.asarray(unpacked[f.name]), want, err_msg=f.name)
