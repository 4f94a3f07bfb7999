"""Several replicas behind a router: N replica loops in one SimPy environment, one arrival source.

Each replica is a ``loop.ReplicaLoop`` as ``run_replica`` drives one: its own policy object, state,
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
replica of several runs ahead of SimPy. A plan that holds ``past_arrivals`` (its waiting queue's
head refused: a newcomer queues behind it) runs on past arrivals, the steps it has run ahead
undone in the router's view as below. One replica that cannot fail has no choice to route: its
router is not asked and no history is kept.

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

import time
from bisect import bisect_right
from heapq import heappop, heappush
from typing import Any, Callable, Sequence

import numpy as np
import simpy

from schedlab.routers import ClusterView, ReplicaSignals, RouteError, route_checked
from schedlab.traces.schema import Request

from .clock import SimClock
from .deployment import Deployment
from .gcpause import gc_paused
from .loop import PassLog, PolicyError, ReplicaLoop, RunResult, StepLog, request_speculation, speculation_counts
from .prefix import Blocks
from .sources import ArrivalSource, TraceSource, may_cancel
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


class Cluster:
    """A deployment's replicas behind its router, over one arrival source, in one SimPy
    environment: ``Cluster(deployment, arrivals).run()`` (``sim.run`` makes one for every
    deployment with a router).

    The result is the whole cluster's (every request, in arrival order, with ``replica``: the
    replica that served each; the steps and passes of all replicas, by replica); ``replicas``
    holds each replica's own ``RunResult``. A router that raises, or returns anything but the
    index of a replica that is up, stops the run (``error``: one line naming the router and the
    request), as a plan the state machine refuses does.

    Failures (the deployment's ``fail``): that replica dies at that time (no pass that would end
    after it happens). From then on the router sees it down. Its unfinished requests that had no
    token yet are routed again at once (once: the router chooses among the replicas up; their
    arrival time stays theirs, so the time lost shows in their TTFT); one that had tokens
    already, or was retried already, or finds no replica up, is refused with the reason (a client
    that saw tokens cannot be answered again without repeating them)."""

    def __init__(
        self,
        deployment: Deployment,
        arrivals: Sequence[Request] | ArrivalSource,
        *,
        trace_name: str = "trace",
        record_steps: bool = True,
        record_passes: bool = True,
        token_keys: Callable[[Any], Sequence[int] | None] | None = None,
    ) -> None:
        if deployment.router is None or deployment.disaggregated:
            raise ValueError("a Cluster runs a deployment with a router and no pools (sim.run runs any)")
        self.deployment = d = deployment
        self.trace_name = trace_name
        self.router = d.router
        self.n = n = d.replicas
        self.delay = d.router_delay
        self.faults = dict(d.fail)
        self.source = source = arrivals if hasattr(arrivals, "process") else TraceSource(arrivals)
        self.env = simpy.Environment()
        self.sending = True  # the source may still send
        self.pending_faults = sorted(self.faults.values())  # (a failure sends its requests elsewhere: an arrival)
        next_arrival = self._next_arrival_fn()
        cancels = may_cancel(source)
        # one replica that cannot fail: the router has no choice to make, and is not asked
        self.alone = n == 1 and not self.faults
        self.replicas: list[ReplicaLoop] = []
        self.histories: list[_History] = []
        self.dirty: set[int] = set()  # replicas with history entries recorded since their signals were made
        for i, (pol, cost, capacity) in enumerate(zip(d.policies, d.cost_models, d.kv_capacities)):
            h = _History(None, i, self.dirty)
            rep = ReplicaLoop(
                pol,
                cost,
                kv_capacity=capacity,
                next_arrival=next_arrival,  # the cluster's next arrival: any may come here
                finished=source.finished,
                clock=SimClock(self.env),
                record_steps=record_steps,
                block_size=d.block_size,
                prefix_caching=d.prefix_caching,
                token_keys=token_keys,
                record_passes=record_passes,
                on_change=None if self.alone else (h.record, h.record_run),
                acceptance=d.acceptance,
            )
            h.state = rep.state
            rep.fail_at = self.faults.get(i)
            rep.arrivals_cancel = cancels
            self.replicas.append(rep)
            self.histories.append(h)
        self.requests: list[RequestState] = []  # every request, in arrival order
        self.replica_of: list[int] = []
        self.rejected: list[tuple[RequestState, str]] = []
        self.capacities = [rep.state.kv_capacity for rep in self.replicas]
        self.caches = [rep.state.prefix for rep in self.replicas]
        # Each replica's signals as last made, and until when they hold (a heap of (time, version,
        # replica)): an arrival remakes only those that have changed since (the replicas whose
        # history has a new entry, or whose signals ran out), so what a decision costs grows with
        # what happened since the last one, not with the number of replicas.
        self.signals = [ReplicaSignals(i, kv_capacity=self.capacities[i]) for i in range(n)]
        self.version = [0] * n
        self.expiry: list[tuple[float, int, int]] = []
        self.up = [True] * n
        self.position: dict[str, int] = {}  # request id -> its place in requests
        self.retried: dict[str, int] = {}  # request id -> the replica it was first sent to
        self.failures: list[dict[str, Any]] = []

    def _next_arrival_fn(self) -> Callable[[], float | None]:
        """When the cluster's next arrival is due (a failure counts: it sends its requests
        elsewhere), as the replicas ask it to know how far they may run ahead of SimPy."""
        source_next, pending = self.source.next_arrival_s, self.pending_faults
        if self.n == 1 and not self.faults:
            return source_next
        if self.n == 1:

            def next_arrival():
                t = source_next()
                f = pending[0] if pending else None
                return f if t is None or (f is not None and f < t) else t

            return next_arrival
        env = self.env

        def next_arrival():
            # Unknown while the source is open (closed-loop clients wait on a finish): it may come
            # from another replica's finish at any time, so no replica runs ahead of SimPy (one
            # replica alone may: only its own finishes can send it more).
            t = source_next()
            if t is None and self.sending:
                return env.now
            f = pending[0] if pending else None
            return f if t is None or (f is not None and f < t) else t

        return next_arrival

    def _prefix_hits(self, req: Request) -> list[int]:
        # one probe for every replica: the prompt's block hashes are made once
        caches = self.caches
        probe = RequestState(req, -1)
        probe._blk = Blocks(caches[0], req.id)
        return [c.lookup(probe)[0] * c.bs for c in caches]

    def _refresh(self, i: int, x: float) -> None:
        vals, hi = self.histories[i].at(x)
        self.signals[i] = ReplicaSignals(i, *vals, self.capacities[i], 0, self.up[i])
        self.version[i] += 1
        if hi != _INF:
            heappush(self.expiry, (hi, self.version[i], i))

    def _view(self, req: Request) -> ClusterView:
        """The cluster as the router sees it now: each replica ``router_delay`` seconds ago."""
        now = self.env.now
        x = now - self.delay
        dirty, expiry, version, refresh = self.dirty, self.expiry, self.version, self._refresh
        while dirty:
            refresh(dirty.pop(), x)
        while expiry and expiry[0][0] <= x:
            _, v, i = heappop(expiry)
            if v == version[i]:
                refresh(i, x)
        if self.deployment.prefix_caching:
            hits = self._prefix_hits(req)
            signals = tuple(s._replace(prefix_hit=h) for s, h in zip(self.signals, hits))
            return ClusterView(now, req, len(self.requests), signals)
        return ClusterView(now, req, len(self.requests), tuple(self.signals))

    def _place(self, req: Request, r: RequestState, j: int, retry: bool) -> None:
        """Where ``req``'s state is found: its place among the arrivals (kept on a retry)."""
        if retry:
            k = self.position[req.id]
            self.requests[k], self.replica_of[k] = r, j
        else:
            self.position[req.id] = len(self.requests)
            self.requests.append(r)
            self.replica_of.append(j)

    def deliver(self, req: Request, retry: bool = False) -> RequestState | None:
        """Route ``req`` now; its state on the replica chosen (None: refused)."""
        if self.faults and not any(self.up):  # no router can choose: refused (replica -1: none)
            r = RequestState(req, -1)
            self._place(req, r, -1, retry)
            self.refuse(r, "no replica is up")
            return None
        j = 0 if self.alone else route_checked(self.router, self._view(req))
        rep = self.replicas[j]
        r = rep.deliver(req)
        st = rep.state
        self._place(req, st.requests[-1], j, retry)
        if r is None:
            self.rejected.append(st.rejected[-1])
        elif not self.alone:
            self.histories[j].sent_one(self.env.now, req)
        return r

    def refuse(self, r: RequestState, why: str) -> None:
        self.rejected.append((r, why))
        self.source.finished(r, self.env.now)

    def _fault(self, i: int, at: float):
        yield self.env.timeout(at)
        self.pending_faults.remove(at)
        rep = self.replicas[i]
        rep.kill()
        self.up[i] = False
        self.dirty.add(i)
        refused = {id(r) for r, _ in rep.state.rejected}
        # its unfinished requests (those it refused on arrival were answered then)
        lost = [
            r
            for r in rep.state.requests
            if r.finish_s is None and id(r) not in refused and self.requests[self.position[r.id]] is r
        ]
        again = failed = 0
        for r in lost:
            if r.first_token_s is not None:
                why = f"replica {i} failed at {at:g} s after {len(r.token_times)} token(s)"
            elif r.id in self.retried:
                why = f"replica {i} failed at {at:g} s, and the request was retried once already"
            elif not any(self.up):
                why = f"replica {i} failed at {at:g} s and no replica is up"
            else:
                self.retried[r.id] = i
                self.deliver(r.request, retry=True)
                again += 1
                continue
            self.refuse(r, why)
            failed += 1
        self.failures.append({"replica": i, "at_s": at, "retried": again, "refused": failed})

    def _arrivals(self, dying):
        yield from self.source.process(self.env, self.deliver)
        if dying:  # a failure to come may send requests to the others: they stay open till then
            yield self.env.all_of(dying)
        self.sending = False
        for rep in self.replicas:
            rep.close()

    @staticmethod
    def _tagged(i: int, rep: ReplicaLoop):
        try:
            yield from rep.process()
        except PlanError as exc:
            raise PlanError(f"replica {i}: {exc}") from exc
        except PolicyError as exc:
            raise PolicyError(f"replica {i}: {exc}") from exc

    def run(self) -> RunResult:
        env, replicas = self.env, self.replicas
        wall0 = time.perf_counter()
        for rep in replicas:
            rep.backend.start(rep.state, self.source.requests)
            rep.clock.start()
        dying = [env.process(self._fault(i, at)) for i, at in self.faults.items()]
        sending_done = env.process(self._arrivals(dying))
        if self.n == 1 and not self.faults:
            until = env.process(replicas[0].process())
        else:  # (after failures the source may go on sending: into a cluster with no replica up)
            procs = [env.process(self._tagged(i, rep)) for i, rep in enumerate(replicas)]
            until = env.all_of([sending_done, *dying, *procs])
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
        return self._result(wall0, error)

    def _result(self, wall0: float, error: str | None) -> RunResult:
        parts = [rep.result(None, self.trace_name, wall0, None) for rep in self.replicas]
        describe = getattr(self.source, "describe", None)
        one, n = parts[0], self.n
        return RunResult(
            policy=one.policy,
            mode=one.mode,
            trace=self.trace_name,
            requests=self.requests,
            rejected=self.rejected,
            steps=one.steps if n == 1 else merged_steps([p.steps for p in parts]),
            passes=one.passes if n == 1 else merged_passes([p.passes for p in parts]),
            wall_s=time.perf_counter() - wall0,
            meta=one.meta,
            error=error,
            kv_capacity=one.kv_capacity,
            wakes=one.wakes if n == 1 else {},
            block_size=one.block_size,
            prefix_cache=one.prefix_cache if n == 1 else merged_prefix_stats(self.caches),
            source=describe() if describe is not None else None,
            scheduled_s=getattr(self.source, "scheduled_s", None),
            passes_recorded=one.passes_recorded,
            replica=self.replica_of,
            replicas=parts,
            speculative=speculation_counts([rep.state for rep in self.replicas]),
            speculative_requests=request_speculation([rep.state for rep in self.replicas]),
            cluster={
                "replicas": n,
                "router": getattr(self.router, "name", type(self.router).__name__),
                "router_options": self.deployment.router_options(),
                "router_delay": self.delay,
                **({"failures": self.failures, "retried": dict(self.retried)} if self.faults else {}),
            },
        )


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
