"""The one loop: an arrival source and a replica as SimPy processes, a policy, a backend, a clock.

Each step reads top to bottom: the policy plans, the state machine admits (and preempts),
then for each pass the state machine checks it and describes its shape, the backend executes
it and says how many seconds it took, the clock advances by them, and the state applies the
pass at the new time. What differs between a simulation and a real run is only which
backend (``SimBackend``: the cost model's prediction; ``engine.MLXBackend``: a real forward
pass, measured) and which clock (``SimClock`` or ``WallClock``). The cost model's prediction
is logged beside every step either way, so a real run shows how far the prediction was off.

When the backend measures (a real run), the loop also keeps what a fit of the cost model needs:
every pass's ``PassShape`` (``RunResult.shapes``, aligned with ``RunResult.passes``). Every run
keeps, for each step that followed a wait for an arrival, how long the replica sat idle and how
late the step started after the arrival that woke it (``RunResult.wakes``). The cost model's
``idle_seconds(idle_s) -> (wake_s, extra_s)`` is charged for such steps: the replica starts
``wake_s`` after the arrival, and the step costs ``extra_s`` more (both 0 where the model has no
such terms). Neither touches the steps that run back to back. Its ``after_wake_seconds(k)`` is
charged for the k-th step after such a step (k >= 1), when the model ``has_after_wake``: a
machine that sat idle runs slower for a while. (``policies.base.CostModel`` declares them; any
other object with ``pass_seconds`` and ``step_overhead_seconds`` runs as one without such terms.)

A request whose client goes away (``Request.cancel_after_s`` after its arrival in a trace, or
``ReplicaLoop.cancel`` from a live server) is ended before the first step that starts at or after
that time, whatever its phase (``ReplicaState.cancel``: its KV freed, a partial prefill no longer
planned); a run of bulk decode steps stops there as it does at an arrival.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from bisect import bisect_right
from itertools import repeat as _repeat
from operator import add, attrgetter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from schedlab.policies.base import CostModel, Pass, PassShape, Policy, as_cost_model, draft_seconds, verify_seconds
from schedlab.traces.schema import Request

from .backend import Backend, SimBackend
from .clock import SimClock, WallClock
from .gcpause import gc_paused
from .sources import ArrivalSource, TraceSource, may_cancel
from .state import PlanError, ReplicaState, ReplicaView, RequestState


_TOKENS_LEFT = attrgetter("tokens_left")


class PolicyError(RuntimeError):
    """The policy's own code raised; one line naming the policy and the step."""


class StepRecord(NamedTuple):
    index: int
    start_s: float
    end_s: float
    predicted_s: float
    measured_s: float | None
    decode_rows: int
    prefill_tokens: int
    passes: int
    kv_tokens: int


