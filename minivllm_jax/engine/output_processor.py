"""The output processor: a step's sampled tokens in, the callers' deltas out (vLLM V1's
OutputProcessor): detokenizing, stop strings, logprobs, and each sample's and request's end.

Invariants:
- A sample is in `tracked` (by scheduler request id) from its registration until its final
  delta is made; a request is in `parents` (by the caller's id) until its last sample's is.
  The request's RequestOutput comes with the delta of its last sample to end.
- `pending` holds deltas made outside a step (aborts, failures, requeued ones); `process` returns
  them first, then the step's, and empties it only when it returns.
- Logprobs are kept per sample in token order, and prompt logprobs per position, so a preempted
  and recomputed prompt rewrites the same entries.
- A stop string inside a verified speculative run cuts the run there: the request's tokens after
  it are dropped before the scheduler finishes it (stopped).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

from minivllm_jax.engine.admission import sample_ids
from minivllm_jax.engine.detokenizer import IncrementalDetokenizer
from minivllm_jax.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, StepDelta
from minivllm_jax.worker.runner import StepResult, TokenLogprobs
from minivllm_jax.structured_output.manager import StructuredOutputManager
from scheduler import Request, RequestStatus, Scheduler


@dataclass
class Parent:
    """A caller's request: its prompt, its `n` samples (scheduler requests) and, when asked for,
    its prompt logprobs by position."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class Sample:
    """One sample of a request: its scheduler Request, detokenizer and, when asked for, the
    logprobs of its tokens; `final` once it ended."""

    request: Request
    parent: Parent
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    final: CompletionOutput | None = None
    error: str | None = None  # why its constraint ended it (finish_reason "error")


