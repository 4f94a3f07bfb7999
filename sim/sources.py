"""Arrival sources: where the replica loop's requests come from.

A source is a SimPy process that hands requests to the loop (``deliver(request)``) when they
arrive. The loop does not care where they come from: a trace replay today; closed-loop
clients (at most C in flight, the next sent when one finishes) or an HTTP server's requests
plug in the same way. The protocol:

- ``process(env, deliver)``: a generator run as a SimPy process; calls ``deliver(req)`` at
  each arrival and returns when the source has nothing more to send;
- ``next_arrival_s()``: when the next request will arrive, if known (``None`` when there is
  none left or the time is unknown); a simulated replica runs ahead of SimPy until then;
- ``finished(request_state, t)``: a request finished at ``t`` (closed-loop clients react);
- ``requests``: the requests known up front (a trace's), or ``None``; a real backend sizes
  its warm-up and checks prompt lengths against the model with them.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol, Sequence

from traces.schema import Request


class ArrivalSource(Protocol):
    requests: Sequence[Request] | None

    def process(self, env, deliver: Callable[[Request], None]) -> Iterator: ...

    def next_arrival_s(self) -> float | None: ...

    def finished(self, r, t: float) -> None: ...


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
