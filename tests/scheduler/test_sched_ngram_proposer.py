"""The n-gram (prompt lookup) proposer against a brute-force reference, its edge cases, and the
validation of SpeculativeConfig (every bad field -> an InvalidFieldError that names it)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.spec_decode import (MAX_NUM_SPECULATIVE_TOKENS, MAX_PROMPT_LOOKUP, NgramProposer,
                                   SpeculativeConfig)


def reference(seq: list[int], k: int, lo: int, hi: int, max_tokens: int) -> list[int]:
    """vLLM V1's rule, spelled out: the longest n in [lo, hi] whose suffix occurs earlier (the
    occurrence may overlap the suffix, not be it), its earliest occurrence, up to
    min(k, max_tokens) of the tokens after it."""
    t, m = len(seq), min(k, max_tokens)
    if m <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        for start in range(t - n):  # the occurrence seq[start:start+n] ends at <= t-2
            if seq[start:start + n] == seq[t - n:]:
                return seq[start + n:start + n + m]
    return []


def proposer(k: int, lo: int, hi: int) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo))


def propose_rows(p: NgramProposer, seqs: list[np.ndarray], limits: list[int]) -> list[np.ndarray]:
    """`propose_padded` over the sequences as rows of one zero-padded buffer (of the widest
    integer dtype among them), as the engine's input batch holds them."""
    dtype = np.result_type(*(s.dtype for s in seqs)) if seqs else np.dtype(np.int32)
    buf = np.zeros((len(seqs), max(map(len, seqs), default=0)), dtype)
    for i, s in enumerate(seqs):
        buf[i, :len(s)] = s
    return p.propose_padded(buf, np.array([len(s) for s in seqs], np.int64), np.array(limits))


configs = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, MAX_NUM_SPECULATIVE_TOKENS)
                    ).map(lambda t: (min(t[:2]), max(t[:2]), t[2]))  # (lo, hi, k)
streams = st.integers(2, 5).flatmap(lambda vocab: st.lists(st.integers(0, vocab - 1), max_size=48))
dtypes = st.sampled_from([np.int32, np.int64, np.uint16, np.uint32])


@settings(max_examples=200, deadline=None)
@given(configs, streams, st.integers(-1, 20), dtypes)
def test_propose_matches_reference(cfg: tuple[int, int, int], seq: list[int], max_tokens: int,
                                   dtype: type) -> None:
    lo, hi, k = cfg
    arr = np.array(seq, dtype)
    got = proposer(k, lo, hi).propose(arr, max_tokens)
    assert got.tolist() == reference(seq, k, lo, hi, max_tokens)
    assert got.dtype == arr.dtype and not np.shares_memory(got, arr)


@settings(max_examples=100, deadline=None)
@given(configs, st.lists(st.tuples(streams, st.integers(-1, 20), dtypes), max_size=8))
def test_mixed_dtype_rows_match_reference(cfg: tuple[int, int, int],
                                          batch: list[tuple[list[int], int, type]]) -> None:
    lo, hi, k = cfg
    p = proposer(k, lo, hi)
    seqs = [np.array(seq, dtype) for seq, _, dtype in batch]
    limits = [m for _, m, _ in batch]
    for _ in range(2):  # the second call reuses the workspace
        got = propose_rows(p, seqs, limits)
        assert [g.tolist() for g in got] == [reference(s, k, lo, hi, m) for s, m, _ in batch]
        assert all(not np.shares_memory(g, s) for g, s in zip(got, seqs))


@settings(max_examples=100, deadline=None)
@given(configs, st.lists(st.tuples(streams, st.integers(-1, 20)), max_size=8), st.integers(0, 5),
       dtypes, st.booleans())
def test_propose_padded_matches_reference(cfg: tuple[int, int, int],
                                          batch: list[tuple[list[int], int]], extra: int,
                                          dtype: type, strided: bool) -> None:
    """Rows of one 2-D buffer whose padding holds tokens too (which must never match)."""
    lo, hi, k = cfg
    width = max([len(seq) for seq, _ in batch], default=0) + extra
    rng = np.random.default_rng(len(batch) * 31 + width)
    buf = rng.integers(0, 3, (len(batch), width)).astype(dtype)
    for i, (seq, _) in enumerate(batch):
        buf[i, :len(seq)] = seq
    if strided:  # a non-contiguous buffer: every other row of a bigger one
        big = np.zeros((2 * len(batch), width), dtype)
        big[::2] = buf
        buf = big[::2]
    num_tokens = np.array([len(seq) for seq, _ in batch], np.int32)
    limits = [m for _, m in batch]
    p = proposer(k, lo, hi)
    for _ in range(2):  # the second call reuses the workspace
        got = p.propose_padded(buf, num_tokens, np.array(limits))
        assert [g.tolist() for g in got] == [reference(s, k, lo, hi, m) for s, m in batch]
        assert all(g.dtype == buf.dtype and not np.shares_memory(g, buf) for g in got)


