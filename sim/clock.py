"""Clocks: what turns a backend's seconds into time on the replica's timeline.

Both run a SimPy environment (arrivals are SimPy processes) and offer the same calls:

- ``start()``: time 0 is now (called once the backend has warmed up, right before the run);
- ``now()``: the current time on this clock;
- ``advance(seconds)``: a step or pass took ``seconds`` (as the backend reported);
- ``sync(next_arrival_s)``: after a step, the SimPy event the replica must wait on before
  planning again (so that arrivals due by now are delivered first), or ``None``;
- ``woke()``: the replica was idle and an arrival woke it;
- ``advance_steps(overhead, seconds, until)``: a run of steps, each ``overhead`` then one pass
  of the next of ``seconds``, up to the first that ends at or after ``until`` (an arrival; None:
  all of them); returns the seconds taken (those of the steps run) and the passes' starts and ends.
  ``lookahead``: ``seconds`` may be drawn a little past the step that stops the run (a pure
  formula); False for a cost model that may count or record its calls. The same as calling ``advance`` for each,
  time for time; ``SimClock`` does it without a Python call per step.

``SimClock`` jumps: time is the sum of predicted seconds. Between arrivals nothing else can
happen, so the replica runs ahead of ``env.now`` and hands control to SimPy only when an
arrival is due (same events, far fewer hops). ``WallClock`` is real time: a
``simpy.rt.RealtimeEnvironment`` fires arrivals at their wall-clock times, the backend's
seconds have already passed when it returns, and after a step that ends past an arrival's
time (or where the next arrival is not known ahead: a live source) SimPy's clock is moved up
to the wall clock, so that the arrivals due come first and the scheduler's own overhead counts
as it does for a user. A step that ends before the next arrival hands SimPy nothing: a hop per
step (a timeout scheduled, popped and the loop resumed) would be work on every step that
changes no outcome.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from itertools import accumulate, chain, islice, repeat

import simpy
import simpy.rt


class SimClock:
    """Simulated time: the sum of the seconds the backend returned. ``env``: a SimPy environment
    shared with other replicas' clocks (a cluster); each clock keeps its own replica's time."""

    def __init__(self, env: simpy.Environment | None = None) -> None:
        self.env = env if env is not None else simpy.Environment()
        self.t = 0.0

    def start(self) -> None:
        pass

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def sync(self, next_arrival_s: float | None):
        t = self.t
        env = self.env
        if next_arrival_s is not None and next_arrival_s <= t and t > env.now:
            return env.timeout(t - env.now)
        return None

    def woke(self) -> None:
        self.t = self.env.now

    def advance_steps(
        self, overhead: float, seconds, until: float | None, lookahead: bool = True
    ) -> tuple[list, list, list]:
        # the running sum t + overhead + s1 + overhead + s2 ..., added in that order (float
        # for float what advance() gives), taken in growing chunks: an arrival usually stops a
        # run long before its seconds run out
        seconds = iter(seconds)
        taken: list[float] = []
        starts: list[float] = []
        ends: list[float] = []
        t = self.t
        chunk = 8 if lookahead else 1
        grow = 4 if lookahead else 1
        while True:
            part = list(islice(seconds, chunk))
            if not part:
                break
            times = list(accumulate(chain.from_iterable(zip(repeat(overhead), part)), initial=t))
            s, e = times[1::2], times[2::2]
            if until is not None and e[-1] >= until:
                m = bisect_left(e, until) + 1  # the step that reaches the arrival is the last
                taken += part[:m]
                starts += s[:m]
                ends += e[:m]
                break
            taken += part
            starts += s
            ends += e
            t = e[-1]
            chunk *= grow
        if ends:
            self.t = ends[-1]
        return taken, starts, ends


class WallClock:
    """Wall time: arrivals fire in real time and every step takes what it takes."""

    def __init__(self) -> None:
        self.env = simpy.rt.RealtimeEnvironment(factor=1.0, strict=False)

    def start(self) -> None:
        self.env.sync()  # a warm-up before the run is not part of it

    def now(self) -> float:
        env = self.env
        return env.env_start + (time.monotonic() - env.real_start)

    def advance(self, seconds: float) -> None:
        pass  # the seconds have passed on the wall already

    def sync(self, next_arrival_s: float | None):
        t = self.now()
        if next_arrival_s is not None and next_arrival_s > t:
            return None  # nothing is due: no hop (SimPy catches up at the next arrival or wait)
        env = self.env
        return env.timeout(t - env.now) if t > env.now else None

    def woke(self) -> None:
        pass

    def advance_steps(
        self, overhead: float, seconds, until: float | None, lookahead: bool = True
    ) -> tuple[list, list, list]:
        taken: list[float] = []
        starts: list[float] = []
        ends: list[float] = []
        for s in seconds:
            taken.append(s)
            self.advance(overhead)
            starts.append(self.now())
            self.advance(s)
            t = self.now()
            ends.append(t)
            if until is not None and t >= until:
                break
        return taken, starts, ends
