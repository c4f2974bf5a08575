"""Validation of SamplingParams, SchedulerConfig and add_request: bad input names the field."""
from __future__ import annotations

import sys

import pytest

from scheduler import (InvalidFieldError, InvalidFieldTypeError, Request, RequestStatus,
                       SamplingParams, Scheduler, SchedulerConfig)


def test_sampling_params_defaults_match_contract() -> None:
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.min_tokens, tuple(sp.stop_token_ids),
            sp.ignore_eos, sp.seed, sp.stop, sp.include_stop_str_in_output) == \
        (1.0, 1.0, 0, 16, 0, (), False, None, None, False)
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(logit_bias={"5": 1, 7: -100.0}).logit_bias == {5: 1.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    sp = SamplingParams(n=3, logprobs=0, prompt_logprobs=20, repetition_penalty=0.5,
                        presence_penalty=-2, frequency_penalty=2)
    assert (sp.n, sp.logprobs, sp.prompt_logprobs) == (3, 0, 20) and sp.has_penalties
    assert not SamplingParams().has_penalties
    assert SamplingParams(temperature=0, stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p="0.1"), "min_p"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1.5: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: "2"}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=3.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (dict(n=0), "n"),
    (dict(n=2.0), "n"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
])
def test_sampling_params_reject(kwargs: dict, field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=field) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, InvalidFieldError) and e.value.field == field  # no message parsing


def test_invalid_field_error_is_a_value_error_naming_its_field() -> None:
    """A wrong type is a TypeError as well; the field survives pickling; the message is as given."""
    import pickle

    with pytest.raises(TypeError) as e:
        SamplingParams(top_k=2.0)
    assert isinstance(e.value, InvalidFieldTypeError) and isinstance(e.value, ValueError)
    assert str(e.value).startswith("top_k must be an int")
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias={1: 100.5})
    assert not isinstance(e.value, TypeError) and e.value.field == "logit_bias"
    again = pickle.loads(pickle.dumps(InvalidFieldTypeError("seed", "seed must be an int")))
    assert (type(again), again.field, str(again)) == (InvalidFieldTypeError, "seed", "seed must be an int")


def test_scheduler_config_default_and_valid() -> None:
    cfg = SchedulerConfig()
    assert cfg.num_blocks - 1 >= -(-cfg.max_model_len // cfg.block_size)
    Scheduler(cfg)
    SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2, max_model_len=64, block_size=16, num_blocks=5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024), "max_model_len"),
    (dict(enable_chunked_prefill=False, long_prefill_token_threshold=64), "long_prefill_token_threshold"),
    (dict(max_model_len=64, block_size=16, num_blocks=4), "num_blocks"),
    (dict(policy="lifo"), "policy"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=2.0), "max_num_seqs"),
    (dict(max_model_len=True), "max_model_len"),
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching"),
    (dict(hash_algo="md5"), "hash_algo"),
])
def test_scheduler_config_reject(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_xxhash_config_needs_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ValueError, match="xxhash"):
        SchedulerConfig(hash_algo="xxhash")


def _sched() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                                     block_size=4, num_blocks=20))


@pytest.mark.parametrize("prompt, field", [
    ([], "prompt_token_ids"),
    (list(range(32)), "max_model_len"),
    ([1, -3], "prompt_token_ids"),
    ([1, 2.0], "prompt_token_ids"),
    ([1, True], "prompt_token_ids"),
    ([1, "2"], "prompt_token_ids"),
])
def test_add_request_rejects_bad_prompts(prompt: list, field: str) -> None:
    s = _sched()
    with pytest.raises(ValueError, match=field):
        s.add_request(Request("r", prompt, SamplingParams()))
    assert not s.has_unfinished_requests() and len(s.waiting) == 0


def test_add_request_rejects_duplicates_and_reuse() -> None:
    s = _sched()
    s.add_request(Request("r", list(range(31)), SamplingParams()))  # max_model_len - 1 is fine
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(Request("r", [1], SamplingParams()))
    with pytest.raises(TypeError, match="request_id"):
        s.add_request(Request(5, [1], SamplingParams()))
    done = Request("d", [1], SamplingParams())
    done.status = RequestStatus.FINISHED_ABORTED
    with pytest.raises(ValueError, match="fresh"):
        s.add_request(done)
    assert s.get_num_unfinished_requests() == 1


def test_request_attributes_and_status_helpers() -> None:
    r = Request("x", [1, 2, 3], SamplingParams(), eos_token_id=2, priority=3, cache_salt="s")
    assert (r.num_tokens, r.num_prompt_tokens, r.num_computed_tokens, r.status, r.num_preemptions,
            r.stop_reason, r.block_hashes, r.output_token_ids) == (3, 3, 0, RequestStatus.WAITING, 0, None, [], [])
    assert isinstance(r.arrival_time, float)
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6] and r.output_token_ids == [4, 5, 6] and r.num_tokens == 6
    assert [RequestStatus.is_finished(s) for s in RequestStatus] == [False] * 3 + [True] * 4
    assert [RequestStatus.get_finished_reason(s) for s in RequestStatus] == [
        None, None, None, "stop", "length", "abort", "error"]


def test_scheduler_package_does_not_import_jax_or_numpy() -> None:
    import subprocess

    code = "import sys, scheduler; print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