@pytest.mark.parametrize("vocab, length", [(2, 300), (3, 1000), (50, 2000), (32000, 4000)])
def test_long_random_streams(vocab: int, length: int) -> None:
    """Long streams, a batch of mixed lengths; repetitive ones (a copied span) too."""
    rng = np.random.default_rng(vocab + length)
    seqs = [rng.integers(0, vocab, rng.integers(1, length), dtype=np.int32) for _ in range(12)]
    # end on a copy of an earlier span (a long match), or repeat the first half
    seqs += [np.concatenate([s, s[(a := int(rng.integers(0, len(s)))):a + 7]]) for s in seqs[:6]]
    seqs += [np.concatenate([s, s[:len(s) // 2]]) for s in seqs[6:12]]
    for lo, hi, k in [(1, 1, 3), (2, 4, 5), (3, 5, 16), (5, 5, 2)]:
        p = proposer(k, lo, hi)
        want = [reference(s.tolist(), k, lo, hi, 10) for s in seqs]
        assert [g.tolist() for g in propose_rows(p, seqs, [10] * len(seqs))] == want
        assert [p.propose(s, 10).tolist() for s in seqs] == want
        buf = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
        for i, s in enumerate(seqs):
            buf[i, :len(s)] = s
        got = p.propose_padded(buf, np.array([len(s) for s in seqs]), [10] * len(seqs))
        assert [g.tolist() for g in got] == want


@pytest.mark.parametrize("seq, lo, hi, k, want", [
    # vLLM's tests/v1/spec_decode/test_ngram.py cases
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the earliest occurrence of "3"
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram, not the earlier 3-gram
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
    # edge cases
    ([], 1, 1, 3, []),
    ([7], 1, 1, 3, []),
    ([7, 7], 2, 2, 3, []),  # T == n: no room for an earlier occurrence
    ([7, 7], 1, 1, 3, [7]),
    ([1, 1, 1], 2, 2, 5, [1]),  # the occurrence t[0:2] overlaps the suffix t[1:3]: allowed
    ([9, 1, 1, 1, 1], 2, 2, 5, [1, 1]),  # the earliest of the overlapping occurrences
    ([1, 2, 9, 8, 1, 2], 2, 2, 3, [9, 8, 1]),  # a match at the very start
    ([1, 2, 3, 1, 2], 2, 2, 10, [3, 1, 2]),  # k larger than what follows the match
    ([5, 1, 2, 6, 1, 2], 2, 3, 4, [6, 1, 2]),  # no 3-gram: falls back to the 2-gram
])
def test_cases(seq: list[int], lo: int, hi: int, k: int, want: list[int]) -> None:
    assert reference(seq, k, lo, hi, 100) == want
    p = proposer(k, lo, hi)
    assert p.propose(np.array(seq, np.int64), 100).tolist() == want
    assert propose_rows(p, [np.array(seq, np.int32)], [100])[0].tolist() == want


def test_max_tokens_caps_the_draft() -> None:
    p, seq = proposer(5, 2, 2), np.array([1, 2, 3, 4, 5, 6, 1, 2], np.int32)
    assert [p.propose(seq, m).tolist() for m in (-3, 0, 1, 2, 5, 99)] == \
        [[], [], [3], [3, 4], [3, 4, 5, 6, 1], [3, 4, 5, 6, 1]]
    assert [d.tolist() for d in propose_rows(p, [seq] * 4, [0, 1, 3, np.int64(9)])] == \
        [[], [3], [3, 4, 5], [3, 4, 5, 6, 1]]


def test_bad_proposer_inputs() -> None:
    p = proposer(3, 1, 2)
    with pytest.raises(ValueError, match="1-D integer"):
        p.propose(np.zeros((2, 2), np.int32), 3)
    with pytest.raises(ValueError, match="1-D integer"):
        p.propose(np.zeros(4), 3)
    with pytest.raises(TypeError):
        p.propose(np.zeros(4, np.int32), 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        NgramProposer({"method": "ngram", "num_speculative_tokens": 3})  # type: ignore[arg-type]
    for args in [(np.zeros(4, np.int32), [4], [1]), (np.zeros((2, 4)), [4, 4], [1, 1]),
                 (np.zeros((2, 4), np.int32), [4, 5], [1, 1]), (np.zeros((2, 4), np.int32), [4, -1], [1, 1]),
                 (np.zeros((2, 4), np.int32), [4, 4], [1]), (np.zeros((2, 4), np.int32), [4, 4], [1.5, 1]),
                 (np.zeros((2, 4), np.int32), [4.0, 4], [1, 1])]:
        with pytest.raises(ValueError, match="propose_padded needs"):
            p.propose_padded(*args)
    assert p.propose([], 3).tolist() == [] and propose_rows(p, [], []) == []
    assert p.propose_padded(np.zeros((0, 5), np.int32), [], []) == []
    assert p.propose([4, 5, 4], 3).tolist() == [5, 4]  # a list is taken as an array


def test_workspace_grows_and_shrinks() -> None:
    """One proposer across batches of changing size and dtype gives what fresh ones give."""
    rng = np.random.default_rng(7)
    p = proposer(4, 1, 3)
    for size, length, dtype in [(3, 50, np.int32), (40, 400, np.int32), (2, 10, np.int64),
                                (40, 500, np.uint32), (1, 5, np.int32)]:
        seqs = [rng.integers(0, 4, rng.integers(0, length), dtype=dtype) for _ in range(size)]
        got = [g.tolist() for g in propose_rows(p, seqs, [4] * size)]
        assert got == [reference(s.tolist(), 4, 1, 3, 4) for s in seqs]


# --- SpeculativeConfig --------------------------------------------------------------------


def test_config_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == \
        ("ngram", 3, 5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1,
                                     "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig("[ngram]", 2, prompt_lookup_min=7)
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 7, 7)
    assert SpeculativeConfig.from_dict(c) is c
    assert SpeculativeConfig.from_json(json.dumps(dataclasses.asdict(c))) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 4  # type: ignore[misc]


GOOD = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}


@pytest.mark.parametrize("change, names, is_type", [
    ({"method": "eagle"}, ["speculative_config.method", "'eagle'", "'ngram'"], False),
    ({"method": 1}, ["speculative_config.method", "'ngram'"], True),
    ({"method": None}, ["speculative_config.method"], True),
    ({"num_speculative_tokens": 0}, ["speculative_config.num_speculative_tokens", "[1, 16]"], False),
    ({"num_speculative_tokens": MAX_NUM_SPECULATIVE_TOKENS + 1},
     ["speculative_config.num_speculative_tokens"], False),
    ({"num_speculative_tokens": True}, ["speculative_config.num_speculative_tokens", "int"], True),
    ({"num_speculative_tokens": 2.0}, ["speculative_config.num_speculative_tokens", "float"], True),
    ({"num_speculative_tokens": "3"}, ["speculative_config.num_speculative_tokens", "str"], True),
    ({"prompt_lookup_max": 0}, ["speculative_config.prompt_lookup_max"], False),
    ({"prompt_lookup_max": MAX_PROMPT_LOOKUP + 1}, ["speculative_config.prompt_lookup_max"], False),
    ({"prompt_lookup_max": 1.5}, ["speculative_config.prompt_lookup_max", "int"], True),
    ({"prompt_lookup_min": -1}, ["speculative_config.prompt_lookup_min"], False),
    ({"prompt_lookup_min": "2"}, ["speculative_config.prompt_lookup_min", "int"], True),
    ({"prompt_lookup_min": 5}, ["speculative_config.prompt_lookup_min (5)", "prompt_lookup_max (4)"],
     False),
    ({"model": "ngram"}, ["speculative_config.model", "known keys", "num_speculative_tokens"], False),
    ({"num_spec_tokens": 3}, ["speculative_config.num_spec_tokens"], False),
    ({"method": ...}, ["speculative_config.method", "required"], False),
    ({"num_speculative_tokens": ...}, ["speculative_config.num_speculative_tokens", "required"],
     False),
])
def test_config_bad_field_is_named(change: dict, names: list[str], is_type: bool) -> None:
    value = {key: v for key, v in {**GOOD, **change}.items() if v is not ...}
    for parse in (SpeculativeConfig.from_dict, lambda v: SpeculativeConfig.from_json(json.dumps(v))):
        with pytest.raises(InvalidFieldTypeError if is_type else InvalidFieldError) as info:
            parse(value)
        assert info.value.field == "speculative_config"
        assert str(info.value).startswith("speculative_config")
        for name in names:
            assert name in str(info.value)
        assert isinstance(info.value, TypeError) == is_type
        assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", [None, [GOOD], "ngram", 3])
def test_config_not_a_dict(value: object) -> None:
    with pytest.raises(InvalidFieldTypeError, match="speculative_config must be a dict") as info:
        SpeculativeConfig.from_dict(value)  # type: ignore[arg-type]
    assert info.value.field == "speculative_config"


def test_config_from_json_errors() -> None:
    with pytest.raises(InvalidFieldError, match="speculative_config must be a JSON object"):
        SpeculativeConfig.from_json("{'method': 'ngram'}")
    with pytest.raises(InvalidFieldTypeError, match="speculative_config must be a dict"):
        SpeculativeConfig.from_json("[1, 2]")
    with pytest.raises(InvalidFieldTypeError, match="JSON text"):
        SpeculativeConfig.from_json(GOOD)  # type: ignore[arg-type]


def test_config_constructor_validates_too() -> None:
    with pytest.raises(InvalidFieldError, match="speculative_config.method"):
        SpeculativeConfig("medusa", 3)
    with pytest.raises(InvalidFieldError, match="speculative_config.prompt_lookup_min"):
        SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=3)
