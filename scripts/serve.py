#!/usr/bin/env python
"""Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).

    python scripts/serve.py [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] \\
        [--max-waiting-requests N] [--max-body-bytes N] [the engine options of generate.py]

The same as `minivllm-jax serve`; the code and its options are minivllm_jax/cli/serve.py.
"""
import sys

from minivllm_jax.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
