"""The persistent batch (`InputBatch`) and the padded arrays of one step built from it
(`build_step_arrays`, in `step_layout.StepShape`'s fields).

Invariants:
- The batch keeps its own state per request and learns about requests only from SchedulerOutput
  diffs (new requests, cached-request updates, finished and preempted ids) plus the tokens the
  runner samples. Nothing is rebuilt from the full request list.
- Its sampling columns are `sampling_fields.SAMPLING_FIELDS`' (`InputBatch.sampling`, one per
  row, neutral until a request fills its row); a step's sampled rows copy them, padding rows
  hold the neutral values.
- Token rows are padded to `bucket(total, min_tokens, max_num_batched_tokens)` and sampled rows to
  `bucket(n, min_sampled, max_num_seqs)`, minimums per backend (`min_buckets`); logit-bias
  columns to a bucket of 8 and top logprobs to a bucket of 1 (`buckets.bucket`).
- What the host knows about a step becomes static in its shape: the attention kind of its
  query runs (`attention.step_kind`, the backend's rule) and the sampling kind of its sampled
  rows (`sampler.sampling_kind`; padding rows are greedy and do not count).
- Padding token rows have slot -1 (never written) and are never sampled; padding sampled rows are
  greedy reads of row 0 whose results are dropped on the host.
- A token row at a position the batch does not know yet (async scheduling: its step was
  dispatched before the previous one was collected) is that previous step's pending token: its
  `prev_index` is where the id sits in the previous step's output, -1 everywhere else.
- A speculative step's drafts sit in a row's `token_ids` after its known tokens, written there
  for the step (`write_drafts`, before `build_step_arrays`) and never counted in `num_tokens`: only the tokens a verification emits are
  appended (`append_token_lists`), over them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from minivllm_jax.buckets import bucket
from minivllm_jax.config import EngineConfig
from minivllm_jax.sampling.sampler import sampling_kind
from minivllm_jax.sampling.sampling_fields import SAMPLING_FIELDS
from minivllm_jax.step_layout import StepShape, step_kind
from pallas_kernels.kv_cache import slot_of
from scheduler import SamplingParams, SchedulerOutput
from scheduler.spec_decode import NgramProposer
from scheduler.request import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

# logit_bias columns a step may need: a row's own entries, plus while `min_tokens` holds its stop
# tokens at -inf (the min-tokens mask rides the bias columns)
MAX_BIAS_COLUMNS = MAX_LOGIT_BIAS_ENTRIES + MAX_STOP_TOKEN_IDS


def derive_seed(engine_seed: int, request_id: str) -> int:
    """A stable 31-bit seed for a request that gave none (engine seed + the request's id)."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class InputBatch:
    """Persistent per-request state in fixed numpy rows (one row per live request)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int) -> None:
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)  # token ids known on the host
        # tokens sampled by dispatched steps and not collected yet, and where the newest of them
        # sits in the last dispatched step's output
        self.num_pending = np.zeros(max_num_seqs, np.int32)
        self.pending_index = np.full(max_num_seqs, -1, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_seqs, np.int32)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        # one column per SAMPLING_FIELDS row, neutral until a request fills the row
        self.sampling = {f.name: np.full(max_num_seqs, f.neutral, f.dtype) for f in SAMPLING_FIELDS}
        # logit_bias: each row's entries first, the rest id 0 / value 0.0 (adds nothing)
        self.num_bias = np.zeros(max_num_seqs, np.int32)
        self.bias_ids = np.zeros((max_num_seqs, MAX_LOGIT_BIAS_ENTRIES), np.int32)
        self.bias_values = np.zeros((max_num_seqs, MAX_LOGIT_BIAS_ENTRIES), np.float32)
        # min_tokens: while a row has generated fewer, its `stop_ids` (EOS unless ignore_eos, and
        # stop_token_ids) are masked to -inf in the sampler
        self.min_tokens = np.zeros(max_num_seqs, np.int32)
        self.stop_ids: list[np.ndarray] = [np.zeros(0, np.int32)] * max_num_seqs
        self.seed = np.zeros(max_num_seqs, np.int32)
        self.stream = np.zeros(max_num_seqs, np.int32)  # the sample's index among its request's n
        self.has_penalties = np.zeros(max_num_seqs, bool)
        self.structured = np.zeros(max_num_seqs, bool)  # has a structured-output constraint
        self.num_logprobs = np.full(max_num_seqs, -1, np.int32)  # -1: none asked for
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, np.int32)
        # rows (re)built since the runner last looked whose penalty counts must be set up
        self.new_penalty_rows: list[int] = []
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
            block_ids: Sequence[int], num_computed_tokens: int, sampling_params: SamplingParams, seed: int,
            stream: int = 0, eos_token_id: int | None = None) -> None:
        if req_id in self.row_of:
            self.remove(req_id)
        if not self._free_rows:
            raise RuntimeError("persistent batch is full: more live requests than max_num_seqs")
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_pending[row] = 0
        self.pending_index[row] = -1
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(req_id, block_ids)
        sp = sampling_params
        for f in SAMPLING_FIELDS:
            self.sampling[f.name][row] = f.of(sp)
        bias = sp.logit_bias or {}
        n_old, n_new = self.num_bias[row], len(bias)
        self.bias_ids[row, :max(n_old, n_new)] = 0
        self.bias_values[row, :max(n_old, n_new)] = 0.0
        self.bias_ids[row, :n_new] = list(bias.keys())
        self.bias_values[row, :n_new] = list(bias.values())
        self.num_bias[row] = n_new
        self.seed[row] = seed & 0x7FFFFFFF
        self.stream[row] = stream
        self.min_tokens[row] = min(sp.min_tokens, self.token_ids.shape[1])
        if sp.min_tokens:
            eos = () if eos_token_id is None or sp.ignore_eos else (eos_token_id,)
            self.stop_ids[row] = np.array(sorted({*sp.stop_token_ids, *eos}), np.int32)
        self.has_penalties[row] = sp.has_penalties
        self.structured[row] = sp.structured_outputs is not None
        if sp.has_penalties:
            self.new_penalty_rows.append(row)
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def append_blocks(self, req_id: str, block_ids: Sequence[int]) -> None:
        row = self.row_of[req_id]
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def apply_diffs(self, so: SchedulerOutput, engine_seed: int) -> None:
        """Bring the batch up to date with a SchedulerOutput: drop finished and preempted
        requests, (re)build new ones, extend cached ones' block tables and computed counts."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.remove(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            parent = new.parent_id or new.req_id
            seed = params.seed if params.seed is not None else derive_seed(engine_seed, parent)
            self.add(new.req_id, [*new.prompt_token_ids, *new.output_token_ids],
                     len(new.prompt_token_ids), new.block_ids, new.num_computed_tokens, params, seed,
                     new.sample_index, new.eos_token_id)
        cached = so.scheduled_cached_reqs
        if not cached.req_ids:
            return
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids):
            if block_ids:  # most decode steps add no block
                self.append_blocks(req_id, block_ids)
        self.num_computed_tokens[self.rows_of(cached.req_ids)] = cached.num_computed_tokens

    def mark_sampled(self, rows: np.ndarray) -> None:
        """A step that samples these batch rows, in this order, was dispatched."""
        self.num_pending[rows] += 1
        self.pending_index[rows] = np.arange(len(rows), dtype=np.int32)

    def append_token_lists(self, tokens: dict[str, list[int]]) -> None:
        """Append a collected speculative step's emitted tokens (one or more per request) in
        sync mode; requests dropped from the batch since are skipped."""
        for req_id, toks in tokens.items():
            row = self.row_of.get(req_id)
            if row is None:
                continue
            n = int(self.num_tokens[row])
            self.token_ids[row, n:n + len(toks)] = toks
            self.num_tokens[row] = n + len(toks)
            self.num_pending[row] -= 1

    def append_tokens(self, req_ids: Sequence[str], tokens: np.ndarray) -> None:
        """Append a collected step's sampled token to each request's row (req_ids are distinct).
        Requests dropped from the batch since that step was dispatched are skipped."""
        get = self.row_of.get
        rows = np.fromiter((get(r, -1) for r in req_ids), np.int64, len(req_ids))
        if (rows < 0).any():
            tokens, rows = tokens[rows >= 0], rows[rows >= 0]
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
        self.num_pending[rows] -= 1

    def rows_of(self, req_ids: Sequence[str]) -> np.ndarray:
        """The batch rows of live requests, in the given order."""
        return np.fromiter((self.row_of[r] for r in req_ids), np.int64, len(req_ids))

    def write_drafts(self, req_ids: Sequence[str], drafts: Mapping[str, list[int]] | None
                     ) -> np.ndarray | None:
        """Write each request's draft tokens after its known tokens (where the forward reads
        them as input ids; `num_tokens` stays: they are not known yet); returns their counts,
        per request of `req_ids` (None, touching nothing, for a step without drafts)."""
        if not drafts:
            return None
        counts = np.zeros(len(req_ids), np.int32)
        for i, rid in enumerate(req_ids):
            if d := drafts.get(rid):
                row = self.row_of[rid]
                n = self.num_tokens[row]
                self.token_ids[row, n:n + len(d)] = d
                counts[i] = len(d)
        return counts

    def propose_drafts(self, proposer: NgramProposer, limits: Mapping[str, int]
                       ) -> dict[str, list[int]]:
        """Drafts proposed from the batch's own token rows for the requests of `limits` it
        holds, at most ``limits[id]`` tokens each (`NgramProposer.propose_padded`)."""
        held = [r for r in limits if r in self.row_of]
        if not held:
            return {}
        rows = self.rows_of(held)
        drafts = proposer.propose_padded(self.token_ids[rows], self.num_tokens[rows],
                                         [limits[r] for r in held])
        return {r: d.tolist() for r, d in zip(held, drafts)}


