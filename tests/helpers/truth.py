"""The in-process engine's answers, for the server tests to compare with: `answers(loaded,
engine, jobs)` builds `LLM(model, **engine)` (the server's engine options, tests/helpers/
server_helpers.py), whose compiled steps go to the compile cache the server reads too
($MINIVLLM_JAX_COMPILE_CACHE, tests/conftest.py: a program either needs is compiled once), and
returns each job's RequestOutputs as plain data.

A job: {"kind": "generate" | "chat" | "alone", "prompts": [...] | "messages": [...],
"params": SamplingParams keywords}. "generate" is one `LLM.generate` call over all prompts,
"alone" one call per prompt, "chat" one `LLM.chat` call.
"""
from __future__ import annotations

import gc
from typing import Any


def as_json(out: Any) -> dict[str, Any]:
    return {"prompt_token_ids": list(out.prompt_token_ids), "outputs": [{
        "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
        "logprobs": None if c.logprobs is None else [
            {str(t): [lp.logprob, lp.rank, lp.decoded_token] for t, lp in pos.items()}
            for pos in c.logprobs]} for c in out.outputs]}


def answers(loaded: Any, engine: dict[str, Any], jobs: dict[str, dict[str, Any]]
            ) -> dict[str, list[dict[str, Any]]]:
    """Each job's RequestOutputs (`as_json`) from `LLM(model, **engine)`. `loaded` (the session's
    `loaded_model`) is that model when its dtype is the one the server loads ("auto"), else the
    engine loads the embedded model as the server does. The engine is dropped before returning
    (its KV cache is not kept while the server runs)."""
    import jax.numpy as jnp

    from minivllm_jax import LLM, SamplingParams
    from minivllm_jax.loader import resolve_dtype

    same = loaded is not None and jnp.dtype(loaded.dtype) == jnp.dtype(resolve_dtype("auto"))
    llm = LLM(loaded if same else None, **engine)
    out: dict[str, list[dict[str, Any]]] = {}
    for name, job in jobs.items():
        sp = SamplingParams(**job["params"])
        if job["kind"] == "chat":
            outs = llm.chat(job["messages"], sp, use_tqdm=False)
        elif job["kind"] == "generate":
            outs = llm.generate(job["prompts"], sp, use_tqdm=False)
        else:
            outs = [llm.generate(p, sp, use_tqdm=False)[0] for p in job["prompts"]]
        out[name] = [as_json(o) for o in outs]
    del llm
    gc.collect()
    return out
