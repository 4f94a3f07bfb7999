"""Backends turn a checked pass into the seconds it took: predicted or measured.

The protocol (``engine.MLXBackend`` implements it for real forward passes):

- ``mode``: ``"sim"`` or ``"real"`` (recorded in the run's summary);
- ``make_clock()``: the clock that fits the backend's seconds (``SimClock``/``WallClock``);
- ``start(state, requests)``: once, before the clock starts (a real backend checks the known
  requests against its model and warms up here);
- ``step_overhead(predicted_s)``: seconds to add before a step's passes for the scheduler's
  own work: the prediction in a simulation, 0 on a wall clock (it is measured already);
- ``execute(pass, shape, state) -> seconds``: run one pass the state machine has checked,
  before the state advances; may call ``state.stop(rid)`` when a request hits EOS;
- ``release(request)``: free a request's KV (finished or preempted);
- ``finish() -> dict``: once after the run; metadata for summary.json.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from policies.base import CostModel, Pass, PassShape

from .clock import SimClock


class Backend(Protocol):
    mode: str

    def make_clock(self): ...

    def start(self, state, requests: Sequence[Any] | None) -> None: ...

    def step_overhead(self, predicted_s: float) -> float: ...

    def execute(self, p: Pass, shape: PassShape, state) -> float: ...

    def release(self, r) -> None: ...

    def finish(self) -> dict[str, Any]: ...


class SimBackend:
    """Simulation: every pass takes the seconds the cost model predicts for its shape."""

    mode = "sim"

    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model
        self.execute = lambda p, shape, state, _predict=cost_model.pass_seconds: _predict(shape)

    def make_clock(self) -> SimClock:
        return SimClock()

    def start(self, state, requests) -> None:
        pass

    def step_overhead(self, predicted_s: float) -> float:
        return predicted_s

    def release(self, r) -> None:
        pass

    def finish(self) -> dict[str, Any]:
        return {}