class _Columns(Sequence):
    """A log kept as one list per field (a simulated hour has millions of steps and passes:
    columns are cheap to append to and to write out); reads as a sequence of records."""

    fields: tuple[str, ...] = ()
    record = staticmethod(lambda *row: row)

    def __init__(self) -> None:
        self._lists = tuple([] for _ in self.fields)

    @property
    def columns(self) -> tuple[list, ...]:
        """One list per field, in ``fields`` order."""
        return self._lists

    def __len__(self) -> int:
        return len(self._lists[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.record(*row) for row in zip(*(c[i] for c in self.columns))]
        return self.record(*(c[i] for c in self.columns))

    def __iter__(self):
        return map(self.record, *self.columns)


_STEP_TYPES = (np.int64, np.float64, np.float64, np.float64, None, np.int32, np.int64, np.int16, np.int64)


class StepLog(_Columns):
    """Every step: ``StepRecord`` rows; ``columns`` in ``StepRecord``'s field order.

    A run of repeated decode steps (``Plan.repeat``: static's hour holds a million such steps)
    is kept as one block (``add_run``: its ends and predictions; the rest follows from them)
    instead of nine Python objects a step. ``arrays()`` gives the columns as numpy arrays with
    the blocks filled in; ``columns`` (and reading records) first puts them into the lists."""

    fields = StepRecord._fields
    record = StepRecord

    def __init__(self) -> None:
        super().__init__()
        self._runs: list[tuple] = []  # (position in the lists, first index, t0, ends, predicted, rows, kv0)
        self._in_runs = 0

    def add_run(self, index0: int, t0: float, ends: list[float], predicted: list[float], rows: int, kv0: int) -> None:
        """``len(ends)`` decode steps of ``rows`` rows from step ``index0`` on: the first starts
        at ``t0``, each next one where the one before ended; KV grows by ``rows`` a step from
        ``kv0``; nothing measured, no prefill, one pass each."""
        if ends:
            self._runs.append((len(self._lists[0]), index0, t0, ends, predicted, rows, kv0))
            self._in_runs += len(ends)

    def __len__(self) -> int:
        return len(self._lists[0]) + self._in_runs

    @property
    def columns(self) -> tuple[list, ...]:
        if self._runs:  # the blocks go into the lists, in place: whoever holds the lists keeps them
            for col, full in zip(self._lists, self.arrays()):
                col[:] = full if isinstance(full, list) else full.tolist()
            self._runs.clear()
            self._in_runs = 0
        return self._lists

    def arrays(self) -> list:
        """The columns as numpy arrays in ``fields`` order (``measured_s``: a list, None where
        nothing was measured), the runs filled in, all as whole columns (no per-run numpy)."""
        lists = self._lists
        plain = [
            col if dt is None else np.fromiter(col, dtype=dt, count=len(col)) for col, dt in zip(lists, _STEP_TYPES)
        ]
        if not self._runs:
            return plain
        pos_l, i0_l, t0_l, ends_l, pred_l, rows_l, kv0_l = zip(*self._runs)
        pos, i0, rows, kv0 = (np.array(c, dtype=np.int64) for c in (pos_l, i0_l, rows_l, kv0_l))
        t0 = np.array(t0_l, dtype=np.float64)
        m = np.fromiter(map(len, ends_l), dtype=np.int64, count=len(ends_l))
        ends_flat: list[float] = []
        pred_flat: list[float] = []
        for e, v in zip(ends_l, pred_l):  # (list += list: no per-element Python)
            ends_flat += e
            pred_flat += v
        ends = np.array(ends_flat, dtype=np.float64)
        pred = np.array(pred_flat, dtype=np.float64)
        first = np.cumsum(m) - m  # each run's first row among the runs' rows
        within = np.arange(self._in_runs, dtype=np.int64) - np.repeat(first, m)
        # where every row goes: a run comes after the plain rows logged before it
        n_plain = len(lists[0])
        dest_plain = np.arange(n_plain, dtype=np.int64)
        before = np.searchsorted(pos, dest_plain, side="right")  # runs logged before each plain row
        dest_plain += np.concatenate(([0], np.cumsum(m)))[before]
        dest_run = np.repeat(pos + first, m) + within
        start = np.empty(self._in_runs)
        start[1:] = ends[:-1]
        start[first] = t0
        rows_r = np.repeat(rows, m)
        from_runs = (
            np.repeat(i0, m) + within,
            start,
            ends,
            pred,
            None,
            rows_r,
            0,
            1,
            np.repeat(kv0, m) + (within + 1) * rows_r,
        )
        out: list = []
        for col, run_col, dt in zip(plain, from_runs, _STEP_TYPES):
            if dt is None:  # measured_s: nothing is measured in a run of repeats
                merged = [None] * len(self)
                if col.count(None) != len(col):
                    for j, v in zip(dest_plain.tolist(), col):
                        merged[j] = v
                out.append(merged)
                continue
            full = np.empty(len(self), dtype=dt)
            full[dest_plain] = col
            full[dest_run] = run_col
            out.append(full)
        return out


class PassLog(_Columns):
    """Every pass: ``(step, index in step, start_s, end_s, Pass)`` rows."""

    fields = ("step", "pass", "start_s", "end_s", "passes")


@dataclass
class RunResult:
    policy: str
    mode: str  # "sim" (predicted seconds) or "real" (measured seconds)
    trace: str
    requests: list[RequestState]
    rejected: list[tuple[RequestState, str]]
    steps: StepLog
    wall_s: float
    passes: PassLog = field(default_factory=PassLog)  # (step, index in step, start, end, Pass)
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the run stopped early (the rest is kept)
    kv_capacity: int = 0
    # real runs: the PassShape of every pass, aligned with ``passes`` (empty in a simulation)
    shapes: list = field(default_factory=list)
    # step index -> (idle_s, wake_s): the step followed a wait for an arrival; idle_s from the end
    # of the previous step (or the run's start) to the arrival, wake_s from the arrival to the step
    wakes: dict = field(default_factory=dict)
    block_size: int = 1
    prefix_cache: dict[str, Any] | None = None  # the prefix cache's statistics, when it had one
    source: dict[str, Any] | None = None  # the arrival source's description (closed-loop clients)
    scheduled_s: dict[str, float] | None = None  # per request: when its client issued it
    passes_recorded: bool = True  # False: run(record_passes=False) kept no pass log
    # a cluster (``sim.cluster``): each request's replica (aligned with ``requests``), each
    # replica's own result, and the cluster's settings (replicas, router, its options, delay)
    replica: list[int] | None = None
    replicas: list["RunResult"] | None = None
    cluster: dict[str, Any] | None = None
    # speculative decoding, when a pass verified drafts: vLLM's counts (``speculation_counts``),
    # and each drafting request's own (``request_speculation``: what per-request profiles need)
    speculative: dict[str, Any] | None = None
    speculative_requests: dict[str, dict[str, Any]] | None = None

    @property
    def several(self) -> bool:
        """A run of more than one replica (its files say which replica served what)."""
        return self.replicas is not None and len(self.replicas) > 1


def request_speculation(states) -> dict[str, dict[str, Any]] | None:
    """Each request's spec-decode counters (``speculation_counts``' kind, one request's verify
    rows: ``sim.speculation.Acceptance.from_requests`` makes a profile per request of them); None
    when no row was given room to draft."""
    from .speculation import counters

    out = {}
    for st in states:
        for rid, (drafts, empty, per_pos, tokens) in st.spec_by_request.items():
            out[rid] = counters(drafts, tokens, sum(per_pos), per_pos, empty)
    return out or None


def speculation_counts(states) -> dict[str, Any] | None:
    """What the verify rows of ``states`` (one replica's, or a cluster's) did, as vLLM's
    spec-decode counters count it: rows that verified drafts (``drafts``), draft tokens, accepted
    ones, and per position the rows that accepted it; None when none verified a draft."""
    drafts = sum(st.spec_drafts for st in states)
    if not drafts:
        return None
    width = max(len(st.spec_accepted_per_pos) for st in states)
    per_pos = [
        sum(st.spec_accepted_per_pos[i] for st in states if i < len(st.spec_accepted_per_pos)) for i in range(width)
    ]
    tokens = sum(st.spec_draft_tokens for st in states)
    accepted = sum(st.spec_accepted_tokens for st in states)
    from .speculation import counters

    return counters(drafts, tokens, accepted, per_pos, sum(st.spec_empty for st in states))


def run_replica(
    arrivals: Sequence[Request] | ArrivalSource,
    policy: Policy,
    cost_model: CostModel,
    *,
    kv_capacity: int,
    backend: Backend | None = None,
    clock: SimClock | WallClock | None = None,
    trace_name: str = "trace",
    on_step: Callable[[ReplicaState], None] | None = None,
    record_steps: bool = True,
    block_size: int = 1,
    prefix_caching: bool = False,
    token_keys: Callable[[Any], Sequence[int] | None] | None = None,
    record_passes: bool = True,
    acceptance: Any = None,
) -> RunResult:
    """Run ``policy`` on one replica over ``arrivals`` (a trace's requests, or a source).

    ``backend`` defaults to ``SimBackend(cost_model)``; ``clock`` to the backend's own
    (``backend.make_clock()``). The policy sees ``cost_model`` in either case. KV is
    ``kv_capacity // block_size`` blocks of ``block_size`` tokens (1: token-exact); with
    ``prefix_caching`` full blocks are cached and shared (``sim.prefix``). ``record_passes=False``
    keeps no pass log in a simulation (``RunResult.passes`` stays empty: less memory and time on
    long traces when nothing wants the per-pass timeline); a real run always keeps it.
    ``acceptance``: the acceptance profile of a simulation whose policy drafts (speculative
    decoding: ``sim.speculation``).
    """
    source = arrivals if hasattr(arrivals, "process") else TraceSource(arrivals)
    replica = ReplicaLoop(
        policy,
        cost_model,
        kv_capacity=kv_capacity,
        next_arrival=source.next_arrival_s,
        finished=source.finished,
        backend=backend,
        clock=clock,
        on_step=on_step,
        record_steps=record_steps,
        block_size=block_size,
        prefix_caching=prefix_caching,
        token_keys=token_keys,
        record_passes=record_passes,
        acceptance=acceptance,
    )
    if hasattr(source, "replica_cancel"):  # a source that hears of clients going away (LiveSource)
        source.replica_cancel = replica.cancel
    replica.arrivals_cancel = may_cancel(source)
    env = replica.env
    wall0 = time.perf_counter()
    replica.backend.start(replica.state, source.requests)  # warm-up happens before the clock starts

    def arrivals_process():
        yield from source.process(env, replica.deliver)
        replica.close()

    replica.clock.start()  # after the backend's warm-up: time 0 is now
    env.process(arrivals_process())
    proc = env.process(replica.process())
    error = None
    try:
        with gc_paused(not replica.measured):
            env.run(until=proc)
    except (PlanError, PolicyError) as exc:
        error = str(exc)
    except RuntimeError as exc:
        if "No scheduled events left" not in str(exc):
            raise
        error = replica.stalled()
    return replica.result(source, trace_name, wall0, error)


class ReplicaLoop:
    """One replica: its state, policy, backend and clock, and its loop as a SimPy process.

    ``run_replica`` drives one of them with an arrival source; ``sim.cluster`` drives several in one
    SimPy environment, each fed by a router. Whoever drives it hands it its requests
    (``deliver``) at their arrival times and says when no more will come (``close``);
    ``next_arrival()`` says when the next request is due to whoever feeds it (a simulated
    replica runs ahead of SimPy until then, and its bulk steps stop there); ``finished(r, t)``
    is told of every request that finished, or was refused on arrival.

    ``on_change``: ``(record, record_run)``, called after every step (``record(t_end)``) and
    after every run of bulk steps (``record_run(ends, rows)``: ``len(ends)`` decode steps of
    ``rows`` rows), for a caller that keeps the replica's history (a cluster's delayed signals).

    ``fail_at`` (a simulated replica): the replica dies at that time: no pass that would end
    after it is applied, no step starts at or after it, and its process ends there (``failed``);
    the caller decides what becomes of its unfinished requests. Whoever feeds it must count the
    failure among its next arrivals, so that the replica's bulk steps stop there.
    """

    def __init__(
        self,
        policy: Policy,
        cost_model: CostModel,
        *,
        kv_capacity: int,
        next_arrival: Callable[[], float | None],
        finished: Callable[[RequestState, float], None],
        backend: Backend | None = None,
        clock: SimClock | WallClock | None = None,
        on_step: Callable[[ReplicaState], None] | None = None,
        record_steps: bool = True,
        block_size: int = 1,
        prefix_caching: bool = False,
        token_keys: Callable[[Any], Sequence[int] | None] | None = None,
        record_passes: bool = True,
        on_change: tuple[Callable, Callable] | None = None,
        acceptance: Any = None,
    ):
        given, cost_model = cost_model, as_cost_model(cost_model)
        self.backend = backend = backend if backend is not None else SimBackend(cost_model, acceptance=acceptance)
        draft = getattr(policy, "draft_model", None)
        if draft is not None and hasattr(backend, "use_draft"):  # (speculative decoding with a draft model)
            backend.use_draft(draft, getattr(policy, "draft_cost", None))
        self.clock = clock = clock if clock is not None else backend.make_clock()
        self.env = clock.env
        self.policy = policy
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        self.cost_model = cost_model
        # the memory of a model with sliding-window or recurrent layers: the real engine's own
        # model's, else what the cost model knows of it (a profile's, the analytic model's)
        layout = getattr(backend, "cache_layout", None)
        self.state = ReplicaState(
            (),
            kv_capacity,
            self.policy_name,
            block_size=block_size,
            prefix_caching=prefix_caching,
            token_keys=token_keys,
            layout=layout if layout is not None else cost_model.cache_layout,
        )
        self.steps = self.state.steps = StepLog()
        self.pass_log = PassLog()
        self.next_arrival = next_arrival
        self.finished = finished
        self.on_step = on_step
        self.on_change = on_change
        self.record_steps = record_steps
        # A backend whose seconds are this cost model's predictions needs no second prediction.
        own = getattr(backend, "cost_model", None)
        self.measured = own is not cost_model and own is not given
        self.shapes: list = []
        self.wakes: dict[int, tuple[float, float]] = {}
        self.log_passes = record_steps and (record_passes or self.measured)
        self._wake = None  # the event the idle replica waits on, if it is waiting
        self._idle_from = 0.0  # when the replica last ran out of work (the run's start at first)
        self.fail_at: float | None = None
        self.failed = False
        # cancellations to come, a min-heap of (time, order, request id): a request's client goes
        # away (``Request.cancel_after_s`` after it arrived, or ``cancel`` now); the replica ends
        # it at the first step that starts at or after that time
        self._cancels: list[tuple[float, int, str]] = []
        self._cancel_order = itertools.count()
        # whether an arrival may bring a cancellation: bulk steps then stop at every arrival
        # (``Plan.past_arrivals`` is not taken); the runner says, from its source (``may_cancel``)
        self.arrivals_cancel = True

    def deliver(self, req: Request) -> RequestState | None:
        """``req`` arrives now: into the waiting queue (and the replica woken), or refused at
        once (None: it can never fit; a server's 400, the client hears now)."""
        state = self.state
        r = state.receive(req)
        if r is None:
            self.finished(state.rejected[-1][0], self.env.now)
            return None
        if req.cancel_after_s is not None:
            heapq.heappush(self._cancels, (req.arrival_s + req.cancel_after_s, next(self._cancel_order), req.id))
        wake = self._wake
        if wake is not None and not wake.triggered:
            wake.succeed()
        return r

    def cancel(self, rid: str) -> None:
        """Request ``rid``'s client went away now: the replica ends it before its next step,
        whatever its phase (nothing happens if it is unknown here or already finished)."""
        heapq.heappush(self._cancels, (-math.inf, next(self._cancel_order), rid))
        wake = self._wake
        if wake is not None and not wake.triggered:
            wake.succeed()

    def _cancel_due(self, t: float) -> bool:
        """End the requests whose cancellation is due by ``t``; whether any was ended (then the
        change is recorded at ``t`` for ``on_change``, as a step's is)."""
        cancels, state = self._cancels, self.state
        ended = False
        while cancels and cancels[0][0] <= t:
            r = state.cancel(heapq.heappop(cancels)[2], t)
            if r is not None:
                ended = True
                self.backend.release(r)
                self.finished(r, t)
        if ended and self.on_change is not None:
            self.on_change[0](t)
        return ended

    def close(self) -> None:
        """No more requests will come: the replica finishes what it has, then its process ends."""
        self.state.open = False
        wake = self._wake
        if wake is not None and not wake.triggered:
            wake.succeed()

    def kill(self) -> None:
        """The replica is dead (its ``fail_at`` has come): an idle one's process ends now."""
        self.failed = True
        wake = self._wake
        if wake is not None and not wake.triggered:
            wake.succeed()

    def stalled(self) -> str:
        """The error of a run whose replica waits idle for an arrival that waits for a finish."""
        state = self.state
        return (
            f"policy '{self.policy_name}' step {state.step_index}: planned nothing with "
            f"{state.n_accepted - state.finished} request(s) unfinished while the arrival source "
            f"waits for one of them to finish"
        )

    def process(self):
        """The replica loop, a SimPy process generator. A step: plan, apply the admissions, execute
        the passes (the clock advances; the state applies each), record; then any bulk repeats. A
        step starts where the previous one ended (on a wall clock the hops between steps count)."""
        state, clock, backend, policy, cost_model = self.state, self.clock, self.backend, self.policy, self.cost_model
        measured, log_passes, record_steps, cancels = self.measured, self.log_passes, self.record_steps, self._cancels
        s_index, s_start, s_end, s_pred, s_meas, s_rows, s_ptoks, s_passes, s_kv = self.steps._lists
        p_step, p_k, p_start, p_end, p_pass = self.pass_log._lists
        on_step, next_arrival, finished = self.on_step, self.next_arrival, self.finished
        record = self.on_change[0] if self.on_change is not None else None
        view = ReplicaView(state, cost_model)
        overhead, predict, execute = cost_model.step_overhead_seconds, cost_model.pass_seconds, self._executor()
        deadline = self.fail_at if self.fail_at is not None else float("inf")
        run_repeats = self._bulk_runner(deadline)  # None: every step is planned on its own
        draft_cost = getattr(policy, "draft_cost", None)  # a draft model's, whose passes come before a verify
        # when the previous step ended (None after waiting idle); the after-idle cost the next step
        # carries; the steps run since the last wake (None: none to charge any more)
        t_end, pending, since_wake = None, 0.0, None
        # a run of bulk steps that an arrival stopped (``run_repeats``' rest): when the arrival
        # went to another replica (a cluster), nothing here changed, and the policy's promise
        # still holds: the run goes on without asking it
        rest = None
        while not state.done:
            t0 = clock.now() if t_end is None else t_end
            if t0 >= deadline or self.failed:
                return self._fail()
            if cancels and cancels[0][0] <= t0 and self._cancel_due(t0):
                rest = None
                continue  # (the queues changed: the policy sees them as they are now)
            if rest is not None:
                repeat, p, shape, sent = rest
                if len(state.requests) == sent:
                    t_end, rest = run_repeats(repeat, p, shape, t_end, False)
                    if state.open:
                        ev = clock.sync(next_arrival())
                        if ev is not None:
                            yield ev
                    continue
                rest = None
            view.now = t0
            view.step_index = state.step_index
            try:
                plan = policy.plan(view)
            except (PlanError, KeyboardInterrupt):
                raise
            except Exception as exc:  # the user's policy code
                raise self._policy_error(exc) from exc
            for r in state.apply_admin(plan, t0):
                backend.release(r)
            try:
                passes = [p for p in plan.passes if p.decode or p.prefill]
            except AttributeError:  # (shape() checks each pass; a thing with no decode never gets there)
                bad = next((p for p in plan.passes if not isinstance(p, Pass)), None)
                if bad is None:
                    raise
                raise state._fail(f"plan holds {type(bad).__name__}, not a Pass") from None
            if not passes:  # nothing to run: plan again at once if the state changed, else wait idle
                if not (plan.admit or plan.preempt):
                    t_end, pending, since_wake = yield from self._idle(t_end, pending, since_wake)
                continue
            n_rows = 0
            for p in passes:
                n_rows += len(p.decode) + len(p.prefill)
            predicted = overhead(len(passes), n_rows)
            if pending or since_wake is not None:  # the steps just after a wake cost more
                predicted, pending, since_wake = self._wake_charges(predicted, pending, since_wake)
            clock.advance(backend.step_overhead(predicted))  # planning comes first
            rows = ptoks = 0
            ended, prefilling = False, len(state.prefilling)
            for k, p in enumerate(passes):
                shape = state.shape(p)
                t_pass = clock.now()
                seconds = execute(p, shape, state)
                clock.advance(seconds)
                t = clock.now()
                if t > deadline:  # the replica dies while this pass runs: it never ends
                    return self._fail()
                if measured:  # (a verify pass's draft positions priced as a simulation prices them)
                    predicted += predict(shape)
                    if p.draft:
                        predicted += verify_seconds(cost_model, shape) + draft_seconds(draft_cost, shape)
                else:
                    predicted += seconds
                rows += len(p.decode)
                if p.prefill:
                    ptoks += shape.prefill_tokens
                if log_passes:
                    p_step.append(state.step_index)
                    p_k.append(k)
                    p_start.append(t_pass)
                    p_end.append(t)
                    p_pass.append(p)
                for r in state.apply_pass(p, t):
                    ended = True
                    backend.release(r)
                    finished(r, t)
            t_end = clock.now()
            if record_steps:
                s_index.append(state.step_index)
                s_start.append(t0)
                s_end.append(t_end)
                s_pred.append(predicted)
                s_meas.append((t_end - t0) if measured else None)
                s_rows.append(rows)
                s_ptoks.append(ptoks)
                s_passes.append(len(passes))
                s_kv.append(state.kv_used)
            state.step_index += 1
            if record is not None:
                record(t_end)
            if on_step is not None:
                on_step(state)
            if plan.repeat and run_repeats is not None and not ended and since_wake is None:
                # (one decode pass, no row finished, none handed off from prefilling: queues as planned)
                if len(passes) == 1 and not passes[0].prefill and len(state.prefilling) == prefilling:
                    t_end, rest = run_repeats(plan.repeat, passes[0], shape, t_end, plan.past_arrivals)
            if state.open:  # (once the source is done nothing can arrive: no hop to make)
                ev = clock.sync(next_arrival())
                if ev is not None:
                    yield ev

    def _executor(self) -> Callable:
        """``backend.execute``; in a real run that records its steps, one that also keeps every
        pass's shape (``shapes``, for fits; a simulation never needs it)."""
        backend = self.backend
        if not (self.measured and self.record_steps):
            return backend.execute

        def execute(p, shape, state, _run=backend.execute, _keep=self.shapes.append):
            _keep(shape)
            return _run(p, shape, state)

        return execute

    def _policy_error(self, exc: Exception) -> PolicyError:
        """The one-line error of a policy whose own code raised ``exc`` at this step."""
        return PolicyError(
            f"policy '{self.policy_name}' step {self.state.step_index} raised {type(exc).__name__}: {exc}"
        )

    def _fail(self) -> None:
        """The replica dies here (its ``fail_at`` has come, or it was killed): its process ends
        (``return self._fail()``); no step starts and no pass that would end later is applied."""
        self.failed = True

    def _idle(self, t_end: float | None, pending: float, since_wake: int | None):
        """Nothing to run now (a generator, ``yield from`` it): only the next arrival, or a
        cancellation's time, can change the policy's mind; a ``PlanError`` if the source is done.

        ``t_end``: when the previous step ended (None: the replica was already idle). Returns the
        new ``(t_end, pending, since_wake)``: ``t_end`` None (no step just ended), and the
        after-idle charges the next steps carry, unchanged after a wait that a cancellation's time
        ended (or a ``kill``: then ``failed``, and the loop ends at its top); after an arrival the
        wait is logged in ``wakes`` and charged by the cost model's ``idle_seconds`` (the replica
        starts ``wake_s`` late; ``pending``: the wake's own step's extra) and, where it
        ``has_after_wake``, ``after_wake_seconds`` (``since_wake`` 0: the next step is the wake's)."""
        state, env, clock, cancels = self.state, self.env, self.clock, self._cancels
        if not state.open:
            raise PlanError(
                f"policy '{self.policy_name}' step {state.step_index}: planned nothing with "
                f"{state.n_accepted - state.finished} request(s) unfinished and no arrivals left"
            )
        if t_end is not None:
            self._idle_from = t_end
        self._wake = wake = env.event()
        if cancels:  # ... or a cancellation's time
            yield env.any_of([wake, env.timeout(max(cancels[0][0] - env.now, 0.0))])
        else:
            yield wake
        self._wake = None
        if self.failed:
            return None, pending, since_wake
        clock.woke()
        if not wake.triggered:  # woken by a cancellation's time, not an arrival
            return None, pending, since_wake
        cost_model = self.cost_model
        if cost_model.has_after_wake:  # the steps after a wake are counted only for a model that charges them
            since_wake = 0
        arrived = env.now  # the arrival's time (the wall clock is a little later)
        late = clock.now() - arrived
        self.wakes[state.step_index] = (arrived - self._idle_from, late)
        w, pending = cost_model.idle_seconds(arrived - self._idle_from)
        w = self.backend.step_overhead(w) if w else 0.0  # 0 on a wall clock
        if w:
            clock.advance(w)
            ev = clock.sync(self.next_arrival())  # arrivals due meanwhile come first
            if ev is not None:
                yield ev
        return None, pending, since_wake

    def _wake_charges(self, predicted: float, pending: float, since_wake: int | None) -> tuple:
        """A step after a wake: ``predicted`` plus the wake's ``pending`` extra and the cost
        model's ``after_wake_seconds(k)`` for the k-th step after the wake's own (counting stops
        where it charges nothing); the new ``(predicted, pending, since_wake)``."""
        if pending:
            predicted += pending
            pending = 0.0
        if since_wake is not None:
            if since_wake:
                extra = self.cost_model.after_wake_seconds(since_wake)
                if not extra:  # past the steps it charges
                    since_wake = None
                predicted += extra
            if since_wake is not None:
                since_wake += 1
        return predicted, pending, since_wake

    def _bulk_runner(self, deadline: float) -> Callable | None:
        """``run_repeats(repeat, p, shape, t_end, past_arrivals) -> (t_end, rest)``: the steps a
        ``Plan.repeat`` allows after the step that ran the decode pass ``p`` (of ``shape``), in
        bulk; ``rest``: where an arrival (or a cancellation's time) stopped them, ``(repeat left,
        p, the last pass's shape, how many requests the replica had been sent then)``, to go
        on with them if nothing came to this replica, else None. None where they run one by one:
        the backend can't say their seconds at once, they are measured, or a callback (``on_step``)
        wants to see every step. The replica dies at ``deadline`` (``fail_at``)."""
        state, clock, backend, steps, cancels = self.state, self.clock, self.backend, self.steps, self._cancels
        repeat_decode = getattr(backend, "repeat_decode", None) if self.on_step is None and not self.measured else None
        if repeat_decode is None:
            return None
        next_arrival = self.next_arrival
        overhead = self.cost_model.step_overhead_seconds
        # a cost model's own run formula is pure and may be evaluated ahead; any other is asked
        # exactly once per step, as if the steps were planned one by one
        lookahead = self.cost_model.has_run_formula
        record_steps, log_passes = self.record_steps, self.log_passes
        p_step, p_k, p_start, p_end, p_pass = self.pass_log._lists
        record_run = self.on_change[1] if self.on_change is not None else None

        def run_repeats(repeat: int, p: Pass, shape, t_end: float, past_arrivals: bool = False) -> tuple:
            """The same decode pass until a row is about to finish, a request arrives (unless
            the plan holds ``past_arrivals``), or ``repeat`` runs out. Every step is recorded
            (and timed) as if planned on its own."""
            # (a prefix cache's blocks, which the steps add, are read at an arrival: a router's
            # prefix hit, a newcomer's lookup; a newcomer's cancellation is due from its arrival)
            nxt = None if past_arrivals and state.prefix is None and not self.arrivals_cancel else next_arrival()
            if cancels and (nxt is None or cancels[0][0] < nxt):
                nxt = cancels[0][0]  # (a cancellation ends the run as an arrival does)
            k = min(repeat, min(map(_TOKENS_LEFT, map(state.by_id.__getitem__, p.decode))) - 1)
            if k <= 0 or (nxt is not None and nxt <= t_end):
                return t_end, None
            rows = len(p.decode)
            predicted_overhead = overhead(1, rows)
            seconds, pass_starts, ends = clock.advance_steps(
                backend.step_overhead(predicted_overhead), repeat_decode(shape, k), nxt, lookahead
            )
            dies = bool(ends) and ends[-1] > deadline
            if dies:  # the replica dies first: the step reaching it never ends
                m = bisect_right(ends, deadline)
                del seconds[m:], pass_starts[m:], ends[m:]
                clock.t = ends[-1] if ends else t_end
            t = ends[-1] if ends else t_end
            m = len(ends)
            if record_steps:
                steps.add_run(
                    state.step_index,
                    t_end,
                    ends,
                    list(map(add, _repeat(predicted_overhead, m), seconds)),
                    rows,
                    state.kv_used,
                )
            if log_passes:
                p_step.extend(range(state.step_index, state.step_index + m))
                p_k.extend([0] * m)
                p_start.extend(pass_starts)
                p_end.extend(ends)
                p_pass.extend([p] * m)
            state.repeat_decode(p, ends)
            if record_run is not None and ends:
                record_run(ends, rows)
            if m == k or dies:
                return t, None
            if m:  # (the shape of the run's last pass: what the steps after it follow)
                shape = PassShape(tuple(map(add, shape.decode_contexts, _repeat(m, rows))), (), False, rows)
            return t, (repeat - m, p, shape, len(state.requests))

        return run_repeats

    def result(self, source: Any, trace_name: str, wall0: float, error: str | None) -> RunResult:
        """The run's result, once its process has ended (or stopped on ``error``)."""
        state = self.state
        meta = self.backend.finish()
        if state.layout is not None and "cache_layout" not in meta:  # (a real engine's says it already)
            meta = {**meta, "cache_layout": state.layout.as_dict()}
        describe = getattr(source, "describe", None) if source is not None else None
        return RunResult(
            policy=self.policy_name,
            mode=self.backend.mode,
            trace=trace_name,
            requests=state.requests,
            rejected=state.rejected,
            steps=self.steps,
            passes=self.pass_log,
            wall_s=time.perf_counter() - wall0,
            meta=meta,
            error=error,
            kv_capacity=state.kv_capacity,
            shapes=self.shapes,
            wakes=self.wakes,
            block_size=state.block_size,
            prefix_cache=state.prefix.stats() if state.prefix is not None else None,
            source=describe() if describe is not None else None,
            scheduled_s=getattr(source, "scheduled_s", None) if source is not None else None,
            passes_recorded=self.log_passes,
            speculative=speculation_counts([state]),
            speculative_requests=request_speculation([state]),
        )
