"""Admission: the one place where a tokenized request is checked against an engine and made into
scheduler requests (vLLM V1's input processor). The prompt's own rules are `prompts.py`'s.

- `Admission.check` raises what `LLMEngine.add_request` would refuse: an `InvalidFieldError`
  (`InvalidFieldTypeError` for a wrong type) whose `field` names the argument or SamplingParams
  field, or a plain ValueError for a feature this engine lacks. It accepts exactly the requests
  `requests` can build.
- A request of `n` samples is `n` scheduler requests, ids `sample_ids(request_id, n)`; sample 0
  (the lead) computes the prompt, and its prompt logprobs, once for every sample; the others
  fork from it. A model's EOS ids past the first are stop tokens of every request that does not
  ignore EOS.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence

from minivllm_jax.engine_spec import EngineSpec
from minivllm_jax.engine.prompts import check_token_ids
from minivllm_jax.structured_output.manager import StructuredOutputManager
from scheduler import Request, SamplingParams
from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.request import INT64_MAX, INT64_MIN, MAX_STOP_TOKEN_IDS


def sample_ids(request_id: str, n: int) -> list[str]:
    """The scheduler request ids of a request's `n` samples."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def request_id_list(request_ids: object) -> list[str]:
    """A str or an iterable of str (an abort's argument) as a list; TypeError else."""
    if isinstance(request_ids, str):
        return [request_ids]
    if isinstance(request_ids, Iterable) and not isinstance(request_ids, (bytes, dict)):
        ids = list(request_ids)
        if all(isinstance(i, str) for i in ids):
            return ids
    raise TypeError(f"request_ids must be a str or an iterable of str, got "
                    f"{type(request_ids).__name__}")


@dataclass(frozen=True)
class Admission:
    """An engine's admission rules. `multi_host`: the run has a step header (no penalties,
    prompt logprobs or constraints there); `structured`: None when the model has no tokenizer
    (no constraint possible)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    scheduling_policy: str
    multi_host: bool
    structured: StructuredOutputManager | None

    @classmethod
    def of(cls, spec: EngineSpec, structured: StructuredOutputManager | None) -> Admission:
        """The rules of an engine built from `spec`."""
        m, c = spec.model_config, spec.config
        return cls(m.vocab_size, c.max_model_len, tuple(m.eos_token_ids), c.scheduling_policy,
                   spec.plan.multi_host, structured)

    def check(self, prompt_token_ids: Sequence[int], sampling_params: object,
              priority: object = 0) -> None:
        """Besides SamplingParams' own bounds (checked again: a frozen value can be forced) and
        the prompt's rules (`prompts.check_token_ids`: ids within the vocabulary, shorter than
        max_model_len), the bounds of this engine: top_k at most the vocabulary, stop and bias
        ids in it, at most MAX_STOP_TOKEN_IDS stop ids with the other EOS ids, and a
        `structured_outputs` constraint that compiles for this tokenizer. `n` may exceed
        max_num_seqs: its samples then run in waves."""
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidFieldTypeError("sampling_params", "sampling_params must be a SamplingParams, "
                                                           f"got {type(sampling_params).__name__}")
        sp = sampling_params
        self.check_priority(priority)
        dataclasses.replace(sp)
        vocab = self.vocab_size
        check_token_ids(prompt_token_ids, vocab, self.max_model_len)
        if sp.top_k > vocab:
            raise InvalidFieldError("top_k", f"top_k must be at most the vocabulary size {vocab} "
                                             f"(or 0 / -1: off), got {sp.top_k}")
        for name, tokens in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", sp.logit_bias or ())):
            unknown = [t for t in tokens if t >= vocab]
            if unknown:
                raise InvalidFieldError(name, f"{name} has token ids outside the vocabulary "
                                              f"[0, {vocab}): {unknown[:5]}")
        eos = self.eos_token_ids
        if not sp.ignore_eos and len({*sp.stop_token_ids, *eos[1:]}) > MAX_STOP_TOKEN_IDS:
            raise InvalidFieldError("stop_token_ids", f"stop_token_ids with this model's other EOS "
                                                      f"ids {list(eos[1:])} are more than {MAX_STOP_TOKEN_IDS}")
        if self.multi_host and (sp.has_penalties or sp.prompt_logprobs is not None
                                or sp.structured_outputs is not None):
            raise ValueError("penalties, prompt_logprobs and structured_outputs are not supported "
                             "in multi-host runs")
        if sp.structured_outputs is not None:
            if self.structured is None:
                raise InvalidFieldError("structured_outputs", "structured_outputs needs a tokenizer, "
                                                              "and this model was loaded without one")
            self.structured.prepare(sp.structured_outputs)

    def check_priority(self, priority: object) -> None:
        """`priority`: an int of 64 bits, 0 unless the scheduling policy is "priority"."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise InvalidFieldTypeError("priority", f"priority must be an int, got {type(priority).__name__}")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidFieldError("priority", f"priority must fit in 64 bits, got {priority}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidFieldError("priority", f"priority={priority} needs scheduling_policy="
                                                f"'priority' (this engine's is {self.scheduling_policy!r})")

    def requests(self, request_id: str, ids: list[int], params: SamplingParams,
                 priority: int) -> list[Request]:
        """The scheduler requests of a checked request, one per sample, lead first."""
        eos = self.eos_token_ids
        if len(eos) > 1 and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(
                (*params.stop_token_ids, *eos[1:]))))
        n, lead, out = params.n, None, []
        for index, sample_id in enumerate(sample_ids(request_id, n)):
            sp = params if index == 0 else dataclasses.replace(params, prompt_logprobs=None)
            request = Request(sample_id, ids, sp, eos_token_id=eos[0] if eos else None,
                              priority=priority, fork_of=lead,
                              parent_id=request_id if n > 1 else None, sample_index=index)
            lead = lead or request
            out.append(request)
        return out
