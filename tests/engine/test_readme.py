"""The README's Python examples run as written, in order, in one namespace (its "Use" section is
what users paste into a notebook first).

Its `LLM()` has the default engine shape, which test_cli.py's run of the embedded model takes too
(and copies its compiled step programs to the session's compile cache): after it, of the
examples' step programs only the 16-token forward compiles here."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run() -> None:
    blocks = _python_blocks()
    assert len(blocks) >= 2 and "llm.step()" in blocks[1]
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    printed = out.getvalue()
    # greedy: the same text again, from the same call (the same two prompts: a batch shape whose
    # programs the examples compiled; the first prompt alone would compile another)
    first = namespace["llm"].generate(["The capital of France is", "1, 2, 3,"],
                                      namespace["SamplingParams"](temperature=0.0, max_tokens=32),
                                      use_tqdm=False)[0].outputs[0]
    assert printed.startswith(f"{first.text} {first.finish_reason}\n")
    chat = namespace["outs"][0].outputs[0]
    assert chat.finish_reason == "stop" and "Paris" in chat.text  # explicit greedy parameters
    assert namespace["answer"]["capital"] == "Paris"  # structured outputs: valid JSON of the schema
    stats = namespace["llm"].get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1  # every block came back
    assert not namespace["llm"].has_unfinished_requests()
