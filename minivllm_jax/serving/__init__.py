"""An OpenAI-compatible HTTP server over the engine (`scripts/serve.py` runs it).

- `body`: raw request bytes -> JSON -> a parsed request, on the parser thread (hostile bodies
  are 400s naming the field).
- `protocol`: OpenAI request bodies -> `GenerationRequest` (prompts and `SamplingParams`), and
  the response, stream-chunk and error shapes.
- `tools`: tool calling (`tools`, `tool_choice`, tool conversations) and how a chat choice's
  text becomes its message; `output_parsers`: the tool-call and reasoning parsers it uses.
- `errors`: `APIError`, OpenAI's error shape.
- `async_engine`: the one engine thread and the per-request asyncio queues of deltas.
- `metrics`: Prometheus metrics (vLLM's names) on a per-app registry.
- `api`: the FastAPI app factory `build_app`.

Importing `minivllm_jax` never imports this package (nor fastapi); import the modules directly.
"""
