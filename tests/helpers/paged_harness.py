"""A minimal paged runner for model tests: hand-built block tables, one jitted step per call.

Each sequence gets fresh blocks from a bump allocator (block 0 is never used); a step is a list of
chunks ``(seq_id, token_ids)`` continuing each sequence where its previous chunk stopped, flattened
into one token batch padded to ``pad_to`` rows (padding rows have slot -1).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# models.llama before attention: importing minivllm_jax.models.attention first is a circular import
# (attention -> sharding -> models -> llama -> attention), which failed this file's tests when
# they ran on their own
from minivllm_jax.models.llama import LlamaForCausalLM, unstack_layers
from minivllm_jax.models.attention import AttentionMetadata
from minivllm_jax.kv_cache_sizing import init_kv_cache
from minivllm_jax.model_config import ModelConfig
from minivllm_jax.models.rope import rope_table
from minivllm_jax.plan import ModelPlan


@functools.lru_cache(maxsize=None)
def compiled_step(config: ModelConfig, backend: str, interpret: bool | None,
                  feature_major_rows: int = 0, layer_layout: str = "stacked") -> Callable[..., Any]:
    """One jitted ``step(params, cache, ids, pos, md, rope) -> (logits, cache)`` per model, shared
    by all runners so equal shapes compile once per test session. The cache is donated."""
    model = LlamaForCausalLM(config, ModelPlan(backend, layer_layout, feature_major_rows, interpret))

    def step(params, cache, ids, pos, md, rope):
        hidden, cache = model.apply({"params": params}, ids, pos, cache, md, rope)
        logits = model.apply({"params": params}, hidden, method=LlamaForCausalLM.compute_logits)
        return logits, cache

    return jax.jit(step, donate_argnums=(1,))


@dataclass
class PagedRunner:
    config: ModelConfig
    params: dict
    backend: str = "xla"
    block_size: int = 4
    num_blocks: int = 128
    max_num_seqs: int = 4
    max_blocks_per_seq: int = 32
    interpret: bool | None = None
    cache_dtype: object = jnp.float32
    feature_major_rows: int = 0  # models/llama.py ``project``: > 0 runs small batches as W @ x^T
    layer_layout: str = "stacked"  # models/llama.py; ``params`` stay stacked, unstacked here if need be
    tables: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cache = init_kv_cache(self.config, self.num_blocks, self.block_size, self.cache_dtype)
        self._next_block = 1
        if self.layer_layout != "stacked":
            self.params = unstack_layers(self.params, self.config.num_hidden_layers)
        self._step = compiled_step(self.config, self.backend, self.interpret, self.feature_major_rows,
                                   self.layer_layout)
        # every position a sequence's block table can hold
        self.rope = jnp.asarray(rope_table(self.config, self.max_blocks_per_seq * self.block_size))

    def run(self, chunks: list[tuple[int, list[int]]], pad_to: int | None = None) -> list[np.ndarray]:
        """Run one step; returns float32 logits ``[len(chunk), vocab]`` for each chunk."""
        ids, pos, slots, kv_lens, cu = [], [], [], [], [0]
        tables = np.zeros((self.max_num_seqs, self.max_blocks_per_seq), np.int32)
        for s, (seq, toks) in enumerate(chunks):
            start = self.lens.get(seq, 0)
            blocks = self.tables.setdefault(seq, [])
            end = start + len(toks)
            while len(blocks) * self.block_size < end:
                blocks.append(self._next_block)
                self._next_block += 1
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            self.lens[seq] = end
            kv_lens.append(end)
            cu.append(cu[-1] + len(toks))
            tables[s, :len(blocks)] = blocks
        n = len(ids)
        pad = (pad_to or n) - n
        assert pad >= 0
        ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad
        kv_lens += [0] * (self.max_num_seqs - len(chunks))
        cu += [cu[-1]] * (self.max_num_seqs + 1 - len(cu))
        md = AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32),
                               block_tables=jnp.asarray(tables),
                               kv_lens=jnp.asarray(kv_lens, jnp.int32),
                               cu_q_lens=jnp.asarray(cu, jnp.int32),
                               num_seqs=jnp.asarray([len(chunks)], jnp.int32))
        logits, self.cache = self._step(self.params, self.cache, jnp.asarray(ids, jnp.int32),
                                        jnp.asarray(pos, jnp.int32), md, self.rope)
        logits = np.asarray(logits)
        return [logits[cu[i]:cu[i + 1]] for i in range(len(chunks))]

    def greedy(self, seq: int, prompt: list[int], max_new_tokens: int, pad_to: int = 8,
               prefill_pad: int | None = None) -> list[int]:
        """Prefill ``prompt`` in one step (padded to ``prefill_pad``, default the power of two
        that holds it, at least ``pad_to``), then decode one token per step (padded to ``pad_to``)."""
        bucket = prefill_pad or max(pad_to, 1 << (len(prompt) - 1).bit_length())
        logits = self.run([(seq, prompt)], pad_to=bucket)[0]
        out = [int(np.argmax(logits[-1]))]
        while len(out) < max_new_tokens:
            logits = self.run([(seq, [out[-1]])], pad_to=pad_to)[0]
            out.append(int(np.argmax(logits[-1])))
        return out
