"""One engine thread steps the engine; each HTTP request reads its own asyncio queue of deltas.

Invariants:
- Every `LLMEngine` call (check, add, abort, step, stats) happens on the engine thread. The event
  loop hands it work only through a `queue.Queue` of commands, and it answers only through
  `loop.call_soon_threadsafe`; so no request waits on another's HTTP I/O, and the engine never
  waits on a client.
- A `Submission` (one HTTP request: one engine request per prompt) ends exactly once: when every
  engine request of it has reported `finished`, or with an `EngineError` (engine dead, shutting
  down). It is tracked (`_tracked`, touched on the loop thread only) until it ends, whether or not
  anyone still reads it, and its ids are aborted when its reader goes away first.
- A model step that fails (`LLMEngine.before_dispatch` included, which runs inside it) fails
  only the submissions whose requests were in that step, with `RequestFailed`; the engine serves
  on (see `LLMEngine.step`). Any other exception on the engine thread kills the engine: the thread
  stops, `health()` reports it, every tracked submission fails with `EngineDeadError`, and every
  later `submit` with `EngineUnavailable`. Nothing waits for the engine again.
- Admission: samples queued for the engine thread (a constraint's grammar being prepared
  included) plus the scheduler's waiting ones never exceed `max_waiting_requests`; a submit
  that would exceed it fails at once with `Overloaded`.
- A structured-output constraint's grammar work (checks, an isolated first compile, the compile)
  runs on a thread of its own pool before the request reaches the engine thread
  (`StructuredOutputManager.prepare`; llguidance releases the GIL): neither the event loop nor
  the engine waits for it, and a constraint that cannot be served is a `RequestRejected`
  naming ``structured_outputs``. A request its constraint ends mid-generation fails alone with
  a `RequestRejected` carrying the reason.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from minivllm_jax.engine.llm_engine import EngineStats, LLMEngine
from minivllm_jax.outputs import RequestOutput, StepDelta
from minivllm_jax.serving.metrics import ServerMetrics
from minivllm_jax.structured_output.manager import StructuredOutputManager
from scheduler import InvalidFieldError, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """A request the engine did not serve to its end."""


class RequestRejected(EngineError):
    """The engine refused the request's input: its ValueError/TypeError message, and `field`, the
    engine's name of the field it refused (`InvalidFieldError.field`; None when it named none)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    @classmethod
    def of(cls, error: Exception) -> "RequestRejected":
        """The rejection of the engine's `error`."""
        return cls(str(error), error.field if isinstance(error, InvalidFieldError) else None)


class Overloaded(EngineError):
    """More waiting requests than `max_waiting_requests`."""


class EngineUnavailable(EngineError):
    """The engine is dead or shutting down: no new request is taken."""


class EngineDeadError(EngineError):
    """The engine thread died while this request was in flight."""


class RequestFailed(EngineError):
    """A model step this request was part of failed (the engine serves on)."""


class ShuttingDown(EngineError):
    """The server is shutting down while this request was in flight."""


# threads preparing constraints' grammars at once (their first compiles queue on one process)
GRAMMAR_THREADS = 4


@dataclass(frozen=True)
class AsyncEngineConfig:
    """`max_waiting_requests`: the most samples that may wait for a batch slot (None: no cap).
    `stop_timeout_s`: how long `stop()` waits for the engine thread to finish its step."""

    max_waiting_requests: int | None = None
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        m = self.max_waiting_requests
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"max_waiting_requests must be an int >= 0 or None, got {m!r}")


