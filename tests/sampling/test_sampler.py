"""The sampler vs plain numpy: top-k/top-p and min-p masks, greedy rows, seeded reproducibility,
and the empirical distribution of temperature sampling."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minivllm_jax.sampling.sampler import SamplingTensors, apply_min_p, apply_top_k_top_p
from minivllm_jax.sampling.sampler import sample as _sample

sample = jax.jit(_sample, static_argnames="vocab_major")


def _numpy_keep_mask(logits: np.ndarray, k: int, p: float) -> np.ndarray:
    """Brute force: walk tokens from most to least likely, keeping the top k, then keep tokens
    while the probability mass before them (within the top-k set) is below p."""
    order = np.argsort(-logits, kind="stable")
    if k > 0:
        order = order[:k]
    probs = np.exp(logits[order].astype(np.float64) - logits[order].max())
    probs /= probs.sum()
    keep = np.zeros(logits.shape[0], bool)
    mass = 0.0
    for tok, pr in zip(order, probs):
        if mass >= p and keep.any():
            break
        keep[tok] = True
        mass += pr
    return keep


def _tensors(n: int, temperature, top_k, top_p, seed, step, min_p=0.0) -> SamplingTensors:
    full = lambda v, dt: jnp.broadcast_to(jnp.asarray(v, dt), (n,))
    return SamplingTensors(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                           full(min_p, jnp.float32), full(seed, jnp.int32), full(step, jnp.int32))


def test_top_k_top_p_mask_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    rows, vocab = 24, 50
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    top_k = rng.choice([-1, 0, 1, 3, 10, 50, 80], rows).astype(np.int32)   # -1 and 0: off
    top_p = rng.choice([1.0, 0.9, 0.5, 0.1, 0.01], rows).astype(np.float32)
    got = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for r in range(rows):
        want = _numpy_keep_mask(logits[r], int(top_k[r]), float(top_p[r]))
        np.testing.assert_array_equal(np.isfinite(got[r]), want, err_msg=f"row {r} k={top_k[r]} p={top_p[r]}")
        np.testing.assert_array_equal(got[r][want], logits[r][want])
    # top_p 1 keeps every token, even where the float32 mass reaches 1.0 before the tail
    peaked = np.full((2, 1000), -20.0, np.float32)
    peaked[:, 0] = 10.0
    got = np.asarray(apply_top_k_top_p(jnp.asarray(peaked), jnp.zeros(2, jnp.int32), jnp.array([1.0, 0.5])))
    np.testing.assert_array_equal(got[0], peaked[0])
    assert np.isfinite(got[1]).sum() == 1


@pytest.mark.parametrize("vocab_major", [False, True])
def test_greedy_rows_mixed_with_sampled_rows(vocab_major: bool) -> None:
    """Also with the logits given vocab-major ([V, R], as the runner's feature-major LM head
    writes them): the same tokens, sampled rows included."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(8, 300)).astype(np.float32))
    temps = jnp.asarray([0.0, 1.0, 0.0, 2.0, 0.0, 0.5, 1.0, 0.0], jnp.float32)
    st = SamplingTensors(temps, jnp.zeros(8, jnp.int32), jnp.ones(8, jnp.float32), jnp.zeros(8),
                         jnp.arange(8, dtype=jnp.int32), jnp.zeros(8, jnp.int32))
    out = np.asarray(sample(logits.T if vocab_major else logits, st, vocab_major=vocab_major))
    if vocab_major:
        np.testing.assert_array_equal(out, np.asarray(sample(logits, st)))
    greedy = np.asarray(logits).argmax(-1)
    is_greedy = np.asarray(temps) == 0
    np.testing.assert_array_equal(out[is_greedy], greedy[is_greedy])
    # top_k = 1 is greedy whatever the temperature
    out_k1 = np.asarray(sample(logits.T if vocab_major else logits, _tensors(8, 1.3, 1, 1.0, 5, 3),
                               vocab_major=vocab_major))
    np.testing.assert_array_equal(out_k1, greedy)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_greedy_ties_take_the_lowest_index_like_numpy(vocab_major: bool) -> None:
    rng = np.random.default_rng(4)
    logits = rng.integers(-3, 4, size=(16, 40)).astype(np.float32)  # many tied maxima per row
    logits[3] = 7.0  # a row that is all ties
    logits[5, -1] = 50.0  # the maximum in the last column
    logits[6] = -np.inf  # nothing allowed: index 0, as numpy
    logits[7, [9, 30]] = np.nan  # a NaN counts as +inf: the first NaN, as numpy
    logits[8, [2, 11]] = [np.inf, np.nan]  # ... tied with a real +inf before it
    given = logits.T.copy() if vocab_major else logits
    out = np.asarray(sample(jnp.asarray(given), _tensors(16, 0.0, 0, 1.0, 0, 0), vocab_major=vocab_major))
    np.testing.assert_array_equal(out, np.where(np.isnan(logits), np.inf, logits).argmax(-1))
    assert out[7] == logits[7].argmax() == 9


