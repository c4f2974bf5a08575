"""The scheduler: one token budget per step, no prefill or decode phase.

Each step every scheduled request's `num_computed_tokens` moves towards its `num_tokens`. A
request whose scheduled tokens reach that end will sample a token: it holds one more
`num_output_placeholders` until `update_from_output` brings the token.
With `config.async_scheduling`, `schedule()` may run again before the previous step's update, and
the end a request moves towards includes its placeholders: a decoding request is scheduled on its
placeholder, whose id the runner forwards from the step in flight. A request whose placeholders
reach its length limit is not scheduled again; one that an EOS or stop token ends is scheduled one
step too many, and that step's token is dropped. A preempted request keeps its placeholders, and
its pending token still arrives (without async scheduling, a preemption drops them).
Running requests are served first, in order; waiting requests are admitted only when nothing was
preempted in this step. Preemption is by recomputation (blocks freed, progress reset to 0).
Speculative decoding (vLLM V1's): a decoding request with no token in flight and
`spec_token_ids` set before `schedule()` is scheduled on its last token plus those drafts (as
many as the budget and max_model_len allow; `SchedulerOutput.scheduled_spec_decode_tokens`), with
blocks for all of them; every request's drafts are consumed by the call. `update_from_output`
rolls `num_computed_tokens` back by the drafts rejected, so no KV of a rejected draft is read
again; blocks are hashed from `all_token_ids`, which only accepted tokens reach.

Invariants between calls: every request known to the scheduler is in exactly one of `running`
(status RUNNING) and `waiting` (WAITING or PREEMPTED); `len(running) <= max_num_seqs`; a
running request holds blocks for all its computed tokens; waiting requests hold no blocks.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from scheduler.block_pool import KVCacheBlock
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput, SchedulerStats
from scheduler.request import Request, RequestStatus
from scheduler.request_queue import create_request_queue, priority_order

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """`requests`: every unfinished request by id; `running`: in scheduling order; `waiting`: the
    policy's queue. `finished_req_ids` collects ids finished since the last output."""

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo, max_model_len=config.max_model_len)
        self._block_hasher = self.kv_cache_manager.block_hasher if config.enable_prefix_caching else None
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = create_request_queue(config.policy)
        self.finished_req_ids: set[str] = set()  # sent with the next SchedulerOutput
        self.num_preemptions = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request. Bad input raises ValueError/TypeError naming the field."""
        _check_new_request(request, self.requests, self.config.max_model_len)
        if self._block_hasher is not None:
            request.set_block_hasher(self._block_hasher, self.config.block_size)
        request.set_stop_filter(self.config.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def discard_request(self, request_id: str) -> None:
        """Undo `add_request` of a request that no step has scheduled yet (an add interrupted
        half-way); unknown ids are ignored. Nothing of it is reported."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING:
            return
        del self.requests[request_id]
        if any(r is req for r in self.waiting):
            self.waiting.remove_request(req)

    def set_drafts(self, drafts: Mapping[str, Sequence[int]]) -> None:
        """Speculative draft tokens of requests (unknown ids and empty drafts ignored): the next
        `schedule()` verifies each where it schedules its request as a decode, and consumes it
        either way. The caller bounds a draft by `spec_decode.draft_limit`."""
        for rid, draft in drafts.items():
            req = self.requests.get(rid)
            if req is not None and len(draft):
                req.spec_token_ids = list(draft)

    def check_prompt(self, prompt_token_ids: list[int], request_id: str = "") -> None:
        """The prompt rules of `add_request`: non-empty, non-negative ints, and shorter than
        max_model_len so at least one token can be generated. Raises ValueError naming the field."""
        _check_prompt(prompt_token_ids, request_id, self.config.max_model_len)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus,
                        uncache: bool = False) -> None:
        """Finish (abort) requests wherever they are; unknown or already finished ids are ignored.
        With FINISHED_ERROR or `uncache` (a step they were scheduled in failed or was interrupted,
        so KV it was to write may be missing), their blocks that nobody else holds also lose
        their hashes."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is _RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove_request(req)
            req.status = finished_status
            self._free_request(req, uncache)

    def _free_request(self, req: Request, uncache: bool = False) -> None:
        self.kv_cache_manager.free(req, uncache=uncache or req.status is RequestStatus.FINISHED_ERROR)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kvm = self.kv_cache_manager
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=kvm.usage, prefix_cache_queries=kvm.prefix_cache_queries,
                              prefix_cache_hits=kvm.prefix_cache_hits, num_preemptions=self.num_preemptions,
                              spec_num_drafts=self.spec_num_drafts,
                              spec_num_draft_tokens=self.spec_num_draft_tokens,
                              spec_num_accepted_tokens=self.spec_num_accepted_tokens)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Build one step (`_Step`): running requests in order, then admissions if nothing was
        preempted. Every scheduled request's `num_computed_tokens` is advanced when this returns."""
        step = _Step(self)
        step.schedule_running()
        new_reqs = [] if step.preempted else step.schedule_waiting()
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(step.req_ids, step.new_block_ids, step.computed_before),
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted},
            scheduled_spec_decode_tokens=step.spec)
        self.finished_req_ids = set()
        return out

    def _pick_victim(self) -> Request:
        """FCFS: the last running request; priority: the running request last in priority_order."""
        if self.config.policy == "priority":
            return max(self.running, key=priority_order)
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free every block (cached ones stay hittable), restart from 0."""
        if not self.config.async_scheduling:
            req.num_output_placeholders = 0  # a token still owed is dropped, as for any non-runner
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    # ------------------------------------------------------------------ after the model ran

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Append sampled tokens, apply the stop rules, free finished requests.

        Returns the requests that finished in this update (status and stop_reason set; they
        are also reported in the next output's finished_req_ids). A request's tokens fill its
        oldest placeholder; tokens for a request that has none (a partial prefill) or that has
        finished (aborted, or ended by the step before under async scheduling) are ignored, so
        a runner may send one token per scheduled request. A request preempted since the step
        was scheduled still takes its token. Token ids may be Python or numpy ints. A request
        verified with d drafts brings 1 to d + 1 tokens (the accepted drafts, then the token drawn
        where the first was rejected or after the last); its computed tokens shrink by the
        rejected drafts.
        """
        finished: list[Request] = []
        finished_waiting: list[Request] = []
        get = self.requests.get
        max_model_len = self.config.max_model_len
        running_status = _RUNNING
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid, toks in sampled_token_ids.items():
            if not toks:
                continue
            req = get(rid)
            if req is None or not req.num_output_placeholders:
                continue
            req.num_output_placeholders -= 1
            if spec and rid in spec:
                drafted, accepted = len(spec[rid]), len(toks) - 1
                if not 0 <= accepted <= drafted:
                    raise ValueError(f"request {rid!r} verified {drafted} drafts but got {len(toks)} tokens")
                req.num_computed_tokens -= drafted - accepted
                req.num_draft_tokens += drafted
                req.num_accepted_tokens += accepted
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += drafted
                self.spec_num_accepted_tokens += accepted
            all_ids = req.all_token_ids
            out_ids = req.output_token_ids
            for tok in toks:
                # Request.append_output_token_ids, inlined for the hot path
                if type(tok) is not int:
                    tok = int(tok)
                out_ids.append(tok)
                all_ids.append(tok)
                if len(all_ids) >= req._next_hash_at:
                    req.hash_new_blocks()
                # exact pre-filter: only these tokens/lengths can trigger a stop rule
                if tok in req.stop_candidates or len(all_ids) >= req.length_limit:
                    was_running = req.status is running_status
                    if not _check_stop(req, tok, max_model_len):
                        continue
                    if was_running:
                        finished.append(req)
                    else:
                        self.waiting.remove_request(req)
                        finished_waiting.append(req)
                    break
        for req in finished_waiting:
            self._free_request(req)
        if finished:
            done = set(map(id, finished))
            self.running[:] = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._free_request(req)
        return finished + finished_waiting


