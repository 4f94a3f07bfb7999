"""Arrival sources: where the replica loop's requests come from.

A source is a SimPy process that hands requests to the loop (``deliver(request)``) when they
arrive. The loop does not care where they come from: a trace replay today; closed-loop
clients (at most C in flight, the next sent when one finishes) or an HTTP server's requests
plug in the same way (``ClientSource``: closed-loop clients). The protocol:

- ``process(env, deliver)``: a generator run as a SimPy process; calls ``deliver(req)`` at
  each arrival and returns when the source has nothing more to send;
- ``next_arrival_s()``: when the next request will arrive, if known (``None`` when there is
  none left or the time is unknown); a simulated replica runs ahead of SimPy until then;
- ``finished(request_state, t)``: a request finished at ``t`` (closed-loop clients react); the
  loop also calls it, at the delivery time, for a request the replica refused on arrival
  (too large for its KV cache: a server's immediate error);
- ``requests``: the requests known up front (a trace's), or ``None``; a real backend sizes
  its warm-up and checks prompt lengths against the model with them.

``LiveSource``: requests handed in from other threads while the replica runs (an HTTP
server's), on the wall clock, and cancellations (a client that went away).
"""

from __future__ import annotations

import heapq
import math
import queue
import threading
from dataclasses import replace
from typing import Any, Callable, Iterator, Protocol, Sequence

from schedlab.traces.schema import Request


class ArrivalSource(Protocol):
    requests: Sequence[Request] | None

    def process(self, env, deliver: Callable[[Request], None]) -> Iterator: ...

    def next_arrival_s(self) -> float | None: ...

    def finished(self, r, t: float) -> None: ...


def may_cancel(source: ArrivalSource) -> bool:
    """Whether a request still to come may carry a cancellation (``Request.cancel_after_s``): a
    replica then stops its bulk steps at every arrival, as the time its client goes away is
    known only once it has come. A source whose requests are not all known ahead (a live one)
    may."""
    if not isinstance(source, (TraceSource, ClientSource)):
        return True
    return any(r.cancel_after_s is not None for r in source.requests)


class TraceSource:
    """Replays a trace: each request arrives at its ``arrival_s`` (in trace order)."""

    def __init__(self, requests: Sequence[Request]):
        self.requests = list(requests)
        self._next = 0

    def process(self, env, deliver):
        reqs = self.requests
        for i, r in enumerate(reqs):
            if r.arrival_s > env.now:
                yield env.timeout(r.arrival_s - env.now)
            self._next = i + 1
            deliver(r)

    def next_arrival_s(self) -> float | None:
        i = self._next
        return self.requests[i].arrival_s if i < len(self.requests) else None

    def finished(self, r, t: float) -> None:
        pass


