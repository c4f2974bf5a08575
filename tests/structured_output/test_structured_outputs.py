"""Structured outputs (docs/API.md §3b): every output that stops satisfies its constraint.

The generation runs on a tiny random Llama with a byte-level tokenizer (`byte_llama`), whose
steps cost a fraction of SmolLM2's; SmolLM2's real BPE vocabulary (tokens that span JSON
punctuation) is checked here by a scan of its first-token masks, and end to end by the server's
test (tests/serving/test_serve.py) and the README's example.

Truths: the `jsonschema` package validates JSON outputs, `re.fullmatch` regex outputs, a
brute-force scan of the vocabulary the first-token masks, transformers' logits the frequencies of
sampled choices, numpy the device bitmask, and the engine's own unconstrained greedy run the free
rows of a mixed batch.
"""
from __future__ import annotations

import json
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import BASE, hf_float32, no_leaks, step_compiles
from minivllm_jax import LLM, SamplingParams, StructuredOutputsParams
from minivllm_jax.loader import LoadedModel, load_model
from minivllm_jax.sampling.sampler import SamplingTensors, apply_token_bitmask, sample
from minivllm_jax.structured_output.manager import StructuredOutputManager
from scheduler import InvalidFieldError

jsonschema = pytest.importorskip("jsonschema")

# held-out schemas: nested objects, enums in arrays with min/max items, bounded numbers, patterns
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "palette": {"type": "object", "additionalProperties": False, "required": ["colors"],
                "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                          "items": {"type": "string", "enum": ["red", "green", "blue"]}}}},
    "player": {"type": "object", "additionalProperties": False, "required": ["age", "score", "level"],
               "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                              "score": {"type": "number", "minimum": 0, "maximum": 1},
                              "level": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}}},
    "ticket": {"type": "object", "additionalProperties": False, "required": ["id", "open"],
               "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                              "open": {"type": "boolean"}}},
}
REGEXES = {"date": r"\d{4}-\d{2}-\d{2}", "email": r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)",
           "identifier": r"[A-Za-z_][A-Za-z0-9_]{0,15}"}
# a Lark grammar: a sum of small numbers, e.g. "3+14+7"
LARK = 'start: num ("+" num)*\nnum: /[1-9][0-9]?/'
LARK_REGEX = r"[1-9][0-9]?(\+[1-9][0-9]?)*"
FREE = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
SAMPLES = 20


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_bitmask_on_the_device_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word's high bits are padding
    mask = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, np.where(bits, logits, -np.inf))
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits.T), jnp.asarray(mask), vocab_major=True))
    np.testing.assert_array_equal(got, np.where(bits, logits, -np.inf).T)
    # before logit_bias: a bias cannot bring back a masked token, and greedy takes the best allowed
    best_masked = np.where(bits, -np.inf, logits).argmax(axis=1)
    params = SamplingTensors(temperature=jnp.zeros(3), top_k=jnp.zeros(3, jnp.int32),
                             top_p=jnp.ones(3), min_p=jnp.zeros(3), seed=jnp.zeros(3, jnp.int32),
                             step=jnp.zeros(3, jnp.int32), bias_ids=jnp.asarray(best_masked[:, None], jnp.int32),
                             bias_values=jnp.full((3, 1), 100.0), token_bitmask=jnp.asarray(mask))
    for vocab_major in (False, True):
        x = jnp.asarray(logits.T if vocab_major else logits)
        np.testing.assert_array_equal(np.asarray(sample(x, params, vocab_major)),
                                      np.where(bits, logits, -np.inf).argmax(axis=1))


def test_params_validation() -> None:
    for bad in (dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice="ab"),
                dict(json="{not json"), dict(json=[1]), dict(regex=""), dict(json_object=False, grammar=3)):
        with pytest.raises(InvalidFieldError) as e:
            StructuredOutputsParams(**bad)
        assert e.value.field == "structured_outputs"
    with pytest.raises(InvalidFieldError, match="guided_json"):
        StructuredOutputsParams.from_dict({"jsn": {}}, field="guided_json")
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.key == b.key and a.json == b.json
    sp = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert sp.structured_outputs == StructuredOutputsParams(choice=("x", "y"))


