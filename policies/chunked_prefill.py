"""chunked-prefill: a per-step prefill token budget, then a decode pass (Sarathi-style).

Per step: admit from the FIFO while active + prefilling < ``max_batch``; fill ``budget``
prefill tokens off the front of the prefilling queue, in order. A prompt that does not fit
takes a partial chunk and stays at the front. So that short prompts behind a long one are
still served in the same step, no one chunk may exceed ``long_prefill_threshold`` tokens
while other prompts are queued behind it (vLLM's ``long_prefill_token_threshold``; 0 means
``budget // 2``; set it to ``budget`` for strict FIFO). Then one decode pass over every
request that was decoding at the start of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Pass, Plan, PolicyBase, SchedulerView, admit_fifo, decode_plan, fifo_chunks, require_positive


@dataclass
class ChunkedPrefill(PolicyBase):
    name = "chunked-prefill"
    budget: int = 1024
    max_batch: int = 32
    long_prefill_threshold: int = 0

    def __post_init__(self) -> None:
        require_positive(self.name, budget=self.budget, max_batch=self.max_batch)
        if self.long_prefill_threshold < 0:
            raise ValueError("long_prefill_threshold must be >= 0")

    def plan(self, view: SchedulerView) -> Plan:
        active = len(view.prefilling) + len(view.decoding)
        admitted = admit_fifo(view, self.max_batch - active)
        queue = list(view.prefilling) + admitted
        cap = None
        if len(queue) > 1:
            cap = self.long_prefill_threshold or max(1, self.budget // 2)
        chunks = fifo_chunks(queue, self.budget, max_chunk=cap)
        if not chunks and not admitted and view.decoding:
            return decode_plan(view.decoding.ids(), blocked=bool(view.waiting))  # (the FIFO head was refused)
        passes = []
        if chunks:
            passes.append(Pass(prefill=tuple(chunks)))
        if view.decoding:
            passes.append(Pass(decode=view.decoding.ids()))
        return Plan(admit=tuple(r.id for r in admitted), passes=tuple(passes))
