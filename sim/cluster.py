"""Several replicas behind a router: N replica loops in one SimPy environment, one arrival source.

Each replica is a ``loop.ReplicaLoop`` as ``run`` drives one: its own policy object, state,
``SimBackend``, KV cache and ``SimClock`` (all the clocks share the one environment; each keeps
its own replica's time). The arrival source's ``deliver`` is the dispatcher: at each arrival it
shows the router (``routers``) a frozen view of the cluster, checks the replica index it
returns, and hands the request to that replica, which wakes if it sat idle.

Exactness. A simulated replica runs ahead of SimPy between arrivals, and its bulk steps
(``Plan.repeat``) stop at the next arrival; here the next arrival is the next one to the
*cluster* (any arrival may be routed to any replica), so every replica stops where it would if
the request were its own, and with one replica the run is the single-replica run event for
event (the same files, byte for byte). While the next arrival is unknown but may still come
(closed-loop clients waiting on a finish, which another replica may make at any time), no
replica of several runs ahead of SimPy.

Signals. A replica that runs ahead has already applied the step in progress at an arrival, and
with ``router_delay`` S the router must see each replica as it was S seconds before. So each
replica keeps a history of what the router reads (``_History``): after every step, stamped with
the step's end, what the steps did (running requests, admitted or finished ones, prompt and
output work done, KV used: counters only steps move), and at every arrival it was sent,
stamped with the arrival's time, what it was sent. The view at time x is the last entry of each
at or before x, and what is outstanding is what was sent less what was done. A step counts from
its end (its admissions too). ``prefix_hit`` is read from the replica's prefix cache as it is at
the decision.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from heapq import heappop, heappush
from typing import Any, Callable, Sequence

import numpy as np
import simpy

from schedlab.policies.base import CostModel, Policy
from schedlab.routers import ClusterView, ReplicaSignals, RouteError, route_checked
from schedlab.traces.schema import Request

from .clock import SimClock
from .gcpause import gc_paused
from .loop import PassLog, PolicyError, ReplicaLoop, RunResult, StepLog
from .prefix import Blocks
from .sources import ArrivalSource, TraceSource
from .state import PlanError, RequestState


class _History:
    """One replica's signals over time (see the module's docstring): what its steps did and what
    it was sent, each a list of entries in time order with their stamps."""

    __slots__ = ("state", "t_done", "done", "t_sent", "sent", "n", "p", "o", "index", "dirty")

    def __init__(self, state, index: int = 0, dirty: set | None = None) -> None:
        self.state = state
        self.index = index
        self.dirty = dirty if dirty is not None else set()  # where it says that it has a new entry
        self.t_done: list[float] = []
        self.done: list[tuple] = []  # (running, admitted or finished, prompt done, output done, KV[, ends, rows])
        self.t_sent: list[float] = []
        self.sent: list[tuple[int, int, int]] = []  # (requests, prompt tokens, output tokens) sent so far
        self.n = self.p = self.o = 0

    def record(self, t_end: float) -> None:
        st = self.state
        running = len(st.running)
        self.t_done.append(t_end)
        self.done.append((running, running + st.finished, st.prompt_done, st.output_done, st.kv_used))
        self.dirty.add(self.index)

    def record_run(self, ends: list[float], rows: int) -> None:
        # one entry for a run of bulk decode steps: the state after its last step, and what it
        # takes to go back to the state after any earlier one (each step: rows tokens and KV)
        st = self.state
        running = len(st.running)
        self.t_done.append(ends[0])
        self.done.append((running, running + st.finished, st.prompt_done, st.output_done, st.kv_used, ends, rows))
        self.dirty.add(self.index)

    def sent_one(self, t: float, req: Request) -> None:
        self.n += 1
        self.p += req.prompt_tokens
        self.o += req.output_tokens
        self.t_sent.append(t)
        self.sent.append((self.n, self.p, self.o))
        self.dirty.add(self.index)

    def at(self, x: float) -> tuple[tuple[int, int, int, int, int], float]:
        """(waiting, running, prompt tokens, output tokens outstanding, KV used) at time ``x``,
        and until when (exclusive) they stay so as far as the entries recorded so far tell
        (``inf``: until the next entry)."""
        t_sent, t_done = self.t_sent, self.t_done
        i = bisect_right(t_sent, x) - 1
        n, p, o = self.sent[i] if i >= 0 else (0, 0, 0)
        hi = t_sent[i + 1] if i + 1 < len(t_sent) else _INF
        j = bisect_right(t_done, x) - 1
        if j + 1 < len(t_done) and t_done[j + 1] < hi:
            hi = t_done[j + 1]
        if j < 0:
            return (n, 0, p, o, 0), hi
        e = self.done[j]
        # the times asked for never go back (arrivals come in order): what is older than the
        # entries found now is never read again
        if i > 1024:
            del t_sent[:i], self.sent[:i]
        if j > 1024:
            del t_done[:j], self.done[:j]
        running, admitted, prompt_done, output_done, kv = e[:5]
        if len(e) > 5:  # within a run of bulk steps: the steps that had not ended at x are undone
            ends, rows = e[5], e[6]
            k = bisect_right(ends, x)
            if k < len(ends) and ends[k] < hi:
                hi = ends[k]
            back = (len(ends) - k) * rows
            output_done -= back
            kv -= back
        return (n - admitted, running, p - prompt_done, o - output_done, kv), hi


_INF = float("inf")


def run_cluster(
    arrivals: Sequence[Request] | ArrivalSource,
    policies: Sequence[Policy],
    cost_model: CostModel | Sequence[CostModel],
    router: Any,
    *,
    kv_capacity: int | Sequence[int],
    router_delay: float = 0.0,
    trace_name: str = "trace",
    block_size: int = 1,
    prefix_caching: bool = False,
    token_keys: Callable[[Any], Sequence[int] | None] | None = None,
    record_passes: bool = True,
    router_options: dict | None = None,
    fail: Sequence[tuple[int, float]] = (),
) -> RunResult:
    """Simulate ``len(policies)`` replicas, replica i running ``policies[i]`` (each its own
    object), behind ``router`` (an object with ``name`` and ``route(view) -> int``), over
    ``arrivals``. Every replica has ``kv_capacity`` tokens of KV in blocks of ``block_size`` and
    the cost model ``cost_model`` (either may be a sequence, one per replica: a heterogeneous
    cluster); ``router_delay``: the router sees each replica as it was that
    many seconds before the arrival.

    The result is the whole cluster's (every request, in arrival order, with ``replica``: the
    replica that served each; the steps and passes of all replicas, by replica); ``replicas``
    holds each replica's own ``RunResult``. A router that raises, or returns anything but the
    index of a replica that is up, stops the run (``error``: one line naming the router and the
    request), as a plan the state machine refuses does.

    ``fail``: ``(replica, seconds)`` pairs: that replica dies at that time (no pass that would
    end after it happens). From then on the router sees it down. Its unfinished requests that
    had no token yet are routed again at once (once: the router chooses among the replicas up;
    their arrival time stays theirs, so the time lost shows in their TTFT); one that had tokens
    already, or was retried already, or finds no replica up, is refused with the reason (a
    client that saw tokens cannot be answered again without repeating them)."""
    policies = list(policies)
    n = len(policies)
    if n < 1:
        raise ValueError(f"a cluster has at least one replica, got {n}")
    if isinstance(router_delay, bool) or not (isinstance(router_delay, (int, float)) and router_delay >= 0):
        raise ValueError(f"router_delay must be a number of seconds >= 0, got {router_delay!r}")
    if not math.isfinite(router_delay):
        raise ValueError(f"router_delay must be finite, got {router_delay!r}")
    costs = list(cost_model) if isinstance(cost_model, (list, tuple)) else [cost_model] * n
    capacities = list(kv_capacity) if isinstance(kv_capacity, (list, tuple)) else [kv_capacity] * n
    if len(costs) != n or len(capacities) != n:
        raise ValueError(
            f"one cost model and one KV capacity per replica: {n} replicas, {len(costs)} cost models, "
            f"{len(capacities)} KV capacities"
        )
    faults = _checked_faults(fail, n)
    source = arrivals if hasattr(arrivals, "process") else TraceSource(arrivals)
    env = simpy.Environment()
    sending = [True]  # the source may still send
    pending_faults = sorted(faults.values())  # (a failure sends its requests elsewhere: an arrival)
    if n == 1 and not faults:
        next_arrival = source.next_arrival_s
    elif n == 1:

        def next_arrival(_next=source.next_arrival_s):
            t = _next()
            f = pending_faults[0] if pending_faults else None
            return f if t is None or (f is not None and f < t) else t
    else:

        def next_arrival(_next=source.next_arrival_s):
            # Unknown while the source is open (closed-loop clients wait on a finish): it may come
            # from another replica's finish at any time, so no replica runs ahead of SimPy (one
            # replica alone may: only its own finishes can send it more).
            t = _next()
            if t is None and sending[0]:
                return env.now
            f = pending_faults[0] if pending_faults else None
            return f if t is None or (f is not None and f < t) else t

    replicas: list[ReplicaLoop] = []
    histories: list[_History] = []
    dirty: set[int] = set()  # replicas with history entries recorded since their signals were made
    for i, (pol, cost, capacity) in enumerate(zip(policies, costs, capacities)):
        h = _History(None, i, dirty)
        rep = ReplicaLoop(
            pol,
            cost,
            kv_capacity=capacity,
            next_arrival=next_arrival,  # the cluster's next arrival: any may come here
            finished=source.finished,
            clock=SimClock(env),
            block_size=block_size,
            prefix_caching=prefix_caching,
            token_keys=token_keys,
            record_passes=record_passes,
            on_change=(h.record, h.record_run),
        )
        h.state = rep.state
        rep.fail_at = faults.get(i)
        replicas.append(rep)
        histories.append(h)

    router_name = getattr(router, "name", type(router).__name__)
    delay = float(router_delay)
    requests: list[RequestState] = []  # every request, in arrival order
    replica_of: list[int] = []
    rejected: list[tuple[RequestState, str]] = []
    capacities = [rep.state.kv_capacity for rep in replicas]
    caches = [rep.state.prefix for rep in replicas]

    def prefix_hits(req: Request) -> list[int]:
        # one probe for every replica: the prompt's block hashes are made once
        probe = RequestState(req, -1)
        probe._blk = Blocks(caches[0], req.id)
        return [c.lookup(probe)[0] * c.bs for c in caches]

    # Each replica's signals as last made, and until when they hold (a heap of (time, version,
    # replica)): an arrival remakes only those that have changed since (the replicas whose
    # history has a new entry, or whose signals ran out), so what a decision costs grows with
    # what happened since the last one, not with the number of replicas.
    signals = [ReplicaSignals(i, kv_capacity=capacities[i]) for i in range(n)]
    version = [0] * n
    expiry: list[tuple[float, int, int]] = []
    up = [True] * n

    def refresh(i: int, x: float) -> None:
        vals, hi = histories[i].at(x)
        signals[i] = ReplicaSignals(i, *vals, capacities[i], 0, up[i])
        version[i] += 1
        if hi != _INF:
            heappush(expiry, (hi, version[i], i))

    position: dict[str, int] = {}  # request id -> its place in requests
    retried: dict[str, int] = {}  # request id -> the replica it was first sent to
    failures: list[dict[str, Any]] = []

    def deliver(req: Request, retry: bool = False) -> RequestState | None:
        """Route ``req`` now; its state on the replica chosen (None: refused)."""
        now = env.now
        if faults and not any(up):  # no router can choose: refused (replica -1: none)
            r = RequestState(req, -1)
            if retry:
                k = position[req.id]
                requests[k], replica_of[k] = r, -1
            else:
                position[req.id] = len(requests)
                requests.append(r)
                replica_of.append(-1)
            refuse(r, "no replica is up")
            return None
        x = now - delay
        while dirty:
            refresh(dirty.pop(), x)
        while expiry and expiry[0][0] <= x:
            _, v, i = heappop(expiry)
            if v == version[i]:
                refresh(i, x)
        if prefix_caching:
            hits = prefix_hits(req)
            view = ClusterView(now, req, len(requests), tuple(s._replace(prefix_hit=h) for s, h in zip(signals, hits)))
        else:
            view = ClusterView(now, req, len(requests), tuple(signals))
        j = route_checked(router, view)
        rep = replicas[j]
        r = rep.deliver(req)
        st = rep.state
        if retry:
            k = position[req.id]
            requests[k] = st.requests[-1]
            replica_of[k] = j
        else:
            position[req.id] = len(requests)
            requests.append(st.requests[-1])
            replica_of.append(j)
        if r is None:
            rejected.append(st.rejected[-1])
        else:
            histories[j].sent_one(now, req)
        return r

    def refuse(r: RequestState, why: str) -> None:
        rejected.append((r, why))
        source.finished(r, env.now)

    def fault(i: int, at: float):
        yield env.timeout(at)
        pending_faults.remove(at)
        rep = replicas[i]
        rep.kill()
        up[i] = False
        dirty.add(i)
        refused = {id(r) for r, _ in rep.state.rejected}
        # its unfinished requests (those it refused on arrival were answered then)
        lost = [
            r
            for r in rep.state.requests
            if r.finish_s is None and id(r) not in refused and requests[position[r.id]] is r
        ]
        again = failed = 0
        for r in lost:
            if r.first_token_s is not None:
                refuse(r, f"replica {i} failed at {at:g} s after {len(r.token_times)} token(s)")
                failed += 1
            elif r.id in retried:
                refuse(r, f"replica {i} failed at {at:g} s, and the request was retried once already")
                failed += 1
            elif not any(up):
                refuse(r, f"replica {i} failed at {at:g} s and no replica is up")
                failed += 1
            else:
                retried[r.id] = i
                deliver(r.request, retry=True)
                again += 1
        failures.append({"replica": i, "at_s": at, "retried": again, "refused": failed})

    def arrivals_process():
        yield from source.process(env, deliver)
        if dying:  # a failure to come may send requests to the others: they stay open till then
            yield env.all_of(dying)
        sending[0] = False
        for rep in replicas:
            rep.close()

    def tagged(i: int, rep: ReplicaLoop):
        try:
            yield from rep.process()
        except PlanError as exc:
            raise PlanError(f"replica {i}: {exc}") from exc
        except PolicyError as exc:
            raise PolicyError(f"replica {i}: {exc}") from exc

    wall0 = time.perf_counter()
    for rep in replicas:
        rep.backend.start(rep.state, source.requests)
        rep.clock.start()
    dying = [env.process(fault(i, at)) for i, at in faults.items()]
    sending_done = env.process(arrivals_process())
    if n == 1 and not faults:
        until = env.process(replicas[0].process())
    else:  # (after failures the source may go on sending: into a cluster with no replica up)
        until = env.all_of([sending_done, *dying] + [env.process(tagged(i, rep)) for i, rep in enumerate(replicas)])
    error = None
    try:
        with gc_paused():
            env.run(until=until)
    except (PlanError, PolicyError, RouteError) as exc:
        error = str(exc)
    except RuntimeError as exc:
        if "No scheduled events left" not in str(exc):
            raise
        stuck = next((rep for rep in replicas if not rep.state.done and not rep.failed), replicas[0])
        error = stuck.stalled()
    parts = [rep.result(None, trace_name, wall0, None) for rep in replicas]
    describe = getattr(source, "describe", None)
    one = parts[0]
    return RunResult(
        policy=one.policy,
        mode=one.mode,
        trace=trace_name,
        requests=requests,
        rejected=rejected,
        steps=one.steps if n == 1 else merged_steps([p.steps for p in parts]),
        passes=one.passes if n == 1 else merged_passes([p.passes for p in parts]),
        wall_s=time.perf_counter() - wall0,
        meta=one.meta,
        error=error,
        kv_capacity=one.kv_capacity,
        wakes=one.wakes if n == 1 else {},
        block_size=one.block_size,
        prefix_cache=one.prefix_cache if n == 1 else merged_prefix_stats(caches),
        source=describe() if describe is not None else None,
        scheduled_s=getattr(source, "scheduled_s", None),
        passes_recorded=one.passes_recorded,
        replica=replica_of,
        replicas=parts,
        cluster={
            "replicas": n,
            "router": router_name,
            "router_options": dict(router_options or {}),
            "router_delay": delay,
            **({"failures": failures, "retried": dict(retried)} if faults else {}),
        },
    )


def _checked_faults(fail: Sequence[tuple[int, float]], n: int) -> dict[int, float]:
    """``fail`` as {replica: seconds}, or a ValueError naming what is wrong."""
    out: dict[int, float] = {}
    for item in fail:
        try:
            i, at = item
        except (TypeError, ValueError):
            raise ValueError(f"a failure is (replica, seconds), got {item!r}") from None
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"a failure names replica 0 to {n - 1}, got {i!r}")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not (math.isfinite(at) and at >= 0):
            raise ValueError(f"replica {i} fails at a finite time >= 0 s, got {at!r}")
        if i in out:
            raise ValueError(f"replica {i} fails twice (at {out[i]:g} s and {at:g} s); a replica fails once")
        out[i] = float(at)
    return out


def merged_steps(logs: Sequence[StepLog]) -> StepLog:
    """The replicas' step logs as one, replica by replica, with ``replica``: each step's."""
    out = StepLog()
    sizes = []
    for log in logs:
        cols = log.columns  # (the bulk runs filled in)
        sizes.append(len(cols[0]))
        for mine, theirs in zip(out._lists, cols):
            mine.extend(theirs)
    out.replica = np.repeat(np.arange(len(logs), dtype=np.int32), sizes)
    return out


def merged_passes(logs: Sequence[PassLog]) -> PassLog:
    """The replicas' pass logs as one, replica by replica, with ``replica``: each pass's."""
    out = PassLog()
    sizes = []
    for log in logs:
        cols = log.columns
        sizes.append(len(cols[0]))
        for mine, theirs in zip(out._lists, cols):
            mine.extend(theirs)
    out.replica = np.repeat(np.arange(len(logs), dtype=np.int32), sizes)
    return out


def merged_prefix_stats(caches) -> dict[str, Any] | None:
    """The prefix caches' statistics over the whole cluster (``PrefixCache.stats``' keys)."""
    if not caches or caches[0] is None:
        return None
    fq = sum(c.first_queries for c in caches)
    fh = sum(c.first_hits for c in caches)
    q = sum(c.queries for c in caches)
    h = sum(c.hits for c in caches)
    return {
        "block_size": caches[0].bs,
        "hit_rate": fh / fq if fq else None,
        "prompt_tokens_queried": fq,
        "prompt_tokens_hit": fh,
        "saved_prefill_tokens": h,
        "lookups_hit_rate": h / q if q else None,
        "evicted_blocks": sum(c.evictions for c in caches),
        "cached_blocks_at_end": sum(len(c.ref) for c in caches),
    }
