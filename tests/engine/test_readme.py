"""The README's Python examples run as written, in order, in one namespace (its "Use" section is
what users paste into a notebook first)."""
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
    first = namespace["llm"].generate(["The capital of France is"],
                                      namespace["SamplingParams"](temperature=0.0, max_tokens=32),
                                      use_tqdm=False)[0].outputs[0]
    assert printed.startswith(f"{first.text} {first.finish_reason}\n")  # greedy: same text again
    chat = namespace["outs"][0].outputs[0]
    assert chat.finish_reason == "stop" and "Paris" in chat.text  # explicit greedy parameters
    stats = namespace["llm"].get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1  # every block came back
    assert not namespace["llm"].has_unfinished_requests()
