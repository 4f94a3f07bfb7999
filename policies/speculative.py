"""Speculative decoding as a schedule: any policy, its decode rows verifying draft tokens.

``Speculative(inner, k=4)`` plans as ``inner`` does, then lets each decode row of the step's
first decode pass verify up to ``k`` draft tokens (``Pass.draft``): k + 1 positions of the row
in the same forward, of which the row keeps its accepted drafts and one more token. How many are
accepted is the target model's on the real engine and an acceptance profile's in a simulation
(``sim.speculation``). ``--speculative ngram:k=4`` wraps every bundled policy so.

What a draft costs, and what it takes from others:

- **Tokens of the step's budget.** A policy with a token budget (``unified``'s
  ``token_budget``, ``vllm``'s ``max_num_batched_tokens``) counts verify positions in it, as
  vLLM's scheduler does (a running request schedules 1 + its draft tokens, running requests
  first): the inner policy plans with its budget less the drafts, so under load the drafts
  crowd out prefill. A policy without a budget has nothing to crowd.
- **KV.** The forward writes KV for every draft position before the rejected ones are dropped:
  a row drafts only as far as the blocks left after the step's own passes allow (the rejected
  positions' blocks are given back at the pass's end: ``ReplicaState``).
- **Time.** A verify pass costs more than a decode pass (``policies.base.verify_seconds``); a
  draft model's drafts cost its own passes first (``draft_seconds``: k decode passes of the
  draft model over the drafting rows, priced by its own cost model ``draft_cost``).

Where drafts come from (``method``): ``ngram``, prompt lookup over the row's own tokens (free to
find); ``draft``, a smaller model of the same vocabulary (``draft_model``: what the real engine
loads, ``engine.MLXBackend.use_draft``; ``draft_cost``: its cost model, which a simulation
charges and the adaptive k weighs).

``adaptive=True`` chooses k each step (at most ``k``): the one that gives the most tokens per
second of the step, the expected tokens of every row under the acceptance seen so far (the
``accept`` prior until enough drafts were verified) over the pass's predicted seconds with
those drafts (a draft model's k passes included: ``draft_seconds``). As the batch grows the
drafts' share of the pass grows and k shrinks, as it does when acceptance falls.

A row drafts at most its tokens left - 1 (it never writes KV past its reservation); a request
handed off from prefilling (its first decode) drafts none; the plan never repeats in bulk.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from .base import OptionError, Pass, PassShape, Plan, draft_seconds, verify_seconds

METHODS = ("ngram", "draft")
BUDGETS = ("token_budget", "max_num_batched_tokens")  # a policy's per-step token budget, by name
MIN_OBSERVED = 32  # verify rows seen before the adaptive k trusts what it saw over its prior


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class Speculative:
    """``inner``, its decode rows drafting up to ``k`` tokens (``method``: where drafts come
    from, ``ngram``: prompt lookup, ``draft``: the draft model ``draft_model``, a model name or a
    loaded model, whose passes cost what ``draft_cost`` says); ``adaptive``: k chosen per step;
    ``accept``: the per-position acceptance the adaptive choice expects before it has seen any."""

    drafts = True  # (a deployment of it needs an acceptance profile in a simulation)

    def __init__(
        self,
        inner: Any,
        k: int = 4,
        method: str = "ngram",
        adaptive: bool = False,
        accept: Sequence[float] = (),
        draft_model: Any = None,
        draft_cost: Any = None,
    ):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise OptionError(f"speculative: k must be an integer >= 1 (draft tokens per row), got {k!r}")
        if method not in METHODS:
            raise OptionError(
                f"speculative: method must be ngram (prompt lookup) or draft (a draft model), got {method!r}"
            )
        if method == "draft" and draft_model is None:
            raise OptionError("speculative: the draft method needs its draft model (draft:model=M)")
        if method != "draft" and (draft_model is not None or draft_cost is not None):
            raise OptionError(f"speculative: a draft model goes with the draft method, not {method}")
        if adaptive and not accept:
            raise OptionError("speculative: adaptive k needs the acceptance it expects (accept=P1/P2/...)")
        self.inner = inner
        self.k = k
        self.method = method
        self.adaptive = bool(adaptive)
        self.accept = tuple(float(p) for p in accept)
        self.draft_model = draft_model
        self.draft_cost = draft_cost  # (None: the draft's passes are not priced, n-gram's cost nothing)
        self.name = f"{getattr(inner, 'name', type(inner).__name__)}+{method}-k{k}" + ("-adaptive" if adaptive else "")
        self._budget = next((b for b in BUDGETS if isinstance(getattr(inner, b, None), int)), None)
        self.k_chosen: list[int] = []  # the adaptive k of every step that had rows to draft for

    def __deepcopy__(self, memo):
        out = copy.copy(self)
        out.inner = copy.deepcopy(self.inner, memo)
        out.k_chosen = []
        return out

    def options(self) -> dict[str, Any]:
        get = getattr(self.inner, "options", None)
        own = {"method": self.method, "k": self.k, "adaptive": self.adaptive}
        if self.accept:
            own["accept"] = list(self.accept)
        if self.draft_model is not None:
            own["draft_model"] = str(getattr(self.draft_model, "name", self.draft_model))
        return {**(dict(get()) if callable(get) else {}), "speculative": own}

    # ------------------------------------------------------------------ the plan
    def plan(self, view) -> Plan:
        k = self._choose_k(view) if self.adaptive else self.k
        want = {r.id: min(k, r.tokens_left - 1) for r in view.decoding if r.tokens_left > 1} if k else {}
        inner = self.inner
        if self._budget is not None and want:
            budget = getattr(inner, self._budget)
            room = budget - len(view.decoding) - 1  # the rows' own tokens, and one to spare
            want = _fit(want, max(room, 0))
            setattr(inner, self._budget, budget - sum(want.values()))
            try:
                plan = inner.plan(view)
            finally:
                setattr(inner, self._budget, budget)
        else:
            plan = inner.plan(view)
        if not any(want.values()):
            return plan if not plan.repeat else Plan(plan.admit, plan.preempt, plan.passes, 0)
        return Plan(plan.admit, plan.preempt, self._with_drafts(view, plan.passes, want), 0)

    def _with_drafts(self, view, passes: Sequence[Pass], want: Mapping[str, int]) -> tuple[Pass, ...]:
        """The passes, the first decode pass's rows drafting what the KV left after every pass's
        own blocks allows (in row order)."""
        bs = view.block_size
        free = view.kv_blocks_free - sum(self._pass_blocks(view, p, bs) for p in passes)
        out = list(passes)
        for i, p in enumerate(passes):
            if not p.decode:
                continue
            drafts = []
            for rid in p.decode:
                k = want.get(rid, 0)
                if k:
                    c = view.request(rid).context  # its KV after this pass's own token
                    while k and _blocks(c + k, bs) - _blocks(c, bs) > free:
                        k -= 1
                    free -= _blocks(c + k, bs) - _blocks(c, bs)
                drafts.append(k)
            if any(drafts):
                out[i] = Pass(p.decode, p.prefill, p.padded, tuple(drafts))
            break
        return tuple(out)

    @staticmethod
    def _pass_blocks(view, p: Pass, bs: int) -> int:
        """Blocks the pass allocates without drafts (its rows' tokens, its chunks)."""
        n = 0
        for rid in p.decode:
            c = view.request(rid).context
            n += _blocks(c, bs) - _blocks(c - 1, bs)
        for rid, tokens in p.prefill:
            p0 = view.request(rid).prefilled
            n += _blocks(p0 + tokens, bs) - _blocks(p0, bs)
        return n

    # ------------------------------------------------------------------ adaptive k
    def acceptance(self, view) -> tuple[float, ...]:
        """The per-position acceptance expected now: what the run's verify rows showed once
        ``MIN_OBSERVED`` of them drafted, else the prior."""
        drafts, _, _, per_pos = view.speculation
        if drafts < MIN_OBSERVED or not per_pos:
            return self.accept
        out, before = [], drafts
        for i, accepted in enumerate(per_pos[: self.k]):
            if before <= 0:
                out.append(self.accept[i] if i < len(self.accept) else 0.0)
            else:
                out.append(accepted / before)
            before = accepted
        return tuple(out)

    def _choose_k(self, view) -> int:
        rows = [r for r in view.decoding if r.tokens_left > 1]
        model = view.cost_model
        if not rows or model is None:
            return self.k
        accept = self.acceptance(view)
        ctxs = tuple(view.decoding.contexts())
        lefts = [r.tokens_left for r in view.decoding]
        base = model.pass_seconds(PassShape(ctxs))
        best_k, best = 0, len(ctxs) / base if base > 0 else 0.0
        for k in range(1, self.k + 1):
            drafts = tuple(min(k, left - 1) if left > 1 else 0 for left in lefts)
            tokens = sum(expected_tokens(accept, d) for d in drafts)
            shape = PassShape(ctxs, decode_drafts=drafts)
            seconds = base + verify_seconds(model, shape) + draft_seconds(self.draft_cost, shape)
            if seconds > 0 and tokens / seconds > best:
                best_k, best = k, tokens / seconds
        self.k_chosen.append(best_k)
        return best_k


def expected_tokens(accept: Sequence[float], k: int) -> float:
    """Tokens a row of ``k`` drafts yields on average under the per-position acceptance
    ``accept``: 1 + the expected accepted drafts (the simulator's profile says the same:
    ``sim.speculation.Acceptance.expected_tokens``)."""
    out, keep = 1.0, 1.0
    for p in accept[:k]:
        keep *= p
        out += keep
    return out


def _fit(want: dict[str, int], room: int) -> dict[str, int]:
    """The drafts cut, in row order, to ``room`` tokens in all."""
    out = {}
    for rid, k in want.items():
        k = min(k, room)
        out[rid] = k
        room -= k
    return out