@dataclass(frozen=True)
class EngineRequest:
    """One engine request: its id, tokenized prompt (and its text), sampling parameters and
    priority; `checks`, constraints that must compile (a refusal names its request field) though
    they constrain nothing (a request's tools: tools.py)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    checks: tuple[tuple[str, StructuredOutputsParams], ...] = ()


@dataclass(frozen=True)
class Health:
    healthy: bool
    status: str  # "ok", "dead", "shutting down", "starting"
    error: str | None
    stats: EngineStats


class Submission:
    """The deltas of one HTTP request's engine requests, in engine order, from one asyncio
    queue; `outputs[i]` is prompt i's RequestOutput once it finished."""

    def __init__(self, requests: Sequence[EngineRequest], loop: asyncio.AbstractEventLoop) -> None:
        self.requests = list(requests)
        self.request_ids = [r.request_id for r in requests]
        self.outputs: list[RequestOutput | None] = [None] * len(requests)
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.queue: asyncio.Queue[tuple[int, StepDelta] | EngineError] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.first_token: list[float | None] = [None] * len(requests)
        self.last_token: list[float] = [0.0] * len(requests)
        self.error: EngineError | None = None
        self._unread = len(self.requests)  # prompts whose finished delta nobody read yet

    @property
    def num_samples(self) -> int:
        return sum(r.params.n for r in self.requests)

    @property
    def done(self) -> bool:
        return self.error is not None or all(o is not None for o in self.outputs)

    async def deltas(self) -> AsyncIterator[tuple[int, StepDelta]]:
        """(prompt index, delta) until every prompt's finished delta was read; raises the
        EngineError that ended the submission early, if one did."""
        while self._unread:
            item = await self.queue.get()
            if isinstance(item, EngineError):
                raise item
            if item[1].finished:
                self._unread -= 1
            yield item

    async def results(self) -> list[RequestOutput]:
        """Every prompt's finished RequestOutput, in prompt order."""
        async for _ in self.deltas():
            pass
        return [o for o in self.outputs if o is not None]

    def fail(self, error: EngineError) -> None:
        if self.done:
            return
        self.error = error
        if not self.accepted.done():
            self.accepted.set_exception(error)
            self.accepted.exception()  # retrieved: no "never retrieved" warning if unawaited
        self.queue.put_nowait(error)


@dataclass
class _Add:
    submission: Submission


@dataclass
class _Abort:
    request_ids: list[str]


class _Stop:
    pass


Command = _Add | _Abort | _Stop


class GrammarPool:
    """Constraints' grammar work (`StructuredOutputManager.prepare`) on threads of its own, off
    the event loop and the engine thread; the manager's grammar worker runs from `start` to
    `close`. With no manager (a model without a tokenizer) there is nothing to do."""

    def __init__(self, structured: StructuredOutputManager | None) -> None:
        self.structured = structured
        self._threads = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="minivllm-grammar")

    def start(self) -> None:
        if self.structured is not None:
            self.structured.start_worker()

    async def prepare(self, requests: Sequence[EngineRequest]) -> None:
        """Every distinct check, then every distinct constraint, of `requests` prepared
        (RequestRejected when one cannot be served: a check's names its request field)."""
        checks = {c.key: (name, c) for r in requests for name, c in r.checks}
        constraints = {r.params.structured_outputs.key: (None, r.params.structured_outputs)
                       for r in requests if r.params.structured_outputs is not None}
        structured = self.structured
        for group in (checks, constraints):
            if group and structured is not None:
                await asyncio.gather(*(self._prepare(structured, name, c)
                                       for name, c in group.values()))

    async def _prepare(self, structured: StructuredOutputManager, name: str | None,
                       constraint: StructuredOutputsParams) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._threads, structured.prepare, constraint)
        except (ValueError, TypeError) as e:
            if name is None:
                raise RequestRejected.of(e) from None
            raise RequestRejected(str(e).replace(f"structured_outputs.{constraint.kind}",
                                                 name, 1), name) from None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.structured is not None:
            self.structured.close()


