#!/usr/bin/env python
"""Run minivllm-jax tensor-parallel over several processes (hosts) with jax.distributed.

    python scripts/launch_multihost.py --coordinator HOST0:7777 --num-processes 2 --process-id 0

The same as `minivllm-jax multihost`; the code and its options are minivllm_jax/cli/multihost.py.
"""
import sys

from minivllm_jax.cli.multihost import main

if __name__ == "__main__":
    sys.exit(main())
