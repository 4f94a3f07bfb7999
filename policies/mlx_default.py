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

``time_budget`` (seconds; 0, the default: off) is what ``mlx_lm.server`` adds around the
generator (``TimeBudget`` in mlx_lm/server.py, 0.5 s): it hands the generator the requests that
arrived only between runs of steps that long, and at once when the batch has nothing to do. Here
a window opens every ``time_budget`` seconds while requests are running (at once when none is),
and a waiting request may be admitted from the first step of the first window that opened after
it arrived. A burst is then admitted in fuller prompt batches, and the requests that arrive while
the batch runs join it at most once a window.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    OptionError,
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
    time_budget: float = 0.0

    def __post_init__(self) -> None:
        require_positive(
            self.name,
            completion_batch_size=self.completion_batch_size,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
        )
        if not self.time_budget >= 0:
            raise OptionError(f"policy '{self.name}': option time_budget must be >= 0 seconds, got {self.time_budget}")
        # mlx-lm: completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.completion_batch_size = max(self.completion_batch_size, self.prefill_batch_size)
        self._window: float | None = None  # when the current time-budget window opened

    def visible(self, view: SchedulerView) -> int | None:
        """With a ``time_budget``: how many of the waiting requests (from the front, at most a
        prompt batch) arrived before the current window opened, opening a new one when due.
        None without one: every waiting request may be admitted."""
        if not self.time_budget:
            return None
        now, w, budget = view.now, self._window, self.time_budget
        # idle, mlx_lm.server hands over what came at once (a clock behind the window: the object
        # plans another run); busy, a window opens every budget's worth of steps
        if w is None or now < w or not (view.decoding or view.prefilling):
            self._window = w = now
        elif now - w >= budget:
            self._window = w = w + budget * ((now - w) // budget)
        n = 0
        for r in view.waiting:
            if n >= self.prefill_batch_size or r.arrival_s > w:
                break
            n += 1
        return n

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
        seen = self.visible(view)
        admitted = admit_fifo(view, room if seen is None else min(room, seen))
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
            if self.time_budget and view.waiting:  # (a window opening may admit them: no promise)
                return Plan(passes=(Pass(decode=rows),))
            # (with requests waiting, the batch is full or the FIFO head was refused)
            return decode_plan(rows, blocked=bool(view.waiting))
        if prefill is not None:
            passes.append(prefill)
        return Plan(admit=tuple(admit), passes=tuple(passes))
