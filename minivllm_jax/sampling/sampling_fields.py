"""The per-request sampling fields the device reads, one record each (the only place their
facts are written): the persistent batch's columns (`InputBatch.sampling`), the sampler's part
of the packed step buffer (`StepShape.fields`, `StepShape.empty_step`) and the sampler's
`SamplingTensors` are all made from `SAMPLING_FIELDS`.

Invariants:
- A row's `name` is its SamplingParams field, its batch column, its buffer field and its
  `SamplingTensors` attribute alike; `dtype` is the column's and the buffer's (float32 values are
  bit-cast into the int32 buffer); `neutral` is what a fresh batch row, a padding sampled row and
  an empty step hold, and leaves a row's sampling as if the field were off; `read` takes the value
  from a SamplingParams (default: the attribute of that name). Its bounds are SamplingParams'
  (scheduler/request.py validates every value at construction), so any value read fits `dtype`.
- `group` says when a row rides the sampler program: "always", or "penalties" only in steps with
  `StepShape.penalties` (some sampled row's `SamplingParams.has_penalties`); a "penalties" field
  of `SamplingTensors` is None otherwise. Adding a field is one row here and its use in the
  sampler's math (`sampler.py`: a `SamplingTensors` attribute of the same name).

Per-row fields that are not rows here, because they are not one value copied from a request's
SamplingParams:
- ``seed``: the request's seed, or one derived from the engine seed and the request id when it
  gave none (`input_batch.derive_seed`), kept to 31 bits.
- ``stream``: the sample's index among its request's `n` (the request's, not its parameters').
- ``step``: the tokens the row had generated before this one: it changes every step.
- ``bias_ids`` / ``bias_values``: logit_bias is a block of `StepShape.num_bias` columns a row, as
  wide as the widest row needs, and while a row has generated fewer than `min_tokens` its stop
  ids (EOS unless `ignore_eos`, and `stop_token_ids`) join them at -inf; padding id 0, value 0.
- ``batch_row``: the row's place in the device's penalty state; padding rows hold
  `max_num_seqs`, a value of the config, so no row's counts change.
- `logprobs` / `prompt_logprobs` never reach the buffer: they choose statics of the step
  (`StepShape.num_logprobs`, `StepShape.all_hidden`), not per-row values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from scheduler import SamplingParams

GROUPS = ("always", "penalties")


@dataclass(frozen=True)
class SamplingField:
    """One per-request sampling field (see the module's invariants)."""

    name: str
    dtype: type  # np.float32 or np.int32
    neutral: float | int
    group: str = "always"
    read: Callable[[SamplingParams], float | int] | None = None

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"{self.name}: group must be one of {GROUPS}, got {self.group!r}")
        if self.dtype not in (np.float32, np.int32):
            raise ValueError(f"{self.name}: dtype must be np.float32 or np.int32, got {self.dtype}")

    def of(self, params: SamplingParams) -> float | int:
        """This field's value for a request with these parameters."""
        return getattr(params, self.name) if self.read is None else self.read(params)


SAMPLING_FIELDS = (
    # greedy rows (below MIN_SAMPLING_TEMPERATURE) carry 0: the sampler takes their argmax
    SamplingField("temperature", np.float32, 0.0,
                  read=lambda p: 0.0 if p.is_greedy else p.temperature),
    SamplingField("top_k", np.int32, 0),
    SamplingField("top_p", np.float32, 1.0),
    SamplingField("min_p", np.float32, 0.0),
    SamplingField("repetition_penalty", np.float32, 1.0, "penalties"),
    SamplingField("presence_penalty", np.float32, 0.0, "penalties"),
    SamplingField("frequency_penalty", np.float32, 0.0, "penalties"),
)


def fields_of(group: str) -> tuple[SamplingField, ...]:
    """The rows of one group, in table order."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    return tuple(f for f in SAMPLING_FIELDS if f.group == group)