def test_first_token_masks_match_a_vocabulary_scan(tokenizer: Any) -> None:
    """The allowed first tokens of a choice and of a regex are exactly the tokens whose text is
    a non-empty prefix of a string of the language; EOS only once complete."""
    vocab = len(tokenizer)
    texts = tokenizer.batch_decode([[t] for t in range(vocab)])
    special = set(tokenizer.all_special_ids)
    manager = StructuredOutputManager(tokenizer, vocab, [2])
    choices = ["yes", "no", "not sure"]
    for name, params, ok in (
            ("choice", StructuredOutputsParams(choice=choices), lambda s: any(c.startswith(s) for c in choices)),
            ("regex", StructuredOutputsParams(regex=r"[0-9]{3}"), lambda s: re.fullmatch(r"[0-9]{1,3}", s))):
        manager.add(name, params)
        mask, failed = manager.bitmask([name, "free"], 2)
        assert failed == {}
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
        want = np.array([t not in special and texts[t] != "" and bool(ok(texts[t])) for t in range(vocab)])
        np.testing.assert_array_equal(bits[0], want, err_msg=name)
        assert bits[1].all()  # an unconstrained row allows everything
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert manager.advance("choice", yes) is None
    bits = np.unpackbits(manager.bitmask(["choice"], 1)[0].view(np.uint8), bitorder="little")[:vocab]
    assert np.nonzero(bits)[0].tolist() == [2]  # "yes" is complete and nothing extends it
    assert manager.advance("choice", [*yes, 2]) is None
    assert "refused" in manager.advance("regex", tokenizer.encode("x", add_special_tokens=False))
    with pytest.raises(InvalidFieldError, match="structured_outputs.regex cannot be compiled"):
        manager.prepare(StructuredOutputsParams(regex="([0-9]"))
    manager.close()


def _check(text: str, truth: dict[str, Any] | str) -> None:
    """A stopped output against its constraint: a schema (compact JSON) or a regex."""
    if isinstance(truth, dict):
        jsonschema.validate(json.loads(text), truth)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact
    else:
        assert re.fullmatch(truth, text), (truth, text)


def _check_all(jobs: list[tuple[Any, SamplingParams, Any]], outs: list[Any]) -> float:
    """Every stopped output of each job satisfies it, a greedy one stops, the others stop or
    reach max_tokens; returns the share that stopped."""
    stopped = total = 0
    for (_, sp, truth), out in zip(jobs, outs):
        for c in out.outputs:
            total += 1
            if c.finish_reason != "stop":
                assert c.finish_reason == "length" and len(c.token_ids) == sp.max_tokens, c
                continue
            stopped += 1
            _check(c.text, truth)
        if sp.is_greedy:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0]
    return stopped / total


def _no_leaks(llm: LLM) -> None:
    no_leaks(llm)
    assert not llm.engine.structured


def test_a_tokenizer_llguidance_cannot_read_is_refused(tiny_model: Any, backend: str) -> None:
    """The tiny Llama's word-level tokenizer has no decoder llguidance knows."""
    engine = LLM(tiny_model, attention_backend=backend, **BASE).engine
    with pytest.raises(InvalidFieldError, match="not supported with this model's tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["t5"])))
    assert not engine.has_unfinished_requests()


# ---- a tiny random Llama whose tokens are the 256 bytes (ids 3..258; 0 unk, 1 bos, 2 eos) ----
@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory: pytest.TempPathFactory, make_tiny_llama: Any) -> str:
    pytest.importorskip("transformers")
    from tiny_configs import save_byte_tokenizer

    out = make_tiny_llama(tmp_path_factory.mktemp("byte_llama"), seed=3, vocab_size=259)
    save_byte_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def byte_model(byte_llama: str) -> LoadedModel:
    return load_model(byte_llama, dtype="float32")


