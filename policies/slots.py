"""slots: a fixed number of slots recycled as soon as a request finishes.

Per step: fill free slots from the FIFO; newly admitted prompts are prefilled whole (each
its own forward, no padding); then every request that was already decoding takes one
decode step in lockstep. A finished request frees its slot for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Pass, Plan, PolicyBase, SchedulerView, admit_fifo, decode_plan, require_positive


@dataclass
class Slots(PolicyBase):
    name = "slots"
    n_slots: int = 8

    def __post_init__(self) -> None:
        require_positive(self.name, n_slots=self.n_slots)

    def plan(self, view: SchedulerView) -> Plan:
        active = len(view.prefilling) + len(view.decoding)
        admitted = admit_fifo(view, self.n_slots - active)
        chunks = tuple((r.id, r.remaining_prompt) for r in list(view.prefilling) + admitted)
        if not chunks and view.decoding:
            return decode_plan(view.decoding.ids(), blocked=bool(view.waiting))  # (the FIFO head was refused)
        passes = []
        if chunks:
            passes.append(Pass(prefill=chunks))
        if view.decoding:
            passes.append(Pass(decode=view.decoding.ids()))
        return Plan(admit=tuple(r.id for r in admitted), passes=tuple(passes))
