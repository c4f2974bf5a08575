"""The ahead-of-time tests' shared fixture."""
from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def libtpu_env() -> Iterator[None]:
    """What the command line sets before libtpu loads: no metadata server to ask, and no lock
    on a TPU (another process may hold /tmp/libtpu_lockfile)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPU_SKIP_MDS_QUERY", "1")
        mp.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        yield