@pytest.fixture(scope="module")
def byte_hf(byte_llama: str) -> Any:
    """transformers' load of the same checkpoint: the oracle of its probabilities."""
    pytest.importorskip("transformers")
    return hf_float32(byte_llama)


def _next_token_probs(hf: Any, prompt: list[int]) -> np.ndarray:
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()


def test_samples_of_every_schema_and_free_rows(byte_model: LoadedModel, backend: str) -> None:
    """SAMPLES at temperature 1 and a greedy one per schema, regexes and a Lark grammar sampled,
    beside free greedy rows, which equal their run alone."""
    llm = LLM(byte_model, attention_backend=backend, **BASE)
    tok = byte_model.tokenizer
    jobs: list[tuple[Any, SamplingParams, Any]] = []
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams(json=schema)
        prompt = {"prompt_token_ids": tok.encode(f"A {name}: ")}
        jobs.append((prompt, SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=so), schema))
        jobs += [(prompt, SamplingParams(temperature=1.0, seed=seed, n=4, max_tokens=96,
                                         structured_outputs=so), schema) for seed in range(SAMPLES // 4)]
    for name, pattern in {**REGEXES, "sum": LARK}.items():
        so = StructuredOutputsParams(grammar=LARK) if name == "sum" else StructuredOutputsParams(regex=pattern)
        jobs.append(({"prompt_token_ids": tok.encode(f"A {name}: ")}, SamplingParams(
            temperature=1.0, seed=3, n=4, max_tokens=32, structured_outputs=so),
            LARK_REGEX if name == "sum" else pattern))
    free = [{"prompt_token_ids": tok.encode(p)} for p in FREE]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    alone = llm.generate(free, greedy, use_tqdm=False)
    outs = llm.generate([j[0] for j in jobs] + free, [j[1] for j in jobs] + [greedy] * len(free), use_tqdm=False)
    assert _check_all(jobs, outs) >= 0.8
    assert [o.outputs[0].token_ids for o in outs[len(jobs):]] == [o.outputs[0].token_ids for o in alone]
    _no_leaks(llm)


def test_preempted_requests_still_satisfy_their_schema(byte_model: LoadedModel, backend: str) -> None:
    """Outputs of ~82 tokens (20 three-digit numbers, a byte a digit) in a pool of 23 blocks of 16
    tokens, 7 blocks a request at the end: requests are preempted mid-output and recomputed, and
    their matchers keep their output tokens."""
    llm = LLM(byte_model, attention_backend=backend, **{**BASE, "num_kv_blocks": 24})
    schema = {"type": "array", "minItems": 20, "maxItems": 20,
              "items": {"type": "integer", "minimum": 100, "maximum": 999}}
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 259, 16).tolist()} for _ in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=11, max_tokens=112,
                                                structured_outputs=StructuredOutputsParams(json=schema)),
                        use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0
    _no_leaks(llm)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        _check(o.outputs[0].text, schema)


