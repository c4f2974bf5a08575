"""Token sampling, vectorised over rows that each carry their own parameters.

Invariants:
- A structured-output row's token bitmask (`structured_outputs`) is applied to the raw logits
  before anything else: a token whose bit is clear is -inf, so neither bias nor penalties nor
  greedy can pick it. Should logit_bias then leave a row no token (min_tokens' -inf on EOS where
  the constraint allows only EOS), the constraint wins: the row samples from its masked logits.
- logit_bias is added to the raw logits first (a row that has generated fewer than its
  `min_tokens` carries its stop ids there too, at -inf: EOS and stop tokens cannot be drawn),
  then the penalties (repetition over prompt and
  output tokens, then frequency and presence over output tokens) are applied; then a row with
  temperature 0 takes the argmax (greedy) and its other parameters are ignored.
- A batch's sampling kind (`sampling_kind`, chosen on the host, static in the program) says
  which math runs: "greedy" (every row greedy: argmax only), "random" (some row samples at its
  temperature, none filters its vocabulary) or "filtered" (some sampled row has min-p, top-k or
  top-p); no program branches at run time. Each kind gives every row of a batch it admits the
  same token as the next, more general kind would.
- top_k <= 0 (or >= vocab) disables top-k; top_p >= 1 disables top-p; min_p <= 0 disables min-p.
  Masking keeps every token whose scaled logit is >= the threshold, so tokens tied with the last
  kept one are kept too. Order (vLLM's): temperature, min-p, top-k, top-p.
- A sampled row's randomness (one uniform draw) depends only on (seed, stream, step): key =
  fold_in(fold_in(PRNGKey(seed), stream), step), where stream is the sample's index among its
  request's `n` and step the number of tokens it had generated before this one. The same request
  therefore samples the same tokens whatever else shares the batch.
- Logprobs are the model's own: log-softmax of the raw logits, before bias, penalties,
  temperature and truncation (vLLM's default); a token's rank is 1 + the number of tokens with a
  strictly larger logprob.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

GREEDY, RANDOM, FILTERED = "greedy", "random", "filtered"
SAMPLING_KINDS = (GREEDY, RANDOM, FILTERED)  # each admits every batch the ones before it admit


def sampling_kind(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> str:
    """The sampling kind of a batch of rows with these parameters (host side, numpy; greedy
    rows carry temperature 0): "greedy" when no row samples, "filtered" when a sampled row has
    top-k, top-p or min-p on, else "random"."""
    sampled = np.asarray(temperature) > 0
    if not sampled.any():
        return GREEDY
    filters = (np.asarray(top_k) > 0) | (np.asarray(top_p) < 1.0) | (np.asarray(min_p) > 0)
    return FILTERED if (filters & sampled).any() else RANDOM


@struct.dataclass
class SamplingTensors:
    """Per-row sampling parameters, each [num_rows] unless noted. The rows of
    `sampling_fields.SAMPLING_FIELDS` are fields of the same name (dtype and neutral value
    there); those of its "penalties" group are None when no row has a penalty, and then so are
    `output_counts` and `prompt_mask`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array  # i32
    step: jax.Array  # i32, output tokens generated so far
    # logit_bias, [num_rows, K] token ids and added values (padding: id 0, value 0); None: no row
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    stream: jax.Array | None = None  # i32, the sample's index among its request's n (None: 0)
    repetition_penalty: jax.Array | None = None
    presence_penalty: jax.Array | None = None
    frequency_penalty: jax.Array | None = None
    # each row's output token counts [num_rows, V] i32 and whether each token is in its prompt
    # [num_rows, V] bool
    output_counts: jax.Array | None = None
    prompt_mask: jax.Array | None = None
    # structured outputs: per row, the allowed tokens as bits [num_rows, ceil(V / 32)] i32 (bit
    # t % 32 of word t // 32); None: no row is constrained
    token_bitmask: jax.Array | None = None


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array, vocab_major: bool = False) -> jax.Array:
    """logits [R, V] (``[V, R]`` with ``vocab_major``: the mask is unpacked in that layout, so
    the logits are never transposed) with every token whose bit is clear in its row's bitmask
    [R, ceil(V/32)] set to -inf."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    if vocab_major:
        bits = (bitmask.T[:, None, :] >> shifts[None, :, None]) & 1  # [W, 32, R]
        allowed = bits.reshape(-1, bitmask.shape[0])[:logits.shape[0]] != 0
    else:
        bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
        allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, p: SamplingTensors) -> jax.Array:
    """Repetition penalty (transformers': a logit of a token seen in the prompt or the output is
    divided by the penalty when positive, multiplied when negative), then OpenAI's frequency and
    presence penalties over output tokens: ``logit - count * frequency - (count > 0) * presence``.
    logits [R, V]; neutral values leave a row unchanged."""
    counts = p.output_counts
    seen = p.prompt_mask | (counts > 0)
    rep = p.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - counts.astype(jnp.float32) * p.frequency_penalty[:, None]
            - (counts > 0).astype(jnp.float32) * p.presence_penalty[:, None])


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Of raw logits [R, V] and one chosen token per row: the chosen token's logprob f32 [R] and
    rank i32 [R], and the k most likely tokens' ids i32 [R, k] and logprobs f32 [R, k]."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1, dtype=jnp.int32)
    if k == 0:
        rows = lp.shape[0]
        return chosen, rank, jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set to -inf every logit outside the row's top-k and top-p (nucleus) sets.

    logits [R, V] (already temperature-scaled), top_k i32 [R], top_p f32 [R]. The nucleus is the
    smallest prefix of the descending-sorted tokens whose probability mass reaches top_p, computed
    after top-k masking (the order vLLM applies them in).
    """
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p >= 1 keeps everything: a float32 cumsum can reach 1.0 before the last tokens
    keep_sorted = (mass_before < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1.0)
    # The smallest kept sorted value is the nucleus threshold.
    p_thresh = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    thresh = jnp.maximum(kth, p_thresh)
    return jnp.where(logits >= thresh, logits, -jnp.inf)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Set to -inf every logit whose probability is below ``min_p`` times its row's largest:
    ``p_i < min_p * p_max`` is ``logit_i < logit_max + log(min_p)``. logits [R, V] (temperature-
    scaled), min_p f32 [R]; a row with min_p 0 keeps everything."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    floor = top + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    return jnp.where((min_p[:, None] <= 0) | (logits >= floor), logits, -jnp.inf)


