"""What the engine hands back: finished outputs (vLLM-style) and per-step streaming deltas."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model (log-softmax of the raw logits), its rank
    among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# per position: token id -> Logprob, holding the chosen token and the k most likely ones
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence (sample `index` of its request). finish_reason is "stop",
    "length", "abort", "error" (a model step it was part of failed), or None while running;
    stop_reason is the stop string or stop token id that ended it, if any. `logprobs` (one
    entry per token of `token_ids`) and `cumulative_logprob` are set when the request asked for
    logprobs."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All outputs of one request: `n` samples in `outputs`, by index. `prompt_logprobs` (when
    asked for) has one entry per prompt token, None for the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class StepDelta:
    """What one engine step added to sample `index` of one request: new tokens, new text, their
    logprobs (when asked for), and `finish_reason` once that sample ended. `finished` says the
    whole request ended (every sample); then `output` is its complete RequestOutput."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None
    index: int = 0
    new_logprobs: list[PositionLogprobs] | None = None
    # why the sample's constraint ended it (finish_reason "error"; the model step itself ran):
    # a message naming ``structured_outputs``; None for every other end
    error: str | None = None
