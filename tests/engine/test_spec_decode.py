"""Speculative decoding (n-gram prompt lookup) end to end: outputs with speculation against the
same requests without it (greedy and seeded sampling are token-identical, since verification
draws each position with the uniform plain sampling would use), stop rules inside a verified run,
max_tokens, aborts, preemption and chunked prefill, the metrics, and the distribution of a
sampled token against transformers' probabilities (chi-square); with and without async
scheduling.

The "chain" model is a tiny Llama whose layers add nothing (o_proj and down_proj are zero) and
whose LM head maps token t to logit 8 for its successor in one fixed cycle over tokens 3..255 and
about N(0, 1) for the rest: greedy output walks the cycle, so a prompt that holds the walk's
future gives prompt lookup drafts that are accepted, and at temperature 1 about 88 % of them.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from minivllm_jax import LLM, SamplingParams
from engine_helpers import BASE, TINY_PROMPTS, hf_float32, no_leaks, token_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
LONG = {**BASE, "max_model_len": 256, "num_kv_blocks": 96}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, make_tiny_llama: Callable[..., str]
          ) -> tuple[str, list[int]]:
    """(the chain model's directory, its cycle's order: token order[i] is followed by order[i+1])."""
    import torch

    path = make_tiny_llama(tmp_path_factory.mktemp("chain_llama"), seed=3)
    model = hf_float32(path)
    order = np.random.default_rng(0).permutation(np.arange(3, 256)).tolist()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        unit = torch.nn.functional.normalize(model.model.embed_tokens.weight, dim=-1)
        head = torch.zeros_like(model.lm_head.weight)
        for i, t in enumerate(order):  # successor s = order[i + 1] gets h_t . unit_t = 8 (rms norm)
            head[order[(i + 1) % len(order)]] = unit[t]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path, order


def _chain_prompts(order: list[int]) -> list[list[int]]:
    """Prompts whose greedy walk is in the prompt (lookup hits), others without it, long and short."""
    return [order[10:60] + order[30:33], order[100:104], order[5:9] * 4, order[200:230] + order[200:202],
            *TINY_PROMPTS[:3]]


@pytest.fixture(scope="module")
def engines(chain: tuple[str, list[int]]) -> tuple[LLM, LLM]:
    """The chain model's plain engine and a speculative one with async scheduling (LONG), shared
    by the tests here (test_preemption_abort_and_metrics and the SmolLM2 test speculate without
    async scheduling)."""
    return LLM(chain[0], **LONG), LLM(chain[0], **LONG, speculative_config=NGRAM, async_scheduling=True)


def _both(engines: tuple[LLM, LLM], prompts: list[Any], params: Any) -> tuple[Any, Any, dict[str, float]]:
    """Both engines' outputs, and the speculative one's spec_* counts over this call."""
    plain, spec = engines
    before = spec.get_stats()
    want, got = (llm.generate(prompts, params, use_tqdm=False) for llm in (plain, spec))
    after = spec.get_stats()
    counts = {k: after[k] - before[k] for k in after if k.startswith("spec_num")}
    return want, got, counts


def test_greedy_is_token_identical(chain: tuple[str, list[int]], engines: tuple[LLM, LLM]) -> None:
    """Greedy with speculation equals greedy without it on the chain model, for prompts with and
    without lookup hits, long ones chunked by BASE's 64-token steps (a random model's drafts,
    mostly rejected, are test_tensor_parallel.py's at tp=3)."""
    path, order = chain
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    plain, spec, counts = _both(engines, _chain_prompts(order), greedy)
    assert token_ids(spec) == token_ids(plain)
    assert token_ids(plain)[0][:20] == order[33:53]  # the model walks its cycle
    assert counts["spec_num_accepted_tokens"] > 30 and counts["spec_num_drafts"] > 10
    assert 0 < engines[1].get_stats()["spec_acceptance_rate"] <= 1
    no_leaks(engines[1])


def test_sampled_rows_match_plain_sampling(chain: tuple[str, list[int]], engines: tuple[LLM, LLM]) -> None:
    """Seeded sampling with temperature, top-p, min_tokens, logit_bias and a repetition penalty
    (counts that include each position's drafts) emits exactly what plain sampling emits."""
    path, order = chain
    prompts = _chain_prompts(order)
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=i,
                             repetition_penalty=1.0 + 0.5 * (i % 2), min_tokens=10 * (i % 3),
                             logit_bias={order[0]: 2.0} if i == 3 else None)
              for i in range(len(prompts))]
    plain, spec, counts = _both(engines, prompts, params)
    assert token_ids(spec) == token_ids(plain)
    assert counts["spec_num_accepted_tokens"] > 20
    no_leaks(engines[1])


