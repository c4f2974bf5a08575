"""The static shape of one step (`StepShape`) and the layout of its packed buffer: every
metadata array of a step in ONE int32 host buffer, moved to the device in one transfer.

Invariants:
- A StepShape is hashable; its `forward` and `sampler` are the static arguments of the step's two
  programs: the forward does not depend on the sampled rows, nor the sampler on the token rows.
  So the forward compiles once per (token bucket, attention kind) met and the sampler once per
  (sample bucket, sampling kind) (`buckets.bucket`; the kinds are what the host knows about the
  batch, so that no program branches at run time); `step_shapes` lists every shape a config can
  meet.
- `fields()` is the buffer's layout, in one place. Its *main* part is the forward's fields up to
  ``num_seqs``, then the sampler's fields every step has (``num_seqs`` on: a fixed size); the
  *extra* part the sampler's optional groups (logit bias, penalties, drafts). A plain step is
  one transfer: the main part goes to the forward, which hands its sampler tail on to the
  sampler (`split`, `part_fields`). Per-sequence and per-sampled-row fields always have
  max_num_seqs entries; the sampler reads the first num_sampled. float32 fields are bit-cast
  (`pack`, `unpack`).
- The sampler's per-row fields are `sampling_fields.SAMPLING_FIELDS`' rows of the groups the
  shape carries (`StepShape.sampling_fields`), then ``seed``, ``stream``, ``step``, the logit-bias
  columns (with `num_bias`), ``batch_row`` (with `penalties`) and the drafts (with `num_spec`);
  an empty step holds each table row's neutral value.
- A speculative step (`num_spec` = K > 0) gathers K + 1 hidden rows per sampled sequence,
  ``logits_indices[s * (K + 1) + i]`` its i-th verified position (the last one repeated after
  its drafts), and carries each sequence's drafts (``draft_tokens``, -1 padded) and their number.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from minivllm_jax.backends import ATTENTION_BACKENDS
from minivllm_jax.buckets import all_buckets, bucket
from minivllm_jax.sampling.sampler import FILTERED, SAMPLING_KINDS
from minivllm_jax.sampling.sampling_fields import SAMPLING_FIELDS, SamplingField, fields_of
from pallas_kernels import DECODE, MIXED, STEP_KINDS

_ALWAYS, _PENALTIES = fields_of("always"), fields_of("penalties")
# the float32 fields, bit-cast in the buffer
FLOAT_FIELDS = frozenset({f.name for f in SAMPLING_FIELDS if f.dtype == np.float32} | {"bias_values"})


@dataclass(frozen=True)
class StepShape:
    """Static shapes of one step; hashable. Its `forward` and `sampler` are the static arguments
    of the runner's two jitted programs: the forward does not depend on the sampled rows, nor the
    sampler on the token rows."""

    num_tokens: int
    num_sampled: int
    max_num_seqs: int
    max_blocks_per_seq: int
    num_bias: int = 0  # logit_bias entries per sampled row (a bucket; 0: no row has any)
    penalties: bool = False  # some sampled row has a penalty: the sampler reads token counts
    num_logprobs: int = -1  # top logprobs per sampled row (a bucket); -1: no row asks for any
    all_hidden: bool = False  # the forward also returns every token row's hidden state
    # some sampled row has a structured-output constraint: the sampler takes a token bitmask
    # (not in the buffer: the host fills it after the forward is dispatched). Never in a
    # multi-host step (`header`): the engine refuses such requests there.
    structured: bool = False
    num_spec: int = 0  # K: draft tokens verified per sampled row (speculative decoding); 0: none
    kind: str = MIXED  # the attention kind of the batch (`attention.step_kind`): the forward's
    sampling: str = FILTERED  # the sampling kind of its sampled rows (`sampler.sampling_kind`)

    @property
    def positions_per_row(self) -> int:
        """Logits rows per sampled sequence: its K drafts' positions and one more."""
        return self.num_spec + 1

    @property
    def forward(self) -> StepShape:
        return replace(self, num_sampled=0, num_bias=0, penalties=False, num_logprobs=-1,
                       structured=False, sampling=FILTERED)

    @property
    def sampler(self) -> StepShape:
        return replace(self, num_tokens=0, all_hidden=False, kind=MIXED)

    @property
    def header(self) -> tuple[int, ...]:
        """What varies between steps (a multi-host step header): `from_header(header,
        max_num_seqs, max_blocks_per_seq)` is this shape again."""
        if self.num_spec:
            raise ValueError("a speculative step has no multi-host header (refused there)")
        return (self.num_tokens, self.num_sampled, self.num_bias, int(self.penalties),
                self.num_logprobs, int(self.all_hidden), STEP_KINDS.index(self.kind),
                SAMPLING_KINDS.index(self.sampling))

    @classmethod
    def from_header(cls, header: tuple[int, ...], max_num_seqs: int, max_blocks_per_seq: int
                    ) -> StepShape:
        t, s, k, pen, lp, hid, kind, sampling = (int(x) for x in header)
        return cls(t, s, max_num_seqs, max_blocks_per_seq, k, bool(pen), lp, bool(hid),
                   kind=STEP_KINDS[kind], sampling=SAMPLING_KINDS[sampling])

    @property
    def sampling_fields(self) -> tuple[SamplingField, ...]:
        """The `SAMPLING_FIELDS` rows this step's buffer carries: "always", and "penalties" with
        `penalties`."""
        return _ALWAYS + (_PENALTIES if self.penalties else ())

    def fields(self) -> tuple[tuple[str, int], ...]:
        """The buffer layout: the main part (the forward's fields, then from num_seqs on the
        sampler's fields of every step), then the extra part (with `num_bias`, the rows'
        logit-bias ids and values, `num_bias` a row; with `penalties` their fields; with
        `num_spec` the drafts). Sampled rows are padded to max_num_seqs; the sampler reads
        num_sampled."""
        t, n, b = self.num_tokens, self.max_num_seqs, self.max_blocks_per_seq
        return (("input_ids", t), ("prev_index", t), ("positions", t), ("slot_mapping", t),
                ("block_tables", n * b), ("kv_lens", n), ("cu_q_lens", n + 1),
                ("logits_indices", n * self.positions_per_row), ("num_seqs", 1),
                *((f.name, n) for f in _ALWAYS),
                ("seed", n), ("stream", n), ("step", n)) + self._extra_fields()

    def _extra_fields(self) -> tuple[tuple[str, int], ...]:
        n, k = self.max_num_seqs, self.num_bias
        bias = (("bias_ids", n * k), ("bias_values", n * k)) if k else ()
        penalties = (*((f.name, n) for f in _PENALTIES), ("batch_row", n)) if self.penalties else ()
        spec = (("draft_tokens", n * self.num_spec), ("num_drafts", n)) if self.num_spec else ()
        return bias + penalties + spec

    def part_fields(self, part: str = "all") -> tuple[tuple[str, int], ...]:
        """The fields of the whole buffer (``"all"``) or of one part: ``"main"`` (what the
        forward takes), ``"forward"`` (main up to num_seqs), ``"sampler"`` (main from num_seqs
        on: what the forward hands to the sampler), ``"extra"`` (the sampler's optional
        groups, possibly none)."""
        fields = self.fields()
        names = [name for name, _ in fields]
        at, extra = names.index("num_seqs"), len(fields) - len(self._extra_fields())
        parts = {"all": fields, "main": fields[:extra], "forward": fields[:at + 1],
                 "sampler": fields[at:extra], "extra": fields[extra:]}
        if part not in parts:
            raise ValueError(f"part must be one of {sorted(parts)}, got {part!r}")
        return parts[part]

    @property
    def sampler_offset(self) -> int:
        """Where the "sampler" part starts in the main part (num_seqs' offset)."""
        return sum(size for _, size in self.part_fields("forward")) - 1

    def split(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The main and the extra parts of a packed buffer (views; extra None when the shape
        has no optional group)."""
        main = sum(size for _, size in self.part_fields("main"))
        return buf[:main], (buf[main:] if main < buf.shape[0] else None)

    def pack(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """Concatenate the step's arrays into one int32 buffer (float32 arrays bit-cast)."""
        parts = []
        for name, size in self.fields():
            a = np.ascontiguousarray(arrays[name]).reshape(-1)
            a = a.view(np.int32) if a.dtype == np.float32 else a.astype(np.int32, copy=False)
            if a.shape[0] != size:
                raise ValueError(f"{name}: expected {size} entries, got {a.shape[0]}")
            parts.append(a)
        return np.concatenate(parts)

    def empty_step(self, temperature: float | None = None) -> np.ndarray:
        """The packed buffer of a step with no live sequence: every slot -1, so running it
        compiles (or profiles) this shape and leaves the KV cache as it was; every sampling
        field neutral. A temperature > 0 sends every row down the sampling path (the memory
        profile wants its peak)."""
        n = self.max_num_seqs
        arrays = {name: np.zeros(size, np.int32) for name, size in self.fields()}
        arrays["slot_mapping"][:] = -1
        arrays["prev_index"][:] = -1
        for f in self.sampling_fields:
            arrays[f.name] = np.full(n, f.neutral, f.dtype)
        if temperature is not None:
            arrays["temperature"][:] = temperature
        if self.penalties:
            arrays["batch_row"][:] = n  # no row's counts change
        if self.num_spec:
            arrays["draft_tokens"][:] = -1
        return self.pack(arrays)

    def unpack(self, buf: jax.Array, part: str = "all") -> dict[str, jax.Array]:
        """The fields of a whole buffer (``part="all"``) or of one part (`part_fields`) as device
        arrays; in the "sampler" and "extra" parts the per-row fields keep their first
        num_sampled entries."""
        out, offset = {}, 0
        for name, size in self.part_fields(part):
            out[name] = buf[offset:offset + size]
            offset += size
        for name in ("bias_ids", "bias_values"):
            if name in out:
                out[name] = out[name].reshape(self.max_num_seqs, self.num_bias)
        if "draft_tokens" in out:
            out["draft_tokens"] = out["draft_tokens"].reshape(self.max_num_seqs, self.num_spec)
        if part in ("sampler", "extra"):
            out = {k: v if k == "num_seqs" else v[:self.num_sampled] for k, v in out.items()}
        for name in FLOAT_FIELDS & out.keys():
            out[name] = jax.lax.bitcast_convert_type(out[name], jnp.float32)
        if "block_tables" in out:
            out["block_tables"] = out["block_tables"].reshape(self.max_num_seqs, self.max_blocks_per_seq)
        return out


def step_kind(backend: str, q_lens: np.ndarray, num_tokens: int) -> str:
    """The attention kind of a step whose live sequences have ``q_lens`` query rows, padded to a
    bucket of ``num_tokens`` rows: the backend's rule (`AttentionBackend.step_kind`), "mixed"
    where it has none. Host side, numpy only."""
    rule = ATTENTION_BACKENDS[backend].step_kind
    return MIXED if rule is None else getattr(pallas_kernels, rule)(q_lens, num_tokens)


def step_kinds(backend: str, num_tokens: int) -> tuple[str, ...]:
    """The attention kinds the backend compiles apart in a bucket of ``num_tokens`` rows."""
    rule = ATTENTION_BACKENDS[backend].step_kinds
    return (MIXED,) if rule is None else getattr(pallas_kernels, rule)(num_tokens)


def step_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                min_buckets: tuple[int, int],
                kinds_of: Callable[[int], tuple[str, ...]] = lambda num_tokens: (MIXED,)
                ) -> list[StepShape]:
    """Every StepShape a step can meet: token buckets from the minimum to max_num_batched_tokens,
    each with the attention kinds its backend compiles apart there (``kinds_of``; "decode" only
    in buckets a batch of max_num_seqs one-row sequences reaches), and with the sample buckets
    its rows allow (a step samples at most min(its tokens, max_num_seqs) rows), each in every
    sampling kind."""
    min_tokens, min_sampled = min_buckets
    decode_max = bucket(min(max_num_seqs, max_num_batched_tokens), min_tokens, max_num_batched_tokens)
    shapes = []
    for t in all_buckets(min_tokens, max_num_batched_tokens):
        most = min(t, max_num_seqs)
        kinds = [k for k in kinds_of(t) if k != DECODE or t <= decode_max]
        for s in all_buckets(min_sampled, max_num_seqs):
            if s == bucket(0, min_sampled, max_num_seqs) or s // 2 < most:
                shapes += [StepShape(t, s, max_num_seqs, max_blocks_per_seq, kind=kind,
                                     sampling=sampling)
                           for kind in kinds for sampling in SAMPLING_KINDS]
    return shapes
