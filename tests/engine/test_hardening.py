"""Hostile input and failed steps, on a tiny random Llama: no SamplingParams value can fail a
step, a failed step fails only its own requests, aborted or interrupted requests never linger,
automatic ids never collide, and `min_tokens` masks the stop tokens on the device.

Truth: transformers' greedy loop on the same checkpoint (with the same logit bias and EOS mask),
the engine's own answer before any hostile input, and the block pool's free count.
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

import numpy as np
import pytest

from engine_helpers import BASE, token_ids
from minivllm_jax import LLM, SamplingParams
from scheduler import InvalidFieldError

EOS = 2  # the tiny Llama's (tests/conftest.py)
_rng = np.random.default_rng(5)
PROMPTS = [_rng.integers(3, 256, size=n).tolist() for n in (7, 12, 5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# hostile values for every SamplingParams field (huge and negative ints, 2**31, 2**63, NaN,
# inf, 1e-300) and a few ordinary ones: each must be refused by name or served
EXTREMES: list[Any] = [2**31, 2**31 - 1, 2**63, -2**63 - 1, 2**64, -1, -2**31, 10**30, 0, 1,
                       float("nan"), float("inf"), float("-inf"), 1e-300, -1e-300, 1e300, 0.5,
                       3.5e38, True, "7", None]
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def _hf_masked_greedy(model: Any, ids: list[int], n: int, bias: dict[int, float],
                      min_tokens: int, stop_ids: set[int]) -> list[int]:
    """transformers' logits plus `bias`, with `stop_ids` at -inf while fewer than `min_tokens`
    tokens were generated; argmax; stops after a stop id once min_tokens is reached."""
    import torch

    ids, out = list(ids), []
    with torch.no_grad():
        while len(out) < n:
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            for tok, value in bias.items():
                logits[tok] += value
            if len(out) < min_tokens:
                logits[list(stop_ids)] = -float("inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            if out[-1] in stop_ids:
                break
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest, tiny_model: Any, backend: str) -> LLM:
    return LLM(tiny_model, attention_backend=backend, async_scheduling=request.param, **BASE)


@pytest.fixture(scope="module")
def plain(tiny_model: Any, backend: str) -> list[list[int]]:
    """The engine's own greedy answers, before anything hostile happened to any engine."""
    llm = LLM(tiny_model, attention_backend=backend, **BASE)
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False))


def _all_blocks_free(llm: LLM) -> bool:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == len(pool.blocks) - 1


def _answers(llm: LLM) -> list[list[int]]:
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False))


def test_extreme_sampling_values_are_refused_by_name_or_served(llm: LLM, plain: list[list[int]]) -> None:
    """Every field, fed every extreme value (and random pairs of them), either raises a
    ValueError/TypeError whose message starts with that field, or is served to its end; the
    engine then still gives its plain greedy answers and no block leaks."""
    rng = random.Random(0)
    served = refused = 0
    cases = [{name: v} for name in FIELDS for v in EXTREMES]
    cases += [{a: rng.choice(EXTREMES), b: rng.choice(EXTREMES)}
              for a, b in (rng.sample(FIELDS, 2) for _ in range(40))]
    for case in cases:
        try:
            sp = SamplingParams(**{"max_tokens": 3, **case})
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)
        except (ValueError, TypeError) as e:
            assert re.match(r"[a-z_]+", str(e)).group(0) in case, (case, str(e))
            refused += 1
            continue
        assert all(c.finish_reason in ("stop", "length") for c in out[0].outputs), case
        served += 1
    assert served > 20 and refused > 100
    assert _answers(llm) == plain
    assert not llm.has_unfinished_requests() and _all_blocks_free(llm)


