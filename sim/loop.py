"""The one loop: an arrival source and a replica as SimPy processes, a policy, a backend, a clock.

Each step reads top to bottom: the policy plans, the state machine admits (and preempts),
then for each pass the state machine checks it and describes its shape, the backend executes
it and says how many seconds it took, the clock advances by them, and the state applies the
pass at the new time. What differs between a simulation and a real run is only which
backend (``SimBackend``: the cost model's prediction; ``engine.MLXBackend``: a real forward
pass, measured) and which clock (``SimClock`` or ``WallClock``). The cost model's prediction
is logged beside every step either way, so a real run shows how far the prediction was off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from policies.base import CostModel, Pass, Policy
from traces.schema import Request

from .backend import Backend, SimBackend
from .clock import SimClock, WallClock
from .sources import ArrivalSource, TraceSource
from .state import PlanError, ReplicaState, ReplicaView, RequestState


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


@dataclass
class RunResult:
    policy: str
    mode: str  # "sim" (predicted seconds) or "real" (measured seconds)
    trace: str
    requests: list[RequestState]
    rejected: list[tuple[RequestState, str]]
    steps: list[StepRecord]
    wall_s: float
    passes: list[tuple[int, int, float, float, Pass]] = field(default_factory=list)  # step, index, start, end
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the run stopped early (the rest is kept)
    kv_capacity: int = 0


def run(
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
) -> RunResult:
    """Run ``policy`` on one replica over ``arrivals`` (a trace's requests, or a source).

    ``backend`` defaults to ``SimBackend(cost_model)``; ``clock`` to the backend's own
    (``backend.make_clock()``). The policy sees ``cost_model`` in either case.
    """
    source = arrivals if hasattr(arrivals, "process") else TraceSource(arrivals)
    backend = backend if backend is not None else SimBackend(cost_model)
    clock = clock if clock is not None else backend.make_clock()
    env = clock.env
    policy_name = getattr(policy, "name", type(policy).__name__)
    state = ReplicaState((), kv_capacity, policy_name)
    steps: list[StepRecord] = []
    pass_log: list[tuple[int, int, float, float, Pass]] = []
    wall0 = time.perf_counter()
    backend.start(state, source.requests)  # warm-up happens before the clock starts

    wake = None  # the event the idle replica waits on, if it is waiting

    def deliver(req: Request) -> None:
        state.receive(req)
        if wake is not None and not wake.triggered:
            wake.succeed()

    def arrivals_process():
        yield from source.process(env, deliver)
        state.open = False
        if wake is not None and not wake.triggered:
            wake.succeed()

    view = ReplicaView(state, cost_model)
    overhead = cost_model.step_overhead_seconds
    predict = cost_model.pass_seconds
    execute = backend.execute
    # A backend whose seconds are this cost model's predictions needs no second prediction.
    measured = getattr(backend, "cost_model", None) is not cost_model
    next_arrival = source.next_arrival_s
    finished = source.finished

    def replica():
        nonlocal wake
        t_end = None  # when the previous step ended (None after waiting idle)
        while not state.done:
            # A step starts where the previous one ended: on a wall clock the SimPy hops and
            # arrival handling between two steps belong to its time, as they do to a user.
            t0 = clock.now() if t_end is None else t_end
            view.now = t0
            view.step_index = state.step_index
            try:
                plan = policy.plan(view)
            except (PlanError, KeyboardInterrupt):
                raise
            except Exception as exc:  # the user's policy code
                raise PolicyError(
                    f"policy '{policy_name}' step {state.step_index} raised "
                    f"{type(exc).__name__}: {exc}") from exc
            for r in state.apply_admin(plan, t0):
                backend.release(r)
            passes = [p for p in plan.passes if p.decode or p.prefill]
            if not passes:
                if plan.admit or plan.preempt:
                    continue  # the state changed: plan again at the same instant
                if state.open:
                    # nothing to run now: only the next arrival can change the policy's mind
                    wake = env.event()
                    yield wake
                    wake = None
                    t_end = None
                    clock.woke()
                    continue
                raise PlanError(
                    f"policy '{policy_name}' step {state.step_index}: planned nothing with "
                    f"{state.n_accepted - state.finished} request(s) unfinished and no arrivals left")
            n_rows = 0
            for p in passes:
                n_rows += len(p.decode) + len(p.prefill)
            predicted = overhead(len(passes), n_rows)
            clock.advance(backend.step_overhead(predicted))  # planning comes first
            rows = ptoks = 0
            for k, p in enumerate(passes):
                shape = state.shape(p)
                t_pass = clock.now()
                seconds = execute(p, shape, state)
                clock.advance(seconds)
                t = clock.now()
                predicted += predict(shape) if measured else seconds
                rows += len(p.decode)
                if p.prefill:
                    ptoks += shape.prefill_tokens
                if record_steps:
                    pass_log.append((state.step_index, k, t_pass, t, p))
                for r in state.apply_pass(p, t):
                    backend.release(r)
                    finished(r, t)
            t_end = clock.now()
            if record_steps:
                steps.append(StepRecord(
                    state.step_index, t0, t_end, predicted, (t_end - t0) if measured else None,
                    rows, ptoks, len(passes), state.kv_used))
            state.step_index += 1
            if on_step is not None:
                on_step(state)
            ev = clock.sync(next_arrival())
            if ev is not None:
                yield ev

    env.process(arrivals_process())
    proc = env.process(replica())
    error = None
    try:
        env.run(until=proc)
    except (PlanError, PolicyError) as exc:
        error = str(exc)
    meta = backend.finish()
    return RunResult(
        policy=policy_name, mode=backend.mode, trace=trace_name, requests=state.requests,
        rejected=state.rejected, steps=steps, passes=pass_log, wall_s=time.perf_counter() - wall0,
        meta=meta, error=error, kv_capacity=state.kv_capacity,
    )
