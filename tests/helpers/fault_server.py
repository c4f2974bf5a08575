"""scripts/serve.py with a step fault, for tests/serving/test_serve_faults.py (the fault lives
here, in the tests, not in the shipped server).

    python tests/helpers/fault_server.py [serve.py's options]

Every engine the server builds gets a `before_dispatch` hook (the engine's own tracing hook, which
runs inside each step before it is dispatched; what it raises fails that step) that raises when
the step holds a request whose prompt text contains MARKER.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

MARKER = "fault-marker-7f3a"


def install() -> None:
    """Patch LLMEngine so that each engine built afterwards fails a step that holds a marked
    request (one whose prompt text contains MARKER)."""
    from minivllm_jax.engine.llm_engine import LLMEngine

    from_model, add_request = LLMEngine.from_model.__func__, LLMEngine.add_request  # type: ignore[attr-defined]

    def faulty_from_model(cls: type[LLMEngine], *args: Any, **kwargs: Any) -> LLMEngine:
        engine = from_model(cls, *args, **kwargs)
        engine.marked = set()  # type: ignore[attr-defined]

        def fault(request_ids: set[str]) -> None:
            if request_ids & engine.marked:  # type: ignore[attr-defined]
                raise RuntimeError("injected step fault (tests/helpers/fault_server.py)")

        engine.before_dispatch = fault
        return engine

    def marking_add_request(self: LLMEngine, *args: Any, **kwargs: Any) -> str:
        request_id = add_request(self, *args, **kwargs)
        prompt = inspect.signature(add_request).bind(self, *args, **kwargs).arguments.get("prompt")
        if isinstance(prompt, str) and MARKER in prompt and hasattr(self, "marked"):
            self.marked.add(request_id)
        return request_id

    LLMEngine.from_model = classmethod(faulty_from_model)  # type: ignore[method-assign,assignment]
    LLMEngine.add_request = marking_add_request  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from minivllm_jax.cli.serve import main

    sys.exit(main())
