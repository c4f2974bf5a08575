"""The in-process engine's answers, for the server tests to compare with: run as a script, it
reads jobs (JSON on stdin), builds `LLM(None, **engine)`, whose compiled steps go to the
compile cache the server reads too ($MINIVLLM_JAX_COMPILE_CACHE, tests/conftest.py: a program
either needs is compiled once), and writes each job's RequestOutputs as JSON on stdout.

A job: {"kind": "generate" | "chat" | "alone", "prompts": [...] | "messages": [...],
"params": SamplingParams keywords}. "generate" is one `LLM.generate` call over all prompts,
"alone" one call per prompt, "chat" one `LLM.chat` call.
"""
from __future__ import annotations

import json
import sys
from typing import Any


def as_json(out: Any) -> dict[str, Any]:
    return {"prompt_token_ids": list(out.prompt_token_ids), "outputs": [{
        "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
        "logprobs": None if c.logprobs is None else [
            {str(t): [lp.logprob, lp.rank, lp.decoded_token] for t, lp in pos.items()}
            for pos in c.logprobs]} for c in out.outputs]}


def main() -> None:
    spec = json.load(sys.stdin)
    from minivllm_jax import LLM, SamplingParams

    llm = LLM(None, **spec["engine"])  # its compiled steps go to the shared compile cache
    answers: dict[str, list[dict[str, Any]]] = {}
    for name, job in spec["jobs"].items():
        sp = SamplingParams(**job["params"])
        if job["kind"] == "chat":
            outs = llm.chat(job["messages"], sp, use_tqdm=False)
        elif job["kind"] == "generate":
            outs = llm.generate(job["prompts"], sp, use_tqdm=False)
        else:
            outs = [llm.generate(p, sp, use_tqdm=False)[0] for p in job["prompts"]]
        answers[name] = [as_json(o) for o in outs]
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
