"""The penalties' device state: per batch row, the output tokens' counts and the prompt's token
set, `[max_num_seqs, vocab]` each (`step_programs.PenaltyState`), which the sampler program reads
and returns updated.

Invariants: the state exists from the first step that has a request with penalties; a batch row
that such a request (re)takes is set from its tokens (`InputBatch.new_penalty_rows`) before the
step that samples it is dispatched; a state a failed step consumed is rebuilt from the batch.
"""
from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from minivllm_jax.parallel import sharding
from minivllm_jax.buckets import bucket
from minivllm_jax.worker.input_batch import InputBatch
from minivllm_jax.worker.step_programs import PenaltyState, init_penalty_row


class PenaltyCounts:
    """One runner's penalty state (`state`: None until a request with penalties comes)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, max_model_len: int,
                 mesh: Mesh | None) -> None:
        self.shape, self.max_model_len, self.mesh = (max_num_seqs, vocab_size), max_model_len, mesh
        self.state: PenaltyState | None = None

    def init_rows(self, batch: InputBatch) -> None:
        """Set up the rows that a request with penalties just (re)took."""
        rows, batch.new_penalty_rows = batch.new_penalty_rows, []
        if not rows:
            return
        if self.state is None:
            self.state = (sharding.put_replicated(np.zeros(self.shape, np.int32), self.mesh),
                          sharding.put_replicated(np.zeros(self.shape, bool), self.mesh))
        for row in rows:
            n = int(batch.num_tokens[row])
            ids = np.full(bucket(n, 64, self.max_model_len), -1, np.int32)
            ids[:n] = batch.token_ids[row, :n]
            self.state = init_penalty_row(
                self.state, np.int32(row), sharding.put_replicated(ids, self.mesh),
                np.int32(batch.num_prompt_tokens[row]), mesh=self.mesh)

    def rebuild_later(self, batch: InputBatch) -> None:
        """After a failure consumed the state: drop it, and have every row with penalties set up
        again by the next `init_rows`."""
        self.state = None
        batch.new_penalty_rows = [row for row in batch.row_of.values() if batch.has_penalties[row]]