def test_min_tokens_stop_strings_logprobs_and_abort(byte_model: LoadedModel, byte_hf: Any,
                                                    backend: str) -> None:
    """The constraint wins over min_tokens (EOS once it is complete, as often as min_tokens
    asks: the scheduler ends the request there); a stop string cuts a constrained output only
    where the cut output satisfies the constraint, and is passed over elsewhere; logprobs are
    the raw model's; an abort frees the matcher."""
    llm = LLM(byte_model, attention_backend=backend, **BASE)
    tok = byte_model.tokenizer
    prompt = tok.encode("Answer: ")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, [
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=8, logprobs=2, structured_outputs=choice),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, stop=["-"],
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}(-[a-z]{3})?")),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12, structured_outputs=choice),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, stop=["-"],
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[a-z]{3}"))],
        use_tqdm=False)
    first, cut, sampled, passed = (o.outputs[0] for o in outs)
    assert first.finish_reason == "stop" and first.text in ("yes", "no")
    assert first.token_ids[-1] == 2 and len(first.token_ids) == 6  # EOS until min_tokens
    raw = np.log(_next_token_probs(byte_hf, prompt))
    assert first.logprobs[0][first.token_ids[0]].logprob == pytest.approx(raw[first.token_ids[0]], abs=1e-4)
    assert cut.finish_reason == "stop" and cut.stop_reason == "-" and re.fullmatch("[a-z]{3}", cut.text)
    # "abc" does not match [a-z]{3}-[a-z]{3}: the "-" there is no stop, the output goes on
    assert passed.finish_reason == "stop" and passed.stop_reason is None, passed
    assert re.fullmatch(r"[a-z]{3}-[a-z]{3}", passed.text), passed.text
    assert sampled.finish_reason == "stop" and sampled.text in ("yes", "no")
    compiled: list[list[str]] = []
    for pattern in (r"[0-9]+", r"[a-f]+", r"x|yy"):  # the first may compile; others reuse it
        with step_compiles() as seen:
            again = llm.generate([{"prompt_token_ids": prompt}] * 3, [SamplingParams(
                temperature=1.0, seed=s, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=pattern))
                for s in range(3)], use_tqdm=False)
        compiled.append(seen)
        assert all(re.fullmatch(pattern, o.outputs[0].text) for o in again if o.outputs[0].finish_reason == "stop")
    assert compiled[1:] == [[], []]
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["person"])))
    engine.step()
    assert len(engine.structured) == 1
    engine.abort_request(rid)
    assert [d.finished for d in engine.step()] == [True] and not engine.has_unfinished_requests()
    _no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_choice_frequencies_follow_the_model(byte_model: LoadedModel, byte_hf: Any, backend: str,
                                             async_scheduling: bool) -> None:
    """A choice is decided by its first byte (the choices start with distinct letters), so its
    frequency at temperature 1 is the model's probability of that byte over the three:
    transformers' logits give it. With async scheduling the engine also speculates: constrained
    rows get no drafts, and free greedy rows beside them, which do, equal plain decoding's."""
    tok = byte_model.tokenizer
    prompt = tok.encode("Pick one: ")
    p = _next_token_probs(byte_hf, prompt)
    letters = sorted("abcdefghijklmnopqrstuvwxyz", key=lambda c: -p[tok.encode(c)[0]])[:3]
    choices = [c + "ok" for c in letters]
    probs = np.array([p[tok.encode(c)[0]] for c in letters])
    probs /= probs.sum()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if async_scheduling else None
    llm = LLM(byte_model, attention_backend=backend, async_scheduling=async_scheduling,
              speculative_config=spec, **BASE)
    so = StructuredOutputsParams(choice=choices)
    params = [SamplingParams(temperature=1.0, seed=s, n=8, max_tokens=8, structured_outputs=so) for s in range(40)]
    free = [{"prompt_token_ids": tok.encode(t * 6)} for t in ("abc ", "xyz ", "12 ")] if spec else []
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params) + free,
                        params + [greedy] * len(free), use_tqdm=False)
    if spec:
        plain = LLM(byte_model, attention_backend=backend, **BASE).generate(free, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[len(params):]] == [o.outputs[0].token_ids for o in plain]
        assert llm.get_stats()["spec_num_drafts"] > 0
        outs = outs[:len(params)]
    texts = [c.text for o in outs for c in o.outputs]
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    counts = np.array([texts.count(c) for c in choices])
    assert counts.sum() == len(texts) == 320
    chi2 = float((((counts - len(texts) * probs) ** 2) / (len(texts) * probs)).sum())
    assert chi2 < 13.8, (counts, probs)  # chi-square, 2 degrees of freedom, p = 0.001
    _no_leaks(llm)


def test_bad_constraints_are_refused_when_added(byte_model: LoadedModel, backend: str) -> None:
    engine = LLM(byte_model, attention_backend=backend, **BASE).engine
    for bad in (StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(json={"type": "nonsense"}),
                StructuredOutputsParams(grammar="start: undefined_rule"),
                StructuredOutputsParams(json={"type": "string", "pattern": "[z-a]"})):
        with pytest.raises(InvalidFieldError, match="structured_outputs") as e:
            engine.add_request([1, 2, 3], SamplingParams(structured_outputs=bad))
        assert e.value.field == "structured_outputs"
    assert not engine.has_unfinished_requests() and not engine.structured


