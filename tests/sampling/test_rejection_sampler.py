"""Draft verification (speculative decoding) vs independent truths: greedy rows vs a numpy
argmax walk; sampled rows token for token vs `sample` chained over the positions (step + i);
the exact distribution of the emitted tokens vs a numpy model of non-speculative sampling
(chi-square over many seeded rows); per-row determinism whatever the batch around a row."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from minivllm_jax.sampling.rejection_sampler import verify as _verify
from minivllm_jax.sampling.sampler import SamplingTensors
from minivllm_jax.sampling.sampler import sample as _sample

verify = jax.jit(_verify, static_argnames="vocab_major")
sample = jax.jit(_sample)


def _params(temperature, top_k, top_p, min_p, seed, step, stream) -> SamplingTensors:
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    return SamplingTensors(f32(temperature), i32(top_k), f32(top_p), f32(min_p), i32(seed), i32(step),
                           stream=i32(stream))


def _run(logits: np.ndarray, draft: np.ndarray, num_draft: np.ndarray, params: SamplingTensors,
         vocab_major: bool = False) -> tuple[np.ndarray, np.ndarray]:
    x = jnp.asarray(logits)
    if vocab_major:
        x = jnp.transpose(x, (2, 0, 1))  # [V, R, K+1]
    tokens, emitted = verify(x, jnp.asarray(draft, jnp.int32), jnp.asarray(num_draft, jnp.int32), params,
                             vocab_major=vocab_major)
    return np.asarray(tokens), np.asarray(emitted)


def _check_layout(tokens: np.ndarray, emitted: np.ndarray, num_draft: np.ndarray) -> None:
    assert tokens.dtype == np.int32 and emitted.dtype == np.int32
    assert np.all((emitted >= 1) & (emitted <= num_draft + 1))
    cols = np.arange(tokens.shape[1])[None, :]
    assert np.all((tokens >= 0) == (cols < emitted[:, None]))
    assert np.all(tokens[cols >= emitted[:, None]] == -1)


def _drafts_with_prefix(target: np.ndarray, rng: np.random.Generator, vocab: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drafts for tokens ``target`` [R, K+1] that would be drawn: each row gets a random num_draft,
    and agrees with target on a random prefix of it, then differs (padding -1 after num_draft).
    Returns (draft, num_draft, expected accepted count)."""
    rows, k = target.shape[0], target.shape[1] - 1
    num_draft = rng.integers(0, k + 1, rows)
    num_draft[:4] = [0, k, k, k]
    prefix = np.array([rng.integers(0, n + 1) for n in num_draft])
    prefix[1:4] = [k, 0, k // 2]  # all accepted, none, partial
    draft = np.full((rows, k), -1, np.int64)
    for r in range(rows):
        draft[r, :num_draft[r]] = rng.integers(0, vocab, num_draft[r])
        draft[r, :prefix[r]] = target[r, :prefix[r]]
        if prefix[r] < num_draft[r]:  # the first mismatch
            draft[r, prefix[r]] = (target[r, prefix[r]] + 1 + rng.integers(0, vocab - 1)) % vocab
    return draft, num_draft, prefix


@pytest.mark.parametrize("vocab_major", [False, True])
def test_greedy_rows_accept_the_argmax_prefix(vocab_major: bool) -> None:
    """Temperature 0 (other parameters ignored): accept while the draft equals the argmax (the
    lowest index among tied maxima), then emit the argmax: a numpy walk over the positions."""
    rng = np.random.default_rng(0)
    rows, k, vocab = 24, 4, 50
    logits = rng.normal(size=(rows, k + 1, vocab)).astype(np.float32)
    logits[5:8, :, 7] = logits[5:8, :, 3] = logits[5:8].max(-1) + 1.0  # ties: 3 is the argmax
    argmax = logits.argmax(-1)  # numpy's tie rule: the first index
    draft, num_draft, _ = _drafts_with_prefix(argmax, rng, vocab)
    draft[5:8, 0], num_draft[5:8] = 7, np.maximum(num_draft[5:8], 1)  # the tied loser: rejected
    params = _params(np.zeros(rows), rng.integers(0, 5, rows), rng.uniform(0.1, 1, rows), rng.uniform(0, 0.5, rows),
                     np.arange(rows), rng.integers(0, 100, rows), np.zeros(rows))
    tokens, emitted = _run(logits, draft, num_draft, params, vocab_major)
    _check_layout(tokens, emitted, num_draft)
    for r in range(rows):
        want = []
        for i in range(num_draft[r] + 1):
            want.append(int(argmax[r, i]))
            if i == num_draft[r] or draft[r, i] != argmax[r, i]:
                break
        assert tokens[r, :emitted[r]].tolist() == want, f"row {r}"
    assert emitted[1:4].tolist() == [k + 1, 1, k // 2 + 1] and np.all(emitted[5:8] == 1)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_sampled_rows_equal_sample_chained_over_positions(vocab_major: bool) -> None:
    """Position i draws what `sample` draws at step + i from the same logits and parameters, so
    the emitted tokens are those of non-speculative sampling up to the first mismatch (rows with
    num_draft 0: exactly sample()'s token). Mixed greedy and sampled rows, every parameter set."""
    rng = np.random.default_rng(1)
    rows, k, vocab = 32, 3, 40
    logits = (rng.normal(size=(rows, k + 1, vocab)) * 2).astype(np.float32)
    temperature = np.where(rng.random(rows) < 0.25, 0.0, rng.uniform(0.3, 2.0, rows))
    params = _params(temperature, rng.choice([0, 1, 5, 20], rows), rng.choice([1.0, 0.9, 0.5], rows),
                     rng.choice([0.0, 0.05, 0.2], rows), rng.integers(0, 2**31 - 1, rows),
                     rng.integers(0, 500, rows), rng.integers(0, 4, rows))
    drawn = np.stack([np.asarray(sample(jnp.asarray(logits[:, i]), params.replace(step=params.step + i)))
                      for i in range(k + 1)], axis=1)
    draft, num_draft, prefix = _drafts_with_prefix(drawn, rng, vocab)
    tokens, emitted = _run(logits, draft, num_draft, params, vocab_major)
    _check_layout(tokens, emitted, num_draft)
    np.testing.assert_array_equal(emitted, prefix + 1)
    for r in range(rows):
        assert tokens[r, :emitted[r]].tolist() == drawn[r, :emitted[r]].tolist(), f"row {r}"


def _numpy_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Non-speculative sampling's distribution for one position, brute force in float64: scale by
    temperature, drop tokens under min_p times the top probability, keep the top_k most likely of
    the rest, then the most likely of those while the mass before them is below top_p."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = [t for t in np.argsort(-x, kind="stable") if keep[t]][:top_k]
    q = p[order] / p[order].sum()
    mass, nucleus = 0.0, []
    for t, pt in zip(order, q):
        if nucleus and mass >= top_p:
            break
        nucleus.append(t)
        mass += pt
    out = np.zeros_like(p)
    out[nucleus] = p[nucleus] / p[nucleus].sum()
    return out


def _outcome_distribution(probs: np.ndarray, draft: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """The exact distribution of the tokens emitted in one verification step of non-speculative
    sampling's chain: at position i the token is drawn from probs[i] (the logits given the drafts
    before it); a token different from draft i ends the step, and after len(draft) drafts come
    true the bonus is drawn from probs[len(draft)]."""
    out, before = {}, 1.0
    for i, d in enumerate(draft):
        for t in np.flatnonzero(probs[i]):
            if t != d:
                out[draft[:i] + (int(t),)] = before * probs[i][t]
        before *= probs[i][d]
    for t in np.flatnonzero(probs[len(draft)]):
        out[draft + (int(t),)] = before * probs[len(draft)][t]
    return out


def _chi_square_p(observed: dict, expected: dict[tuple, float], n: int) -> float:
    """Chi-square goodness of fit; categories with expected counts under 5 are pooled (smallest
    first) until the pool reaches 5. An observed impossible outcome gives 0."""
    if set(observed) - set(expected):
        return 0.0
    keys = sorted(expected, key=expected.get)
    f_exp = np.array([expected[c] * n for c in keys])
    f_obs = np.array([observed.get(c, 0) for c in keys], np.float64)
    cut = int(np.searchsorted(np.cumsum(f_exp), 5.0)) + 1 if f_exp[0] < 5 else 0
    if cut:
        f_exp = np.concatenate([[f_exp[:cut].sum()], f_exp[cut:]])
        f_obs = np.concatenate([[f_obs[:cut].sum()], f_obs[cut:]])
    return float(stats.chisquare(f_obs, f_exp).pvalue)


def test_emitted_tokens_have_the_exact_non_speculative_distribution() -> None:
    """V=6, K=2, temperature, top-k, top-p and min-p all set: for drafts of a likely token, an
    unlikely one, one masked out (by top-p, by top-k, by min-p; at either position) and shorter
    drafts, the tokens emitted by 20,000 seeded rows each fit the exact distribution (chi-square,
    p > 1e-3), tokens of probability 0 never appear, and a wrong model (temperature 1) is
    rejected. Position i's logits are fixed: the target's, given the drafts before it."""
    n, vocab = 20_000, 6
    temperature, top_k, top_p, min_p = 0.8, 4, 0.9, 0.02
    # position 0: token 0 likely, 2 unlikely; 3 cut by top-p, 4 by top-k, 5 by min-p
    first = temperature * np.log([0.55, 0.30, 0.08, 0.05, 0.019, 0.001])
    logits = np.array([first,
                       [-1.0, 0.3, 1.5, 0.2, -0.4, -0.9],    # 4 cut by top-p; 0 and 5 by top-k
                       [0.0, 0.4, -0.6, 1.1, -2.0, 0.9]], np.float32)
    probs = np.stack([_numpy_probs(row, temperature, top_k, top_p, min_p) for row in logits])
    wrong_probs = np.stack([_numpy_probs(row, 1.0, top_k, top_p, min_p) for row in logits])
    np.testing.assert_array_equal(probs[:2] == 0, [[0, 0, 0, 1, 1, 1], [1, 0, 0, 0, 1, 1]])
    assert 0.05 < probs[0, 2] < 0.1 and probs[0, 0] > 0.5
    cases = [(0, 2), (2, 1), (3, 2), (4, 2), (5, 2), (0, 4), (0, 0), (1,), (0,), ()]
    rows = n * len(cases)
    draft = np.full((rows, 2), -1)
    num_draft = np.zeros(rows, np.int64)
    for c, d in enumerate(cases):
        draft[c * n:(c + 1) * n, :len(d)] = d
        num_draft[c * n:(c + 1) * n] = len(d)
    rng = np.random.default_rng(2)
    params = _params(np.full(rows, temperature), np.full(rows, top_k), np.full(rows, top_p), np.full(rows, min_p),
                     np.arange(rows) * 7 + 1, rng.integers(0, 1000, rows), rng.integers(0, 3, rows))
    tokens, emitted = _run(np.broadcast_to(logits, (rows, 3, vocab)), draft, num_draft, params)
    _check_layout(tokens, emitted, num_draft)
    for c, d in enumerate(cases):
        outcomes, counts = np.unique(tokens[c * n:(c + 1) * n], axis=0, return_counts=True)
        observed = {tuple(int(t) for t in o if t >= 0): int(m) for o, m in zip(outcomes, counts)}
        expected = _outcome_distribution(probs, d)
        assert abs(sum(expected.values()) - 1) < 1e-9
        assert set(observed) <= set(expected), f"draft {d}: impossible outcomes {set(observed) - set(expected)}"
        p_value = _chi_square_p(observed, expected, n)
        assert p_value > 1e-3, f"draft {d}: p = {p_value}"
        # the test has power: the distribution at temperature 1 instead of 0.8 fails it
        assert _chi_square_p(observed, _outcome_distribution(wrong_probs, d), n) < 1e-6


def test_a_row_does_not_depend_on_its_batch() -> None:
    """The same (logits, draft, seed, stream, step) gives the same tokens alone as among other
    rows (greedy or sampled) at a shuffled index; and the randomness does vary with the seed."""
    rng = np.random.default_rng(3)
    k, vocab, m, others = 3, 8, 16, 24
    logits = (rng.normal(size=(m, k + 1, vocab)) * 0.3).astype(np.float32)  # flat: outcomes vary
    draft = rng.integers(0, vocab, (m, k))
    num_draft = np.full(m, k)
    args = (np.full(m, 1.0), np.zeros(m), np.ones(m), np.zeros(m), rng.integers(0, 10**6, m),
            rng.integers(0, 100, m), rng.integers(0, 4, m))
    alone = [_run(logits[i:i + 1], draft[i:i + 1], num_draft[i:i + 1], _params(*[a[i:i + 1] for a in args]))
             for i in range(m)]
    o_args = (np.where(np.arange(others) % 2 == 0, 0.0, 0.7), np.full(others, 3), np.full(others, 0.8),
              np.full(others, 0.1), rng.integers(0, 10**6, others), rng.integers(0, 100, others), np.zeros(others))
    perm = rng.permutation(m + others)
    cat = lambda a, b: np.concatenate([a, b])[perm]
    tokens, emitted = _run(cat(logits, rng.normal(size=(others, k + 1, vocab)).astype(np.float32)),
                           cat(draft, rng.integers(0, vocab, (others, k))), cat(num_draft, rng.integers(0, k + 1, others)),
                           _params(*[cat(a, b) for a, b in zip(args, o_args)]))
    where = np.argsort(perm)[:m]
    for i in range(m):
        assert tokens[where[i]].tolist() == alone[i][0][0].tolist() and emitted[where[i]] == alone[i][1][0]
    # the same row under other seeds (same batch size: no new compile): not always the same outcome
    rows = m + others
    reseeded, _ = _run(np.repeat(logits[:1], rows, 0), np.repeat(draft[:1], rows, 0), np.full(rows, k),
                       _params(*[np.repeat(a[:1], rows) for a in args[:4]], np.arange(rows),
                               np.repeat(args[5][:1], rows), np.zeros(rows)))
    assert len({tuple(t) for t in reseeded.tolist()}) > 5


def test_rejects_processing_fields_and_bad_shapes() -> None:
    """Bias, penalties and masks are the caller's (per position); drafts must be [R, K]."""
    p = _params([1.0], [0], [1.0], [0.0], [0], [0], [0])
    logits = jnp.zeros((1, 3, 8))
    with pytest.raises(ValueError, match="bias_ids"):
        _verify(logits, jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32),
                p.replace(bias_ids=jnp.zeros((1, 1), jnp.int32), bias_values=jnp.zeros((1, 1))))
    with pytest.raises(ValueError, match="draft"):
        _verify(logits, jnp.zeros((1, 3), jnp.int32), jnp.ones(1, jnp.int32), p)

