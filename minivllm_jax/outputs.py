"""What the engine hands back: finished outputs (vLLM-style) and per-step streaming deltas."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One generated sequence. finish_reason is "stop", "length", "abort", or None while running;
    stop_reason is the stop string or stop token id that ended it, if any."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All outputs of one request (this engine produces one sequence per request)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class StepDelta:
    """What one engine step added to one request: new tokens, new text, and whether it ended
    (then `output` is the request's complete RequestOutput)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None