# ---- constraints that must not crash, fail or freeze the engine --------------------------------
def _deep_lark(depth: int) -> str:
    """A grammar of `depth` rules, each the next one or "x": llguidance overflows its stack
    compiling 3,000 of them (a segfault of its process; 60 KB, under the size limit)."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(depth)) + f'r{depth}: "y"\n'


# constraint -> the words its refusal must hold (the truth: what each is, read by hand)
HOSTILE = [
    (dict(grammar=_deep_lark(3000)), "crashed"),
    (dict(json={"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                "required": ["x"]}}, "$ref": "#/$defs/a"}), "admits no finite value"),
    (dict(json={"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/b"}}, "required": ["x"]},
                          "b": {"type": "object", "properties": {"y": {"$ref": "#/$defs/a"}}, "required": ["y"]}},
                "$ref": "#/$defs/a"}), "admits no finite value"),
    (dict(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}),
     "the limit is 65,536"),
    (dict(json='{"const": 1e999}'), "cannot carry"),
    (dict(json={"enum": [2 ** 100]}), "cannot carry"),
    (dict(regex=r"[^\s\S]"), "admits no complete output"),
    (dict(grammar='start: a\na: a "x"\n'), "admits no complete output"),
    (dict(grammar='start: <[2]> "a"\n'), "end-of-sequence token inside"),  # the byte model's EOS
    (dict(regex="a{1000000}"), "exceeds a limit"),
    (dict(regex="(a|aa){1000}"), "exceeds a limit"),
]


def test_hostile_constraints_are_refused_before_anything_is_scheduled(byte_model: LoadedModel,
                                                                        backend: str) -> None:
    """Each constraint of HOSTILE, beside a good request in one generate(), raises ValueError
    naming structured_outputs and why before anything is added (the grammar library's crash
    happens in its worker process); the engine then serves a constrained batch, and nothing
    leaks."""
    llm = LLM(byte_model, attention_backend=backend, **BASE)
    tok = byte_model.tokenizer
    good = SamplingParams(temperature=0.0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    prompt = {"prompt_token_ids": tok.encode("Answer: ")}
    for fields, words in HOSTILE:
        with pytest.raises(ValueError, match="structured_outputs") as e:
            llm.generate([prompt, prompt], [good, SamplingParams(
                max_tokens=8, structured_outputs=StructuredOutputsParams(**fields))], use_tqdm=False)
        assert isinstance(e.value, InvalidFieldError) and e.value.field == "structured_outputs"
        assert words in str(e.value), (fields if len(str(fields)) < 200 else words, str(e.value))
        assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([prompt] * 4, good, use_tqdm=False)
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"}
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    _no_leaks(llm)


def test_a_constraint_that_dead_ends_ends_its_request_alone(byte_model: LoadedModel,
                                                            backend: str) -> None:
    """A grammar that needs EOS in its middle ("a", EOS, "b") can begin, so it is admitted; after
    "a" nothing it allows can be generated (EOS ends an output only where the constraint is
    complete): that request ends alone with finish_reason "error" and the reason, and the
    others of the batch finish as a batch without it would. So does a stop token id the
    constraint needs in its middle, and a 2,000-rule chain (it compiles, but consuming its
    first token trips the grammar engine's per-row limit)."""
    llm = LLM(byte_model, attention_backend=backend, **BASE)
    tok = byte_model.tokenizer
    prompt = {"prompt_token_ids": tok.encode("Answer: ")}
    good = SamplingParams(temperature=0.0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    dash = tok.encode("-")[0]
    bad = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
               grammar='start: "a" <[2]> "b"\n')),
           SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[dash],
                          structured_outputs=StructuredOutputsParams(regex="x-y")),
           SamplingParams(temperature=0.0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(grammar=_deep_lark(2000)))]
    alone = llm.generate([prompt] * 2, good, use_tqdm=False)
    outs = llm.generate([prompt] * 5, [good, bad[0], good, bad[1], bad[2]], use_tqdm=False)
    for i, words in ((1, "allows no token"), (3, "allows no token"), (4, "per-token limit")):
        out = outs[i].outputs[0]
        assert out.finish_reason == "error", out
        assert out.stop_reason.startswith("structured_outputs: generation stopped"), out.stop_reason
        assert words in out.stop_reason, out.stop_reason
    assert outs[1].outputs[0].text == "a" and outs[3].outputs[0].text == "x"
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in alone]
    _no_leaks(llm)