class AsyncEngine:
    """The engine thread and the loop-side bookkeeping of an `LLMEngine`. Loop-side methods
    (`start`, `submit`, `abort`, `begin_shutdown`, `stop`, `health`) run on the event loop's
    thread; `begin_shutdown_threadsafe` may be called from anywhere, a signal handler included."""

    def __init__(self, engine: LLMEngine, config: AsyncEngineConfig | None = None, *,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config or AsyncEngineConfig()
        self.metrics = metrics
        self._commands: queue.Queue[Command] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tracked: dict[str, tuple[Submission, int]] = {}  # loop thread: request id -> (sub, prompt)
        # shared with the engine thread, under _lock: samples queued for it, its latest stats
        self._lock = threading.Lock()
        self._queued_samples = 0
        self._stats = engine.make_stats()
        self._dead: str | None = None  # set once, by the engine thread
        self._closing = False          # loop thread
        self._live: set[str] = set()   # engine thread: ids of the engine's unfinished requests
        self._grammars = GrammarPool(engine.structured)

    # ---- loop side -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the deltas."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = asyncio.get_running_loop()
        self._publish_stats()
        self._grammars.start()  # before the engine thread uses the tokenizer
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    async def submit(self, requests: Sequence[EngineRequest]) -> Submission:
        """Queue the requests (all or none) and wait until the engine took them. Raises
        Overloaded / EngineUnavailable at once, RequestRejected when the engine refuses one."""
        if self._loop is None:
            raise EngineUnavailable("the engine is not started")
        if self._dead is not None or self._closing:
            raise EngineUnavailable("the engine is dead: " + self._dead if self._dead is not None
                                    else "the server is shutting down")
        sub = Submission(requests, self._loop)
        with self._lock:
            limit = self.config.max_waiting_requests
            waiting = self._stats.num_waiting_reqs + self._queued_samples
            if limit is not None and waiting + sub.num_samples > limit:
                raise Overloaded(f"the server has {waiting} requests waiting (at most {limit}); "
                                 "retry later")
            self._queued_samples += sub.num_samples
        try:
            await self._grammars.prepare(sub.requests)
        except BaseException:
            with self._lock:
                self._queued_samples -= sub.num_samples
            raise
        for i, rid in enumerate(sub.request_ids):
            self._tracked[rid] = (sub, i)
        self._commands.put(_Add(sub))
        try:
            await sub.accepted
        except asyncio.CancelledError:  # the client went away before the engine took them
            self.abort(sub)
            raise
        return sub

    def abort(self, sub: Submission) -> None:
        """Abort the unfinished engine requests of `sub` (a no-op once it ended); their final
        deltas still arrive and untrack them."""
        if sub.done or self._dead is not None:
            return
        ids = [rid for rid, out in zip(sub.request_ids, sub.outputs) if out is None]
        self._commands.put(_Abort(ids))

    def begin_shutdown(self) -> None:
        """Fail every tracked submission with ShuttingDown, refuse new ones, and tell the engine
        thread to abort everything and stop."""
        if self._closing:
            return
        self._closing = True
        self._fail_all(ShuttingDown("the server is shutting down"))
        self._commands.put(_Stop())

    def begin_shutdown_threadsafe(self) -> None:
        """`begin_shutdown` on the loop's thread; safe from a signal handler (it only schedules)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_shutdown)

    async def stop(self) -> None:
        """Shut down and wait (up to `stop_timeout_s`) for the engine thread to end; then stop
        the grammar threads and worker."""
        self.begin_shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self.config.stop_timeout_s)
        self._grammars.close()

    def health(self) -> Health:
        stats = self.stats()
        if self._dead is not None:
            return Health(False, "dead", self._dead, stats)
        if self._closing:
            return Health(False, "shutting down", None, stats)
        if self._thread is None:
            return Health(False, "starting", None, stats)
        return Health(True, "ok", None, stats)

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    def _deliver(self, deltas: list[StepDelta]) -> None:
        """Loop thread: route one step's deltas to their submissions' queues."""
        now = time.perf_counter()
        seen: set[str] = set()
        for d in deltas:
            entry = self._tracked.get(d.request_id)
            if entry is None:  # its submission already failed (shutdown)
                continue
            sub, i = entry
            if d.finish_reason == "error":  # all its samples failed in this step: it ends here
                if self.metrics is not None:
                    self.metrics.request_finished("error", now - sub.arrival)
                self._fail(sub, RequestFailed("the engine failed to run a step of this request; "
                                              "other requests are unaffected")
                           if d.error is None else RequestRejected(d.error, "structured_outputs"))
                continue
            if d.new_token_ids:
                self._record_tokens(sub, i, len(d.new_token_ids), now, d.request_id in seen)
                seen.add(d.request_id)
            if d.finished and d.output is not None:
                sub.outputs[i] = d.output
                del self._tracked[d.request_id]
                if self.metrics is not None:
                    reason = d.output.outputs[0].finish_reason or "abort"
                    self.metrics.request_finished(reason, now - sub.arrival)
            sub.queue.put_nowait((i, d))

    def _record_tokens(self, sub: Submission, i: int, count: int, now: float, again: bool) -> None:
        """Token timing of engine request i of `sub` (`again`: another sample's delta of the
        same step, timed already)."""
        first = sub.first_token[i] is None
        if first:
            sub.first_token[i] = now
        ttft = now - sub.arrival if first else None
        itl = None if first or again else now - sub.last_token[i]
        sub.last_token[i] = now
        if self.metrics is not None:
            self.metrics.tokens(count, ttft, itl)

    def _accepted(self, sub: Submission, error: EngineError | None) -> None:
        """Loop thread: the engine thread took `sub` (error None) or refused all of it."""
        if error is not None:
            for rid in sub.request_ids:
                self._tracked.pop(rid, None)
            sub.fail(error)
            return
        if self.metrics is not None:
            self.metrics.request_accepted(sum(len(r.prompt_token_ids) for r in sub.requests))
        if not sub.accepted.done():
            sub.accepted.set_result(None)

    def _fail_all(self, error: EngineError) -> None:
        subs = {id(s): s for s, _ in self._tracked.values()}
        self._tracked.clear()
        for sub in subs.values():
            sub.fail(error)

    def _fail(self, sub: Submission, error: EngineError) -> None:
        """Loop thread: end `sub` with `error`, and abort its other engine requests."""
        self.abort(sub)
        for rid in sub.request_ids:
            self._tracked.pop(rid, None)
        sub.fail(error)

    def _died(self) -> None:
        """Loop thread: the engine thread died (`_dead` is set)."""
        self._fail_all(EngineDeadError(f"the engine failed: {self._dead}"))

    # ---- engine thread ---------------------------------------------------------------------
    def _call_loop(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile: nobody is left to tell
            pass

    def _run(self) -> None:
        engine, stopping, live = self.engine, False, self._live
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if stopping and idle:
                    return
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in commands:
                    if isinstance(cmd, _Add):
                        self._add(cmd.submission, live, refuse=stopping)
                    elif isinstance(cmd, _Abort):
                        engine.abort_request(cmd.request_ids)
                    elif not stopping:  # _Stop: abort all; the loop ends once they are reported
                        stopping = True
                        engine.abort_request(list(live))
                if engine.has_unfinished_requests():
                    deltas = engine.step()
                    for d in deltas:
                        if d.finished:
                            live.discard(d.request_id)
                    self._call_loop(self._deliver, deltas)
                self._publish_stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            self._dead = f"{type(e).__name__}: {e}"
            logger.error("the engine failed; every in-flight request ends with an error", exc_info=e)
            self._publish_stats()
            self._call_loop(self._died)

    def _add(self, sub: Submission, live: set[str], refuse: bool) -> None:
        """Engine thread: check every request of `sub`, then add them all (or none)."""
        engine, error = self.engine, None
        if refuse:
            error = EngineUnavailable("the server is shutting down")
        else:
            try:
                for r in sub.requests:
                    engine.check_request(r.prompt_token_ids, r.params, r.priority)
            except (ValueError, TypeError) as e:
                error = RequestRejected.of(e)
        if error is None:
            for r in sub.requests:
                engine.add_request(r.prompt_token_ids, r.params, r.request_id, r.prompt, r.priority)
                live.add(r.request_id)
        with self._lock:
            self._queued_samples -= sub.num_samples
        self._call_loop(self._accepted, sub, error)

    def _publish_stats(self) -> None:
        """Engine thread (or before it starts): snapshot the engine's state."""
        stats = self.engine.make_stats()
        with self._lock:
            self._stats = stats