def test_seeded_rows_do_not_depend_on_batch() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    st = SamplingTensors(jnp.full(6, 1.0), jnp.zeros(6, jnp.int32), jnp.full(6, 0.95),
                         jnp.asarray([0.0, 0.1, 0.0, 0.3, 0.0, 0.05]),
                         jnp.asarray([11, 12, 13, 14, 15, 16], jnp.int32), jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32))
    full = np.asarray(sample(jnp.asarray(logits), st))
    # the same rows alone, in another order and position, with other companions
    perm = [4, 1]
    sub = SamplingTensors(*(x[jnp.asarray(perm)] for x in (st.temperature, st.top_k, st.top_p, st.min_p,
                                                           st.seed, st.step)))
    alone = np.asarray(sample(jnp.asarray(logits[perm]), sub))
    np.testing.assert_array_equal(alone, full[perm])
    # different seeds or steps give different draws (over many rows of the same logits)
    same = np.tile(logits[:1], (64, 1))
    a = np.asarray(sample(jnp.asarray(same), _tensors(64, 1.0, 0, 1.0, jnp.arange(64), 0)))
    assert len(set(a.tolist())) > 20


def test_temperature_sampling_distribution() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))
    n, temp = 4000, 0.7
    rows = jnp.tile(jnp.asarray(logits)[None], (n, 1))
    draws = np.asarray(sample(rows, _tensors(n, temp, 0, 1.0, 3, jnp.arange(n))))
    expected = np.exp(logits / temp) / np.exp(logits / temp).sum()
    freq = np.bincount(draws, minlength=4) / n
    np.testing.assert_allclose(freq, expected, atol=0.03)
    # top_p 0.6 keeps the two most likely tokens (mass before the 2nd is < 0.6, before the 3rd is not)
    draws = np.asarray(sample(rows, _tensors(n, 1.0, 0, 0.6, 3, jnp.arange(n))))
    freq = np.bincount(draws, minlength=4) / n
    np.testing.assert_allclose(freq, [2 / 3, 1 / 3, 0, 0], atol=0.03)


def test_min_p_mask_matches_numpy() -> None:
    """Kept: tokens whose probability is at least min_p times the row's largest (float64)."""
    rng = np.random.default_rng(5)
    rows, vocab = 16, 60
    logits = (rng.normal(size=(rows, vocab)) * 2).astype(np.float32)
    min_p = rng.choice([0.0, 0.01, 0.1, 0.3, 0.9, 1.0], rows).astype(np.float32)
    got = np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    probs = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    for r in range(rows):
        want = probs[r] >= min_p[r] * probs[r].max() * (1 - 1e-6)
        np.testing.assert_array_equal(np.isfinite(got[r]), want, err_msg=f"row {r} min_p={min_p[r]}")
        np.testing.assert_array_equal(got[r][want], logits[r][want])


