"""prefer-prefill: mlx-default, but prompts go first while the decode batch has room.

While any prefill is queued or in flight (the prefill pass mlx-default would run this step
is not empty) and the decoding batch is below saturation (``completion_batch_size``), the
decode pass is skipped: new requests get their first token sooner, running requests stall.
With no prefill pending the plan is exactly mlx-default's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Plan, SchedulerView
from .mlx_default import MlxDefault


@dataclass
class PreferPrefill(MlxDefault):
    name = "prefer-prefill"

    def plan(self, view: SchedulerView) -> Plan:
        decoding = len(view.decoding)
        if decoding < self.completion_batch_size:
            # Skipping decode: nothing finishes, so the batch after is the batch now.
            admit, prefill = self.prompt_step(view, decoding)
            if prefill is not None:
                return Plan(admit=tuple(admit), passes=(prefill,))
        return super().plan(view)
