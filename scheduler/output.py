"""What one `schedule()` call hands to the model runner: full data for requests the runner has
not seen (or must rebuild after a preemption), diffs for the ones it already holds."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner must (re)build from scratch: first admission or resumption after a
    preemption (then `output_token_ids` is non-empty). `num_computed_tokens` counts the tokens
    already in the cache before this step (prefix-cache hits); `block_ids` is its whole table."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    parent_id: str | None = None  # the request a sibling sample (n > 1) belongs to
    sample_index: int = 0  # its index among the parent's n samples
    eos_token_id: int | None = None  # masked with stop_token_ids while min_tokens holds


@dataclass
class CachedRequestData:
    """Column-wise diffs for requests the runner already holds, in scheduling order.
    `new_block_ids[i]` are blocks appended this step (often empty); `num_computed_tokens[i]` is
    the count before this step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step. `num_scheduled_tokens` maps every scheduled request to its token count (decodes
    get exactly 1); `finished_req_ids` are requests finished since the previous output (the
    runner drops their state); `preempted_req_ids` were preempted in this step.
    `scheduled_spec_decode_tokens`: the draft tokens of each request verified in this step (its
    num_scheduled_tokens is 1 + their number: its last token, then the drafts)."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """Snapshot for logging. Prefix-cache figures are cumulative and in tokens."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # speculative decoding, cumulative: steps' drafts verified (one per request and step), their
    # tokens, and the draft tokens accepted
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