class ClientSource:
    """Clients as ``vllm bench serve`` runs them: every request is *issued* at its scheduled
    time, in trace order, and *sent* once one of ``max_concurrency`` slots is free.

    vllm/benchmarks/serve.py (``benchmark``): ``get_request`` yields the requests at their
    schedule (the request-rate schedule, or a trace's own timestamps), each becomes a task,
    and the task waits on ``asyncio.Semaphore(max_concurrency)`` before it sends; the
    semaphore wakes waiters first come, first served. The request's start (TTFT, E2E are
    measured from it) is when it is sent, after the semaphore. So here: the send time of
    request i is the first moment at or after its scheduled time when fewer than C requests
    are in flight, and requests are sent in schedule order. A request's ``arrival_s`` on the
    replica is its send time; ``scheduled_s`` keeps the schedule (its ``client_queue`` time is
    the difference). ``max_concurrency=None``: no semaphore (the schedule alone, an open loop).

    ``think_s`` (not in vLLM): a slot becomes free that many seconds after its request
    finished, as a user who reads the answer before asking again.

    Works with both clocks. Under ``SimClock`` the replica runs ahead of SimPy: ``finished``
    is called at the replica's time, ahead of ``env.now``, so the release is kept as a pending
    time and ``next_arrival_s`` reports the next send time as soon as a release makes it
    known (the replica then hands control to SimPy in time for it).
    """

    def __init__(
        self,
        requests: Sequence[Request],
        max_concurrency: int | None = None,
        think_s: float = 0.0,
        schedule: Sequence[float] | None = None,
    ):
        if max_concurrency is not None and (
            isinstance(max_concurrency, bool) or int(max_concurrency) != max_concurrency or max_concurrency < 1
        ):
            raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
        if not (think_s >= 0 and math.isfinite(think_s)):
            raise ValueError(f"think time must be a finite number >= 0, got {think_s!r}")
        self.requests = list(requests)
        times = [r.arrival_s for r in self.requests] if schedule is None else [float(t) for t in schedule]
        if len(times) != len(self.requests):
            raise ValueError(f"{len(times)} scheduled times for {len(self.requests)} requests")
        if any(not (t >= 0 and math.isfinite(t)) for t in times):
            raise ValueError("scheduled times must be finite and >= 0")
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("requests are issued in order: scheduled times must not decrease")
        self.schedule = times
        self.max_concurrency = None if max_concurrency is None else int(max_concurrency)
        self.think_s = float(think_s)
        self.scheduled_s: dict[str, float] = {r.id: t for r, t in zip(self.requests, times)}
        self.sent_s: dict[str, float] = {}
        self._next = 0  # index of the next request to send
        self._active = 0  # slots held (a slot whose release time has come is freed lazily)
        self._releases: list[float] = []  # pending release times (a min-heap)
        self._wake = None  # the event the process waits on while every slot is held
        self.options: dict[str, Any] = {}  # how the schedule was made (for the run's summary)

    def describe(self) -> dict[str, Any]:
        return {"max_concurrency": self.max_concurrency, "think_s": self.think_s, **self.options}

    def _free_due(self, now: float) -> None:
        rel = self._releases
        while rel and rel[0] <= now:
            heapq.heappop(rel)
            self._active -= 1

    def process(self, env, deliver):
        cap = self.max_concurrency
        for i, r in enumerate(self.requests):
            s = self.schedule[i]
            while True:
                self._free_due(env.now)
                if cap is None or self._active < cap:
                    if s > env.now:
                        yield env.timeout(s - env.now)
                        continue  # (nothing else takes a slot meanwhile: only this process sends)
                    break
                if self._releases:  # every slot held: wait for the first release
                    yield env.timeout(max(self._releases[0] - env.now, 0.0))
                else:  # ... which a finish will tell
                    self._wake = env.event()
                    yield self._wake
                    self._wake = None
            self._active += 1
            self._next = i + 1
            self.sent_s[r.id] = env.now
            deliver(r if r.arrival_s == env.now else replace(r, arrival_s=env.now))

    def next_arrival_s(self) -> float | None:
        i = self._next
        if i >= len(self.requests):
            return None
        s = self.schedule[i]
        cap = self.max_concurrency
        if cap is None or self._active < cap:
            return s
        k = self._active - cap  # releases needed beyond the ones that free a slot: the (k+1)-th
        if len(self._releases) <= k:
            return None  # it waits on a finish not yet known
        t = heapq.nsmallest(k + 1, self._releases)[-1]
        return max(s, t)

    def finished(self, r, t: float) -> None:
        heapq.heappush(self._releases, t + self.think_s)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()


class SourceClosed(RuntimeError):
    """A request handed to a ``LiveSource`` that no longer takes any."""


