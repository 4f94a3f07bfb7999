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

Optional: ``repeat_decode(shape, k) -> iterator of seconds``, of the ``k`` decode passes that
follow a decode pass of ``shape`` over the same rows (a ``Plan.repeat`` run). A backend that has
it lets the loop run such steps in bulk; one that does not (a real engine must compute every
token) runs them one by one, still without asking the policy.

Optional: ``use_draft(model, cost)``, called once before ``start`` when the policy drafts with a
draft model (speculative decoding's ``draft`` method: ``policies.speculative``): ``model`` the
draft model (a real engine loads it and proposes with it), ``cost`` its cost model (a simulation
charges its passes: ``policies.base.draft_seconds``).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Protocol, Sequence

from schedlab.policies.base import CostModel, Pass, PassShape, as_cost_model, draft_seconds, verify_seconds

from .clock import SimClock
from .speculation import Acceptance, SpeculationError


class Backend(Protocol):
    mode: str

    def make_clock(self): ...

    def start(self, state, requests: Sequence[Any] | None) -> None: ...

    def step_overhead(self, predicted_s: float) -> float: ...

    def execute(self, p: Pass, shape: PassShape, state) -> float: ...

    def release(self, r) -> None: ...

    def finish(self) -> dict[str, Any]: ...


class SimBackend:
    """Simulation: every pass takes the seconds the cost model predicts for its shape.

    ``time_scale``: a machine that runs everything — passes, the scheduler's own work, waking
    from idle — ``time_scale`` times as long as the cost model says, while the policy still
    plans with the model's estimates (as a real engine's policy does on a machine that has
    sped up or slowed down since its calibration). ``validate``'s speed-matched comparison
    simulates each real run again at that run's own measured speed this way."""

    mode = "sim"

    def __init__(self, cost_model: CostModel, time_scale: float = 1.0, acceptance: Acceptance | None = None):
        if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time_scale must be a positive number, got {time_scale!r}")
        self.cost_model = cost_model
        self._model = model = as_cost_model(cost_model)
        self.time_scale = f = float(time_scale)
        self.acceptance = acceptance
        self.draft_cost = None  # a draft model's cost model (``use_draft``)
        self._drafted: set[str] = set()  # requests whose draft cache the draft model has filled
        if acceptance is not None:
            self._draws: dict = {}  # each request's generator of acceptance draws (this run's)
            self.execute = self._execute_speculative
        elif f == 1.0:
            self.execute = lambda p, shape, state, _predict=model.pass_seconds: _predict(shape)
        else:
            self.execute = lambda p, shape, state, _predict=model.pass_seconds: f * _predict(shape)

    def _execute_speculative(self, p: Pass, shape: PassShape, state) -> float:
        """A pass whose rows may verify drafts: whether each row's drafter proposes at all
        (``Acceptance.propose``: one that does not is a plain row, its positions not in the
        forward) and how many of its drafts it accepts, drawn from the acceptance profile
        (``state.accept``); the pass priced with the drafts proposed (``verify_seconds`` on top
        for a cost model that does not price them itself)."""
        if p.draft:
            acceptance, draws = self.acceptance, self._draws
            drafts = list(p.draft)
            for i, (rid, k) in enumerate(zip(p.decode, drafts)):
                if k:
                    if acceptance.proposes(rid, draws):
                        state.accept(rid, acceptance.accepted(rid, k, draws))
                    else:  # (its drafter found nothing: a plain row, its positions not computed)
                        state.accept(rid, 0, 0)
                        drafts[i] = 0
            if drafts != list(p.draft):
                shape = shape._replace(decode_drafts=tuple(drafts) if any(drafts) else ())
            seconds = self._model.pass_seconds(shape) + verify_seconds(self._model, shape)
            if self.draft_cost is not None:
                seconds += self._draft_seconds(p, shape)
        else:
            seconds = self._model.pass_seconds(shape)
        return self.time_scale * seconds

    def use_draft(self, model: Any, cost: Any) -> None:
        """The policy's rows draft with draft model ``model``, whose passes ``cost`` prices."""
        if cost is None:
            name = getattr(model, "name", model)
            raise SpeculationError(
                f"a simulation of draft model {name}'s drafts needs its cost model: give draft_profile=PATH "
                f"(a profile calibrate measured on it)"
            )
        self.draft_cost = as_cost_model(cost)

    def _draft_seconds(self, p: Pass, shape: PassShape) -> float:
        """The draft model's passes before a verify pass (``draft_seconds``), its prefill of a
        row's context first where the row has no draft cache yet (as the engine's draft has none)."""
        held = self._drafted
        fresh = [bool(k) and rid not in held for rid, k in zip(p.decode, p.draft)]
        held.update(rid for rid, k in zip(p.decode, p.draft) if k)
        return draft_seconds(self.draft_cost, shape, fresh)

    def make_clock(self) -> SimClock:
        return SimClock()

    def start(self, state, requests) -> None:
        pass

    def step_overhead(self, predicted_s: float) -> float:
        return predicted_s if self.time_scale == 1.0 else self.time_scale * predicted_s

    def repeat_decode(self, shape: PassShape, k: int) -> Iterator[float]:
        seconds = self._model.decode_run_seconds(shape, k)
        f = self.time_scale
        return seconds if f == 1.0 else (f * t for t in seconds)

    def release(self, r) -> None:
        self._drafted.discard(r.id)  # (finished or preempted: its draft cache goes with its KV)

    def finish(self) -> dict[str, Any]:
        return {}
