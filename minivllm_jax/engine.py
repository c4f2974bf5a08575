"""LLMEngine: requests in, one scheduled and executed step at a time, deltas out.

Invariants:
- A model step is schedule -> dispatch -> collect -> update -> process outputs; the scheduler
  owns request state and stop-token rules, the runner owns device state, the engine owns
  detokenization and stop strings.
- With `async_scheduling` (by default on accelerators) one step stays in flight between calls,
  as in vLLM V1: a call schedules and dispatches step N+1 while step N still runs
  (decoding requests are scheduled on placeholders, their input ids forwarded on the device
  from step N's output), then collects step N, updates the scheduler and processes step N's
  outputs (detokenization, stop strings, deltas) while N+1 runs. So the device always has the
  next step queued, and none of the host's work (scheduling, input preparation, output
  processing, the caller's own) sits between two steps. The first call returns no deltas; call
  k returns step k-1's. A request that an EOS, stop token or stop string ends in step N is also
  in step N+1; that token is dropped and never reported (a length limit is seen coming, and
  costs nothing). Token ids, texts and finish reasons equal those of `async_scheduling=False`,
  where each call runs and processes one step. With speculative decoding the proposer needs
  step N's tokens, so a call collects step N before it schedules N+1 (no token is in flight when
  the scheduler runs), and processes N's outputs while N+1 runs.
- Every added request is reported finished exactly once, in a StepDelta whose `output` holds its
  RequestOutput (aborted requests are reported by the next `step()`, unless aborted with
  `report=False`).
- A step that raises fails only its own requests: every request scheduled in the steps that call
  handled (with async scheduling, the one collected and the one dispatched), with all their
  samples, ends with finish_reason "error" (or "abort" on KeyboardInterrupt, which is then
  re-raised); their blocks lose their hashes; `last_error` keeps the exception; the engine keeps
  serving everyone else. Only when the failure took the KV cache with it does every running
  request fail (and the prefix cache start empty).
- A request with `n` samples is `n` scheduler requests (ids `f"{i}_{request_id}"` for n > 1);
  each streams its own deltas (`StepDelta.index`) and ends on its own, the request when all have.
  Sample 0 computes the prompt (and its prompt logprobs); the others share its full prompt blocks.
- Logprobs are kept per sample in token order, and prompt logprobs per position, so a preempted
  and recomputed prompt rewrites the same entries.
- Structured outputs (`structured_outputs.StructuredOutputManager`): a step with a constrained
  row dispatches its forward, then fills the rows' token bitmask on the host while the forward
  runs, then dispatches its sampler. With async scheduling that bitmask is filled after the
  previous step is collected and its tokens consumed by the matchers, so every row's mask follows
  all its tokens. A sample's matcher is made when it is added and freed when it ends.
- `last_step` describes the latest `step()` call (`StepStats`): where its time went and what the
  model step it collected computed.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import numbers
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from minivllm_jax import kv_cache_sizing
from minivllm_jax.config import EngineConfig
from minivllm_jax.detokenizer import IncrementalDetokenizer
from minivllm_jax.loader import LoadedModel, load_model
from minivllm_jax.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, StepDelta
from minivllm_jax.engine_spec import device_bytes_limit, draft_spec, sized_spec
from minivllm_jax.plan import current_platform
from minivllm_jax.prompts import check_token_ids
from minivllm_jax.runner import InFlight, ModelRunner, StepResult, TokenLogprobs, place_params
from minivllm_jax.structured_outputs import StructuredOutputManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput
from scheduler.errors import InvalidFieldError, InvalidFieldTypeError
from scheduler.output import SchedulerStats
from scheduler.request import INT64_MAX, INT64_MIN, MAX_STOP_TOKEN_IDS
from scheduler.spec_decode import NgramProposer, draft_limit

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One `step()` call: seconds spent in each of its phases, and the model step whose tokens it
    collected (all zero when it collected none): its scheduled tokens and requests and the KV
    tokens its attention read. `collect` is mostly waiting for the device: the device time that
    host work did not hide. `mask`: filling structured outputs' token bitmasks."""

    schedule: float = 0.0
    dispatch: float = 0.0
    mask: float = 0.0
    collect: float = 0.0
    update: float = 0.0
    process: float = 0.0
    num_tokens: int = 0
    num_reqs: int = 0
    kv_tokens: int = 0