class LiveSource:
    """Requests that arrive while the replica runs, from any thread (an HTTP server's handlers):
    ``submit(request)`` stamps it with the clock's time at that moment and queues it; the
    source's SimPy process hands the queued requests to the replica every ``poll_s`` seconds
    of wall time (the replica sees a request at its next step either way: a step is not
    interrupted). ``close()`` ends the source: what was submitted before is still delivered,
    then the replica finishes its requests and the run ends.

    ``on_ready()`` is called once the clock runs (after the backend's warm-up: from then on
    arrival times are the run's); ``on_finish(r, t)`` for every request that finished, or was
    refused on arrival (``r.finish_s`` is None then: larger than the KV capacity), on the
    replica's thread. ``received`` lists the requests as delivered, with their arrival times.
    """

    requests = None  # none known up front

    def __init__(
        self,
        clock,
        *,
        poll_s: float = 0.002,
        on_ready: Callable[[], None] | None = None,
        on_finish: Callable[[Any, float], None] | None = None,
    ):
        if not (poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError(f"poll_s must be a finite number > 0, got {poll_s!r}")
        self.clock = clock
        self.poll_s = float(poll_s)
        self.on_ready = on_ready
        self.on_finish = on_finish
        self.received: list[Request] = []
        # request id -> when its client went away (the clock's time), as ``cancel`` heard it
        self.cancelled: dict[str, float] = {}
        # where cancellations go: the replica loop's ``cancel`` (``sim.loop.run_replica`` sets it)
        self.replica_cancel: Callable[[str], None] | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # stamps and queues in one order
        self._running = False
        self._closed = False

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (any ``arrival_s``: it is stamped now); returns it as stamped.
        ``SourceClosed`` before the clock runs or after ``close()``."""
        with self._lock:
            if self._closed or not self._running:
                raise SourceClosed(
                    "the replica is not taking requests" if not self._closed else "the replica is shutting down"
                )
            r = replace(request, arrival_s=self.clock.now())
            self._queue.put(r)
        return r

    def cancel(self, rid: str) -> None:
        """Request ``rid``'s client went away (any thread): the replica ends it at its next step,
        wherever it is (waiting, prefilling, decoding); the time is kept in ``cancelled``."""
        with self._lock:
            if rid in self.cancelled:
                return
            self.cancelled[rid] = self.clock.now()
            self._cancels.put(rid)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        """Whether it was closed (the replica shuts down: it takes no more requests)."""
        return self._closed

    def process(self, env, deliver):
        with self._lock:
            self._running = True
        if self.on_ready is not None:
            self.on_ready()
        q = self._queue
        while True:
            while True:
                try:
                    r = q.get_nowait()
                except queue.Empty:
                    break
                self.received.append(r)
                deliver(r)
            while True:  # (after the arrivals: a request is delivered before its cancellation)
                try:
                    rid = self._cancels.get_nowait()
                except queue.Empty:
                    break
                if self.replica_cancel is not None:
                    self.replica_cancel(rid)
            with self._lock:
                if self._closed and q.empty():
                    return
            yield env.timeout(self.poll_s)

    def next_arrival_s(self) -> float | None:
        return None  # not known ahead

    def finished(self, r, t: float) -> None:
        if self.on_finish is not None:
            self.on_finish(r, t)


def clients(
    requests: Sequence[Request],
    max_concurrency: int | None = None,
    request_rate: float | None = None,
    burstiness: float | None = None,
    think_s: float = 0.0,
    seed: Any = 0,
):
    """What to hand ``run``: the requests themselves when no client option is given (a trace
    replay), else a ``ClientSource``: requests issued in trace order at the trace's times or,
    with ``request_rate``, at ``vllm bench serve``'s schedule (``traces.request_times``:
    Poisson, or gamma gaps of shape ``burstiness``; inf: all at once), each sent once fewer
    than ``max_concurrency`` are in flight."""
    if max_concurrency is None and request_rate is None:
        return requests
    schedule = None
    if request_rate is not None:
        from schedlab.traces import request_times

        schedule = request_times(len(requests), request_rate, 1.0 if burstiness is None else burstiness, seed)
    src = ClientSource(requests, max_concurrency, think_s, schedule)
    src.options = {
        "request_rate": request_rate,
        "burstiness": (1.0 if burstiness is None else burstiness) if request_rate is not None else None,
        "schedule": "request-rate" if request_rate is not None else "trace arrival times",
    }
    return src