def test_min_p_sampling_distribution() -> None:
    """min_p 0.35 of [0.5, 0.25, 0.15, 0.1] keeps p >= 0.175: the first two, renormalised; min_p 1
    keeps only the most likely token at any temperature."""
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))
    n = 4000
    rows = jnp.tile(jnp.asarray(logits)[None], (n, 1))
    draws = np.asarray(sample(rows, _tensors(n, 1.0, 0, 1.0, 7, jnp.arange(n), min_p=0.35)))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / n, [2 / 3, 1 / 3, 0, 0], atol=0.03)
    draws = np.asarray(sample(rows, _tensors(n, 1.7, 0, 1.0, 7, jnp.arange(n), min_p=1.0)))
    assert (draws == 0).all()


@pytest.mark.parametrize("vocab_major", [False, True])
def test_logit_bias_is_added_before_greedy_and_sampling(vocab_major: bool) -> None:
    """Greedy rows take the argmax of logits + bias (numpy); a +100 bias makes a sampled row draw
    its token; rows without entries (padding: id 0, value 0) are unchanged."""
    rng = np.random.default_rng(6)
    rows, vocab, k = 6, 90, 8
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    ids = np.zeros((rows, k), np.int32)
    values = np.zeros((rows, k), np.float32)
    ids[0, :3], values[0, :3] = [5, 17, 40], [3.0, -2.0, 4.5]
    ids[1, :1], values[1, :1] = [int(logits[1].argmax())], [-100.0]
    ids[3, :1], values[3, :1] = [61], [100.0]
    temps = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 0.0], np.float32)
    st = SamplingTensors(jnp.asarray(temps), jnp.zeros(rows, jnp.int32), jnp.ones(rows), jnp.zeros(rows),
                         jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32),
                         jnp.asarray(ids), jnp.asarray(values))
    given = logits.T.copy() if vocab_major else logits
    out = np.asarray(sample(jnp.asarray(given), st, vocab_major=vocab_major))
    biased = logits.copy()
    for r in range(rows):
        np.add.at(biased[r], ids[r], values[r])
    greedy = temps == 0
    np.testing.assert_array_equal(out[greedy], biased.argmax(-1)[greedy])
    assert out[1] != logits[1].argmax() and out[3] == 61


def _params(rows: int, **kw: object) -> SamplingTensors:
    base = dict(temperature=jnp.zeros(rows), top_k=jnp.zeros(rows, jnp.int32), top_p=jnp.ones(rows),
                min_p=jnp.zeros(rows), seed=jnp.arange(rows, dtype=jnp.int32),
                step=jnp.zeros(rows, jnp.int32))
    base.update(kw)
    return SamplingTensors(**base)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_penalties_match_numpy(vocab_major: bool) -> None:
    """Greedy rows take the argmax of the logits after transformers' repetition penalty (prompt or
    output tokens) and OpenAI's frequency/presence penalties (output counts), in float64 numpy;
    neutral rows are unchanged."""
    from minivllm_jax.sampling.sampler import apply_penalties

    rng = np.random.default_rng(7)
    rows, vocab = 5, 40
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    counts = rng.integers(0, 4, size=(rows, vocab)).astype(np.int32) * (rng.random((rows, vocab)) < 0.3)
    seen = rng.random((rows, vocab)) < 0.2
    rep = np.array([1.0, 1.3, 0.7, 1.0, 2.0], np.float32)
    pres = np.array([0.0, 0.5, -1.0, 0.0, 2.0], np.float32)
    freq = np.array([0.0, 0.25, 0.0, 1.5, -2.0], np.float32)
    want = logits.astype(np.float64)
    hit = seen | (counts > 0)
    want = np.where(hit, np.where(want > 0, want / rep[:, None], want * rep[:, None]), want)
    want = want - counts * freq[:, None] - (counts > 0) * pres[:, None]
    kw = dict(repetition_penalty=jnp.asarray(rep), presence_penalty=jnp.asarray(pres),
              frequency_penalty=jnp.asarray(freq), output_counts=jnp.asarray(counts),
              prompt_mask=jnp.asarray(seen))
    np.testing.assert_allclose(np.asarray(apply_penalties(jnp.asarray(logits), _params(rows, **kw))),
                               want, rtol=1e-6, atol=1e-5)
    given = logits.T.copy() if vocab_major else logits
    out = np.asarray(sample(jnp.asarray(given), _params(rows, **kw), vocab_major=vocab_major))
    np.testing.assert_array_equal(out, want.argmax(-1))
    assert out[0] == logits[0].argmax() and (out != logits.argmax(-1)).any()


