"""The README's Python examples run as written, in order, in one namespace (its "Use" section is
what users paste into a notebook first); then examples/quickstart.ipynb runs top to bottom in a
real Jupyter kernel (nbclient, ipykernel), loading the programs the README's `LLM()` compiled.

Its `LLM()` has the default engine shape, which test_cli.py's run of the embedded model takes too
(and copies its compiled step programs to the session's compile cache): after it, of the
examples' step programs only the 16-token forward compiles here."""
from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run() -> None:
    blocks = _python_blocks()
    assert len(blocks) >= 2 and "llm.step()" in blocks[1]
    namespace: dict = {}
    out = io.StringIO()
    first = None  # the first example's greedy output, kept before `outs` is reassigned
    with contextlib.redirect_stdout(out):
        for block in blocks:  # statement by statement
            for statement in ast.parse(block).body:
                exec(compile(ast.Module([statement], []), str(README), "exec"), namespace)
                if first is None and "outs" in namespace:
                    first = namespace["outs"][0].outputs[0]
    printed = out.getvalue()
    assert first.finish_reason in ("length", "stop") and 0 < len(first.token_ids) <= 32
    assert printed.startswith(f"{first.text} {first.finish_reason}\n") and "Paris" in first.text
    chat = namespace["outs"][0].outputs[0]
    assert chat.finish_reason == "stop" and "Paris" in chat.text  # explicit greedy parameters
    assert namespace["answer"]["capital"] == "Paris"  # structured outputs: valid JSON of the schema
    stats = namespace["llm"].get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] - 1  # every block came back
    assert not namespace["llm"].has_unfinished_requests()
    # add_request given a conversation sends what the tokenizer's chat template makes of it
    llm, tok = namespace["llm"], namespace["llm"].tokenizer
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    rid = llm.add_request(conversation, namespace["SamplingParams"](temperature=0.0, max_tokens=1))
    finals = []
    while llm.has_unfinished_requests():
        finals += [d.output for d in llm.step() if d.finished and d.request_id == rid]
    want = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert finals[0].prompt == want and finals[0].prompt.startswith("<|im_start|>")  # SmolLM2's
    assert finals[0].prompt_token_ids == tok(want, add_special_tokens=False)["input_ids"]


def test_quickstart_notebook_runs_in_a_kernel(tmp_path: Path) -> None:
    """Committed with outputs cleared; every cell runs without error in a fresh kernel (nbclient
    raises on the first failing cell); the outputs say what the cells claim: the repr, greedy
    and chat text, a widget progress bar (tqdm.auto in Jupyter), three samples, JSON of the
    schema, a figure, and an engine left with every block free."""
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    def text(cell: object) -> str:  # printed text and the cell's value (not displays: widgets)
        return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs
                       if o.output_type in ("stream", "execute_result"))

    def has(cell: object, mime: str) -> bool:
        return any(mime in o.get("data", {}) for o in cell.outputs)

    def cell(start: str) -> object:  # the code cell whose source starts so
        return next(c for c in code if c.source.startswith(start))

    assert text(code[0]).startswith("LLM(model=") and "kv_blocks=" in text(code[0])
    greedy = text(cell("greedy = ")).splitlines()
    assert len(greedy) == 2 and greedy[0].startswith("'The capital of France is' -> ")
    assert has(cell("greedy = "), "application/vnd.jupyter.widget-view+json")  # tqdm.auto's widget bar
    assert "Paris" in text(cell("reply = llm.chat"))
    samples = text(cell('out = llm.chat([{"role": "user", "content": "Name'))
    assert [line.split()[0] for line in samples.splitlines()[:3]] == ["0", "1", "2"]
    assert "'capital': 'Paris'" in text(cell("import json"))
    assert has(cell("import matplotlib.pyplot as plt"), "image/png")
    assert text(code[-1]).strip() == "True"
