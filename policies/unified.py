"""unified: one pass per step holding every decode row, then prefill chunks (vLLM v1).

Decode rows come first, one token each; the rest of ``token_budget`` is filled with
prefill chunks in FIFO order (running prompts first, then newly admitted ones, a partial
chunk for the one that does not fit). Admission stops at ``max_batch`` running requests
or when the budget is spent.

``separate``: the same plan run as two forwards per step, the prefill chunks and then the
decode rows (a v0-style model runner under vLLM's v1 scheduler, as vllm-metal ran before its
unified pass): the schedule is unchanged, the cost is two passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Pass, Plan, PolicyBase, SchedulerView, admit_fifo, decode_plan, fifo_chunks, require_positive


@dataclass
class Unified(PolicyBase):
    name = "unified"
    token_budget: int = 2048
    max_batch: int = 64
    separate: bool = False

    def __post_init__(self) -> None:
        require_positive(self.name, token_budget=self.token_budget, max_batch=self.max_batch)

    def plan(self, view: SchedulerView) -> Plan:
        decode = view.decoding.ids()[: self.token_budget]
        budget = self.token_budget - len(decode)
        running = list(view.prefilling)
        in_flight = sum(r.remaining_prompt for r in running)
        admitted = []
        if budget > in_flight:
            active = len(running) + len(view.decoding)
            admitted = admit_fifo(view, self.max_batch - active)
            # admit only what this step's budget can start on
            room, kept = budget - in_flight, []
            for r in admitted:
                if room <= 0:
                    break
                kept.append(r)
                room -= r.remaining_prompt
            admitted = kept
        chunks = fifo_chunks(running + admitted, budget)
        if not decode and not chunks:
            return Plan(admit=tuple(r.id for r in admitted))
        if not chunks and not admitted:
            return decode_plan(decode, blocked=bool(view.waiting))  # (the FIFO head was refused)
        admit = tuple(r.id for r in admitted)
        if self.separate and decode and chunks:
            return Plan(admit=admit, passes=(Pass(prefill=tuple(chunks)), Pass(decode=decode)))
        return Plan(admit=admit, passes=(Pass(decode=decode, prefill=tuple(chunks)),))