class _Step:
    """One step under construction for `sched`: budget left, tokens per scheduled request, the
    CachedRequestData columns (running requests, in scheduling order), the requests preempted,
    the ids of running requests given a placeholder (a token to sample) in this step, and the
    drafts scheduled per request."""

    __slots__ = ("sched", "budget", "num_scheduled", "req_ids", "new_block_ids",
                 "computed_before", "preempted", "sampling", "spec")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.budget = sched.config.max_num_batched_tokens
        self.num_scheduled: dict[str, int] = {}
        self.req_ids: list[str] = []
        self.new_block_ids: list[list[int]] = []
        self.computed_before: list[int] = []
        self.preempted: list[Request] = []
        self.sampling: set[str] = set()
        self.spec: dict[str, list[int]] = {}

    def schedule_running(self) -> None:
        """Serve `running` in order while budget is left, each request on its capped share of the
        tokens up to its end. A decode whose slot its blocks already cover (below
        `kvm.no_alloc_limit`) skips `allocate_slots`. Stops at a request preempted for itself."""
        cfg = self.sched.config
        kvm = self.sched.kv_cache_manager
        allocate_slots = kvm.allocate_slots
        no_alloc_limit_get = kvm.no_alloc_limit.get
        threshold = cfg.long_prefill_token_threshold
        last_pos = cfg.max_model_len - 1
        ahead = cfg.async_scheduling  # schedule on placeholders (tokens still in flight)
        num_scheduled, sampling = self.num_scheduled, self.sampling
        req_ids, new_block_ids, computed_before = self.req_ids, self.new_block_ids, self.computed_before
        running = self.sched.running
        budget = self.budget
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            end = len(req.all_token_ids)
            if ahead and req.num_output_placeholders:
                end += req.num_output_placeholders
                if end >= req.length_limit:
                    i += 1  # its pending token ends it: nothing more to compute
                    continue
            n = end - computed
            drafts = req.spec_token_ids
            if drafts:  # consumed: the caller proposes afresh before each schedule()
                req.spec_token_ids = []
                if n == 1 and end == len(req.all_token_ids):  # a decode, no token in flight
                    n += len(drafts)
                else:
                    drafts = []
            if n == 1:  # a decode step; the caps cannot bite (end < max_model_len)
                rid = req.request_id
                if computed < no_alloc_limit_get(rid, 0):  # allocate_slots(req, 1) would be a no-op
                    num_scheduled[rid] = 1
                    req_ids.append(rid)
                    new_block_ids.append([])
                    computed_before.append(computed)
                    req.num_computed_tokens = computed + 1
                    req.num_output_placeholders += 1
                    sampling.add(rid)
                    budget -= 1
                    i += 1
                    continue
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > last_pos - computed:
                n = last_pos - computed
            if n <= 0:  # nothing to compute until the runner's output comes back
                i += 1
                continue
            new_blocks = allocate_slots(req, n)
            if new_blocks is None:
                self.budget = budget
                new_blocks, i = self.preempt_until_allocated(req, i, n)
                budget = self.budget
                if new_blocks is None:
                    break
            rid = req.request_id
            num_scheduled[rid] = n
            req_ids.append(rid)
            new_block_ids.append([b.block_id for b in new_blocks])
            computed_before.append(computed)
            req.num_computed_tokens = computed + n
            if drafts and n > 1:
                self.spec[rid] = drafts[:n - 1]
            if computed + n >= end:  # reaches its known tokens (verified ones: past, by drafts)
                req.num_output_placeholders += 1
                sampling.add(rid)
            budget -= n
            i += 1
        self.budget = budget

    def preempt_until_allocated(self, req: Request, i: int, n: int
                                ) -> tuple[list[KVCacheBlock] | None, int]:
        """Preempt victims until `allocate_slots(req, n)` succeeds. Returns the new blocks (None
        once `req` itself is the victim) and `req`'s index `i` in `running`, shifted past victims
        removed before it."""
        sched = self.sched
        running = sched.running
        new_blocks = None
        while new_blocks is None:
            victim = sched._pick_victim()
            idx = len(running) - 1 if victim is running[-1] else running.index(victim)
            del running[idx]
            if idx < i:
                i -= 1
            if victim.request_id in self.num_scheduled:
                self.unschedule(victim)
            sched._preempt(victim)
            self.preempted.append(victim)
            if victim is req:
                return None, i
            new_blocks = sched.kv_cache_manager.allocate_slots(req, n)
        return new_blocks, i

    def unschedule(self, victim: Request) -> None:
        """Take back `victim`, scheduled earlier in this step: its tokens return to the budget, its
        placeholder is dropped, blocks cached for those never-computed tokens lose their hashes
        (nobody may hit KV that will not be written), and it leaves the CachedRequestData columns."""
        vid = victim.request_id
        n_back = self.num_scheduled.pop(vid)
        self.spec.pop(vid, None)
        self.budget += n_back
        victim.num_computed_tokens -= n_back
        if vid in self.sampling:
            self.sampling.discard(vid)
            victim.num_output_placeholders -= 1
        self.sched.kv_cache_manager.uncache_blocks_beyond(victim, victim.num_computed_tokens)
        j = self.req_ids.index(vid)
        for col in (self.req_ids, self.new_block_ids, self.computed_before):
            del col[j]

    def schedule_waiting(self) -> list[NewRequestData]:
        """Admit waiting requests in queue order while seats and budget are left. The first one
        that cannot be admitted (a token still in flight, no blocks, or with chunked prefill off
        its whole prompt not in the budget) stops admission for this step. A sibling sample
        (`fork_of`) shares its lead's full prompt blocks: the lead is ahead of it in the queue and
        takes the whole budget until its prompt is scheduled, so those blocks exist by then."""
        cfg = self.sched.config
        kvm = self.sched.kv_cache_manager
        threshold = cfg.long_prefill_token_threshold
        waiting, running = self.sched.waiting, self.sched.running
        budget = self.budget
        new_reqs: list[NewRequestData] = []
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting.peek_request()
            if req.num_output_placeholders:  # preempted with a token still in flight
                break
            hits, num_hit = kvm.get_computed_blocks(req, record_stats=False)
            lead = req.fork_of
            if lead is not None and not lead.is_finished():
                shared, num_shared = kvm.get_sibling_blocks(req, lead)
                if num_shared > num_hit:
                    hits, num_hit = shared, num_shared
            n = req.num_tokens - num_hit
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            if kvm.allocate_slots(req, n, num_hit, hits) is None:
                break
            waiting.pop_request()
            kvm.record_prefix_cache_stats(req.num_tokens, num_hit)
            rid = req.request_id
            req.status = _RUNNING
            running.append(req)
            new_reqs.append(NewRequestData(
                req_id=rid, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids), block_ids=kvm.get_block_ids(rid),
                num_computed_tokens=num_hit, sampling_params=req.sampling_params,
                parent_id=req.parent_id, sample_index=req.sample_index,
                eos_token_id=req.eos_token_id))
            req.num_computed_tokens = num_hit + n
            if num_hit + n == req.num_tokens:
                req.num_output_placeholders += 1
            self.num_scheduled[rid] = n
            budget -= n
        self.budget = budget
        return new_reqs


