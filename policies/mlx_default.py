"""mlx-lm's BatchGenerator schedule (mlx_lm/generate.py, ``BatchGenerator._next``).

Per step: one decode pass over the decoding batch; then, if the batch left after that pass
is below ``completion_batch_size``, admit prompts until the prompt batch holds
``prefill_batch_size``, and run one padded prefill pass in which every prompt in the batch
advances by up to ``prefill_step_size`` tokens (right-padded to the longest row: padding
costs real compute).

As in mlx-lm, the prefill stops one token short of each prompt's end: a prompt with one
token left joins the decode batch, its last prompt token is the first decode input, and
prefill logits are never computed. (mlx-lm runs that first decode of the newcomers as a
separate small forward and hands the token out one step later; here the newcomers ride in
the next decode pass, which computes the same tokens with one forward fewer.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    Pass,
    Plan,
    PolicyBase,
    RequestView,
    SchedulerView,
    admit_fifo,
    count_finishing,
    decode_plan,
    require_positive,
)


@dataclass
class MlxDefault(PolicyBase):
    name = "mlx-default"
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048

    def __post_init__(self) -> None:
        require_positive(
            self.name,
            completion_batch_size=self.completion_batch_size,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
        )
        # mlx-lm: completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.completion_batch_size = max(self.completion_batch_size, self.prefill_batch_size)

    # -- pieces shared with prefer-prefill -------------------------------------------
    @staticmethod
    def handoffs(view: SchedulerView) -> list[RequestView]:
        """Prompts with one token left: it is decoded, not prefilled (mlx-lm's hand-off)."""
        return [r for r in view.prefilling if r.remaining_prompt == 1]

    def prompt_step(self, view: SchedulerView, batch_after: int) -> tuple[list[str], Pass | None]:
        """Admissions and the padded prefill pass, given the decode batch size after decode."""
        if batch_after >= self.completion_batch_size or not (view.prefilling or view.waiting):
            return [], None
        prompt_batch = list(view.prefilling)  # includes hand-offs, as in mlx-lm at admission
        room = min(
            self.prefill_batch_size - len(prompt_batch),
            self.completion_batch_size - batch_after,
        )
        admitted = admit_fifo(view, room)
        chunks = []
        for r in prompt_batch + admitted:
            n = min(r.remaining_prompt - 1, self.prefill_step_size)
            if n > 0:
                chunks.append((r.id, n))
        return [r.id for r in admitted], (Pass(prefill=tuple(chunks), padded=True) if chunks else None)

    def plan(self, view: SchedulerView) -> Plan:
        handoffs = self.handoffs(view) if view.prefilling else []
        rows = view.decoding.ids() + tuple(r.id for r in handoffs)
        passes = []
        if rows:
            passes.append(Pass(decode=rows))
        batch_after = len(rows) - count_finishing(view.decoding) - count_finishing(handoffs)
        admit, prefill = self.prompt_step(view, batch_after)
        if prefill is None and rows and not admit:
            # (with requests waiting, the batch is full or the FIFO head was refused)
            return decode_plan(rows, blocked=bool(view.waiting))
        if prefill is not None:
            passes.append(prefill)
        return Plan(admit=tuple(admit), passes=tuple(passes))
