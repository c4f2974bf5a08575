"""The user-facing LLM class (vLLM's offline API): generate, chat, and a step-level API."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import numbers
import os
import time
from typing import Any, Iterable, Sequence

import numpy as np
from tqdm.auto import tqdm

from minivllm_jax.config import EngineConfig
from minivllm_jax.engine.llm_engine import LLMEngine
from minivllm_jax.loader import LoadedModel
from minivllm_jax.outputs import RequestOutput, StepDelta
from minivllm_jax.engine.prompts import is_token_ids, prompt_token_ids
from scheduler import SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]
logger = logging.getLogger(__name__)


class LLM:
    """An offline inference engine over one model.

    `model` is None (the embedded SmolLM2-135M-Instruct), a Hugging Face checkpoint directory, a
    `.gguf` file, or an already loaded `minivllm_jax.loader.LoadedModel` (then `dtype` and
    `cache_dir` are ignored). Every keyword is an `EngineConfig` field (the one declaration of the
    engine's knobs; `inspect.signature(LLM)` lists them); a wrong name or value raises TypeError
    or ValueError naming it.

    A call given no `SamplingParams` uses `default_sampling_params`: vLLM's defaults (temperature
    1.0, top_p 1.0, top_k off, 16 tokens) with the checkpoint's generation_config.json sampling
    fields (temperature, top_p, top_k, min_p, repetition_penalty) over them, as vLLM does.
    """

    def __init__(self, model: str | os.PathLike | LoadedModel | None = None,
                 **engine_args: object) -> None:
        self._attach(LLMEngine.from_model(model, EngineConfig.from_kwargs("LLM()", engine_args)))

    @classmethod
    def from_config(cls, model: str | os.PathLike | LoadedModel | None, config: EngineConfig
                    ) -> LLM:
        """The LLM of `model` for a config already built (the command line's, from its flags)."""
        llm = cls.__new__(cls)
        llm._attach(LLMEngine.from_model(model, config))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.default_sampling_params = default_sampling_params(engine.generation_defaults)

    def __repr__(self) -> str:
        """The model and the sizes it runs with: where it came from, dtype, platform and attention
        backend, KV blocks (the null block excluded) of `block_size` tokens, and the longest and
        the most sequences."""
        e = self.engine
        c, plan = e.config, e.plan
        parts = [f"model={e.model_source!r}", f"dtype={np.dtype(e.dtype).name}", f"platform={plan.platform}",
                 f"attention={plan.backend.name}", f"kv_blocks={e.runner.num_blocks - 1}x{c.block_size}",
                 f"max_model_len={c.max_model_len}", f"max_num_seqs={c.max_num_seqs}"]
        if plan.model.quantization is not None:
            parts.append(f"quantization={plan.model.quantization}")
        if c.kv_cache_dtype != "auto":
            parts.append(f"kv_cache_dtype={plan.kv_cache_dtype}")
        if c.tensor_parallel_size > 1:
            parts.append(f"tensor_parallel_size={c.tensor_parallel_size}")
        if c.speculative_config is not None:
            parts.append(f"speculative={c.speculative_config.method}")
        return f"LLM({', '.join(parts)})"

    # ---- offline API -----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in prompt order.
        `priority`: an int, or one per prompt, for `scheduling_policy="priority"` (lower first).
        A model step that fails raises RuntimeError (the engine serves on); a request its
        constraint ended comes back with finish_reason "error" and the reason in its
        `stop_reason` (the others go on); on any exception or
        interrupt, this call's unfinished requests are aborted and never reported."""
        items = self._normalize_prompts(prompts)
        return self._run([prompt_token_ids(p, self.tokenizer, dicts=True) for p in items],
                         sampling_params, use_tqdm, priority)

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Sequence[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} dicts) or to each
        of a list of conversations, rendered with the tokenizer's chat template (vLLM's options:
        `chat_template` replaces it; `chat_template_kwargs`, e.g. ``{"enable_thinking": False}``,
        are template variables; `continue_final_message` (with `add_generation_prompt` false)
        continues the last assistant message instead of starting a new one; `tools`, OpenAI's
        tool objects, go to the template)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts "
                            "or a list of such lists")
        options = dict(chat_template=chat_template, tools=tools,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message,
                       template_kwargs=check_chat_options(chat_template_kwargs, add_generation_prompt,
                                                          continue_final_message))
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        return self._run([self._render(conv, **options) for conv in conversations],
                         sampling_params, use_tqdm)

    # ---- step-level API --------------------------------------------------------------------
    def add_request(self, prompt: PromptType | Sequence[dict[str, Any]],
                    sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue one request for `step()`; returns its id. `prompt` is what `generate` takes (sent
        as it is), or a conversation (a list of {"role", "content"} dicts), rendered with the
        chat template as `chat` does."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text, ids = self._render(prompt)
        else:
            text, ids = prompt_token_ids(self._normalize_prompts(prompt, single=True)[0],
                                         self.tokenizer, dicts=True)
        return self.engine.add_request(ids, sampling_params or self.default_sampling_params,
                                       request_id, text, priority)

    def step(self) -> list[StepDelta]:
        """One engine step: per request, its new token ids, new text, and whether it finished."""
        return self.engine.step()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort unfinished requests; their final outputs (finish_reason "abort") come from the
        next step()."""
        self.engine.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_stats(self) -> dict[str, float]:
        return self.engine.get_stats()

    def precompile(self) -> int:
        """Compile every program a step of this engine can need (a forward per token bucket and
        attention kind, a sampler per sample bucket and sampling kind, and as a structured
        step's) now, instead of on first use; returns how many step shapes that covers. Worth
        it before serving; minutes on a CPU."""
        return self.engine.precompile()

    # ---- helpers ---------------------------------------------------------------------------
    def _render(self, conversation: object, **options: Any) -> tuple[str, list[int]]:
        """A conversation's text and token ids with the chat template (`render_chat`'s
        ``options``; by default the tokenizer's template and the generation prompt); TypeError
        unless it is a list of dicts, ValueError without a template."""
        if not isinstance(conversation, (list, tuple)) or not all(isinstance(m, dict) for m in conversation):
            raise TypeError("each conversation must be a list of {'role', 'content'} dicts")
        if self.tokenizer is None or (options.get("chat_template")
                                      or getattr(self.tokenizer, "chat_template", None)) is None:
            raise ValueError("this model's tokenizer has no chat template; send prompts with "
                             "generate() or pass chat_template")
        text = render_chat(self.tokenizer, conversation, tokenize=False, **options)
        return str(text), list(render_chat(self.tokenizer, conversation, **options))

    @staticmethod
    def _normalize_prompts(prompts: Any, single: bool = False) -> list[Any]:
        """The prompts of a call as a list (one prompt, or a list of them); each prompt is
        checked by `minivllm_jax.engine.prompts.prompt_token_ids`."""
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            return [prompts]
        if single or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a string, a list of strings, a list of token-id lists, "
                            f"or dicts with 'prompt_token_ids'; got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts must not be empty")
        return list(prompts)

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        params = per_prompt(sampling_params, SamplingParams, self.default_sampling_params,
                            len(prompts), "sampling_params", "a SamplingParams")
        priorities = per_prompt(priority, numbers.Integral, 0, len(prompts), "priority", "an int")
        engine = self.engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        for i, ((_, token_ids), sp, pr) in enumerate(zip(prompts, params, priorities)):
            try:  # all or nothing: reject before adding any
                engine.check_request(token_ids, sp, pr)
            except (ValueError, TypeError) as e:
                if len(prompts) > 1:  # which prompt; the exception (its type, its `field`) stays
                    e.args = (f"prompt {i}: {e}",)
                raise
        others: list[StepDelta] = []  # deltas of requests added through add_request()
        try:  # each id is ours before its request is added: an interrupt anywhere aborts it
            for (text, token_ids), sp, pr in zip(prompts, params, priorities):
                ids.append(engine.new_request_id(sp.n))
                engine.add_request(token_ids, sp, ids[-1], prompt=text, priority=pr)
            wanted = set(ids)
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
            start, generated, done = time.perf_counter(), 0, 0
            while len(results) < len(ids):
                deltas = engine.step()
                others += [d for d in deltas if d.request_id not in wanted]
                for delta in deltas:
                    if delta.request_id not in wanted:
                        continue
                    generated += len(delta.new_token_ids)
                    if delta.finish_reason == "error" and delta.error is None:
                        raise RuntimeError(f"request {delta.request_id} failed in a model step: "
                                           f"{engine.last_error!r}") from engine.last_error
                    if delta.finished:
                        results[delta.request_id] = delta.output
                        done += 1
                # the rate first, then the count: the bar is drawn once per change, final one too
                bar.set_postfix_str(f"output {generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s",
                                    refresh=False)
                bar.update(done - bar.n)
            bar.close()
        finally:
            engine.requeue(others)
            unfinished = [i for i in ids if i not in results]
            if unfinished:  # an error or interrupt: ours end here, reported to nobody
                engine.abort_request(unfinished, report=False)
        return [results[i] for i in ids]


def default_sampling_params(generation_defaults: dict[str, float]) -> SamplingParams:
    """SamplingParams() with a checkpoint's generation_config sampling fields over it (top_k 0 in
    transformers' sense is off here too); a value SamplingParams rejects is ignored with a
    warning."""
    try:
        return SamplingParams(**generation_defaults)
    except (TypeError, ValueError) as e:
        logger.warning("ignoring the checkpoint's generation_config sampling defaults: %s", e)
        return SamplingParams()


def per_prompt(value: Any, one: type, default: Any, count: int, name: str, kind: str) -> list[Any]:
    """`value` as `count` entries, one per prompt: None gives `default` each, one `one` (`kind`
    in messages) gives itself each, a list or tuple of `count` entries itself."""
    if value is None:
        return [default] * count
    if isinstance(value, one) and not isinstance(value, bool):
        return [value] * count
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be {kind} or a list of them, got {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} prompts; pass {kind} "
                         "or one per prompt")
    return list(value)


# apply_chat_template's own parameters and the template's fixed variables: not `chat_template_kwargs`
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_options(chat_template_kwargs: object = None, add_generation_prompt: object = True,
                       continue_final_message: object = False) -> dict[str, Any]:
    """vLLM's chat rendering options, checked; returns the template's extra variables (a copy
    of `chat_template_kwargs`). TypeError or ValueError naming the field: the kwargs must be a
    dict with string keys, none of `RESERVED_TEMPLATE_KWARGS`; the two flags booleans, not both
    true (a continued final message gets no generation prompt after it)."""
    for name, flag in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a boolean, got {type(flag).__name__}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message cannot be true with add_generation_prompt true "
                         "(set add_generation_prompt to false)")
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(
            isinstance(k, str) for k in chat_template_kwargs):
        raise TypeError("chat_template_kwargs must be an object of named template variables")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {reserved[0]!r}: the renderer sets it "
                         "(pass it as its own field where there is one)")
    return dict(chat_template_kwargs)


def render_chat(tokenizer: Any, conversation: Sequence[dict[str, Any]], *, tokenize: bool = True,
                tools: Sequence[dict[str, Any]] | None = None, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int] | str:
    """A conversation rendered with the chat template: token ids, or the text (``tokenize``
    false). `tools`: OpenAI's tool objects, for the template; `chat_template`: a template
    replacing the tokenizer's; the flags and `template_kwargs` (`check_chat_options`'s) as
    transformers' `apply_chat_template` takes them."""
    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    if chat_template is not None:
        extra["chat_template"] = chat_template
    out = tokenizer.apply_chat_template(
        list(conversation), add_generation_prompt=add_generation_prompt, tokenize=tokenize,
        continue_final_message=continue_final_message, **extra, **(template_kwargs or {}))
    if not tokenize:
        return str(out)
    if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def _llm_signature() -> inspect.Signature:
    """LLM's signature as the engine's knobs make it: `model`, then every EngineConfig field."""
    own = list(inspect.signature(LLM.__init__).parameters.values())[:2]  # self, model
    knobs = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=f.type) for f in dataclasses.fields(EngineConfig)]
    return inspect.Signature(own + knobs, return_annotation=None)


LLM.__init__.__signature__ = _llm_signature()  # type: ignore[attr-defined]