@dataclass(frozen=True)
class _TokenRows:
    """Where one step's token rows sit: per token row its position, sequence and batch row;
    per sequence its KV length and query start; the sequences sampled (those reaching the end of
    their known plus pending tokens) and how many tokens each had generated before this one."""

    positions: np.ndarray
    seq_of_row: np.ndarray
    token_rows: np.ndarray
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    prev_index: np.ndarray
    sampled: np.ndarray
    generated: np.ndarray


def _token_rows(batch: InputBatch, rows: np.ndarray, q_lens: Sequence[int],
                num_drafts: np.ndarray) -> _TokenRows:
    q = np.asarray(q_lens, np.int32)
    total = int(q.sum())
    computed = batch.num_computed_tokens[rows]
    kv_lens = computed + q
    cu = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(q, out=cu[1:])
    seq_of_row = np.repeat(np.arange(len(rows)), q)
    positions = computed[seq_of_row] + (np.arange(total) - cu[seq_of_row])
    token_rows = rows[seq_of_row]
    known = batch.num_tokens[rows]
    end = known + batch.num_pending[rows]
    sampled = np.nonzero(kv_lens >= end)[0]
    # a position past the known tokens is the one pending token (async scheduling dispatches a
    # step before collecting the previous one): its id comes from that step's output
    known_at = (known + num_drafts)[seq_of_row]  # drafts: written after the known tokens
    unknown = positions >= known_at
    prev_index = np.where(unknown, batch.pending_index[token_rows], -1)
    if unknown.any() and ((positions[unknown] != known_at[unknown]).any()
                          or (prev_index[unknown] < 0).any()):
        raise RuntimeError("a scheduled token is neither known nor the last dispatched step's")
    generated = end[sampled] - batch.num_prompt_tokens[rows[sampled]]
    return _TokenRows(positions, seq_of_row, token_rows, kv_lens, cu, prev_index, sampled, generated)


