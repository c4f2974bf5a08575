"""Waiting queues. Both iterate in scheduling order and support `len`.

FCFS: a deque; preempted requests are prepended so they resume first.
Priority: a heap on `priority_order(request)` = (priority, arrival_time, request_id); lower values
are scheduled first, and a preempted request simply goes back into the heap. The scheduler picks
its preemption victim as the running request *last* in this same total order, so of two requests
that keep taking blocks from each other, one always keeps its progress (no livelock on ties).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from scheduler.request import Request


class FCFSRequestQueue:
    """First come, first served; O(1) add, pop, peek and prepend."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def pop_request(self) -> Request:
        return self._q.popleft()

    def peek_request(self) -> Request:
        if not self._q:
            raise IndexError("peek from an empty queue")
        return self._q[0]

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def priority_order(request: Request) -> tuple[int, float, str]:
    """The priority policy's total order (smaller = scheduled first, preempted last)."""
    return request.priority, request.arrival_time, request.request_id


class PriorityRequestQueue:
    """Min-heap on `priority_order`: ties never compare Request objects."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_order(request), request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def prepend_request(self, request: Request) -> None:
        """Priority order decides, so prepending is adding."""
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


_QUEUES = {"fcfs": FCFSRequestQueue, "priority": PriorityRequestQueue}
POLICIES = tuple(_QUEUES)  # SchedulerConfig.policy's values


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy not in _QUEUES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return _QUEUES[policy]()