def test_thousands_of_choices_with_n_samples(byte_model: LoadedModel, backend: str) -> None:
    """4,000 choices (a regex alternation: a grammar alternation that wide fails its parser's
    row limit) with n=6 at temperature 1: every sample stops on one of them."""
    llm = LLM(byte_model, attention_backend=backend, **BASE)
    choices = [f"w{i}" for i in range(4000)]
    out, = llm.generate([{"prompt_token_ids": byte_model.tokenizer.encode("Pick: ")}], SamplingParams(
        temperature=1.0, seed=4, n=6, max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert len(out.outputs) == 6
    assert all(c.finish_reason == "stop" and c.text in set(choices) for c in out.outputs), out.outputs
    _no_leaks(llm)


def test_more_distinct_grammars_than_the_cache_holds(byte_model: LoadedModel, backend: str) -> None:
    """300 requests, each with a choice of its own, more than MAX_CACHED_GRAMMARS: each stops on
    one of its own choices, the cache keeps at most its size, and nothing leaks."""
    from minivllm_jax.structured_output.manager import MAX_CACHED_GRAMMARS

    llm = LLM(byte_model, attention_backend=backend, **BASE)
    prompt = {"prompt_token_ids": byte_model.tokenizer.encode("Pick: ")}
    count = MAX_CACHED_GRAMMARS + 44
    choices = [[f"a{i}", f"b{i}"] for i in range(count)]
    outs = llm.generate([prompt] * count, [SamplingParams(
        temperature=1.0, seed=i, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=c))
        for i, c in enumerate(choices)], use_tqdm=False)
    for out, c in zip(outs, choices):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in c, (c, out.outputs[0])
    assert len(llm.engine.structured._grammars) == MAX_CACHED_GRAMMARS
    _no_leaks(llm)


def test_grammar_worker_survives_crashes_and_time_limits(byte_model: LoadedModel) -> None:
    """The child process that compiles constraints first: a compile over its time limit is
    killed and answered with the limit, a crash of the library with "crashed"; either way the
    next check runs in a new child and succeeds (its process id changes)."""
    from minivllm_jax.structured_output.grammar_worker import GrammarWorker
    from minivllm_jax.structured_output.manager import PARSER_LIMITS, StructuredOutputManager

    manager = StructuredOutputManager(byte_model.tokenizer, 259, [2])
    manager.tokenizer  # noqa: B018 - builds the tokenizer JSON the worker takes
    worker = GrammarWorker(manager._tokenizer_json, 259, [2], PARSER_LIMITS, timeout_s=0.05)
    ok = StructuredOutputsParams(choice=["x", "y"])
    assert worker.check(ok).error is None
    pids = [worker._proc.pid]
    slow = worker.check(StructuredOutputsParams(regex="a{1000000}"))  # ~1 s of lexer work
    assert "longer than the limit of 0.05 s" in slow.error and slow.seconds < 1.0, slow
    worker.timeout_s = 30.0
    assert worker.check(ok).error is None
    pids.append(worker._proc.pid)
    assert "crashed" in worker.check(StructuredOutputsParams(grammar=_deep_lark(3000))).error
    assert worker.check(ok).error is None
    pids.append(worker._proc.pid)
    assert len(set(pids)) == 3
    worker.close()
    assert worker._proc is None
