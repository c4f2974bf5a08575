"""Multi-host serving: every process builds the same engine over the global mesh, and only
process 0 schedules. It broadcasts each step's static header and packed int32 metadata
(`StepChannel`) so that every process runs the jitted programs on identical inputs; the others
loop in `ModelRunner.follow` until process 0 calls `ModelRunner.stop_followers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np


def broadcast_from_leader(value: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """Process 0's int32 ``value`` on every process; the others pass None (only ``shape`` is
    used). A collective: every process must call it, in the same order."""
    from jax.experimental import multihost_utils

    leader = jax.process_index() == 0
    x = np.asarray(value, np.int32) if leader else np.zeros(shape, np.int32)
    if x.shape != shape:
        raise ValueError(f"broadcast value has shape {x.shape}, expected {shape}")
    return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=leader))


@dataclass(frozen=True)
class StepChannel:
    """Process 0 -> all processes: a step's static header ints, then its packed int32 buffer.

    Message: ``[RUN, len(buf), *header]`` (``header_len`` ints), then ``buf``; ``[STOP, 0, ...]``
    ends the followers' loop. Both sides agree on ``header_len``; buffer sizes travel in the
    message, so every broadcast has a shape all processes know.
    """

    header_len: int
    RUN = 1
    STOP = 0

    def send(self, header: Sequence[int], buf: np.ndarray) -> np.ndarray:
        """Leader: broadcast one step; returns the buffer as every process received it."""
        if len(header) != self.header_len:
            raise ValueError(f"header must have {self.header_len} ints, got {len(header)}")
        broadcast_from_leader(np.array([self.RUN, buf.size, *header]), (self.header_len + 2,))
        return broadcast_from_leader(buf, (buf.size,))

    def stop(self) -> None:
        """Leader: tell the followers to return."""
        broadcast_from_leader(np.zeros(self.header_len + 2), (self.header_len + 2,))

    def receive(self) -> tuple[tuple[int, ...], np.ndarray] | None:
        """Follower: the next (header, buf), or None when the leader stopped."""
        head = broadcast_from_leader(None, (self.header_len + 2,))
        if head[0] == self.STOP:
            return None
        return tuple(int(h) for h in head[2:]), broadcast_from_leader(None, (int(head[1]),))
