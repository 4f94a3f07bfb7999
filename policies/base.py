"""The policy API: what a scheduling policy reads (a view) and what it returns (a plan).

A policy is any object with ``name`` and ``plan(view) -> Plan``. The same object runs in
the simulator and on the real MLX engine; nothing here knows which.

Vocabulary (the words the code uses):

- request: one trace row. Its phase is ``waiting`` (arrived, not admitted), ``prefilling``
  (admitted, prompt not yet wholly in the KV cache: it may hold 0 tokens so far),
  ``decoding`` (prompt in the cache, first token out) or ``finished``.
- pass: one model forward call: decode rows (one token each) and prefill chunks
  ``(request id, n_tokens)``. A padded pass batches its prefill chunks into one
  right-padded forward (mlx-lm's prompt batches); otherwise each chunk is its own forward.
- plan: admissions, preemptions, then passes run in order.

The first output token comes from the pass that puts the last prompt token into the KV
cache. That is either a prefill chunk that completes the prompt, or a decode row on a
request with exactly one prompt token left (mlx-lm's hand-off: the last prompt token is
the first decode input and prefill logits are never computed).

This module imports nothing from ``sim`` or ``engine``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from operator import attrgetter, index
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

from .plugins import construct, option_names


class Phase(str, Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@runtime_checkable
class RequestView(Protocol):
    """Read-only facts about one request, as a policy sees them."""

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # the request's max_tokens; runs stop exactly there (ignore-eos)

    @property
    def phase(self) -> Phase: ...
    @property
    def prefilled(self) -> int: ...  # prompt tokens now in the KV cache
    @property
    def generated(self) -> int: ...  # output tokens produced so far
    @property
    def tokens_left(self) -> int: ...  # output tokens still to produce
    @property
    def remaining_prompt(self) -> int: ...  # prompt tokens still to put into the cache
    @property
    def kv_tokens(self) -> int: ...  # tokens this request holds in the KV cache now
    @property
    def kv_footprint(self) -> int: ...  # most KV tokens it will ever hold: prompt + output - 1 (+ fixed_tokens)
    @property
    def fixed_blocks(self) -> int: ...  # blocks it holds whole while admitted: sliding windows, recurrent state
    @property
    def fixed_tokens(self) -> int: ...  # the same in tokens (0 for a model of full-attention layers only)
    @property
    def context(self) -> int: ...  # while admitted: kv_tokens + 1 (what a decode row attends to)

    preemptions: int  # times it was preempted (recompute)
    cached_tokens: int  # prompt tokens found in the prefix cache at its first admission


class _PassFields(NamedTuple):
    decode: tuple[str, ...]
    prefill: tuple[tuple[str, int], ...]
    padded: bool
    draft: tuple[int, ...] = ()


class Pass(_PassFields):
    """One forward call. ``decode``: request ids, one token each. ``prefill``: chunks
    ``(request id, n_tokens)``. ``padded``: run the chunks as one right-padded batch.

    ``draft``: speculative decoding, one number per decode row (empty: none): row i also
    verifies ``draft[i]`` draft tokens, k + 1 positions in the same forward. The pass reserves
    KV for all of them; the row then keeps its accepted drafts and one more token (the target's
    own at the first rejected position, or after the last draft): 1 to k + 1 tokens, all out at
    the pass's end. A draft is at most the row's tokens left - 1; a hand-off row drafts none.

    Immutable (a tuple); lists given by a policy are stored as tuples.
    """

    __slots__ = ()

    def __new__(
        cls,
        decode: Sequence[str] = (),
        prefill: Sequence[tuple[str, int]] = (),
        padded: bool = False,
        draft: Sequence[int] = (),
    ):
        if type(decode) is not tuple:
            decode = tuple(decode)
        if type(prefill) is not tuple:
            prefill = tuple(tuple(c) if isinstance(c, list) else c for c in prefill)
        if type(draft) is not tuple:
            draft = tuple(draft)
        return tuple.__new__(cls, (decode, prefill, padded, draft))


class _PlanFields(NamedTuple):
    admit: tuple[str, ...]
    preempt: tuple[str, ...]
    passes: tuple[Pass, ...]
    repeat: int
    past_arrivals: bool


class Plan(_PlanFields):
    """What one scheduler step does: admissions, preemptions, then passes in order.

    ``repeat``: the policy's promise that, for a plan of one decode-only pass, it would plan
    the very same pass again in each of up to ``repeat`` following steps, as long as no request
    arrives, none of the pass's rows finishes or is about to (its last token), and the step
    moved no request between queues (a hand-off from prefilling to decoding). The loop may
    then run those steps without asking (vLLM's multi-step scheduling does the same); it asks
    again at the first arrival, at the step that finishes a row, and after ``repeat`` steps.
    A policy whose decisions read the clock or per-step token counts beyond that leaves it 0.

    ``past_arrivals``: the promise holds through arrivals too. A FIFO policy can say so when
    the waiting queue's head was refused (or nothing would be admitted before a row finishes):
    a newcomer queues behind that head and changes nothing. The loop then runs the steps past
    arrivals, which join the waiting queue at their own times, and asks again at the first
    finish, hand-off or cancellation (and after every arrival where a prefix cache is on: the
    blocks a step adds are visible to whoever looks next).
    """

    __slots__ = ()

    def __new__(
        cls,
        admit: Sequence[str] = (),
        preempt: Sequence[str] = (),
        passes: Sequence[Pass] = (),
        repeat: int = 0,
        past_arrivals: bool = False,
    ):
        if type(admit) is not tuple:
            admit = tuple(admit)
        if type(preempt) is not tuple:
            preempt = tuple(preempt)
        if type(passes) is not tuple:
            passes = tuple(passes)
        if repeat and (type(repeat) is not int or repeat < 0):  # (0, the default, costs one test)
            repeat = _repeat_count(repeat)
        return tuple.__new__(cls, (admit, preempt, passes, repeat, past_arrivals))


def _repeat_count(repeat: Any) -> int:
    """``Plan.repeat`` off the fast path: an integer >= 0 (a numpy integer becomes an int)."""
    if not isinstance(repeat, bool):
        try:
            n = index(repeat)
        except TypeError:
            n = -1
        if n >= 0:
            return n
    raise ValueError(f"Plan.repeat must be an integer >= 0, got {repeat!r}")


class PassShape(NamedTuple):
    """What the cost of a pass depends on.

    decode_contexts: for each decode row, the tokens it attends to (its KV plus the new one).
    prefill: for each chunk, ``(n_tokens, context_before)``.
    padded: chunks run as one right-padded batch (cost of padding is real).
    batch_rows_before / joins / leaves: the engine keeps decoding rows in one batched KV
      cache; rows joining it (extend) and leaving it (filter: finished, parked or
      preempted) copy the batch. ``leaves`` counts rows removed after this pass.
    prefill_done: for each chunk, whether it completes its prompt (and so yields a token).
      On a lazy framework (MLX) a chunk that does not complete needs only the KV cache of
      the last layer, not its attention output and MLP: measured here, a completing chunk
      costs ~1/3 more. Empty when unknown (treated as not completing).
    join_context: the joining rows' contexts, summed: what merging their own caches copies
      (each row its own length, however long the longest row is). 0 when nothing joins.
    decode_drafts: speculative decoding, for each decode row the draft tokens it verifies
      (its k + 1 positions in the forward; empty: none). A cost model that does not price them
      itself is charged ``verify_seconds`` on top (``SimBackend``).
    """

    decode_contexts: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()
    padded: bool = False
    batch_rows_before: int = 0
    joins: int = 0
    leaves: int = 0
    prefill_done: tuple[bool, ...] = ()
    join_context: int = 0
    decode_drafts: tuple[int, ...] = ()

    @property
    def decode_rows(self) -> int:
        return len(self.decode_contexts)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill)

    @property
    def padded_prefill_tokens(self) -> int:
        """Tokens the forward actually computes: rows x longest chunk when padded."""
        if not self.prefill:
            return 0
        if self.padded:
            return len(self.prefill) * max(n for n, _ in self.prefill)
        return self.prefill_tokens


def verify_seconds(model: Any, shape: PassShape) -> float:
    """What the draft positions of a pass's verify rows add to its seconds (``decode_drafts``)
    beyond its ``pass_seconds``: nothing for a cost model that prices them itself
    (``prices_drafts``: a profile whose ``calibrate`` timed verify passes); else priced as one
    more padded prefill of those rows, k draft positions each at the row's context, the cost
    model's own marginal price of such a forward (its seconds less those of an empty pass). That
    approximation charges the positions' compute and attention as a prefill does and the
    forward's fixed cost once; measured on SmolLM2-135M on a CPU it over-prices a verify pass
    (a calibrated profile's terms say by how much: ``sim.cost``'s v_ terms)."""
    drafts = shape.decode_drafts
    if not drafts or not any(drafts) or getattr(model, "prices_drafts", False):
        return 0.0
    chunks = tuple((k, c) for k, c in zip(drafts, shape.decode_contexts) if k)
    predict = model.pass_seconds
    return max(predict(PassShape((), chunks, True)) - predict(PassShape()), 0.0)


def draft_seconds(model: Any, shape: PassShape, fresh: Sequence[bool] = ()) -> float:
    """What a draft model's proposals for a pass's verify rows cost, before the pass
    (``decode_drafts``; ``model``: the draft model's own cost model, None for drafts that cost
    nothing to find, n-gram lookup's): K decode passes of the draft model over the rows that
    draft, K their most drafts (the engine runs each of them through all K: a row of fewer
    drafts discards the rest), pass j at each row's context + j - 1; then, for each drafting row
    that ``fresh`` marks (its draft cache empty: its first drafts since it was admitted or
    preempted), the draft model's prefill of its context before that, one forward of its own."""
    drafts = shape.decode_drafts
    if model is None or not drafts or not any(drafts):
        return 0.0
    predict = model.pass_seconds
    ctxs = tuple(c for c, k in zip(shape.decode_contexts, drafts) if k)
    t = sum(predict(PassShape(tuple(c + j for c in ctxs))) for j in range(max(drafts)))
    if any(fresh):
        catch_up = tuple((c - 1, 0) for c, k, f in zip(shape.decode_contexts, drafts, fresh) if k and f and c > 1)
        t += predict(PassShape((), catch_up)) if catch_up else 0.0
    return t


class CostModel:
    """Predicts seconds from shapes: what the loop charges, and what a policy may read to decide.

    A cost model subclasses this and defines ``pass_seconds`` and ``step_overhead_seconds``.
    The other methods are the terms a model may have beyond those; their defaults mean "no
    such term", and a model that has one overrides it (and sets the flag that goes with it,
    which the loop reads once per run):

    - ``idle_seconds(idle_s) -> (wake_s, extra_s)``: when an arrival wakes a replica that sat
      idle ``idle_s`` seconds, the step starts ``wake_s`` after the arrival and costs ``extra_s``
      more (default: 0, 0);
    - ``after_wake_seconds(k)``: extra seconds of the k-th step after such a wake, k >= 1
      (default: 0); ``has_after_wake``: True when it is ever non-zero (the loop counts the steps
      after a wake only then);
    - ``decode_run_seconds(shape, k)``: the seconds of the ``k`` decode passes that follow a
      decode pass of ``shape`` over the same rows (a ``Plan.repeat`` run; default: ``pass_seconds``
      of each, asked lazily one pass at a time); ``has_run_formula``: True when a model's own
      is a pure formula the loop may evaluate ahead of the passes it ends up running;
    - ``prices_drafts``: True when ``pass_seconds`` prices a pass's verify positions
      (``PassShape.decode_drafts``) itself; else they are charged ``verify_seconds`` on top.

    ``as_cost_model`` makes one of any object with the two required methods.

    ``cache_layout``: what one request's cache holds besides the KV that grows with its context
    (a model's sliding-window and recurrent layers: a ``sim.layout.CacheLayout`` or its dict);
    None, the default, for a model whose every layer is full attention. The replica's memory
    accounting reads it (a real engine's own model overrides it).
    """

    has_after_wake: bool = False
    has_run_formula: bool = False
    prices_drafts: bool = False
    cache_layout: Any = None

    def pass_seconds(self, shape: PassShape) -> float:
        raise NotImplementedError

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        raise NotImplementedError

    def idle_seconds(self, idle_s: float) -> tuple[float, float]:
        return 0.0, 0.0

    def after_wake_seconds(self, k: int) -> float:
        return 0.0

    def decode_run_seconds(self, shape: PassShape, k: int) -> Iterator[float]:
        predict, rows = self.pass_seconds, len(shape.decode_contexts)
        return (
            predict(PassShape(tuple(c + j for c in shape.decode_contexts), (), False, rows)) for j in range(1, k + 1)
        )


class _Plain(CostModel):
    """A cost model of an object that has ``pass_seconds`` and ``step_overhead_seconds`` and
    nothing else: its own two methods, the defaults for the rest; its other attributes read
    through (``meta``, ...)."""

    def __init__(self, model: Any):
        self.model = model
        self.cache_layout = getattr(model, "cache_layout", None)
        self.prices_drafts = bool(getattr(model, "prices_drafts", False))
        self.pass_seconds = model.pass_seconds  # bound once: the loop's hot path calls them
        self.step_overhead_seconds = model.step_overhead_seconds

    def __getattr__(self, name: str) -> Any:
        if name == "model" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.model, name)


def as_cost_model(model: Any) -> CostModel:
    """``model`` when it is a ``CostModel``; else (any object with callable ``pass_seconds`` and
    ``step_overhead_seconds``) a ``CostModel`` made of those two and the defaults. TypeError for
    anything else."""
    if isinstance(model, CostModel):
        return model
    if not (callable(getattr(model, "pass_seconds", None)) and callable(getattr(model, "step_overhead_seconds", None))):
        raise TypeError(
            f"a cost model has pass_seconds(shape) and step_overhead_seconds(passes, rows); got {type(model).__name__}"
        )
    return _Plain(model)


class RequestQueue(Protocol):
    """An ordered, read-only sequence of requests; ``ids()`` and ``contexts()`` give their ids
    and their ``context`` values fast (no per-request Python), in the same order."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[RequestView]: ...
    def __getitem__(self, i: int) -> RequestView: ...
    def ids(self) -> tuple[str, ...]: ...
    def contexts(self) -> list[int]: ...


class SchedulerView(Protocol):
    """A frozen view of one replica at the start of a step."""

    now: float
    step_index: int
    kv_capacity: int  # KV tokens the replica can hold (kv_blocks x block_size)
    kv_used: int  # KV tokens held now, summed over requests (a shared cached block counts for each holder)
    kv_reserved: int  # sum over admitted, unfinished requests of kv_footprint rounded up to whole blocks
    block_size: int  # KV is allocated in blocks of this many tokens (1: token-exact)
    kv_blocks: int  # blocks the replica can hold
    kv_blocks_used: int  # blocks held now (a request holds ceil(kv_tokens / block_size); shared cached blocks once)
    kv_blocks_free: int  # blocks a pass may still allocate (free cached blocks included: they are evicted)
    prefix_caching: bool  # admitted requests start with their longest cached prefix
    cost_model: CostModel | None

    @property
    def waiting(self) -> RequestQueue: ...  # preempted requests first (latest first), then arrival order
    @property
    def prefilling(self) -> RequestQueue: ...  # admission order
    @property
    def decoding(self) -> RequestQueue: ...  # order they started decoding
    @property
    def running(self) -> RequestQueue: ...  # prefilling and decoding, admission order
    @property
    def more_arrivals(self) -> bool: ...  # requests still to arrive

    def shape(self, p: Pass) -> PassShape: ...

    def prefix_hit(
        self, r: RequestView
    ) -> tuple[int, int]: ...  # (cached tokens, free blocks it takes) if admitted now

    def freeable_blocks(self, r: RequestView) -> int: ...  # blocks freed if running r is preempted now


class Policy(Protocol):
    name: str

    def plan(self, view: SchedulerView) -> Plan: ...


# ---------------------------------------------------------------- helpers for policies

#: ``Plan.repeat`` for "the same decode pass until something changes" (the loop bounds it).
UNTIL_CHANGE = 1 << 30


def decode_plan(rows: tuple[str, ...], admit: Sequence[str] = (), *, blocked: bool = False) -> Plan:
    """One decode pass over ``rows``. With no admission it repeats until something changes:
    for the bundled policies a decode-only plan depends only on the queues' members, the KV
    budget and whether a row is about to finish, and none of those moves in between.

    ``blocked``: nothing waiting can be admitted before a row finishes (the FIFO head was
    refused, or the batch is full), so an arrival, queued behind it, changes nothing either
    (``Plan.past_arrivals``)."""
    if admit:
        return Plan(admit=admit, passes=(Pass(decode=rows),))
    return Plan(passes=(Pass(decode=rows),), repeat=UNTIL_CHANGE, past_arrivals=blocked)


class OptionError(ValueError):
    """A bad ``-o key=value`` option. Exit status 2."""

    code = 2


@dataclass
class PolicyBase:
    """Base for the bundled policies: options are dataclass fields, settable by name (read by
    the plugins' one rule, ``policies.plugins``: strings from the command line are converted to
    the field's type)."""

    name = "policy"

    @classmethod
    def option_names(cls) -> list[str]:
        return option_names(cls)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> "PolicyBase":
        return construct(cls, options, "policy", OptionError)

    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def require_positive(policy: str, **values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise OptionError(f"policy '{policy}': option {key} must be >= 1, got {value}")


def finishes_this_pass(r: RequestView) -> bool:
    """A decode row on ``r`` now produces its last output token."""
    return r.tokens_left == 1


_TOKENS_LEFT = attrgetter("tokens_left")


def count_finishing(rows: Iterable[RequestView]) -> int:
    """How many of ``rows`` would finish if decoded now (no per-row Python: hot path)."""
    return list(map(_TOKENS_LEFT, rows)).count(1)


def admit_fifo(view: SchedulerView, max_new: int, *, reserved: int | None = None) -> list[RequestView]:
    """Take waiting requests in arrival order while their whole KV footprint fits.

    Admission reserves ``prompt + output - 1`` tokens per request, rounded up to whole KV
    blocks, so an admitted request never needs preemption. Stops at the first request that does not fit (FIFO: no
    overtaking), so a big request is not starved by small ones behind it.
    """
    taken: list[RequestView] = []
    if max_new <= 0:
        return taken
    budget = view.kv_capacity - (view.kv_reserved if reserved is None else reserved)
    bs = getattr(view, "block_size", 1)
    for r in view.waiting:
        if len(taken) >= max_new or r.kv_footprint > budget:
            break
        taken.append(r)
        budget -= r.kv_footprint if bs == 1 else -(-r.kv_footprint // bs) * bs  # whole blocks
    return taken


def fifo_chunks(
    requests: Iterable[RequestView],
    budget: int,
    *,
    max_chunk: int | None = None,
) -> list[tuple[str, int]]:
    """Fill a token budget with prefill chunks taken in order; ``max_chunk`` caps any one chunk."""
    chunks: list[tuple[str, int]] = []
    for r in requests:
        if budget <= 0:
            break
        todo = r.remaining_prompt
        if max_chunk is not None:
            todo = min(todo, max_chunk)
        n = min(todo, budget)
        if n > 0:
            chunks.append((r.id, n))
            budget -= n
    return chunks
