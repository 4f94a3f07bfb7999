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

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate, repeat as _repeat
from operator import countOf, eq, mod

from .base import Pass, Phase, Plan, PolicyBase, SchedulerView, UNTIL_CHANGE, require_positive

DECODING = Phase.DECODING


@dataclass
class Vllm(PolicyBase):
    name = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        require_positive(self.name, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")

    def plan(self, view: SchedulerView) -> Plan:
        bs = view.block_size
        free = view.kv_blocks_free
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        running_q = view.running
        ids = running_q.ids()
        n_run = len(ids)
        running = None  # the states in a list, made when a row is planned one by one
        decode: list[str] = []
        chunks: list[tuple[str, int]] = []
        preempt: list[str] = []
        ctxs = running_q.contexts()  # KV tokens + 1 of each running request
        # where the prefilling requests sit among the running (few: those being admitted);
        # every other running request decodes
        pre = sorted(map(ids.index, view.prefilling.ids())) if view.prefilling else []
        pre.append(n_run)
        k_pre = 0
        one = 1 % bs  # a decode row whose context is at ``one`` modulo bs starts a block
        i = 0
        while i < n_run and budget > 0:
            while pre[k_pre] < i:
                k_pre += 1
            j = min(pre[k_pre], n_run, i + budget)
            if j > i:
                # decoding rows i..j-1: one token each, and one block for each whose KV is at
                # a block boundary; taken as a whole while the blocks suffice (the common step)
                total = countOf(map(mod, ctxs[i:j], _repeat(bs)), one)
                if total <= free:
                    decode.extend(ids[i:j])
                    free -= total
                    budget -= j - i
                    i = j
                    continue
                # the rows up to the first whose block is not free; that one preempts (below)
                cum = list(accumulate(map(eq, map(mod, ctxs[i:j], _repeat(bs)), _repeat(one))))
                k = bisect_right(cum, free)
                if k:
                    decode.extend(ids[i : i + k])
                    free -= cum[k - 1]
                    budget -= k
                    i += k
            if running is None:
                running = list(running_q)
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
            active = len(ids)
            for r in view.waiting:
                if budget <= 0 or active >= self.max_num_seqs:
                    break
                hit, taken = view.prefix_hit(r)
                # a prompt whose KV came with it (a disaggregated decode replica's) computes only
                # the rest, in blocks allocated at admission as the transfer fills them
                held = r.prefilled
                new = r.prefill_target - hit - held
                if 0 < threshold < new:
                    new = threshold
                if new > budget:
                    new = budget
                # (+ its windows and recurrent state on a model with such layers: held whole)
                need = -(-(hit + held + new) // bs) - hit // bs + taken + r.fixed_blocks
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
            # (then the decode rows are the first running requests, in order)
            offsets = list(map(mod, ctxs[: len(decode)], _repeat(bs)))
            repeat = self._repeat(offsets, free, bs)
        return Plan(
            admit=tuple(admit),
            preempt=tuple(preempt),
            passes=(Pass(decode=tuple(decode), prefill=tuple(chunks)),),
            repeat=repeat,
            # with requests waiting and none admitted, the head was refused: an arrival queues behind it
            past_arrivals=bool(repeat and view.waiting and not admit),
        )

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
        if not offsets:
            return UNTIL_CHANGE
        rows = len(offsets)
        # over s >= 1 steps, with s - 1 = q * bs + rem, a row at offset a takes q blocks, one
        # more if a >= bs - rem, and one more if a is 0: need(s) = rows * q + #{a >= bs - rem}
        # + #{a = 0}
        left = free - offsets.count(0)  # after need(1)
        if left < 0:
            return 0
        q, left = divmod(left, rows)
        # the largest rem with #{a >= bs - rem} <= left: below the (left + 1)-th largest offset
        rem = bs - 1 - sorted(offsets, reverse=True)[left]
        return min(q * bs + rem + 1, UNTIL_CHANGE)