def test_engine_bounds_name_the_field(llm: LLM) -> None:
    """The vocabulary-dependent bounds (the engine knows them, SamplingParams not)."""
    vocab = llm.engine.model_config.vocab_size
    for sp, field in ((SamplingParams(top_k=2**31 - 1), "top_k"), (SamplingParams(top_k=vocab + 1), "top_k"),
                      (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
                      (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias")):
        with pytest.raises(ValueError) as e:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)
        assert str(e.value).startswith(field), str(e.value)
        assert isinstance(e.value, InvalidFieldError) and e.value.field == field
    forced = SamplingParams()
    object.__setattr__(forced, "temperature", float("inf"))  # a frozen value forced past __init__
    with pytest.raises(ValueError, match="^temperature") as e:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], forced, use_tqdm=False)
    assert e.value.field == "temperature"
    with pytest.raises(ValueError, match="^priority") as e:
        llm.engine.check_request(PROMPTS[0], SamplingParams(), 2**64)
    assert e.value.field == "priority"
    max_len = llm.engine.config.max_model_len
    for prompt, field in (([vocab], "prompt_token_ids"), ([-1], "prompt_token_ids"),
                          ([], "prompt_token_ids"), ([5] * max_len, "prompt_token_ids"),
                          ([1, 2.0], "prompt_token_ids")):  # the engine's own check of token ids
        with pytest.raises(ValueError) as e:
            llm.engine.check_request(prompt, SamplingParams())
        assert isinstance(e.value, InvalidFieldError) and e.value.field == field, (prompt, e.value)
    with pytest.raises(TypeError) as e:
        llm.engine.check_request(PROMPTS[0], {"temperature": 0})
    assert e.value.field == "sampling_params"
    with pytest.raises(ValueError) as e:  # two prompts: the message names which, the field stays
        llm.generate([PROMPTS[0], [vocab]], GREEDY, use_tqdm=False)
    assert str(e.value).startswith("prompt 1: prompt_token_ids") and e.value.field == "prompt_token_ids"
    with pytest.raises(ValueError) as e:  # LLM's own prompt forms: prompts.prompt_token_ids
        llm.generate([[-1]], GREEDY, use_tqdm=False)
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(TypeError) as e:
        llm.generate([[1], 3.5], GREEDY, use_tqdm=False)
    assert e.value.field == "prompt"
    llm.generate([{"prompt_token_ids": PROMPTS[0]}],  # at the bounds; n past max_num_seqs: waves
                 SamplingParams(top_k=vocab, n=BASE["max_num_seqs"] + 1, max_tokens=2), use_tqdm=False)


def test_a_failed_step_fails_only_its_requests(llm: LLM, plain: list[list[int]]) -> None:
    """A step that raises (here in `before_dispatch`, inside the step) ends the requests it ran
    with finish_reason "error" and the engine serves on: requests that were not in it, queued
    behind it, get their plain answers; no block leaks; the next steps are exact."""
    engine = llm.engine
    bad = llm.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    state = {"armed": True}

    def fault(ids: set[str]) -> None:
        if state["armed"] and bad in ids:
            state["armed"] = False
            raise RuntimeError("injected")

    engine.before_dispatch = fault
    try:
        finals = {d.request_id: d.output for d in llm.step() if d.finished}  # nothing else in it
        later = [llm.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
        while llm.has_unfinished_requests():
            for d in llm.step():
                if d.finished:
                    finals[d.request_id] = d.output
    finally:
        engine.before_dispatch = None
    assert finals[bad].outputs[0].finish_reason == "error"
    assert isinstance(engine.last_error, RuntimeError)
    assert [finals[r].outputs[0].token_ids for r in later] == plain
    assert _all_blocks_free(llm)


def test_a_failed_step_among_running_requests(llm: LLM, plain: list[list[int]]) -> None:
    """A fault in a step shared with other requests fails all of them (and every sample of a
    request with n > 1), and through `generate` it raises RuntimeError; the engine's next
    answers are exact and every block is free."""
    engine = llm.engine
    steps = {"n": 0}

    def fault(ids: set[str]) -> None:
        steps["n"] += 1
        if steps["n"] == 4:
            raise RuntimeError("injected")

    engine.before_dispatch = fault
    try:
        with pytest.raises(RuntimeError, match="failed in a model step"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         [GREEDY, GREEDY, dataclasses.replace(GREEDY, n=2)], use_tqdm=False)
    finally:
        engine.before_dispatch = None
    assert not llm.has_unfinished_requests() and _all_blocks_free(llm)
    assert _answers(llm) == plain


def test_a_step_that_loses_the_kv_cache(llm: LLM, plain: list[list[int]]) -> None:
    """When the failure takes the KV cache with it (a donated buffer gone), every running request
    fails, the cache is rebuilt, the prefix cache forgets everything, and answers stay exact
    (the prompts' blocks, cached before, are recomputed, not hit)."""
    engine = llm.engine
    assert _answers(llm) == plain  # fills the prefix cache with these prompts
    other = llm.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY)
    llm.step()
    llm.step()

    def fault(ids: set[str]) -> None:
        engine.runner.kv_cache.delete()
        raise RuntimeError("injected, cache lost")

    engine.before_dispatch = fault
    try:
        finals = {d.request_id: d.output for d in llm.step() if d.finished}
    finally:
        engine.before_dispatch = None
    finals.update({d.request_id: d.output for d in llm.step() if d.finished})
    assert finals[other].outputs[0].finish_reason == "error"
    assert not llm.has_unfinished_requests() and _all_blocks_free(llm)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert not pool.cached_block_hash_to_block
    assert _answers(llm) == plain