@dataclass
class EngineStats(SchedulerStats):
    """The scheduler's snapshot and the KV pool's size (the null block included) and free blocks."""

    num_kv_blocks: int
    num_free_kv_blocks: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens, 0 before any query."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over verified draft tokens, 0 before any draft."""
        d = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / d if d else 0.0


@dataclass
class _Parent:
    """A caller's request: its prompt, its `n` samples (scheduler requests) and, when asked for,
    its prompt logprobs by position."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class _Sample:
    """One sample of a request: its scheduler Request, detokenizer and, when asked for, the
    logprobs of its tokens; `final` once it ended."""

    request: Request
    parent: _Parent
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    final: CompletionOutput | None = None
    error: str | None = None  # why its constraint ended it (finish_reason "error")


def build_runner(loaded: LoadedModel, config: EngineConfig, platform: str) -> ModelRunner:
    """The one-way build (engine_spec): the draft spec, the weights placed on its mesh, then on
    an accelerator a max-size step profiled on a draft runner of one request's cache (dropped),
    the sized spec, and its runner."""
    draft = draft_spec(loaded.config, config, loaded.dtype, platform)
    params = place_params(draft, loaded.config, loaded.params)
    limit = device_bytes_limit(draft)
    peak = None
    if kv_cache_sizing.needs_peak(draft.config, draft.plan, limit):
        peak = ModelRunner(draft, params).max_step_peak_bytes()
    spec = sized_spec(draft, bytes_limit=limit, peak_bytes=peak,
                      fit_length=config.max_model_len is None)
    return ModelRunner(spec, params)


class LLMEngine:
    """Owns a Scheduler, a ModelRunner and the per-request detokenizers of one model."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, platform: str | None = None) -> None:
        """`platform`: where it runs (default: `plan.current_platform()`)."""
        self.model_config = loaded.config
        self.model_source, self.dtype = loaded.source, loaded.dtype  # where from, as what
        self.tokenizer = loaded.tokenizer
        # the checkpoint's generation_config.json sampling fields (LLM's and the server's defaults)
        self.generation_defaults = dict(loaded.generation_defaults)
        self.runner = build_runner(loaded, config, platform or current_platform())
        self.spec = self.runner.spec  # what every part below is built from, read-only
        self.config, self.plan = self.spec.config, self.spec.plan
        self.scheduler = Scheduler(self.spec.scheduler_config())
        spec = self.config.speculative_config
        if spec is not None and self.runner.channel is not None:
            raise ValueError("speculative_config is not supported on a multi-host run (a verified "
                             "step has no step header to broadcast)")
        self.proposer = None if spec is None else NgramProposer(spec)
        # grammars and matchers of structured outputs (None: no tokenizer, none possible)
        self.structured = None if self.tokenizer is None else StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self._tracked: dict[str, _Sample] = {}  # by scheduler request id
        self._parents: dict[str, _Parent] = {}  # by the caller's request id
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs
        self._pending: list[StepDelta] = []
        # samples whose constraint cannot go on, by scheduler request id, with the reason
        self._constraint_errors: dict[str, str] = {}
        self._in_flight: tuple[SchedulerOutput, InFlight] | None = None  # dispatched, not collected
        self._ids = itertools.count()
        self.last_step = StepStats()
        self.last_error: BaseException | None = None  # what the latest failed step raised
        # called with the caller's ids of the requests in each step before it is dispatched (an
        # exception there fails that step, as any other): tracing, and fault injection in tests
        self.before_dispatch: Callable[[set[str]], None] | None = None

    @classmethod
    def from_model(cls, model: str | os.PathLike | LoadedModel | None, config: EngineConfig
                   ) -> "LLMEngine":
        """The engine of `model` (None: the embedded SmolLM2; a checkpoint directory; a .gguf
        file; or a loaded model, whose own dtype then stands), loaded as `config` asks."""
        platform = current_platform()
        loaded = model if isinstance(model, LoadedModel) else load_model(
            model, dtype=config.dtype, cache_dir=config.cache_dir, platform=platform,
            on_host=config.tensor_parallel_size > 1)  # tensor parallelism shards from the host
        return cls(loaded, config, platform)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    priority: int = 0) -> str:
        """Queue a tokenized prompt; returns its request id. Raises ValueError/TypeError on bad
        input. `priority` orders requests under `scheduling_policy="priority"` (lower first).
        All or nothing: an exception (a KeyboardInterrupt included) while its samples are
        registered undoes what was registered, so no sample of it is left behind."""
        self.check_request(prompt_token_ids, sampling_params, priority)
        ids = [int(t) for t in prompt_token_ids]
        n = sampling_params.n
        if request_id is None:
            request_id = self.new_request_id(n)
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        elif not self._id_free(request_id, n):
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent, samples = self._new_samples(request_id, ids, prompt, sampling_params, int(priority))
        try:
            self._parents[request_id] = parent
            for sample in samples:
                sid, sp = sample.request.request_id, sample.request.sampling_params
                if sp.structured_outputs is not None:
                    self.structured.add(sid, sp.structured_outputs, sp.stop_token_ids)
                self.scheduler.add_request(sample.request)
                parent.samples.append(sample)
                self._tracked[sid] = sample
        except BaseException:
            self._unregister(parent, samples)
            raise
        return request_id

    def new_request_id(self, n: int = 1) -> str:
        """The next counter value that a request of `n` samples may take (nobody uses it or its
        sample ids); not reserved: the caller adds the request with it next."""
        return next(i for i in map(str, self._ids) if self._id_free(i, n))

    def _new_samples(self, request_id: str, ids: list[int], prompt: str | None,
                     params: SamplingParams, priority: int) -> tuple[_Parent, list[_Sample]]:
        """A request's parent and samples, built but registered nowhere. Sample 0 (the lead)
        computes the prompt, and its logprobs, once for every sample."""
        n = params.n
        sample_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        eos = self.model_config.eos_token_ids
        if len(eos) > 1 and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(
                (*params.stop_token_ids, *eos[1:]))))
        parent = _Parent(request_id, prompt, ids)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(ids)
        lead, samples = None, []
        for index, sample_id in enumerate(sample_ids):
            sp = params if index == 0 else dataclasses.replace(params, prompt_logprobs=None)
            request = Request(sample_id, ids, sp, eos_token_id=eos[0] if eos else None,
                              priority=priority, fork_of=lead,
                              parent_id=request_id if n > 1 else None, sample_index=index)
            accepts = None
            if sp.structured_outputs is not None:
                accepts = functools.partial(self.structured.accepts_text, sample_id)
            lead = lead or request
            samples.append(_Sample(request, parent, index, IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, accepts),
                logprobs=None if params.logprobs is None else []))
        return parent, samples

    def _unregister(self, parent: _Parent, samples: list[_Sample]) -> None:
        """Undo a partial `add_request`: every sample of `parent` out of the scheduler, the
        structured-output matchers and the engine's tables, as if never added."""
        for sample in samples:
            i = sample.request.request_id
            if self.scheduler.requests.get(i) is sample.request:
                self.scheduler.discard_request(i)
            if self._tracked.get(i) is sample:
                del self._tracked[i]
            if self.structured is not None:
                self.structured.remove(i)
        if self._parents.get(parent.request_id) is parent:
            del self._parents[parent.request_id]

    def _id_free(self, request_id: str, n: int) -> bool:
        """Whether a request of `n` samples may take this id (its samples' ids included): not
        while any of them runs, or while an output of it (an abort's included) waits to be
        returned by step()."""
        sample_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        return (request_id not in self._parents and not any(i in self._tracked for i in sample_ids)
                and not any(d.request_id == request_id for d in self._pending))

    def check_request(self, prompt_token_ids: Sequence[int], sampling_params: object,
                      priority: object = 0) -> None:
        """Raise ValueError/TypeError if add_request would reject this: an InvalidFieldError
        whose `field` names the argument or SamplingParams field (its message starts with it),
        but for a feature this engine lacks. Besides SamplingParams' own bounds (checked again
        here) and the prompt's rules (`minivllm_jax.prompts.check_token_ids`: token ids within
        the vocabulary, shorter than max_model_len), the bounds that depend on this engine: top_k
        at most the vocabulary and a `structured_outputs` constraint that compiles (for this
        engine's tokenizer). `n` may exceed max_num_seqs: its samples then run in waves."""
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidFieldTypeError("sampling_params", "sampling_params must be a SamplingParams, "
                                                           f"got {type(sampling_params).__name__}")
        sp = sampling_params
        self._check_priority(priority)
        dataclasses.replace(sp)  # SamplingParams' own bounds again: a frozen value can be forced
        vocab = self.model_config.vocab_size
        check_token_ids(prompt_token_ids, vocab, self.config.max_model_len)
        if sp.top_k > vocab:
            raise InvalidFieldError("top_k", f"top_k must be at most the vocabulary size {vocab} "
                                             f"(or 0 / -1: off), got {sp.top_k}")
        for name, tokens in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", sp.logit_bias or ())):
            unknown = [t for t in tokens if t >= vocab]
            if unknown:
                raise InvalidFieldError(name, f"{name} has token ids outside the vocabulary "
                                              f"[0, {vocab}): {unknown[:5]}")
        eos = self.model_config.eos_token_ids
        if not sp.ignore_eos and len({*sp.stop_token_ids, *eos[1:]}) > MAX_STOP_TOKEN_IDS:
            raise InvalidFieldError("stop_token_ids", f"stop_token_ids with this model's other EOS "
                                                      f"ids {list(eos[1:])} are more than {MAX_STOP_TOKEN_IDS}")
        if self.runner.channel is not None and (sampling_params.has_penalties
                                                or sampling_params.prompt_logprobs is not None
                                                or sp.structured_outputs is not None):
            raise ValueError("penalties, prompt_logprobs and structured_outputs are not supported "
                             "in multi-host runs")
        if sp.structured_outputs is not None:
            if self.structured is None:
                raise InvalidFieldError("structured_outputs", "structured_outputs needs a tokenizer, "
                                                              "and this model was loaded without one")
            self.structured.prepare(sp.structured_outputs)

    def _check_priority(self, priority: object) -> None:
        """check_request's rule for `priority`: an int of 64 bits, 0 unless this engine's
        scheduling policy is "priority"."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise InvalidFieldTypeError("priority", f"priority must be an int, got {type(priority).__name__}")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidFieldError("priority", f"priority must fit in 64 bits, got {priority}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidFieldError("priority", f"priority={priority} needs scheduling_policy="
                                                f"'priority' (this engine's is {self.config.scheduling_policy!r})")

    def abort_request(self, request_ids: str | Iterable[str], report: bool = True) -> None:
        """Abort unfinished requests (unknown or finished ids are ignored); their final outputs,
        finish_reason "abort", come from the next step(), or never with `report=False` (the
        caller gives up on them, as `LLM.generate` does when interrupted: outputs of theirs
        still waiting for a step() are dropped too)."""
        if isinstance(request_ids, str):
            ids = [request_ids]
        elif isinstance(request_ids, Iterable) and not isinstance(request_ids, (bytes, dict)):
            ids = list(request_ids)
        else:
            raise TypeError(f"request_ids must be a str or an iterable of str, got "
                            f"{type(request_ids).__name__}")
        if not all(isinstance(i, str) for i in ids):
            raise TypeError("request_ids must be a str or an iterable of str")
        self._end(self._unfinished_samples(ids), RequestStatus.FINISHED_ABORTED, report)
        if not report:
            dropped = set(ids)
            self._pending = [d for d in self._pending if d.request_id not in dropped]

    def _unfinished_samples(self, parent_ids: Iterable[str]) -> list[str]:
        return [s.request.request_id for i in dict.fromkeys(parent_ids) if i in self._parents
                for s in self._parents[i].samples if s.final is None]

    def _end(self, sample_ids: list[str], status: RequestStatus, report: bool = True,
             uncache: bool = False) -> list[StepDelta]:
        """Finish these samples with `status` (`uncache`: their blocks lose their hashes, as
        Scheduler.finish_requests says); their final deltas, also queued for the next step()
        when `report`."""
        self.scheduler.finish_requests(sample_ids, status, uncache)
        deltas = [self._finish(i) for i in sample_ids]
        if report:
            self._pending.extend(deltas)
        return deltas

    def requeue(self, deltas: Iterable[StepDelta]) -> None:
        """Hand deltas back so that the next step() returns them (used by LLM.generate for
        requests it did not add)."""
        self._pending.extend(deltas)

    def has_unfinished_requests(self) -> bool:
        """Whether a step() still has something to report: a request not finished or a delta not
        returned. A step in flight whose requests all ended (say, aborted unreported by an
        interrupted `generate`) has nothing to report: the next step() collects and drops it."""
        return bool(self._parents) or bool(self._pending)

    def precompile(self) -> int:
        """`ModelRunner.precompile`: every program a step can need, compiled and run once (the
        structured steps' samplers too, where this engine serves constraints)."""
        return self.runner.precompile(structured=self.structured is not None
                                      and self.runner.channel is None)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """Run one engine step; returns a delta per request that got tokens or finished (with
        `async_scheduling`, those of the step before: see the module invariants). A failure
        inside it fails that step's requests only (see the module invariants)."""
        self.last_step = stats = StepStats()
        previous, self._in_flight = self._in_flight, None
        handled = [] if previous is None else [previous[0]]  # the steps this call is about
        try:
            if self.plan.async_scheduling and self.proposer is not None:
                # drafts need step N's tokens: N is collected, N+1 starts, then N is processed
                sampled = self._collect(previous, stats)
                self._in_flight = self._dispatch(stats, handled)
                self._dispatch_sampler(self._in_flight, stats)
            elif self.plan.async_scheduling:  # step N+1 starts, then N is processed
                current = self._dispatch(stats, handled)
                self._in_flight, current = current, previous
                sampled = self._collect(current, stats)
                self._dispatch_sampler(self._in_flight, stats)
            else:
                current = self._dispatch(stats, handled)
                self._dispatch_sampler(current, stats)
                sampled = self._collect(current, stats)
            start = time.perf_counter()
            deltas = self._process(sampled)
            stats.process = time.perf_counter() - start
            return deltas
        except BaseException as e:
            self._in_flight = None
            failed = self._fail_steps(handled, e)
            if not isinstance(e, Exception):  # an interrupt: the outputs come with the next step
                self._pending.extend(failed)
                raise
            deltas, self._pending = self._pending + failed, []
            return deltas

    def _fail_steps(self, handled: list[SchedulerOutput], error: BaseException) -> list[StepDelta]:
        """End every request (all its samples) scheduled in `handled`, and with the KV cache
        lost every running one; returns their final deltas."""
        interrupted = not isinstance(error, Exception)
        if not interrupted:
            self.last_error = error
            logger.error("a model step failed; its requests end with finish_reason 'error'",
                         exc_info=error)
        parents = [self._tracked[r].parent.request_id for so in handled
                   for r in so.num_scheduled_tokens if r in self._tracked]
        samples = self._unfinished_samples(parents)
        cache_kept = self.runner.recover()
        if not cache_kept:
            logger.error("the failed step lost the KV cache: every running request fails")
            running = [r.request_id for r in self.scheduler.running if r.request_id in self._tracked]
            samples = self._unfinished_samples(
                [*parents, *(self._tracked[r].parent.request_id for r in running)])
        for so in handled:  # the runner may not have seen them: its rows go with the next step
            self.scheduler.finished_req_ids |= so.finished_req_ids | so.preempted_req_ids
        status = RequestStatus.FINISHED_ABORTED if interrupted else RequestStatus.FINISHED_ERROR
        deltas = self._end(samples, status, report=False, uncache=True)
        if not cache_kept:
            self.scheduler.reset_prefix_cache()
        return deltas

    def _dispatch(self, stats: StepStats, handled: list[SchedulerOutput]
                  ) -> tuple[SchedulerOutput, InFlight] | None:
        """Schedule a step (appended to `handled`) and start it on the device; None when
        nothing was scheduled."""
        start = time.perf_counter()
        if self.proposer is not None:
            self._propose_drafts()
        scheduler_output = self.scheduler.schedule()
        handled.append(scheduler_output)
        scheduled = time.perf_counter()
        if self.before_dispatch is not None and scheduler_output.num_scheduled_tokens:
            self.before_dispatch({self._tracked[r].parent.request_id
                                  for r in scheduler_output.num_scheduled_tokens if r in self._tracked})
        in_flight = self.runner.dispatch(scheduler_output)
        stats.schedule, stats.dispatch = scheduled - start, time.perf_counter() - scheduled
        return None if in_flight is None else (scheduler_output, in_flight)

    def _propose_drafts(self) -> None:
        """Drafts for every running request the runner holds, as many as `draft_limit` allows."""
        k, max_len, batch = self.proposer.k, self.config.max_model_len, self.runner.batch
        limits = {r.request_id: m for r in self.scheduler.running
                  if r.request_id in batch.row_of and (m := draft_limit(r, k, max_len)) > 0}
        if not limits:
            return
        rows = batch.rows_of(list(limits))
        drafts = self.proposer.propose_padded(batch.token_ids[rows], batch.num_tokens[rows],
                                              list(limits.values()))
        for rid, draft in zip(limits, drafts):
            if len(draft):
                self.scheduler.requests[rid].spec_token_ids = draft.tolist()

    def _dispatch_sampler(self, step: tuple[SchedulerOutput, InFlight] | None,
                          stats: StepStats) -> None:
        """Launch a structured step's sampler with its rows' token bitmask (others launched
        theirs in `dispatch`)."""
        if step is None or not step[1].needs_bitmask:
            return
        start = time.perf_counter()
        in_flight = step[1]
        mask, failed = self.structured.bitmask(in_flight.req_ids, in_flight.bitmask_rows)
        self._constraint_errors.update(failed)  # they end when this step is collected
        stats.mask = time.perf_counter() - start
        self.runner.dispatch_sampler(in_flight, mask)

    def _collect(self, step: tuple[SchedulerOutput, InFlight] | None,
                 stats: StepStats) -> StepResult | None:
        """Wait for a dispatched step and update the scheduler with its tokens."""
        if step is None:
            return None
        scheduler_output, in_flight = step
        start = time.perf_counter()
        sampled = self.runner.collect(in_flight)
        collected = time.perf_counter()
        self.scheduler.update_from_output(scheduler_output, sampled.tokens)
        if self.structured is not None and len(self.structured):
            self._end_failed_constraints(sampled.tokens)
        stats.collect, stats.update = collected - start, time.perf_counter() - collected
        stats.num_tokens, stats.num_reqs = in_flight.num_tokens, in_flight.num_reqs
        stats.kv_tokens = in_flight.kv_tokens
        return sampled

    def _end_failed_constraints(self, sampled: Iterable[str]) -> None:
        """After a collected step: end, alone and with the reason, the sampled requests whose
        constraint could not go on (`StructuredOutputManager.bitmask`) or refused a token."""
        failed = []
        for r in sampled:
            error = self._constraint_errors.pop(r, None)
            if error is None and r in self._tracked:
                error = self.structured.advance(r, self._tracked[r].request.output_token_ids)
            if error is not None and r in self._tracked:
                self._tracked[r].error = error
                failed.append(r)
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)

    def _process(self, result: StepResult | None) -> list[StepDelta]:
        """Deltas for the pending ones and for one step's sampled tokens (the pending ones are
        taken only when this returns)."""
        if result is None:
            deltas, self._pending = self._pending, []
            return deltas
        deltas = []
        for req_id, entries in result.prompt_logprobs.items():
            sample = self._tracked.get(req_id)
            if sample is not None:  # a recomputed prompt (preemption) writes the same values
                for pos, lp in entries:
                    sample.parent.prompt_logprobs[pos] = self._position_logprobs(
                        sample.parent.prompt_token_ids[pos], lp)
        for req_id in result.tokens:
            sample = self._tracked.get(req_id)
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
            if stop is not None and not sample.request.is_finished():
                self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED)
            if sample.request.is_finished():
                deltas.append(self._finish(req_id, tokens, new_logprobs))
            else:
                deltas.append(StepDelta(sample.parent.request_id, list(tokens),
                                        sample.detokenizer.take_delta(False), False,
                                        index=sample.index, new_logprobs=new_logprobs))
        deltas, self._pending = self._pending + deltas, []
        return deltas

    def _finish(self, req_id: str, new_tokens: Sequence[int] = (),
                new_logprobs: list[PositionLogprobs] | None = None) -> StepDelta:
        """End one sample; the request's RequestOutput comes with its last sample's end."""
        sample = self._tracked.pop(req_id)
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
            del self._parents[parent.request_id]
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

    # ---- stats -----------------------------------------------------------------------------
    def make_stats(self) -> EngineStats:
        pool = self.scheduler.kv_cache_manager.block_pool
        return EngineStats(**vars(self.scheduler.make_stats()), num_kv_blocks=self.runner.num_blocks,
                           num_free_kv_blocks=pool.get_num_free_blocks())

    def get_stats(self) -> dict[str, float]:
        """`make_stats()` as a dict, with the prefix-cache hit rate (tokens)."""
        s = self.make_stats()
        return {**dataclasses.asdict(s), "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                "spec_acceptance_rate": s.spec_acceptance_rate}
