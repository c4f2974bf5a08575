#!/usr/bin/env python
"""Generate completions with minivllm-jax (default model: the embedded SmolLM2-135M-Instruct).

    python scripts/generate.py --prompt "What is the capital of France?"
    python scripts/generate.py --prompts-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1

The same as `minivllm-jax generate`; the code and its options are minivllm_jax/cli/generate.py.
"""
import sys

from minivllm_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