class OutputProcessor:
    """The engine's per-request output state. It finishes requests in the `scheduler` only for
    stop strings (the scheduler applies every other stop rule) and frees their matchers in
    `structured`."""

    def __init__(self, tokenizer: Any, scheduler: Scheduler,
                 structured: StructuredOutputManager | None) -> None:
        self.tokenizer, self.scheduler, self.structured = tokenizer, scheduler, structured
        self.tracked: dict[str, Sample] = {}  # by scheduler request id
        self.parents: dict[str, Parent] = {}  # by the caller's request id
        self.pending: list[StepDelta] = []
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs

    def new_samples(self, request_id: str, prompt: str | None, ids: list[int],
                    requests: list[Request]) -> tuple[Parent, list[Sample]]:
        """A request's parent and its samples (of `Admission.requests`), registered nowhere."""
        params = requests[0].sampling_params
        parent = Parent(request_id, prompt, ids)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(ids)
        samples = []
        for index, request in enumerate(requests):
            accepts = None
            if params.structured_outputs is not None:
                accepts = functools.partial(self.structured.accepts_text, request.request_id)
            samples.append(Sample(request, parent, index, IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, accepts),
                logprobs=None if params.logprobs is None else []))
        return parent, samples

    def register(self, sample: Sample) -> None:
        """Track one sample of `new_samples` (its parent with the first)."""
        sample.parent.samples.append(sample)
        self.parents[sample.parent.request_id] = sample.parent
        self.tracked[sample.request.request_id] = sample

    def forget(self, parent: Parent) -> None:
        """Undo the registration of `parent`'s samples, as if never registered."""
        for sample in parent.samples:
            if self.tracked.get(sample.request.request_id) is sample:
                del self.tracked[sample.request.request_id]
        if self.parents.get(parent.request_id) is parent:
            del self.parents[parent.request_id]

    def id_free(self, request_id: str, n: int) -> bool:
        """Whether a request of `n` samples may take this id (its samples' ids included): not
        while any of them runs, or while an output of it (an abort's included) waits in
        `pending`."""
        return (request_id not in self.parents
                and not any(i in self.tracked for i in sample_ids(request_id, n))
                and not any(d.request_id == request_id for d in self.pending))

    def has_unfinished(self) -> bool:
        """A request not finished, or a delta not returned."""
        return bool(self.parents) or bool(self.pending)

    def drop_pending(self, request_ids: Sequence[str]) -> None:
        """Drop the pending deltas of these requests (the caller gave up on them)."""
        dropped = set(request_ids)
        self.pending = [d for d in self.pending if d.request_id not in dropped]

    def unfinished_samples(self, parent_ids: Sequence[str]) -> list[str]:
        """The scheduler ids of these requests' samples that have not ended."""
        return [s.request.request_id for i in dict.fromkeys(parent_ids) if i in self.parents
                for s in self.parents[i].samples if s.final is None]

    def parent_ids(self, sample_ids: Sequence[str]) -> list[str]:
        """The callers' ids of the tracked ones of these samples."""
        return [self.tracked[r].parent.request_id for r in sample_ids if r in self.tracked]

    def process(self, result: StepResult | None) -> list[StepDelta]:
        """The pending deltas, then one per request of a step's sampled tokens."""
        deltas = [] if result is None else self._step_deltas(result)
        deltas, self.pending = self.pending + deltas, []
        return deltas

    def _step_deltas(self, result: StepResult) -> list[StepDelta]:
        for req_id, entries in result.prompt_logprobs.items():
            sample = self.tracked.get(req_id)
            if sample is not None:  # a recomputed prompt (preemption) writes the same values
                for pos, lp in entries:
                    sample.parent.prompt_logprobs[pos] = self._position_logprobs(
                        sample.parent.prompt_token_ids[pos], lp)
        deltas = []
        for req_id in result.tokens:
            sample = self.tracked.get(req_id)
            if sample is None:  # ended (stop string, abort) while this step was in flight
                continue
            # the tokens the scheduler took (a stop rule may end a verified run inside it)
            request, detok = sample.request, sample.detokenizer
            tokens = request.output_token_ids[len(detok.token_ids):]
            stop = detok.update(tokens)
            extra = len(request.output_token_ids) - len(detok.token_ids)
            if stop is not None and extra > 0:  # a stop string inside a verified run: cut there
                tokens = tokens[:len(tokens) - extra]
                del request.output_token_ids[-extra:], request.all_token_ids[-extra:]
            new_logprobs = None
            if sample.logprobs is not None:
                new_logprobs = [self._position_logprobs(t, lp)
                                for t, lp in zip(tokens, result.logprobs.get(req_id, ()))]
                sample.logprobs.extend(new_logprobs)
                sample.cumulative_logprob += sum(p[t].logprob for t, p in zip(tokens, new_logprobs))
            if stop is not None and not request.is_finished():
                self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED)
            if request.is_finished():
                deltas.append(self.finish(req_id, tokens, new_logprobs))
            else:
                deltas.append(StepDelta(sample.parent.request_id, list(tokens),
                                        detok.take_delta(False), False,
                                        index=sample.index, new_logprobs=new_logprobs))
        return deltas

    def end(self, sample_ids: list[str], status: RequestStatus, report: bool = True,
            uncache: bool = False) -> list[StepDelta]:
        """Finish these samples in the scheduler with `status` (`uncache`: their blocks lose
        their hashes, as `Scheduler.finish_requests` says); their final deltas, also queued in
        `pending` when `report`."""
        self.scheduler.finish_requests(sample_ids, status, uncache)
        deltas = [self.finish(i) for i in sample_ids]
        if report:
            self.pending.extend(deltas)
        return deltas

    def finish(self, req_id: str, new_tokens: Sequence[int] = (),
               new_logprobs: list[PositionLogprobs] | None = None) -> StepDelta:
        """The final delta of one sample, which the scheduler has finished."""
        sample = self.tracked.pop(req_id)
        if self.structured is not None:
            self.structured.remove(req_id)
        request, detok, parent = sample.request, sample.detokenizer, sample.parent
        reason = RequestStatus.get_finished_reason(request.status)
        stop_reason = detok.stop_reason if detok.stop_reason is not None else request.stop_reason
        if sample.error is not None:  # its constraint ended it: the reason, in words
            stop_reason = sample.error
        sample.final = CompletionOutput(
            sample.index, detok.output_text, list(request.output_token_ids), reason, stop_reason,
            sample.logprobs, sample.cumulative_logprob if sample.logprobs is not None else None)
        output = None
        if all(s.final is not None for s in parent.samples):
            del self.parents[parent.request_id]
            output = RequestOutput(parent.request_id, parent.prompt, list(parent.prompt_token_ids),
                                   [s.final for s in parent.samples], True, parent.prompt_logprobs)
        return StepDelta(parent.request_id, list(new_tokens), detok.take_delta(True),
                         output is not None, reason, output, sample.index, new_logprobs,
                         sample.error)

    def _position_logprobs(self, token: int, lp: TokenLogprobs) -> PositionLogprobs:
        """The chosen token's Logprob, then the top ones' (rank = their place), by token id."""
        out = {token: Logprob(lp.logprob, lp.rank, self._decode_token(token))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
            if tid not in out:
                out[tid] = Logprob(value, rank, self._decode_token(tid))
        return out

    def _decode_token(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text
