"""The one loop: arrivals and a replica as SimPy processes, a policy, a backend.

Simulation runs in a ``simpy.Environment`` and the backend predicts each pass from the cost
model. A real run uses ``simpy.rt.RealtimeEnvironment(strict=False)``: arrivals fire at
their wall-clock times, the backend runs the passes on the model, and after every step the
simulated clock is moved up to the wall clock, so the scheduler's own overhead counts as
it does for a user. Policy, state machine, event log and metrics are the same objects in
both modes; only the backend and the clock differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import simpy
import simpy.rt

from policies.base import CostModel, Pass, PassShape, Plan, Policy
from traces.schema import Request

from .state import PlanError, ReplicaState, ReplicaView, RequestState


class PolicyError(RuntimeError):
    """The policy's own code raised; one line naming the policy and the step."""


class Backend(Protocol):
    """Turns passes into elapsed seconds: predicted (simulation) or measured (MLX)."""

    mode: str  # "sim" or "real"

    def start(self, state: ReplicaState) -> None:
        """Called once before the clock starts (a real backend warms up here)."""

    def execute(self, p: Pass, shape: PassShape, state: ReplicaState) -> float | None:
        """Run one checked pass before the state advances; return measured seconds or None."""

    def release(self, r: RequestState) -> None:
        """Free a request's KV cache (finished or preempted)."""

    def finish(self) -> dict[str, Any]:
        """Called once after the run; returns metadata for summary.json."""


class SimBackend:
    """Simulation: passes take the cost model's predicted seconds."""

    mode = "sim"

    def start(self, state: ReplicaState) -> None:
        pass

    def execute(self, p: Pass, shape: PassShape, state: ReplicaState) -> float | None:
        return None

    def release(self, r: RequestState) -> None:
        pass

    def finish(self) -> dict[str, Any]:
        return {}


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
    mode: str
    trace: str
    requests: list[RequestState]
    rejected: list[tuple[RequestState, str]]
    steps: list[StepRecord]
    wall_s: float
    passes: list[tuple[int, int, float, float, Pass]] = field(default_factory=list)  # step, index, start, end
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the run stopped early (the rest is kept)


def run(
    requests: Sequence[Request],
    policy: Policy,
    cost_model: CostModel,
    *,
    kv_capacity: int,
    backend: Backend | None = None,
    trace_name: str = "trace",
    on_step: Callable[[ReplicaState], None] | None = None,
    record_steps: bool = True,
) -> RunResult:
    """Run ``policy`` over ``requests``; simulated unless ``backend`` is a real one."""
    backend = backend or SimBackend()
    policy_name = getattr(policy, "name", type(policy).__name__)
    state = ReplicaState(requests, kv_capacity, policy_name)
    real = backend.mode == "real"
    steps: list[StepRecord] = []
    pass_log: list[tuple[int, int, float, float, Pass]] = []
    wall0 = time.perf_counter()
    backend.start(state)  # warm-up happens before the clock starts
    if real:
        env = simpy.rt.RealtimeEnvironment(factor=1.0, strict=False)

        def now() -> float:
            return env.env_start + (time.monotonic() - env.real_start) / env.factor
    else:
        env = simpy.Environment()
        # The replica runs ahead of env.now between arrivals (nothing else can happen in
        # between), yielding to SimPy only when an arrival is due: same events, fewer hops.
        clock = [0.0]

        def now() -> float:
            return clock[0]

    wake: list = [None]  # the event the idle replica waits on, if it is waiting
    error: list[str] = []

    def arrivals():
        for r in state.accepted:
            if r.arrival_s > env.now:
                yield env.timeout(r.arrival_s - env.now)
            state.arrive(r)
            if wake[0] is not None and not wake[0].triggered:
                wake[0].succeed()

    view = ReplicaView(state, cost_model)
    overhead = cost_model.step_overhead_seconds
    pass_seconds = cost_model.pass_seconds

    def replica():
        # A step starts where the previous one ended (unless the replica sat idle waiting
        # for an arrival): in a real run the SimPy hops and arrival handling between two
        # steps belong to a step's measured time, as they do to a user's latency.
        resume = [None]
        while not state.done:
            t0 = now() if resume[0] is None else resume[0]
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
                if state.arrived < state.n_accepted:
                    # nothing to run now: only the next arrival can change the policy's mind
                    wake[0] = env.event()
                    yield wake[0]
                    wake[0] = None
                    resume[0] = None
                    if not real:
                        clock[0] = env.now
                    continue
                raise PlanError(
                    f"policy '{policy_name}' step {state.step_index}: planned nothing with "
                    f"{state.n_accepted - state.finished} request(s) unfinished and no arrivals left")
            n_rows = 0
            for p in passes:
                n_rows += len(p.decode) + len(p.prefill)
            predicted = overhead(len(passes), n_rows)
            t = t0 if real else t0 + predicted  # simulated overhead: planning comes first
            rows = ptoks = 0
            for k, p in enumerate(passes):
                t_pass = now() if real else t
                shape = state.shape(p)
                pred = pass_seconds(shape)
                predicted += pred
                if real:
                    backend.execute(p, shape, state)
                    t = now()
                else:
                    t += pred
                rows += len(p.decode)
                if record_steps:
                    pass_log.append((state.step_index, k, t_pass, t, p))
                if p.prefill:
                    ptoks += shape.prefill_tokens
                done = state.apply_pass(p, t)
                if done and real:
                    for r in done:
                        backend.release(r)
            if real:
                t = now()
            resume[0] = t
            if record_steps:
                steps.append(StepRecord(
                    state.step_index, t0, t, predicted, (t - t0) if real else None,
                    rows, ptoks, len(passes), state.kv_used))
            state.step_index += 1
            if on_step is not None:
                on_step(state)
            if real:
                if t > env.now:
                    yield env.timeout(t - env.now)
            else:
                clock[0] = t
                nxt = state.arrived
                if nxt < state.n_accepted and accepted[nxt].arrival_s <= t and t > env.now:
                    yield env.timeout(t - env.now)

    accepted = state.accepted
    env.process(arrivals())
    proc = env.process(replica())
    try:
        env.run(until=proc)
    except (PlanError, PolicyError) as exc:
        error.append(str(exc))
    meta = backend.finish()
    return RunResult(
        policy=policy_name, mode=backend.mode, trace=trace_name, requests=state.requests,
        rejected=state.rejected, steps=steps, passes=pass_log, wall_s=time.perf_counter() - wall0, meta=meta,
        error=error[0] if error else None,
    )
