"""Waiting queues: FCFS with prepend, priority heap on (priority, arrival_time, request_id)."""
from __future__ import annotations

import random

import pytest

from scheduler import FCFSRequestQueue, PriorityRequestQueue, Request, SamplingParams
from scheduler.request_queue import create_request_queue


def _r(rid: str, priority: int = 0, t: float = 0.0) -> Request:
    return Request(rid, [1], SamplingParams(), priority=priority, arrival_time=t)


def test_fcfs_order_prepend_remove() -> None:
    q = FCFSRequestQueue()
    a, b, c, d = (_r(x) for x in "abcd")
    for r in (a, b, c):
        q.add_request(r)
    q.prepend_request(d)
    assert [r.request_id for r in q] == ["d", "a", "b", "c"] and len(q) == 4 and q
    assert q.peek_request() is d and q.pop_request() is d
    q.remove_request(b)
    assert [r.request_id for r in q] == ["a", "c"]
    q.pop_request(), q.pop_request()
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.peek_request()


def test_priority_order_matches_sorting() -> None:
    rng = random.Random(0)
    reqs = [_r(f"r{i}", rng.randrange(3), float(rng.randrange(5))) for i in range(30)]
    q = PriorityRequestQueue()
    for r in reqs:
        q.add_request(r)
    expected = sorted(reqs, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    assert list(q) == expected and len(q) == 30  # iteration does not consume
    q.remove_request(expected[3])
    del expected[3]
    late = _r("late", priority=9, t=0.0)
    q.prepend_request(late)  # a preempted request goes back by its priority, not to the front
    expected.append(late)
    assert [q.pop_request() for _ in range(len(q))] == expected


def test_create_request_queue() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match="policy"):
        create_request_queue("random")