def _bias_columns(batch: InputBatch, srows: np.ndarray, generated: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The sampled rows' logit-bias ids and values, as wide as the widest row needs: each row's
    own entries, then, while it has generated fewer than `min_tokens`, its stop ids at -inf;
    padding id 0, value 0.0 (adds nothing)."""
    masked = batch.min_tokens[srows] > generated
    own = batch.num_bias[srows]
    extra = np.array([len(batch.stop_ids[r]) if m else 0 for r, m in zip(srows, masked)], np.int64)
    width = int((own + extra).max(initial=0))
    ids = np.zeros((len(srows), width), np.int32)
    values = np.zeros((len(srows), width), np.float32)
    k = min(width, MAX_LOGIT_BIAS_ENTRIES)
    ids[:, :k], values[:, :k] = batch.bias_ids[srows, :k], batch.bias_values[srows, :k]
    for i in np.nonzero(extra)[0]:
        stop = batch.stop_ids[srows[i]]
        ids[i, own[i]:own[i] + len(stop)] = stop
        values[i, own[i]:own[i] + len(stop)] = -np.inf
    return ids, values


def _padded(values: np.ndarray, size: int, fill: float, dtype: type = np.int32) -> np.ndarray:
    out = np.full((size, *values.shape[1:]), fill, dtype)
    out[:len(values)] = values
    return out


def build_step_arrays(batch: InputBatch, req_ids: Sequence[str], q_lens: Sequence[int],
                      config: EngineConfig, min_buckets: tuple[int, int],
                      num_drafts: np.ndarray | None = None, num_spec: int = 0,
                      attention_backend: str = "reference"
                      ) -> tuple[StepShape, dict[str, np.ndarray], list[str], np.ndarray]:
    """Padded metadata for one step over the requests `req_ids` (sequence s = req_ids[s]) with
    q_lens[s] new tokens each, padded to buckets from `min_buckets` (token rows, sampled rows),
    its attention kind by `attention_backend`'s rule.
    Returns the step's shape, its arrays (see StepShape.fields; with `shape.all_hidden` also the
    unpacked ``prompt_*`` arrays: the token rows whose next token is a prompt token of a request
    asking for prompt logprobs, that token, its position, the row's sequence and k) and the ids
    and batch rows of the sampled requests, in logits_indices order. `num_drafts`: per request,
    the draft tokens to verify that `InputBatch.write_drafts` wrote after its known tokens (each
    scheduled on its last token plus them), at most `num_spec`; any makes a speculative shape
    (`StepShape.num_spec`). Reads the batch; writes nothing to it."""
    rows = batch.rows_of(req_ids)
    if num_drafts is None:
        num_drafts = np.zeros(len(rows), np.int32)
    t = _token_rows(batch, rows, q_lens, num_drafts)
    srows = rows[t.sampled]
    bias_ids, bias_values = _bias_columns(batch, srows, t.generated)
    most_logprobs = int(batch.num_logprobs[srows].max(initial=-1))
    # prompt logprobs: the token rows whose next token is a prompt token of a request asking
    # (scanned only when a scheduled request asks: most steps have none)
    prompt_rows = np.zeros(0, np.int64)
    if (batch.num_prompt_logprobs[rows] >= 0).any():
        prompt_rows = np.nonzero((batch.num_prompt_logprobs[t.token_rows] >= 0)
                                 & (t.positions + 1 < batch.num_prompt_tokens[t.token_rows]))[0]
    width = bias_ids.shape[1]
    num_tokens = bucket(len(t.positions), min_buckets[0], config.max_num_batched_tokens)
    shape = StepShape(num_tokens=num_tokens,
                      num_sampled=bucket(len(srows), min_buckets[1], config.max_num_seqs),
                      max_num_seqs=config.max_num_seqs, max_blocks_per_seq=config.max_blocks_per_seq,
                      num_bias=bucket(width, 8, max(width, MAX_BIAS_COLUMNS)) if width else 0,
                      penalties=bool(batch.has_penalties[srows].any()),
                      num_logprobs=(bucket(most_logprobs, 1, MAX_LOGPROBS) if most_logprobs > 0
                                    else most_logprobs),
                      all_hidden=len(prompt_rows) > 0,
                      structured=bool(batch.structured[srows].any()),
                      num_spec=num_spec if num_drafts.any() else 0,
                      kind=step_kind(attention_backend, np.diff(t.cu_q_lens), num_tokens),
                      sampling=sampling_kind(*(batch.sampling[f][srows]
                                               for f in ("temperature", "top_k", "top_p", "min_p"))))
    arrays = {**_forward_arrays(batch, rows, t, shape, config.block_size),
              **_sampler_arrays(batch, srows, t, shape)}
    if shape.num_spec:
        _spec_arrays(arrays, batch, srows, t, num_drafts[t.sampled], shape)
    if shape.num_bias:
        for name, columns in (("bias_ids", bias_ids), ("bias_values", bias_values)):
            arrays[name] = np.zeros((shape.max_num_seqs, shape.num_bias), columns.dtype)
            arrays[name][:len(srows), :width] = columns
    if shape.all_hidden:  # not packed: the runner's prompt-logprobs program reads these
        p, pos, tok_rows = prompt_rows, t.positions, t.token_rows
        arrays["prompt_rows"] = p.astype(np.int32)
        arrays["prompt_targets"] = batch.token_ids[tok_rows[p], pos[p] + 1]
        arrays["prompt_positions"] = (pos[p] + 1).astype(np.int32)
        arrays["prompt_seqs"] = t.seq_of_row[p].astype(np.int32)
        arrays["prompt_k"] = batch.num_prompt_logprobs[tok_rows[p]]
    return shape, arrays, [req_ids[i] for i in t.sampled], srows


def _forward_arrays(batch: InputBatch, rows: np.ndarray, t: _TokenRows, shape: StepShape,
                    block_size: int) -> dict[str, np.ndarray]:
    """The forward's fields of `StepShape.fields`, padded."""
    t_pad, n_max, n = shape.num_tokens, shape.max_num_seqs, len(rows)
    blocks = batch.block_table[t.token_rows, t.positions // block_size]
    block_tables = np.zeros((n_max, shape.max_blocks_per_seq), np.int32)
    block_tables[:n] = batch.block_table[rows]
    return {
        "input_ids": _padded(batch.token_ids[t.token_rows, t.positions], t_pad, 0),
        "prev_index": _padded(t.prev_index, t_pad, -1),
        "positions": _padded(t.positions, t_pad, 0),
        "slot_mapping": _padded(slot_of(blocks, t.positions % block_size, block_size), t_pad, -1),
        "block_tables": block_tables,
        "kv_lens": _padded(t.kv_lens, n_max, 0),
        "cu_q_lens": _padded(t.cu_q_lens, n_max + 1, len(t.positions)),
        "num_seqs": np.array([n], np.int32),
        "logits_indices": _padded(t.cu_q_lens[t.sampled + 1] - 1, n_max, 0),
    }


def _spec_arrays(arrays: dict[str, np.ndarray], batch: InputBatch, srows: np.ndarray,
                 t: _TokenRows, num_drafts: np.ndarray, shape: StepShape) -> None:
    """A speculative step's logits_indices (K + 1 per sampled sequence: its last token's row
    and its drafts', the last repeated after them) and drafts, padded."""
    n_max, k = shape.max_num_seqs, shape.num_spec
    last = t.cu_q_lens[t.sampled + 1] - 1
    first = last - num_drafts
    idx = first[:, None] + np.minimum(np.arange(k + 1)[None, :], num_drafts[:, None])
    arrays["logits_indices"] = _padded(idx.reshape(-1), n_max * (k + 1), 0)
    draft = np.full((n_max, k), -1, np.int32)
    known = batch.num_tokens[srows]
    for i, (row, n, d) in enumerate(zip(srows, known, num_drafts)):
        draft[i, :d] = batch.token_ids[row, n:n + d]
    arrays["draft_tokens"] = draft
    arrays["num_drafts"] = _padded(num_drafts, n_max, 0)


def _sampler_arrays(batch: InputBatch, srows: np.ndarray, t: _TokenRows, shape: StepShape
                    ) -> dict[str, np.ndarray]:
    """The sampler's per-row fields of `StepShape.fields` but the bias columns, padded."""
    n_max = shape.max_num_seqs
    arrays = {f.name: _padded(batch.sampling[f.name][srows], n_max, f.neutral, f.dtype)
              for f in shape.sampling_fields}
    arrays["seed"] = _padded(batch.seed[srows], n_max, 0)
    arrays["stream"] = _padded(batch.stream[srows], n_max, 0)
    arrays["step"] = _padded(t.generated, n_max, 0)
    if shape.penalties:
        arrays["batch_row"] = _padded(srows, n_max, n_max)
    return arrays