def test_stops_inside_a_verified_run(chain: tuple[str, list[int]], engines: tuple[LLM, LLM]) -> None:
    """A stop token, a stop string or max_tokens falling inside one step's accepted tokens ends the
    request exactly where plain decoding does; logprobs come for every emitted token."""
    path, order = chain
    prompt = order[10:60] + order[30:33]  # greedy continues order[33], order[34], ...
    cases = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[order[40]]),
             SamplingParams(temperature=0.0, max_tokens=30, stop=[f"t{order[38]} t{order[39]}"]),
             SamplingParams(temperature=0.0, max_tokens=7, logprobs=2)]
    plain, spec, counts = _both(engines, [prompt] * 3, cases)
    for p, s in zip(plain, spec):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids
        assert (s.outputs[0].text, s.outputs[0].finish_reason) == (p.outputs[0].text, p.outputs[0].finish_reason)
    stop_token, stop_string, capped = (o.outputs[0] for o in spec)
    assert stop_token.token_ids == order[33:41] and stop_token.finish_reason == "stop"
    assert stop_string.token_ids == order[33:40] and stop_string.stop_reason == f"t{order[38]} t{order[39]}"
    assert capped.token_ids == order[33:40] and capped.finish_reason == "length"
    assert len(capped.logprobs) == 7
    for got, want in zip(capped.logprobs, plain[2].outputs[0].logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    assert counts["spec_num_accepted_tokens"] > 0
    no_leaks(engines[1])


def test_preemption_abort_and_metrics(chain: tuple[str, list[int]], engines: tuple[LLM, LLM]) -> None:
    """Under a KV pool too small for the batch (preemptions) the outputs are still plain
    decoding's (the shared plain engine's: greedy tokens do not depend on the pool); a request
    aborted between verified steps frees its blocks."""
    path, order = chain
    prompts = [order[i:i + 40] + order[i + 10:i + 12] for i in range(0, 120, 20)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    llm = LLM(path, **{**LONG, "num_kv_blocks": 20}, speculative_config=NGRAM)
    plain = engines[0].generate(prompts, greedy, use_tqdm=False)
    spec = llm.generate(prompts, greedy, use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    no_leaks(llm)
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm_jax.serving.metrics import ServerMetrics

    text = ServerMetrics("m").render(llm.engine.make_stats()).decode()
    scraped = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for name, key in (("drafts", "spec_num_drafts"), ("draft_tokens", "spec_num_draft_tokens"),
                      ("accepted_tokens", "spec_num_accepted_tokens")):
        assert scraped[f"vllm:spec_decode_num_{name}_total"] == stats[key] > 0
    engine = llm.engine
    rid = engine.add_request(prompts[0], greedy)
    other = engine.add_request(prompts[1], greedy)
    while len(engine.scheduler.requests[rid].output_token_ids) < 8:
        engine.step()
    engine.abort_request([rid])
    outs = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.finished:
                outs[d.request_id] = d
    assert outs[other].output.outputs[0].token_ids == token_ids(plain)[1]
    no_leaks(llm)


def test_chi_square_against_transformers(chain: tuple[str, list[int]], engines: tuple[LLM, LLM]) -> None:
    """The second generated token, where the first verification happens, sampled at temperature
    1 with top-p 0.9 and a repetition penalty over many seeds: its frequencies (given the most
    common first token) against transformers' probabilities, processed as vLLM does."""
    import torch
    from scipy import stats

    path, order = chain
    prompt = order[10:40] + order[20:22]
    # max_tokens 3: the first decode step verifies one draft, so the second token is drawn there
    params = [SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.3, max_tokens=3, seed=s)
              for s in range(400)]
    before = engines[1].get_stats()["spec_num_draft_tokens"]
    outs = [o.outputs[0].token_ids for o in engines[1].generate([prompt] * len(params), params, use_tqdm=False)]
    assert engines[1].get_stats()["spec_num_draft_tokens"] > before
    first = max(set(o[0] for o in outs), key=[o[0] for o in outs].count)
    seconds = [o[1] for o in outs if o[0] == first]
    model = hf_float32(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [first]])).logits[0, -1].double().numpy()
    seen = list(set(prompt + [first]))

    def nucleus(penalty: float) -> np.ndarray:
        x = logits.copy()
        x[seen] = np.where(x[seen] > 0, x[seen] / penalty, x[seen] * penalty)
        p = np.exp(x - x.max())
        p /= p.sum()
        ranked = np.argsort(-p, kind="stable")
        keep = ranked[:np.searchsorted(np.cumsum(p[ranked]), 0.9) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep] / p[keep].sum()
        return q

    def pvalue(q: np.ndarray) -> float:  # 0 when a token outside q's support was drawn
        if counts[q == 0].sum():
            return 0.0
        big = q * len(seconds) >= 5
        observed = np.append(counts[big], counts[~big].sum())
        expected = np.append(q[big], q[~big].sum()) * len(seconds)
        assert len(observed) >= 2
        return stats.chisquare(observed, expected).pvalue

    q = nucleus(1.3)
    counts = np.bincount(seconds, minlength=len(q))
    assert len(seconds) > 150 and np.count_nonzero(counts) >= 3
    assert pvalue(q) > 1e-3
    assert pvalue(nucleus(1.0)) < 1e-6  # the test can tell a missing penalty


def test_smollm2_grounded_prompts_are_token_identical(loaded_model: Any) -> None:
    """SmolLM2, greedy, a chat prompt that asks it to repeat a given text (prompt lookup hits):
    the same tokens and text with speculation, ended by a stop string inside a verified run."""
    text = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox "
            "runs into the forest.")
    chats = [[{"role": "user", "content": f"Repeat this text exactly:\n{text}"}]]
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["sun"])
    plain = LLM(loaded_model, **BASE).chat(chats, params, use_tqdm=False)
    llm = LLM(loaded_model, **BASE, speculative_config=NGRAM)
    spec = llm.chat(chats, params, use_tqdm=False)
    assert (spec[0].outputs[0].token_ids, spec[0].outputs[0].text) == (
        plain[0].outputs[0].token_ids, plain[0].outputs[0].text)
    assert spec[0].outputs[0].stop_reason == "sun" and spec[0].outputs[0].text.endswith("in the ")
    stats = llm.get_stats()
    assert stats["spec_num_accepted_tokens"] >= 8 and stats["spec_acceptance_rate"] > 0.3
    no_leaks(llm)
