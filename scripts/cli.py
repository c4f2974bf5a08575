"""The scripts' one rule for bad input: a ValueError, TypeError, OSError or NotImplementedError
(an unsupported model) becomes one ``error: ...`` line on stderr and exit status 2, never a
traceback. Scripts run from this folder, which Python puts on ``sys.path`` for them."""
from __future__ import annotations

import sys
from typing import Any, Callable

BAD_INPUT = (ValueError, TypeError, OSError, NotImplementedError)


def run_cli(main: Callable[[], Any]) -> int:
    """Call ``main``; 0 when it returns, 2 (with the one line) when it raises BAD_INPUT."""
    try:
        main()
    except BAD_INPUT as e:
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    return 0