def _check_stop(req: Request, tok: int, max_model_len: int) -> bool:
    """Apply the stop rules to `req`'s last token `tok`, in order: EOS, stop_token_ids (both held
    back below min_tokens), length. Sets the finished status (and stop_reason); True if stopped."""
    sp = req.sampling_params
    num_out = len(req.output_token_ids)
    if num_out >= sp.min_tokens:
        if tok == req.eos_token_id and not sp.ignore_eos:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if tok in sp.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok
            return True
    if num_out >= sp.max_tokens or len(req.all_token_ids) >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def _check_new_request(request: Request, known: dict[str, Request], max_model_len: int) -> None:
    """A fresh Request with a new str id, a valid prompt, an int priority and an int or None EOS."""
    if not isinstance(request, Request):
        raise TypeError(f"request must be a Request, got {type(request).__name__}")
    rid = request.request_id
    if not isinstance(rid, str):
        raise TypeError(f"request_id must be a str, got {type(rid).__name__}")
    if rid in known:
        raise ValueError(f"request_id {rid!r} is already scheduled")
    _check_prompt(request.prompt_token_ids, rid, max_model_len)
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {rid!r} is not fresh (status {request.status.name})")
    if type(request.priority) is not int:
        raise ValueError(f"priority must be an int, got {request.priority!r}")
    if request.eos_token_id is not None and type(request.eos_token_id) is not int:
        raise ValueError(f"eos_token_id must be an int or None, got {request.eos_token_id!r}")


def prompt_length_error(num_tokens: int, max_model_len: int, name: str = "the prompt",
                        flag: str = "max_model_len (--max-model-len)") -> str | None:
    """The one rule for a prompt's length, None when `num_tokens` fits: a prompt must be
    shorter than max_model_len, so at least one token can be generated. Else the reason, naming
    the prompt as `name` and the setting to raise as `flag`."""
    if num_tokens < max_model_len:
        return None
    return (f"{name} has {num_tokens} tokens; it must be shorter than max_model_len "
            f"({max_model_len}): raise {flag} or shorten the prompt")


def _check_prompt(prompt: list[int], rid: str, max_model_len: int) -> None:
    of = f" of {rid!r}" if rid else ""
    if not prompt:
        raise ValueError(f"prompt_token_ids{of} is empty")
    too_long = prompt_length_error(len(prompt), max_model_len, f"the prompt{of}")
    if too_long:
        raise ValueError(too_long)
    if not all(type(t) is int and t >= 0 for t in prompt):
        bad = next(t for t in prompt if type(t) is not int or t < 0)
        raise ValueError(f"prompt_token_ids must be non-negative ints, got {bad!r} in {rid!r}")
