"""vllm: vLLM v1's scheduler (``Scheduler.schedule``), on paged KV with recompute preemption.

Followed from vllm/v1/core/sched/scheduler.py (vllm-project/vllm commit 00024d31) and
vllm/v1/core/kv_cache_manager.py (commit 003df296), with chunked prefill on (v1's default)
and the FCFS policy:

- One token budget per step, ``max_num_batched_tokens``; every scheduled request takes
  ``num_new_tokens``: 1 for a decoding request, the rest of its prompt (prompt + output so
  far after a preemption) for a prefilling one, cut to ``long_prefill_token_threshold`` when
  that is > 0 and to the budget left (a partial chunk: chunked prefill).
- RUNNING requests first, in the order they were admitted, while budget is left. Each
  allocates the blocks its new tokens need (``allocate_slots``: ceil((computed + new) /
  block_size) minus the blocks it holds). When the free blocks do not suffice, the *last*
  running request (``self.running.pop()``: the latest admitted) is preempted and its blocks
  freed, repeatedly, until the allocation fits; when the request itself is the last one
  left it is preempted and running requests stop being scheduled this step.
- Preemption is recompute: the request goes back to the *front* of the waiting queue
  (``prepend_request``) with no KV; when it is scheduled again it prefills its prompt and
  the tokens it had generated (preempted requests resume first).
- WAITING requests next, only if nothing was preempted this step, in queue order, while
  budget is left and fewer than ``max_num_seqs`` requests run. Each takes its cached prefix
  (with prefix caching on; ``get_computed_blocks``) and allocates blocks for its first chunk
  plus the cached blocks it takes from the free pool; the first that does not fit stops
  admission (FCFS: no one overtakes it).
- Everything scheduled runs as one forward (decode rows and prefill chunks together).

Not modelled: the watermark (0 by default in the version read), speculative decoding,
encoder inputs, async scheduling, KV connectors, max_model_len. Defaults: ``max_num_seqs``
256 and ``long_prefill_token_threshold`` 0 (off) are vLLM's; ``max_num_batched_tokens``
2048 is vLLM's online-serving value of the v1 releases before the per-GPU defaults (it is a
setting: the bundled ``unified`` uses the same budget).

Blocks come from the replica (``--block-size``, ``--kv-tokens``); prefix caching is the
replica's (``--prefix-caching``): the policy reads hits through ``view.prefix_hit``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from itertools import repeat as _repeat
from operator import attrgetter, mod

from .base import Pass, Phase, Plan, PolicyBase, SchedulerView, UNTIL_CHANGE, require_positive

DECODING = Phase.DECODING
_CONTEXT = attrgetter("context")


@dataclass
class Vllm(PolicyBase):
    name = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        require_positive(self.name, max_num_seqs=self.max_num_seqs,
                         max_num_batched_tokens=self.max_num_batched_tokens)
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")

    def plan(self, view: SchedulerView) -> Plan:
        bs = view.block_size
        free = view.kv_blocks_free
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        running = list(view.running)
        n_run = len(running)
        decode: list[str] = []
        chunks: list[tuple[str, int]] = []
        preempt: list[str] = []
        ctxs = list(map(_CONTEXT, running))  # KV tokens + 1 of each running request
        one = 1 % bs
        offsets = None  # each running row's context modulo the block size, when all decode
        if n_run and n_run <= budget and len(view.decoding) == n_run:
            # every running request decodes (the common step): one token and, where its KV is
            # at a block boundary, one block each; when they all fit, that is the loop below
            offsets = list(map(mod, ctxs, _repeat(bs)))
            need = offsets.count(one)
            if need <= free:
                decode = list(view.running.ids())
                free -= need
                budget -= n_run
                n_run = 0
        i = 0
        while i < n_run and budget > 0:
            r = running[i]
            computed = ctxs[i] - 1
            if r.phase is DECODING:
                new = 1
                need = 1 if computed % bs == 0 else 0
            else:
                new = r.remaining_prompt
                if 0 < threshold < new:
                    new = threshold
                if new > budget:
                    new = budget
                need = -(-(computed + new) // bs) + computed // -bs
            stopped = False
            while need > free:  # preempt the latest admitted until it fits
                n_run -= 1
                victim = running[n_run]
                preempt.append(victim.id)
                free += view.freeable_blocks(victim)
                if victim is r:
                    stopped = True
                    break
            if stopped:
                break
            free -= need
            budget -= new
            if new == 1 and r.phase is DECODING:
                decode.append(r.id)
            else:
                chunks.append((r.id, new))
            i += 1
        admit: list[str] = []
        head_short = False  # the waiting queue's head was refused for blocks
        if not preempt and view.waiting:
            active = len(running)
            for r in view.waiting:
                if budget <= 0 or active >= self.max_num_seqs:
                    break
                hit, taken = view.prefix_hit(r)
                new = r.prefill_target - hit
                if 0 < threshold < new:
                    new = threshold
                if new > budget:
                    new = budget
                need = -(-(hit + new) // bs) - hit // bs + taken
                if need > free:
                    head_short = True
                    break
                free -= need
                budget -= new
                active += 1
                admit.append(r.id)
                chunks.append((r.id, new))
        if not decode and not chunks:
            return Plan(admit=tuple(admit), preempt=tuple(preempt))
        repeat = 0
        # With prefix caching, the decode steps' new blocks evict free cached blocks, and
        # evicting one from the middle of a refused head's cached prefix cuts its hit (and
        # the blocks it would take) by more than the one block it costs: it may fit next
        # step. Such steps are planned one by one.
        if decode and not chunks and not preempt and not (head_short and view.prefix_caching):
            if offsets is None or n_run:  # (some rows were planned one by one above)
                by_id = {r.id: c for r, c in zip(running, ctxs)}
                offsets = [by_id[rid] % bs for rid in decode]
            repeat = self._repeat(offsets, free, bs)
        return Plan(admit=tuple(admit), preempt=tuple(preempt),
                    passes=(Pass(decode=tuple(decode), prefill=tuple(chunks)),), repeat=repeat)

    @staticmethod
    def _repeat(offsets: list[int], free: int, bs: int) -> int:
        """How many more identical decode steps fit in ``free`` blocks (``Plan.repeat``).

        ``offsets``: each row's context (KV + 1) modulo the block size, i.e. the offset in
        its block of the position the step after this one writes. Over the next ``s`` steps a
        row at offset ``a`` takes floor((a + s - 1) / bs) blocks, plus one if ``a`` is 0 (a
        block boundary). While those fit, vLLM would schedule the very same rows again:
        nothing is preempted, and the waiting queue's head (refused now for budget,
        ``max_num_seqs`` or blocks) is refused again, as blocks only shrink (with prefix caching: see
        ``plan``, a head refused for blocks stops repeats). The loop stops
        earlier at an arrival or a finish.
        """
        if offsets.count(0) > free:  # need(1): the rows at a block boundary take one each
            return 0
        items = list(Counter(offsets).items())
        rows = len(offsets)

        def need(s: int) -> int:
            return sum(c * ((a + s - 1) // bs + (a == 0)) for a, c in items) if s > 0 else 0

        if need(UNTIL_CHANGE) <= free:
            return UNTIL_CHANGE
        # each row takes between (s - 1) / bs - 1 and (s - 1) / bs + 2 blocks over s steps:
        # the answer lies in a window a few blocks wide around free * bs / rows
        lo = max(0, (free // rows - 2) * bs)
        hi = min(UNTIL_CHANGE, (free // rows + 3) * bs + 1)
        while need(lo) > free:  # (never, by the bounds; kept for safety)
            lo //= 2
        while need(hi) <= free:
            hi *= 2
        while hi - lo > 1:  # need(lo) <= free < need(hi)
            mid = (lo + hi) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo
