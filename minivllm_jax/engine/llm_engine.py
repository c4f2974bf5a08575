"""LLMEngine: requests in, one scheduled and executed step at a time, deltas out.

Invariants:
- A model step is schedule -> dispatch -> collect -> update -> process outputs; the scheduler
  owns request state and stop-token rules, the runner owns device state, the output processor
  (`output_processor.py`) detokenization, stop strings, logprobs and outputs; every request is
  checked and made into scheduler requests by `admission.py`. The engine owns the loop and its
  failures.
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
- A request with `n` samples is `n` scheduler requests (`admission.sample_ids`); each streams
  its own deltas (`StepDelta.index`) and ends on its own, the request when all have. Sample 0
  computes the prompt (and its prompt logprobs); the others share its full prompt blocks.
- Structured outputs (`structured_output.manager.StructuredOutputManager`): a step with a constrained
  row dispatches its forward, then fills the rows' token bitmask on the host while the forward
  runs, then dispatches its sampler. With async scheduling that bitmask is filled after the
  previous step is collected and its tokens consumed by the matchers, so every row's mask follows
  all its tokens. A sample's matcher is made when it is added and freed when it ends.
- `last_step` describes the latest `step()` call (`StepStats`): where its time went and what the
  model step it collected computed.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import jax

from minivllm_jax.engine.admission import Admission, request_id_list
from minivllm_jax.config import EngineConfig
from minivllm_jax.loader import LoadedModel, load_model
from minivllm_jax.outputs import StepDelta
from minivllm_jax.engine.output_processor import OutputProcessor
from minivllm_jax import engine_spec
from minivllm_jax.engine_spec import EngineSpec
from minivllm_jax.plan import current_platform
from minivllm_jax.worker.runner import InFlight, ModelRunner, StepResult, place_params
from minivllm_jax.structured_output.manager import StructuredOutputManager
from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerOutput
from scheduler.output import SchedulerStats
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
    # what the engine holds (`footprint`): weight-only quantization (None: the model dtype),
    # the KV cache's dtype, and the weights' and the cache's bytes over all devices
    quantization: str | None = None
    kv_cache_dtype: str = ""
    weight_bytes: int = 0
    kv_cache_bytes: int = 0

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


def footprint(spec: EngineSpec, runner: ModelRunner) -> dict[str, str | int | None]:
    """EngineStats' fields of what the engine holds: its quantization, cache dtype, and the
    weights' and the cache's bytes (all devices)."""
    def nbytes(tree: object) -> int:
        return sum(int(a.nbytes) for a in jax.tree.leaves(tree))
    return dict(quantization=spec.plan.model.quantization, kv_cache_dtype=spec.plan.kv_cache_dtype,
                weight_bytes=nbytes(runner.params), kv_cache_bytes=nbytes(runner.kv_cache))


def build(loaded: LoadedModel, config: EngineConfig, platform: str
          ) -> tuple[EngineSpec, ModelRunner]:
    """The one-way build (engine_spec): the draft spec, the weights placed on its mesh, the
    sized spec (`size_spec`; on an accelerator a max-size step profiled on a draft runner of one
    request's cache, dropped), and the spec's runner."""
    spec, params = engine_spec.build(
        loaded.config, config, loaded.dtype, platform,
        place=lambda draft: place_params(draft, loaded.config, loaded.params),
        measure_peak=lambda draft, params: ModelRunner(draft, params).max_step_peak_bytes())
    return spec, ModelRunner(spec, params)


class LLMEngine:
    """Owns a Scheduler, a ModelRunner, the admission rules and the output processor of one
    model; runs the loop and contains its failures."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, platform: str | None = None) -> None:
        """`platform`: where it runs (default: `plan.current_platform()`)."""
        self.model_config = loaded.config
        self.model_source, self.dtype = loaded.source, loaded.dtype  # where from, as what
        self.tokenizer = loaded.tokenizer
        self.generation_defaults = dict(loaded.generation_defaults)  # generation_config.json's
        # what every part below is built from, read-only, and the runner built from it
        self.spec, self.runner = build(loaded, config, platform or current_platform())
        self.config, self.plan = self.spec.config, self.spec.plan
        self.footprint = footprint(self.spec, self.runner)
        self.scheduler = Scheduler(self.spec.scheduler_config())
        spec = self.config.speculative_config  # refused in a multi-host run by draft_spec
        self.proposer = None if spec is None else NgramProposer(spec)
        # grammars and matchers of structured outputs (None: no tokenizer, none possible)
        self.structured = None if self.tokenizer is None else StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.admission = Admission.of(self.spec, self.structured)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.structured)
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
            on_host=config.tensor_parallel_size > 1, quantization=config.quantization)  # tensor parallelism shards from the host
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
        elif not self.outputs.id_free(request_id, n):
            raise ValueError(f"request_id {request_id!r} is already in use")
        requests = self.admission.requests(request_id, ids, sampling_params, int(priority))
        parent, samples = self.outputs.new_samples(request_id, prompt, ids, requests)
        try:
            for sample in samples:
                sid, sp = sample.request.request_id, sample.request.sampling_params
                if sp.structured_outputs is not None:
                    self.structured.add(sid, sp.structured_outputs, sp.stop_token_ids)
                self.scheduler.add_request(sample.request)
                self.outputs.register(sample)
        except BaseException:  # undone everywhere, as if never added
            for sample in samples:
                i = sample.request.request_id
                if self.scheduler.requests.get(i) is sample.request:
                    self.scheduler.discard_request(i)
                if self.structured is not None:
                    self.structured.remove(i)
            self.outputs.forget(parent)
            raise
        return request_id

    def check_request(self, prompt_token_ids: Sequence[int], sampling_params: object,
                      priority: object = 0) -> None:
        """Raise ValueError/TypeError if add_request would reject this (`Admission.check`)."""
        self.admission.check(prompt_token_ids, sampling_params, priority)

    def new_request_id(self, n: int = 1) -> str:
        """The next counter value that a request of `n` samples may take (nobody uses it or its
        sample ids); not reserved: the caller adds the request with it next."""
        return next(i for i in map(str, self._ids) if self.outputs.id_free(i, n))

    def abort_request(self, request_ids: str | Iterable[str], report: bool = True) -> None:
        """Abort unfinished requests (unknown or finished ids are ignored); their final outputs,
        finish_reason "abort", come from the next step(), or never with `report=False` (the
        caller gives up on them, as `LLM.generate` does when interrupted: outputs of theirs
        still waiting for a step() are dropped too)."""
        ids = request_id_list(request_ids)
        self.outputs.end(self.outputs.unfinished_samples(ids), RequestStatus.FINISHED_ABORTED,
                         report)
        if not report:
            self.outputs.drop_pending(ids)

    def requeue(self, deltas: Iterable[StepDelta]) -> None:
        """Hand deltas back for the next step() to return (LLM.generate: others' requests)."""
        self.outputs.pending.extend(deltas)

    def has_unfinished_requests(self) -> bool:
        """Whether a step() has something to report (a step in flight whose requests all ended,
        say aborted unreported by an interrupted `generate`, has not: a step() drops it)."""
        return self.outputs.has_unfinished()

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
            deltas = self.outputs.process(sampled)
            stats.process = time.perf_counter() - start
            return deltas
        except BaseException as e:
            self._in_flight = None
            failed = self._fail_steps(handled, e)
            if not isinstance(e, Exception):  # an interrupt: the outputs come with the next step
                self.outputs.pending.extend(failed)
                raise
            deltas, self.outputs.pending = self.outputs.pending + failed, []
            return deltas

    def _fail_steps(self, handled: list[SchedulerOutput], error: BaseException) -> list[StepDelta]:
        """End every request (all its samples) scheduled in `handled`, and with the KV cache
        lost every running one; returns their final deltas."""
        interrupted = not isinstance(error, Exception)
        if not interrupted:
            self.last_error = error
            logger.error("a model step failed; its requests end with finish_reason 'error'",
                         exc_info=error)
        out = self.outputs
        parents = [p for so in handled for p in out.parent_ids(list(so.num_scheduled_tokens))]
        samples = out.unfinished_samples(parents)
        cache_kept = self.runner.recover()
        if not cache_kept:
            logger.error("the failed step lost the KV cache: every running request fails")
            running = out.parent_ids([r.request_id for r in self.scheduler.running])
            samples = out.unfinished_samples([*parents, *running])
        for so in handled:  # the runner may not have seen them: its rows go with the next step
            self.scheduler.finished_req_ids |= so.finished_req_ids | so.preempted_req_ids
        status = RequestStatus.FINISHED_ABORTED if interrupted else RequestStatus.FINISHED_ERROR
        deltas = out.end(samples, status, report=False, uncache=True)
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
            self.before_dispatch(set(self.outputs.parent_ids(
                list(scheduler_output.num_scheduled_tokens))))
        in_flight = self.runner.dispatch(scheduler_output)
        stats.schedule, stats.dispatch = scheduled - start, time.perf_counter() - scheduled
        return None if in_flight is None else (scheduler_output, in_flight)

    def _propose_drafts(self) -> None:
        """Drafts for every running request, as many as `draft_limit` allows, proposed from the
        runner's batch and handed to the scheduler."""
        k, max_len = self.proposer.k, self.config.max_model_len
        limits = {r.request_id: m for r in self.scheduler.running
                  if (m := draft_limit(r, k, max_len)) > 0}
        self.scheduler.set_drafts(self.runner.batch.propose_drafts(self.proposer, limits))

    def _dispatch_sampler(self, step: tuple[SchedulerOutput, InFlight] | None,
                          stats: StepStats) -> None:
        """Launch a structured step's sampler with its rows' token bitmask (others launched
        theirs in `dispatch`)."""
        if step is None or not step[1].needs_bitmask:
            return
        start = time.perf_counter()
        in_flight = step[1]
        mask, _ = self.structured.bitmask(in_flight.req_ids, in_flight.bitmask_rows)  # failures
        # end their requests when this step is collected
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
        constraint cannot go on (`StructuredOutputManager.errors_after_step`)."""
        tracked = self.outputs.tracked
        errors = self.structured.errors_after_step(sampled, {
            r: tracked[r].request.output_token_ids for r in sampled if r in tracked})
        for r, error in errors.items():
            tracked[r].error = error
        self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)

    # ---- stats -----------------------------------------------------------------------------
    def make_stats(self) -> EngineStats:
        pool = self.scheduler.kv_cache_manager.block_pool
        return EngineStats(**vars(self.scheduler.make_stats()), num_kv_blocks=self.runner.num_blocks,
                           num_free_kv_blocks=pool.get_num_free_blocks(), **self.footprint)

    def get_stats(self) -> dict[str, float | str | None]:
        """`make_stats()` as a dict, with the prefix-cache hit rate (tokens)."""
        s = self.make_stats()
        return {**dataclasses.asdict(s), "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                "spec_acceptance_rate": s.spec_acceptance_rate}