def test_interrupted_generate_leaves_nothing_behind(llm: LLM, plain: list[list[int]]) -> None:
    """A KeyboardInterrupt inside a step propagates; the interrupted call's requests are gone
    (no pending outputs, nothing unfinished), a request added by hand in the meantime is
    reported exactly once, and later calls see none of the old requests."""
    engine = llm.engine
    mine = llm.add_request({"prompt_token_ids": PROMPTS[2]}, GREEDY, request_id="mine")
    calls = {"n": 0}

    def interrupt(ids: set[str]) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    engine.before_dispatch = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        engine.before_dispatch = None
    reports = []
    while llm.has_unfinished_requests():
        reports += [d for d in llm.step() if d.finished]
    assert [d.request_id for d in reports] == [mine]
    assert _answers(llm) == plain
    assert not llm.has_unfinished_requests() and _all_blocks_free(llm)


def test_abort_request_and_automatic_ids(llm: LLM) -> None:
    with pytest.raises(TypeError, match="request_ids"):
        llm.abort_request(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_ids"):
        llm.abort_request([1, 2])  # type: ignore[list-item]
    engine = llm.engine
    nxt = str(next(engine._ids) + 1)  # the counter's next value, taken by the caller first
    taken = llm.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY, request_id=nxt)
    auto = [llm.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY) for _ in range(3)]
    assert taken not in auto and len(set(auto)) == 3
    llm.abort_request([taken, *auto])
    reasons = []
    while llm.has_unfinished_requests():
        reasons += [d.finish_reason for d in llm.step() if d.finished]
    assert reasons == ["abort"] * 4 and _all_blocks_free(llm)


@pytest.mark.parametrize("stop_token_ids", [(), (7, 9)])
def test_min_tokens_masks_the_stop_tokens(llm: LLM, tiny_hf: Any, stop_token_ids: tuple[int, ...]) -> None:
    """min_tokens=3 with EOS pushed up by logit_bias: three non-EOS tokens, then EOS (vLLM's
    rule), as transformers' greedy loop with the same bias and mask; a batch neighbour without
    min_tokens still stops at once; stop_token_ids are masked alike."""
    bias = {EOS: 100.0, **{t: 90.0 for t in stop_token_ids}}
    sp = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias=bias,
                        stop_token_ids=stop_token_ids)
    free = dataclasses.replace(sp, min_tokens=0)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}], [sp, free],
                        use_tqdm=False)
    got, neighbour = token_ids(outs)
    stops = {EOS, *stop_token_ids}
    assert got == _hf_masked_greedy(tiny_hf, PROMPTS[0], 10, bias, 3, stops)
    assert len(got) == 4 and not stops & set(got[:3]) and got[3] == EOS
    assert outs[0].outputs[0].finish_reason == "stop" and neighbour == [EOS]
    # ignore_eos: EOS is neither masked nor a stop, and its bias wins every step
    ignore = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                          dataclasses.replace(sp, ignore_eos=True, max_tokens=5), use_tqdm=False)
    assert token_ids(ignore)[0] == [EOS] * 5
