"""Verification of draft tokens (speculative decoding) on the device, vectorised over rows.

A row carries up to K draft tokens (n-gram prompt lookup: a deterministic draft, i.e. a point
mass q = 1[x]) and the target model's logits at K + 1 positions: position i's logits are the
model's prediction after the row's context plus drafts 0..i-1 (the target's one forward over the
drafts), so position 0 is the ordinary next-token prediction and position num_draft the bonus.

Standard rejection sampling for a deterministic draft accepts draft x with probability
min(1, p(x) / q(x)) = p(x) and otherwise draws from max(0, p - q), renormalised: p with x removed.
`verify` realises it by drawing y ~ p at each position with `sampler.sample`'s own inverse-CDF
draw and accepting exactly when y == x: P(y == x) = p(x), and y given y != x is distributed as p
with x removed, renormalised, so the emitted tokens have the target distribution. This coupling
is stronger than the distribution: position i draws with the uniform `sample` would use at step
``step + i``, so, logits being equal, a speculative row emits token for token what the same
request emits without speculation (with the same seed), and greedy rows (temperature 0) accept
while the draft equals the argmax (`first_argmax`'s tie rule) and then emit the argmax.

Invariants:
- Every position's distribution is `sampler.sample`'s, from the same functions and in the same
  order (temperature, min-p, top-k, top-p), at the row's own parameters.
- A row's outcome depends only on its logits, draft, num_draft and parameters; its randomness
  at position i only on (seed, stream, step + i), never on the rest of the batch.
- Output: ``tokens[r, :num_emitted[r]]`` are the accepted drafts then one corrected or bonus
  token; ``1 <= num_emitted[r] <= num_draft[r] + 1`` and the rest of the row is -1.
- Static shapes (K, V from the arrays), no control flow on traced values; the batch's sampling
  kind (`sampler.sampling_kind`, static) picks the math, as in `sample`.

The caller's part: position i's logits must already be processed as `sample` would process them
at step ``step + i`` had drafts 0..i-1 been sampled: the structured-output mask of the grammar
advanced over drafts 0..i-1, logit_bias (min_tokens' stop ids at -inf while step + i < min_tokens)
and the penalties with drafts 0..i-1 counted as output tokens. Only positions up to the first
rejection matter: a grammar that rejects draft i masks it out at position i, so the draft is
rejected there and any mask will do after it; positions after num_draft are padding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from minivllm_jax.sampling.sampler import FILTERED, SamplingTensors, process_logits, sample
from minivllm_jax.sampling.sampling_fields import fields_of

# Fields the caller must fold into the per-position logits itself (they are position-dependent:
# penalties count the drafts before each position, structured-output masks follow the grammar
# through the drafts, min_tokens' stop-id bias depends on step + i): the table's "penalties"
# rows and the per-row arrays that are not rows of it.
_PROCESSING_FIELDS = ("bias_ids", "bias_values", *(f.name for f in fields_of("penalties")),
                      "output_counts", "prompt_mask", "token_bitmask")


def verify(logits: jax.Array, draft: jax.Array, num_draft: jax.Array, params: SamplingTensors,
           vocab_major: bool = False, kind: str = FILTERED) -> tuple[jax.Array, jax.Array]:
    """Verify each row's draft tokens against the target's logits.

    logits: f32/bf16 [R, K+1, V] (``[V, R, K+1]`` with ``vocab_major``, e.g. a feature-major LM
        head's ``[V, R*(K+1)]`` reshaped), already through the row's structured-output mask,
        logit_bias and penalties as they apply at each position (see the module docstring).
    draft: i32 [R, K], the draft tokens; entries at or after num_draft are ignored (pad with -1).
    num_draft: i32 [R], each row's number of drafts, clipped to [0, K]; 0 is plain decoding.
    params: per-row [R] temperature, top_k, top_p, min_p, seed, step (tokens the row had
        generated before position 0) and stream (None: 0); its logits-processing fields
        (bias, penalties, counts, bitmask) must be None, as they are the caller's.
    kind: the rows' `sampler.sampling_kind` (static).

    Returns (tokens i32 [R, K+1], num_emitted i32 [R]): tokens[r, i] for i < num_emitted[r] - 1
    are the accepted drafts, tokens[r, num_emitted[r] - 1] the token drawn at the first rejected
    position (or the bonus after num_draft accepts), and -1 after; num_emitted = accepted + 1.
    """
    for name in _PROCESSING_FIELDS:
        if getattr(params, name) is not None:
            raise ValueError(f"verify() takes processed logits: params.{name} must be None")
    if vocab_major:
        vocab, rows, positions = logits.shape
        flat = logits.reshape(vocab, rows * positions)
    else:
        rows, positions, vocab = logits.shape
        flat = logits.reshape(rows * positions, vocab)
    k = positions - 1
    if draft.shape != (rows, k):
        raise ValueError(f"draft {draft.shape} must be [R, K] = {(rows, k)}")
    # One flat row per (row, position): its parameters, at step + position.
    per_position = lambda a: jnp.repeat(a, positions, axis=0, total_repeat_length=rows * positions)
    offset = jnp.tile(jnp.arange(positions, dtype=jnp.int32), rows)
    stream = jnp.zeros_like(params.seed) if params.stream is None else params.stream
    flat_params = SamplingTensors(
        **{f.name: per_position(getattr(params, f.name)) for f in fields_of("always")},
        seed=per_position(params.seed), step=per_position(params.step) + offset,
        stream=per_position(stream))
    drawn = sample(flat, flat_params, vocab_major, kind).reshape(rows, positions)
    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    num_draft = jnp.clip(num_draft, 0, k)
    match = (draft == drawn[:, :k]) & (pos < num_draft[:, None])
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
    emitted_pos = jnp.arange(positions, dtype=jnp.int32)[None, :]
    tokens = jnp.where(emitted_pos <= accepted[:, None], drawn, -1)
    return tokens.astype(jnp.int32), accepted + 1


def verify_step(logits: jax.Array, draft: jax.Array, num_draft: jax.Array, params: SamplingTensors,
                vocab_major: bool = False, kind: str = FILTERED) -> tuple[jax.Array, jax.Array]:
    """`verify` for a step's rows whose `params` carry their logits processing (token bitmask,
    logit_bias, penalty counts and prompt mask, per row as `sample` takes them): each position's
    logits are processed here, with the row's drafts before it counted as output tokens for the
    penalties. logits [R * (K+1), V] row by row, position by position (``[V, R * (K+1)]`` with
    ``vocab_major``). The bias and bitmask apply alike at every position: the caller gives drafts
    only to rows whose min_tokens mask does not change within them and that carry no grammar.
    Returns `verify`'s (tokens [R, K+1], num_emitted [R])."""
    rows, k = draft.shape
    positions = k + 1
    repeat = lambda x: jnp.repeat(x, positions, axis=0, total_repeat_length=rows * positions)
    counts = params.output_counts
    if counts is not None:
        vocab = counts.shape[-1]
        drafted = jnp.where(jnp.arange(k)[None, :] < num_draft[:, None], draft, -1)
        seen = jnp.cumsum(jax.nn.one_hot(drafted, vocab, dtype=counts.dtype), axis=1)
        before = jnp.concatenate([jnp.zeros((rows, 1, vocab), counts.dtype), seen], axis=1)
        counts = (counts[:, None, :] + before).reshape(rows * positions, vocab)
    per_position = jax.tree.map(repeat, params).replace(output_counts=counts)
    processed, vocab_major = process_logits(logits, per_position, vocab_major)
    processed = (processed.reshape(-1, rows, positions) if vocab_major
                 else processed.reshape(rows, positions, -1))
    plain = params.replace(**{name: None for name in _PROCESSING_FIELDS})
    return verify(processed, draft, num_draft, plain, vocab_major, kind)
