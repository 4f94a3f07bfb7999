"""static: classic static batching.

Take up to ``batch_size`` waiting requests, prefill the whole batch in one pass (padded to
the longest prompt when ``padded``), then decode it until every member has finished.
Nothing joins mid-batch: finished members leave their seat empty until the batch is done.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Pass, Plan, PolicyBase, SchedulerView, admit_fifo, decode_plan, require_positive


@dataclass
class Static(PolicyBase):
    name = "static"
    batch_size: int = 8
    padded: bool = True

    def __post_init__(self) -> None:
        require_positive(self.name, batch_size=self.batch_size)

    def plan(self, view: SchedulerView) -> Plan:
        if view.decoding and not view.prefilling:
            return decode_plan(view.decoding.ids(), blocked=True)  # (it admits only once the batch is done)
        if view.prefilling or view.decoding:
            passes = []
            if view.prefilling:
                chunks = tuple((r.id, r.remaining_prompt) for r in view.prefilling)
                passes.append(Pass(prefill=chunks, padded=self.padded))
            if view.decoding:
                passes.append(Pass(decode=view.decoding.ids()))
            return Plan(passes=tuple(passes))
        batch = admit_fifo(view, self.batch_size)
        if not batch:
            return Plan()
        chunks = tuple((r.id, r.remaining_prompt) for r in batch)
        return Plan(admit=tuple(r.id for r in batch), passes=(Pass(prefill=chunks, padded=self.padded),))