def first_argmax(logits: jax.Array, axis: int = -1) -> jax.Array:
    """i32: the lowest index along ``axis`` (the vocabulary) holding each row's maximum
    (jnp.argmax's tie rule; a NaN counts as +inf), as two plain reductions, which XLA:CPU runs
    faster than argmax and which a vocab-split array reduces per shard (an all-reduce each)
    with the same result."""
    logits = jnp.where(jnp.isnan(logits), jnp.inf, logits)
    top = jnp.max(logits, axis=axis, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, axis % logits.ndim)
    return jnp.min(jnp.where(logits == top, ids, logits.shape[axis]), axis=axis)


def _row_key(seed: jax.Array, stream: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), stream), step)


def sample(logits: jax.Array, params: SamplingTensors, vocab_major: bool = False,
           kind: str = FILTERED) -> jax.Array:
    """Sample one token id per row of logits [R, V] (``[V, R]`` with ``vocab_major``); returns
    i32 [R]. ``kind`` (`sampling_kind` of the rows, static): a "greedy" batch skips temperature
    scaling, the filters and the draw altogether, and reduces the logits in the layout given, so
    a feature-major LM head's ``[V, R]`` output is never transposed; a "random" one skips the
    filters (min-p, and the vocabulary sort of top-k/top-p)."""
    if kind not in SAMPLING_KINDS:
        raise ValueError(f"kind must be one of {SAMPLING_KINDS}, got {kind!r}")
    logits, vocab_major = process_logits(logits, params, vocab_major)
    greedy = first_argmax(logits, axis=0 if vocab_major else -1)
    if kind == GREEDY:
        return greedy
    sampled = _sample_rows(logits.T if vocab_major else logits, params, kind == FILTERED)
    return jnp.where(params.temperature <= 0.0, greedy, sampled)


def process_logits(logits: jax.Array, params: SamplingTensors, vocab_major: bool = False
                   ) -> tuple[jax.Array, bool]:
    """float32 logits through the row's token bitmask, logit_bias and penalties (the parts of
    `sample` before temperature); returns them and whether they are still vocab-major (the
    penalty counts are row-major, so penalties make them row-major)."""
    logits = logits.astype(jnp.float32)
    if params.output_counts is not None and vocab_major:  # the counts are row-major
        logits, vocab_major = logits.T, False
    if params.token_bitmask is not None:
        logits = apply_token_bitmask(logits, params.token_bitmask, vocab_major)
    if params.bias_ids is not None:
        rows = jnp.broadcast_to(jnp.arange(params.bias_ids.shape[0])[:, None], params.bias_ids.shape)
        at = (params.bias_ids, rows) if vocab_major else (rows, params.bias_ids)
        biased = logits.at[at].add(params.bias_values)
        if params.token_bitmask is not None:  # a row the bias leaves no token keeps its mask
            vocab_axis = 0 if vocab_major else -1
            biased = jnp.where(jnp.all(biased == -jnp.inf, axis=vocab_axis, keepdims=True), logits, biased)
        logits = biased
    if params.output_counts is not None:
        logits = apply_penalties(logits, params)
    return logits, vocab_major


def _sample_rows(logits: jax.Array, params: SamplingTensors, filtered: bool) -> jax.Array:
    """Every row sampled at its temperature (greedy rows at 1.0; the caller drops them), through
    min-p, top-k and top-p when ``filtered`` (each leaves a row with the neutral value as it is)."""
    is_greedy = params.temperature <= 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
    if filtered:
        scaled = apply_min_p(scaled, params.min_p)
        scaled = apply_top_k_top_p(scaled, params.top_k, params.top_p)
    stream = jnp.zeros_like(params.seed) if params.stream is None else params.stream
    return _inverse_cdf_sample(scaled, params.seed, stream, params.step)


def _inverse_cdf_sample(scaled: jax.Array, seed: jax.Array, stream: jax.Array,
                        step: jax.Array) -> jax.Array:
    """Token i is drawn with probability softmax(scaled)[i]: the first index whose cumulative mass
    reaches u * total, u uniform in (0, 1], so a masked (zero-probability) token is never drawn.
    One uniform per row keeps this cheap next to drawing [R, V] Gumbel noise."""
    cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
    u = 1.0 - jax.vmap(lambda s, i, t: jax.random.uniform(_row_key(s, i, t)))(seed, stream, step)  # (0, 1]
    idx = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
    return jnp.minimum(idx, scaled.shape[-1] - 1).astype(jnp.int32)