def test_token_logprobs_match_numpy() -> None:
    """The chosen token's log-softmax and rank (1 + strictly larger), and the top-k ids and values,
    against float64 numpy."""
    from minivllm_jax.sampling.sampler import token_logprobs

    rng = np.random.default_rng(8)
    logits = (rng.normal(size=(4, 50)) * 4).astype(np.float32)
    chosen = np.array([3, int(logits[1].argmax()), 49, 0], np.int32)
    lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    got, rank, top_ids, top_lp = (np.asarray(x) for x in jax.jit(token_logprobs, static_argnums=2)(
        jnp.asarray(logits), jnp.asarray(chosen), 5))
    np.testing.assert_allclose(got, lp[np.arange(4), chosen], atol=1e-5)
    np.testing.assert_array_equal(rank, 1 + (lp > lp[np.arange(4), chosen][:, None]).sum(-1))
    assert rank[1] == 1
    np.testing.assert_array_equal(top_ids, np.argsort(-lp, axis=-1)[:, :5])
    np.testing.assert_allclose(top_lp, -np.sort(-lp, axis=-1)[:, :5], atol=1e-5)
    _, _, none_ids, none_lp = token_logprobs(jnp.asarray(logits), jnp.asarray(chosen), 0)
    assert none_ids.shape == (4, 0) and none_lp.shape == (4, 0)


def test_streams_of_one_seed_differ_and_stream_0_is_the_default() -> None:
    """Rows with one seed and step but different streams (a request's n samples) draw
    independently; stream 0 draws what a row without streams draws."""
    rows, vocab = 64, 200
    logits = jnp.zeros((rows, vocab))
    kw = dict(temperature=jnp.ones(rows), seed=jnp.full(rows, 5, jnp.int32))
    streams = sample(logits, _params(rows, stream=jnp.arange(rows, dtype=jnp.int32), **kw))
    default = sample(logits, _params(rows, **kw))
    assert len(set(np.asarray(streams).tolist())) > rows // 2
    assert len(set(np.asarray(default).tolist())) == 1
    assert int(streams[0]) == int(default[0])


def test_penalty_state_counts_match_numpy() -> None:
    """init_penalty_row sets a row from a request's tokens (prompt mask, output counts), and the
    sampler program's update counts each sampled token in its batch row; against numpy."""
    from minivllm_jax.worker.step_programs import init_penalty_row

    rng = np.random.default_rng(9)
    seqs, vocab = 4, 30
    state = (jnp.asarray(rng.integers(0, 3, (seqs, vocab)).astype(np.int32)), jnp.ones((seqs, vocab), bool))
    want_counts, want_seen = np.asarray(state[0]).copy(), np.ones((seqs, vocab), bool)
    tokens = rng.integers(0, vocab, 20).astype(np.int32)
    padded = np.full(32, -1, np.int32)
    padded[:20] = tokens
    state = init_penalty_row(state, np.int32(2), jnp.asarray(padded), np.int32(12))
    want_counts[2] = np.bincount(tokens[12:], minlength=vocab)
    want_seen[2] = np.bincount(tokens[:12], minlength=vocab) > 0
    np.testing.assert_array_equal(np.asarray(state[0]), want_counts)
    np.testing.assert_array_equal(np.asarray(state[1]), want_seen)
