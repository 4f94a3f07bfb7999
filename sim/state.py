"""The request state machine shared by simulation and real runs.

``ReplicaState`` holds every request's phase and progress, applies a policy's plan and
checks it: a plan that admits a request that is not waiting, decodes a request that is not
decoding, prefills past a prompt, or overfills the KV cache raises ``PlanError`` naming the
policy and the violation. Nothing here knows whether time is predicted or measured.

KV is paged, as in vLLM: the capacity is ``kv_blocks`` blocks of ``block_size`` tokens
(``kv_capacity`` = blocks x block size tokens) and a request holds ceil(KV tokens / block
size) blocks, one more each time its KV crosses a block boundary (incremental allocation as
tokens are computed). Admission reserves a request's whole footprint rounded up to whole
blocks (``kv_reserved``, in tokens), so a policy that admits while ``kv_footprint <=
kv_capacity - kv_reserved`` never runs out of blocks; one that admits more must preempt.
Block size 1 is token-exact accounting. With a ``PrefixCache`` (``prefix_caching=True``)
full blocks are cached and shared (``sim.prefix``): an admitted request starts with the
longest cached prefix of its tokens already in its KV.

A model with sliding-window or recurrent layers (a ``CacheLayout``, ``layout=``) holds more than
its KV: each request also holds ``fixed_blocks`` whole blocks from admission to its end (its
windows and its recurrent state, in tokens of the full-attention KV), counted in its
``kv_footprint``, its reservation, ``kv_used`` and the blocks used.
"""

from __future__ import annotations

from itertools import chain, compress
from operator import attrgetter, not_
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from schedlab.policies.base import CostModel, Pass, PassShape, Phase, Plan
from schedlab.traces.schema import Request

from .layout import CacheLayout
from .prefix import Blocks, PrefixCache

WAITING, PREFILLING, DECODING, FINISHED = Phase.WAITING, Phase.PREFILLING, Phase.DECODING, Phase.FINISHED


class PlanError(RuntimeError):
    """A policy planned something impossible. One line, names the policy and the step."""


def _dupes(ids) -> str:
    seen, dup = set(), []
    for i in ids:
        if i in seen and i not in dup:
            dup.append(i)
        seen.add(i)
    return ", ".join(map(str, dup))


_CTX = attrgetter("_ctx")
_LEFT = attrgetter("_left")
_NO_TIMES: list[float] = []  # (a request outside any replica never joins a batch)


class Checked(NamedTuple):
    """What ``ReplicaState.shape`` found checking a pass, for ``apply_pass`` to apply it."""

    checked: Pass | None  # the pass (None: nothing checked since the last pass applied)
    new_blocks: int  # KV blocks it allocates
    rows: list | None  # its decode rows' states, in its order (None: no decode rows)
    row_ids: set | None  # their ids (the batch's own set when the rows are exactly the batch)
    handoff: bool  # a row is handed off from prefilling (its last prompt token is the input)
    finishing: int  # rows that produce their last token in it
    joiners: list | tuple  # ids of the rows joining the batch cache
    leavers: set | tuple  # ids of the batch's rows leaving it


_new_checked = tuple.__new__  # Checked without its Python-level __new__: shape() runs once a pass
_UNCHECKED = Checked(None, 0, None, None, False, 0, (), ())


class RequestState:
    """One request's progress. Policies see it read-only (properties without setters)."""

    __slots__ = (
        "id",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "prefix_ids",
        "index",
        "request",
        "_phase",
        "_prefilled",
        "_target",
        "_left",
        "_ctx",
        "_reserved",
        "admitted_s",
        "first_token_s",
        "finish_s",
        "_tt",
        "_seg",
        "_times",
        "preemptions",
        "recomputed_tokens",
        "cached_tokens",
        "_high",
        "_blk",
        "cancelled_s",
        "_xt",
        "_xb",
    )

    def __init__(self, req: Request, index: int):
        self.id = req.id
        self.arrival_s = req.arrival_s
        self.prompt_tokens = req.prompt_tokens
        self.output_tokens = req.output_tokens
        self.prefix_ids = req.prefix_ids
        self.index = index
        self.request = req  # the trace row as it came (its text, for a backend that tokenizes)
        self._phase = WAITING
        # tokens of the (re)prefill target now in the KV cache: 0, but for a request whose
        # prompt's KV came with it (a disaggregated decode replica's: ``sim.disagg``)
        self._prefilled = getattr(req, "kv_transferred", 0)
        self._target = req.prompt_tokens  # prompt, or prompt + generated after preemption
        self._left = req.output_tokens  # output tokens still to produce
        self._ctx = 1  # what a decode row of it would attend to: its KV + the new token
        self._reserved = 0  # KV tokens reserved for it at admission
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self._tt: list[float] = []  # its token times, but for the batch's passes since _seg
        # while it sits in the replica's batch cache: the first of the replica's decode pass ends
        # (``_times``) not yet copied into _tt (-1 outside the batch)
        self._seg = -1
        self._times: list[float] = _NO_TIMES
        self.preemptions = 0
        self.recomputed_tokens = 0  # KV tokens computed again after a preemption
        self.cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self._high = 0  # most KV tokens it ever held (set at preemption)
        self._blk: Blocks | None = None  # its blocks in the prefix cache, if there is one
        self.cancelled_s: float | None = None  # when it was cancelled (its client went away)
        # tokens (whole blocks) of capacity it holds while admitted besides its KV: sliding windows
        # and recurrent state on a model with such layers (``sim.layout``), and those blocks
        self._xt = 0
        self._xb = 0

    # read-only to policies; attrgetter keeps the getters in C (the simulator's hot path)
    phase = property(attrgetter("_phase"))
    prefilled = property(attrgetter("_prefilled"))
    # tokens a decode row of it attends to: its KV tokens + the new one (while admitted)
    context = property(attrgetter("_ctx"))
    # what prefilling puts into the KV cache: the prompt, or prompt + output so far after a
    # preemption (recompute); the pass that completes it yields a token
    prefill_target = property(attrgetter("_target"))

    @property
    def generated(self) -> int:
        return self.output_tokens - self._left

    tokens_left = property(attrgetter("_left"))

    @property
    def remaining_prompt(self) -> int:
        return self._target - self._prefilled

    @property
    def kv_tokens(self) -> int:
        if self._phase is DECODING:
            return self.prompt_tokens + self.output_tokens - self._left - 1
        return self._prefilled

    @property
    def kv_footprint(self) -> int:
        return self.prompt_tokens + self.output_tokens - 1 + self._xt

    # blocks it holds whole from admission to its end besides its KV (``sim.layout``; 0 unless
    # the model has sliding-window or recurrent layers)
    fixed_blocks = property(attrgetter("_xb"))
    fixed_tokens = property(attrgetter("_xt"))

    @property
    def token_times(self) -> list[float]:
        """When each of its output tokens came out (seconds), in order.

        Every row of the replica's batch cache decodes in each decode pass (a row that does not
        leaves the batch), so while a request sits in it its times are the batch's pass ends
        since it joined: the replica keeps those once per pass, not once per row, and they are
        copied in here when read (and when it leaves the batch)."""
        s = self._seg
        if s >= 0:
            times = self._times
            if len(times) > s:
                self._tt += times[s:]
                self._seg = len(times)
        return self._tt

    @classmethod
    def as_seen(
        cls,
        req: Request,
        index: int,
        admitted_s: float | None,
        token_times: list[float],
        finish_s: float | None = None,
        preemptions: int = 0,
        recomputed_tokens: int = 0,
    ) -> "RequestState":
        """``req`` as its client saw it when its tokens came from more than one replica (a
        prefill replica's first token, a decode replica's others: ``sim.disagg``): admitted at
        ``admitted_s``, its ``token_times``, finished at ``finish_s`` (None: it did not finish,
        and its KV holds its prompt only if a token came)."""
        r = cls(req, index)
        r.admitted_s = admitted_s
        r._tt = list(token_times)
        r.first_token_s = token_times[0] if token_times else None
        r._left = req.output_tokens - len(token_times)
        if finish_s is not None:
            r._phase = FINISHED
            r._prefilled = req.prompt_tokens
            r._left = 0
            r.finish_s = finish_s
        r.preemptions = preemptions
        r.recomputed_tokens = recomputed_tokens
        return r

    def __repr__(self) -> str:
        return (
            f"<request {self.id} {self._phase.value} prefilled={self._prefilled}/"
            f"{self._target} generated={self.generated}/{self.output_tokens}>"
        )


class _CachedRequestState(RequestState):
    """A request on a replica with a prefix cache: while waiting, its remaining prompt is
    what admitting it now would leave to compute (the cached prefix is already in)."""

    __slots__ = ()

    @property
    def remaining_prompt(self) -> int:
        if self._phase is WAITING:
            return self._target - self._blk.cache.hit_tokens(self)
        return self._target - self._prefilled


class _Waiting:
    """The waiting queue: requests a preemption put back first (the latest preempted at the
    very front, as vLLM's ``prepend_request``), then arrivals in order. A dict's interface,
    with ``prepend``, which costs the number of preempted requests waiting, not the queue."""

    __slots__ = ("front", "back")

    def __init__(self) -> None:
        self.front: dict[str, RequestState] = {}
        self.back: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.front) + len(self.back)

    def __bool__(self) -> bool:
        return bool(self.back) or bool(self.front)

    def __contains__(self, rid) -> bool:
        return rid in self.back or rid in self.front

    def __iter__(self) -> Iterator[str]:
        return chain(self.front, self.back) if self.front else iter(self.back)

    def values(self):
        return chain(self.front.values(), self.back.values()) if self.front else self.back.values()

    def __setitem__(self, rid: str, r: RequestState) -> None:
        self.back[rid] = r

    def prepend(self, rid: str, r: RequestState) -> None:
        self.front = {rid: r, **self.front}

    def __delitem__(self, rid: str) -> None:
        if rid in self.back:
            del self.back[rid]
        else:
            del self.front[rid]


class _Queue(Sequence):
    """A read-only, ordered, live window on one of the replica's queues."""

    __slots__ = ("_d",)

    def __init__(self, d: dict):
        self._d = d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._d.values())

    def __bool__(self) -> bool:
        return bool(self._d)

    def ids(self) -> tuple[str, ...]:
        """The ids in order (fast: no per-request Python)."""
        return tuple(self._d)

    def contexts(self) -> list[int]:
        """Each request's ``context`` in order (fast: no per-request Python)."""
        return list(map(_CTX, self._d.values()))

    def __getitem__(self, i):
        if i == 0 and self._d and not isinstance(i, slice):
            return next(iter(self._d.values()))
        return list(self._d.values())[i]

    def __contains__(self, r) -> bool:
        return getattr(r, "id", None) in self._d

    def __repr__(self) -> str:
        return f"<queue of {len(self._d)}>"


class ReplicaView:
    """What ``policy.plan(view)`` reads. Valid for the step it was handed out in."""

    __slots__ = (
        "_state",
        "now",
        "step_index",
        "cost_model",
        "waiting",
        "prefilling",
        "decoding",
        "running",
        "kv_capacity",
        "block_size",
        "kv_blocks",
    )

    def __init__(self, state: "ReplicaState", cost_model: CostModel | None):
        self._state = state
        self.cost_model = cost_model
        self.now = 0.0
        self.step_index = 0
        # the queues are live read-only windows: the same objects for the whole run
        self.waiting = state.waiting_q
        self.prefilling = state.prefilling_q
        self.decoding = state.decoding_q
        self.running = state.running_q  # prefilling and decoding, in admission order
        self.kv_capacity = state.kv_capacity
        self.block_size = state.block_size
        self.kv_blocks = state.kv_blocks

    kv_used = property(lambda self: self._state.kv_used)
    kv_reserved = property(lambda self: self._state.kv_reserved)
    # speculative decoding so far: (verify rows with drafts, draft tokens, accepted drafts,
    # per position the rows that accepted it): what an adaptive policy learns acceptance from
    speculation = property(
        lambda self: (
            self._state.spec_drafts,
            self._state.spec_draft_tokens,
            self._state.spec_accepted_tokens,
            tuple(self._state.spec_accepted_per_pos),
        )
    )
    kv_blocks_used = property(lambda self: self._state.blocks_used)
    more_arrivals = property(lambda self: self._state.open)
    prefix_caching = property(lambda self: self._state.prefix is not None)

    @property
    def kv_blocks_free(self) -> int:
        """Blocks a pass may still allocate (free cached blocks count: they are evicted)."""
        st = self._state
        return st.kv_blocks - st.blocks_used

    def request(self, rid: str) -> RequestState:
        return self._state.by_id[rid]

    def prefix_hit(self, r) -> tuple[int, int]:
        """(tokens, blocks): the cached prefix admitting waiting request ``r`` now would give it,
        and how many of its blocks are free cached blocks the admission takes out of the free
        pool. (0, 0) without a prefix cache."""
        pc = self._state.prefix
        if pc is None:
            return 0, 0
        k, taken = pc.lookup(r)
        return k * pc.bs, taken

    def freeable_blocks(self, r) -> int:
        """Blocks that return to the free pool if running request ``r`` is preempted now."""
        return self._state.freeable_blocks(r)

    def shape(self, p: Pass) -> PassShape:
        return self._state.shape(p)


class ReplicaState:
    """Every request's phase and progress on one replica; applies and checks plans.

    Requests are registered as they arrive (``receive``); those that can never fit in the
    KV cache are refused on arrival, like a server's 400, and listed in ``rejected``.
    ``open`` stays true while the arrival source may still send requests.
    """

    def __init__(
        self,
        requests: Sequence[Request] = (),
        kv_capacity: int = 0,
        policy_name: str = "policy",
        *,
        block_size: int = 1,
        prefix_caching: bool = False,
        token_keys: Callable[[Any], Sequence[int] | None] | None = None,
        layout: CacheLayout | None = None,
    ):
        self.policy_name = policy_name
        self.layout = CacheLayout.from_dict(layout)  # None: every layer is full attention
        if isinstance(block_size, bool) or int(block_size) != block_size or block_size < 1:
            raise ValueError(f"block size must be an integer >= 1, got {block_size!r}")
        self.block_size = bs = int(block_size)
        self.kv_blocks = int(kv_capacity) // bs
        self.kv_capacity = self.kv_blocks * bs  # whole blocks
        self.blocks_used = 0  # blocks held by requests (cached blocks nobody references are free)
        self.prefix = PrefixCache(bs, token_keys) if prefix_caching else None
        self._shaped = _UNCHECKED  # the last pass shape() checked, until apply_pass applies it
        # the decode rows of the last pass applied, and their states (while all stay in the batch,
        # the next pass over the same rows needs no checking again: the common decode step)
        self._last_decode: Sequence[str] | None = None
        self._last_rows: list[RequestState] = []
        # speculative decoding: the verify pass shape() checked (the pass, the same pass without
        # its drafts, which the fast path applies), the accepted drafts a backend reported for
        # it (``accept``), and what the run's verify rows did, as vLLM counts it: rows that
        # verified drafts, draft tokens, accepted ones, and per position the rows that accepted it
        self._verify: tuple | None = None
        self._accepted_drafts: dict[str, int] = {}
        self._proposed_drafts: dict[str, int] = {}
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_empty = 0  # verify rows whose drafter found nothing to propose (plain rows then)
        # per request: [verify rows that drafted, rows that found nothing, per position the accepted,
        # draft tokens]
        self.spec_by_request: dict[str, list] = {}
        self.spec_accepted_per_pos: list[int] = []
        self.requests: list[RequestState] = []
        self.by_id: dict[str, RequestState] = {}
        self.rejected: list[tuple[RequestState, str]] = []
        self.accepted: list[RequestState] = []
        self.n_accepted = 0
        self.open = True
        self.arrived = 0
        self.waiting = _Waiting()
        self.prefilling: dict[str, RequestState] = {}
        self.decoding: dict[str, RequestState] = {}
        self.running: dict[str, RequestState] = {}  # prefilling + decoding, admission order
        self.waiting_q, self.prefilling_q, self.decoding_q, self.running_q = (
            _Queue(self.waiting),
            _Queue(self.prefilling),
            _Queue(self.decoding),
            _Queue(self.running),
        )
        self.kv_used = 0
        self.kv_reserved = 0
        self.finished = 0
        self.step_index = 0
        self.steps = None  # the StepLog of the loop running it (sim.loop; serve's /metrics reads it live)
        # Work done, cumulative, by steps alone (arrivals never move them), so that what is
        # outstanding at any time is what arrived minus these (a cluster's router reads them):
        # prompt tokens put into the KV cache, less what preemptions gave back to compute again
        # (prompt_done), and output tokens produced or given up at an EOS (output_done).
        self.prompt_done = 0
        self.output_done = 0
        # Rows of the engine's batched decode cache (see PassShape): mirrors what the
        # MLX backend does, so predicted copies match real ones.
        self.batch: set[str] = set()
        # The batch's rows counted by what stays the same while they decode: each decode pass
        # moves a row's context up by one, its tokens left down by one, and the pass count
        # (len(self._times)) up by one. So a pass's rows at a block boundary (context at 1
        # modulo the block size: a new block) and its rows with one token left (finishing)
        # are two look-ups, not a count over the rows: by context - passes modulo the block
        # size, and by tokens left + passes. Kept on joining and leaving (``_count``).
        self._by_offset = [0] * bs
        self._by_end: dict[int, int] = {}
        # the end of every decode pass applied: the token times of the batch's rows (see
        # ``RequestState.token_times``); only ever appended to
        self._times: list[float] = []
        for req in requests:  # known up front (a caller drives arrivals with ``arrive``)
            self.register(req)

    # ------------------------------------------------------------------ lifecycle
    def register(self, req: Request) -> RequestState | None:
        """Track a new request; ``None`` when it can never fit or has an empty prompt (it is listed in
        ``rejected``, with why)."""
        if req.id in self.by_id:
            raise ValueError(f"request id {req.id!r} is already in use on this replica")
        r = RequestState(req, len(self.requests))
        r._times = self._times
        if self.prefix is not None:
            r.__class__ = _CachedRequestState
            r._blk = Blocks(self.prefix, r.id)
        self.requests.append(r)
        self.by_id[r.id] = r
        if self.layout is not None:
            r._xt = xt = self.fixed_tokens_for(r.kv_footprint)
            r._xb = xt // self.block_size
        if r.prompt_tokens < 1:  # nothing to prefill: admitted, it would be prefilling forever
            self.rejected.append((r, f"request {r.id} has an empty prompt ({r.prompt_tokens} tokens)"))
            return None
        if r.kv_footprint > self.kv_capacity:
            blocks = f" in blocks of {self.block_size}" if self.block_size > 1 else ""
            fixed = f" + {r._xt} for its sliding windows and recurrent state" if r._xt else ""
            self.rejected.append(
                (
                    r,
                    (
                        f"request {r.id} needs {r.kv_footprint} KV tokens (prompt {r.prompt_tokens}"
                        f" + output {r.output_tokens} - 1{fixed}) but the KV capacity is {self.kv_capacity}{blocks}"
                    ),
                )
            )
            return None
        self.accepted.append(r)
        self.n_accepted += 1
        return r

    def fixed_tokens_for(self, kv_tokens: int) -> int:
        """Tokens of capacity, in whole blocks, that a request whose KV reaches ``kv_tokens`` holds
        besides it from admission to its end (its sliding windows and recurrent state; 0 where every
        layer is full attention): what ``register`` adds to its footprint."""
        if self.layout is None:
            return 0
        bs = self.block_size
        return -(-self.layout.fixed_tokens(kv_tokens) // bs) * bs

    def receive(self, req: Request) -> RequestState | None:
        """A request arrives: register it and, unless rejected, put it in the waiting queue."""
        r = self.register(req)
        if r is not None:
            self.arrive(r)
        return r

    def arrive(self, r: RequestState) -> None:
        self.waiting[r.id] = r
        self.arrived += 1

    @property
    def done(self) -> bool:
        return not self.open and self.finished == self.n_accepted

    def stop(self, rid: str) -> None:
        """The request's next token (produced by the pass now running) is its last: EOS.

        Called by a backend during ``execute``, before the state applies the pass. Its
        output becomes the tokens it produced; its KV reservation is freed at finish as usual.
        """
        r = self.by_id[rid]
        keep = 1 + self._accepted_drafts.get(rid, 0)  # (its accepted drafts come out with it)
        if r._phase is FINISHED or r._left <= keep:
            return
        self.output_done += r._left - keep  # (tokens it will not produce)
        r.output_tokens = r.output_tokens - r._left + keep
        if r._seg >= 0:  # a batch row: counted again under its new end
            self._count(r, len(self._times), -1)
            r._left = keep
            self._count(r, len(self._times), 1)
        else:
            r._left = keep
        self._shaped = self._shaped._replace(finishing=self._shaped.finishing + 1)  # (shape counted it as going on)

    def cancel(self, rid: str, now: float) -> RequestState | None:
        """Its client went away: end request ``rid`` now, between two steps, in whatever phase
        (waiting, prefilling, decoding). Its KV is freed at once, its reservation given back; it
        is finished (``finish_s``, ``cancelled_s``: ``now``) with the tokens it produced. Returns
        it, or None when there is nothing to end (unknown here, refused, or already finished)."""
        r = self.by_id.get(rid)
        if r is None or r._phase is FINISHED:
            return None
        phase = r._phase
        self._shaped = _UNCHECKED
        self._last_decode = None
        if phase is WAITING:
            if rid not in self.waiting:  # (refused on arrival: never queued)
                return None
            del self.waiting[rid]
        else:
            if phase is PREFILLING:
                del self.prefilling[rid]
            else:
                del self.decoding[rid]
            del self.running[rid]
            self._leave(r)  # (before its counters change)
            kv = r.kv_tokens
            self.kv_used -= kv + r._xt
            self._free(r, kv)
            self.kv_reserved -= r._reserved
            r._reserved = 0
        # what it will never compute or produce is done, for what is outstanding
        self.prompt_done += r._target - r._prefilled
        self.output_done += r._left
        r.output_tokens -= r._left
        r._left = 0
        r._phase = FINISHED
        r.finish_s = r.cancelled_s = now
        self.finished += 1
        return r

    def _blocks_of(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def freeable_blocks(self, r: RequestState) -> int:
        n = self._blocks_of(r.kv_tokens)
        return (n if self.prefix is None else self.prefix.freeable(r, n)) + r._xb

    def _free(self, r: RequestState, kv: int) -> None:
        """``r`` gives back its blocks (it holds ``kv`` KV tokens, and its fixed blocks): finished,
        preempted or cancelled."""
        n = -(-kv // self.block_size)
        self.blocks_used -= (n if self.prefix is None else self.prefix.release(r, n)) + r._xb

    def _fail(self, msg: str) -> PlanError:
        return PlanError(f"policy '{self.policy_name}' step {self.step_index}: {msg}")

    def _get(self, rid, what: str) -> RequestState:
        r = self.by_id.get(rid) if isinstance(rid, str) else None
        if r is None:
            raise self._fail(f"{what} unknown request {rid!r}")
        return r

    def apply_admin(self, plan: Plan, now: float) -> list[RequestState]:
        """Admissions and preemptions. Returns the preempted requests (their KV is freed)."""
        if not isinstance(plan, Plan):
            raise self._fail(f"plan() returned {type(plan).__name__}, not a Plan")
        preempted = []
        pc = self.prefix
        hits = None
        if pc is not None and plan.admit:
            # cache hits as the policy saw them (a preemption below only adds free cached blocks)
            hits = {}
            for rid in plan.admit:
                r = self.by_id.get(rid) if isinstance(rid, str) else None
                if r is not None and r._phase is WAITING:
                    hits[rid] = pc.lookup(r)[0]
        for rid in plan.preempt:
            r = self._get(rid, "preempts")
            if r._phase is PREFILLING:
                del self.prefilling[rid]
                # (what it had left to compute is replaced below by its whole new target)
                self.prompt_done += r._target - r._prefilled
            elif r._phase is DECODING:
                del self.decoding[rid]
            else:
                raise self._fail(f"preempts request {rid} which is {r._phase.value}")
            self._leave(r)  # (before its counters change)
            # Recompute: its KV is dropped; re-admitted, it prefills prompt + output so far.
            kv = r.kv_tokens
            self.kv_used -= kv + r._xt
            self._free(r, kv)
            if kv > r._high:
                r._high = kv
            del self.running[rid]
            self.kv_reserved -= r._reserved
            r._reserved = 0
            r._target = r.prompt_tokens + r.generated
            self.prompt_done -= r._target
            r._prefilled = 0
            r._ctx = 1
            r._phase = WAITING
            r.preemptions += 1
            # back to the front of the queue (it arrived before anyone still waiting)
            self.waiting.prepend(rid, r)
            preempted.append(r)
        for rid in plan.admit:
            r = self._get(rid, "admits")
            if r._phase is not WAITING or rid not in self.waiting:
                raise self._fail(f"admits request {rid} which is {r._phase.value}")
            del self.waiting[rid]
            r._phase = PREFILLING
            first = r.admitted_s is None
            if first:
                r.admitted_s = now
            self.prefilling[rid] = r
            self.running[rid] = r
            bs = self.block_size
            r._reserved = -(-r.kv_footprint // bs) * bs
            self.kv_reserved += r._reserved
            if r._xb:  # its windows and recurrent state: held whole from now on
                self.blocks_used += r._xb
                self.kv_used += r._xt
            if r._prefilled and first:  # its prompt's KV came with it: held from now on
                n = r._prefilled
                r._ctx = n + 1
                self.kv_used += n
                self.prompt_done += n
                self.blocks_used += -(-n // bs)
            if pc is not None:
                k = hits.get(rid)
                if k is None:  # preempted by this very plan
                    k = pc.lookup(r)[0]
                self.blocks_used += pc.admit(r, k, first)
                if k:
                    n = k * bs
                    r._prefilled = n
                    r._ctx = n + 1
                    self.kv_used += n
                    self.prompt_done += n
                    if first:
                        r.cached_tokens = n
                if r._xb:  # (its fixed blocks may take free cached ones)
                    self._room(pc)
        return preempted

    # ------------------------------------------------------------------ passes
    def shape(self, p: Pass) -> PassShape:
        """Check a pass against the current state and describe it for the cost model."""
        if not isinstance(p, Pass):
            raise self._fail(f"plan holds {type(p).__name__}, not a Pass")
        if p.draft:
            return self._shape_verify(p)
        batch = self.batch
        decode = p.decode
        joins = finishing = join_ctx = 0
        handoff = False
        ctx: tuple[int, ...] = ()
        rs = dset = None
        joiners: list[str] | tuple = ()
        leavers: set[str] | tuple = ()
        if decode:
            if decode == self._last_decode and len(batch) == len(decode):
                # the rows of the last pass applied, every one still in the batch (decoding)
                rs, dset = self._last_rows, batch
            else:
                try:
                    dset = set(decode)
                except TypeError:
                    raise self._fail(f"decode rows must be request ids, got {decode!r:.80}") from None
                if len(dset) != len(decode):
                    raise self._fail(f"decodes a request twice in one pass: {_dupes(decode)}")
                # rows already in the batch cache are decoding (the batch holds nothing else);
                # only newcomers need checking
                joiners = dset - batch if batch else dset
                if joiners:
                    joiners = list(joiners)
                    for rid in joiners:
                        r = self.by_id.get(rid) if isinstance(rid, str) else None
                        self._check_decode(rid, r)
                        if r._phase is PREFILLING:
                            handoff = True
                    joins = len(joiners)
                rs = list(map(self.by_id.__getitem__, decode))
            ctx = tuple(map(_CTX, rs))
            # its rows with one token left, and at a block boundary: those of the batch (two
            # look-ups, see ``_by_end``), less the rows leaving it, plus the rows joining it
            n = len(self._times)
            bs = self.block_size
            one = 1 % bs
            finishing = self._by_end.get(n + 1, 0)
            starts = self._by_offset[(one - n) % bs]
            if dset is not batch and len(batch) + len(joiners) > len(rs):
                leavers = batch - dset
                for rid in leavers:
                    r = self.by_id[rid]
                    finishing -= r._left == 1
                    starts -= r._ctx % bs == one
            for rid in joiners:
                r = self.by_id[rid]
                finishing += r._left == 1
                starts += r._ctx % bs == one
                join_ctx += r._ctx
        chunks: list[tuple[int, int]] = []
        done: list[bool] = []
        for item in p.prefill:
            try:
                rid, n = item
            except (TypeError, ValueError):
                raise self._fail(f"prefill chunk {item!r} is not (request id, n_tokens)") from None
            r = self._get(rid, "prefills")
            if r._phase is not PREFILLING:
                raise self._fail(f"prefills request {rid} which is {r._phase.value}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise self._fail(f"prefill chunk of request {rid} has {n!r} tokens")
            left = r._target - r._prefilled
            if n > left:
                raise self._fail(f"prefills {n} tokens of request {rid} which has {left} prompt tokens left")
            chunks.append((n, r._prefilled))
            done.append(n == left)
        if chunks and (len(chunks) > 1 or decode):
            ids = [rid for rid, _ in p.prefill]
            if len(set(ids)) != len(ids) or (decode and not dset.isdisjoint(ids)):
                raise self._fail(f"a request appears twice in one pass: {_dupes(list(decode) + ids)}")
        bs = self.block_size
        if bs == 1:
            new = len(decode) + sum(n for n, _ in chunks)
        else:
            # a decode row takes a block when its KV (context - 1) is at a block boundary
            new = starts if decode else 0
            for n, p0 in chunks:
                new += -(-(p0 + n) // bs) + p0 // -bs
        if self.blocks_used + new > self.kv_blocks:
            if bs == 1:
                raise self._fail(f"needs {self.blocks_used + new} KV tokens but the capacity is {self.kv_capacity}")
            raise self._fail(
                f"needs {self.blocks_used + new} KV blocks of {bs} tokens but the capacity is {self.kv_blocks} blocks"
            )
        self._shaped = _new_checked(Checked, (p, new, rs, dset, handoff, finishing, joiners, leavers))
        padded = bool(p.padded and chunks)
        if not decode:
            return PassShape((), tuple(chunks), padded, 0, 0, 0, tuple(done))
        leaves = len(batch) - (len(decode) - joins) + finishing
        return PassShape(ctx, tuple(chunks), padded, len(batch), joins, leaves, tuple(done), join_ctx)

    def repeat_decode(self, p: Pass, times: Sequence[float]) -> None:
        """Apply the same decode pass again, once per time in ``times`` (each a pass end), to
        rows that all stay decoding through it (``Plan.repeat``: the loop has checked that none
        finishes); one step each."""
        m = len(times)
        bs = self.block_size
        pc = self.prefix
        new = 0
        rows = list(map(self.by_id.__getitem__, p.decode))
        self._times += times  # (the rows are the batch's: their token times)
        for r in rows:
            r._left -= m
            c = r._ctx
            if bs > 1:  # KV goes from c - 1 to c - 1 + m tokens
                new += (c - 2 + m) // bs - (c - 2) // bs
            r._ctx = c + m
        self.kv_used += len(rows) * m
        self.output_done += len(rows) * m
        self.blocks_used += len(rows) * m if bs == 1 else new
        if pc is not None:
            self._room(pc)
            for r in rows:
                pc.register(r, (r._ctx - 1) // bs)
        self.step_index += m

    def _leave(self, r: RequestState) -> None:
        """``r`` leaves the batch cache (if it is in it): its times from the batch's passes
        are copied in."""
        if r._seg >= 0:
            r.token_times  # noqa: B018  (reading copies them)
            r._seg = -1
            self.batch.discard(r.id)
            self._count(r, len(self._times), -1)

    def _count(self, r: RequestState, n: int, d: int) -> None:
        """Count ``r`` in (``d`` 1: it joins the batch) or out (-1: it leaves) of the batch's
        rows by block offset and by end (``_by_offset``, ``_by_end``), ``n`` passes so far."""
        self._by_offset[(r._ctx - n) % self.block_size] += d
        k = r._left + n
        c = self._by_end.get(k, 0) + d
        if c:
            self._by_end[k] = c
        else:
            del self._by_end[k]

    def _room(self, pc: PrefixCache) -> None:
        """Blocks just allocated: evict free cached blocks if no empty block was left."""
        over = self.blocks_used + len(pc.free) - self.kv_blocks
        if over > 0:
            pc.evict(over)

    def _check_decode(self, rid, r: RequestState | None) -> int:
        if r is None:
            raise self._fail(f"decodes unknown request {rid!r}")
        if r._phase is DECODING:
            return r._ctx
        if r._phase is PREFILLING and r._target - r._prefilled == 1:
            return r._target  # hand-off: the last prompt token is the decode input
        raise self._fail(
            f"decodes request {rid} which is {r._phase.value}"
            + (f" with {r._target - r._prefilled} prompt tokens left" if r._phase is PREFILLING else "")
        )

    def accept(self, rid: str, accepted: int, proposed: int | None = None) -> None:
        """Of the drafts request ``rid`` verifies in the pass now running, the first
        ``accepted`` were accepted (none reported: none), of ``proposed`` draft tokens it had
        (None: all it was given room for; a real drafter may find fewer). Called by a backend
        during ``execute``, before the state applies the pass, as ``stop`` is."""
        self._accepted_drafts[rid] = accepted
        if proposed is not None:
            self._proposed_drafts[rid] = proposed

    def _shape_verify(self, p: Pass) -> PassShape:
        """``shape`` of a pass whose decode rows verify drafts: the pass without them checked as
        usual, then the drafts, and KV for every draft position (what the forward writes before
        the rejected ones are dropped)."""
        base = Pass(p.decode, p.prefill, p.padded)
        shape = self.shape(base)
        drafts = p.draft
        if len(drafts) != len(p.decode):
            raise self._fail(f"has {len(drafts)} draft counts for {len(p.decode)} decode rows")
        bs, by_id, extra = self.block_size, self.by_id, 0
        for rid, k, c in zip(p.decode, drafts, shape.decode_contexts):
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise self._fail(f"request {rid}'s draft is {k!r} tokens, not an integer >= 0")
            if not k:
                continue
            r = by_id[rid]
            if r._phase is not DECODING:
                raise self._fail(f"request {rid} drafts {k} tokens on its hand-off (its first decode drafts none)")
            if k > r._left - 1:
                raise self._fail(f"request {rid} drafts {k} tokens with {r._left} to produce (at most {r._left - 1})")
            extra += -(-(c + k) // bs) + c // -bs  # KV from c to c + k tokens
        if self.blocks_used + self._shaped.new_blocks + extra > self.kv_blocks:
            raise self._fail(
                f"needs {self.blocks_used + self._shaped.new_blocks + extra} KV blocks of {bs} tokens with its drafts, "
                f"but the capacity is {self.kv_blocks} blocks"
            )
        self._verify = (p, base)
        return shape._replace(decode_drafts=drafts)

    def _apply_verify(self, p: Pass, t: float) -> list[RequestState]:
        """``apply_pass`` of a verify pass: each row that accepted ``a`` drafts first advances
        ``a`` tokens (out at ``t``, KV grown by ``a``; re-counted in the batch's lookups), then
        the pass without drafts applies as usual (the row's one more token). The rejected drafts'
        KV is never kept: the blocks held are those of the tokens kept."""
        if self._verify is None or self._verify[0] is not p:
            self.shape(p)
        _, base = self._verify
        self._verify = None
        accepted, self._accepted_drafts = self._accepted_drafts, {}
        proposed, self._proposed_drafts = self._proposed_drafts, {}
        n, bs, by_id = len(self._times), self.block_size, self.by_id
        gained = blocks = 0
        per_pos = self.spec_accepted_per_pos
        for rid, k in zip(p.decode, p.draft):
            if not k:
                continue
            a = accepted.get(rid, 0)
            m = proposed.get(rid, k)
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= m <= k:
                raise self._fail(f"request {rid}: {a!r} of its {k} drafts accepted")
            mine = self.spec_by_request.get(rid)
            if mine is None:
                mine = self.spec_by_request[rid] = [0, 0, [], 0]
            if not m:  # (the drafter found none: a plain decode row)
                self.spec_empty += 1
                mine[1] += 1
                continue
            self.spec_drafts += 1
            self.spec_draft_tokens += m
            mine[0] += 1
            mine[3] += m
            if len(per_pos) < k:
                per_pos.extend([0] * (k - len(per_pos)))
            if len(mine[2]) < k:
                mine[2].extend([0] * (k - len(mine[2])))
            if not a:
                continue
            for i in range(a):
                per_pos[i] += 1
                mine[2][i] += 1
            r = by_id[rid]
            in_batch = r._seg >= 0
            if in_batch:
                self._count(r, n, -1)
            c = r._ctx
            blocks += -(-(c + a) // bs) + c // -bs
            r.token_times  # noqa: B018  (reading copies the batch's times so far in)
            r._tt += [t] * a
            r._ctx = c + a
            r._left -= a
            if in_batch:
                r._seg = n  # (this pass's own time comes from the batch, as every row's)
                self._count(r, n, 1)
            gained += a
        self.spec_accepted_tokens += gained
        self.kv_used += gained
        self.output_done += gained
        self.blocks_used += blocks
        if gained:  # (a row may now have one token left: this pass finishes it)
            rows = self._shaped.rows
            self._shaped = self._shaped._replace(finishing=sum(1 for r in rows if r._left == 1))
        return self.apply_pass(base, t)

    def apply_pass(self, p: Pass, t: float) -> list[RequestState]:
        """Advance requests by an already-checked pass that ended at ``t``; return finishes."""
        if p.draft:
            return self._apply_verify(p, t)
        done: list[RequestState] = []
        decoding = self.decoding
        by_id = self.by_id
        if self._shaped.checked is not p:
            self.shape(p)
        _, new, rs, dset, handoff, finishing, joiners, leavers = self._shaped
        self._shaped = _UNCHECKED
        self.blocks_used += new
        pc = self.prefix
        if pc is not None and new:
            self._room(pc)
        if rs:
            times = self._times
            batch = self.batch
            if dset is not batch:
                for rid in leavers:  # rows of the batch that do not decode leave it
                    self._leave(by_id[rid])
                n = len(times)  # this pass's end: the joiners' first time from the batch
                for rid in joiners:
                    r = by_id[rid]
                    r._seg = n
                    self._count(r, n, 1)
                self.batch = dset
            times.append(t)  # (every row's token time: see RequestState.token_times)
            if handoff:
                for r in rs:
                    if r._phase is PREFILLING:  # hand-off: the last prompt token goes in
                        r._prefilled += 1
                        self.prompt_done += 1
                        r._phase = DECODING
                        del self.prefilling[r.id]
                        decoding[r.id] = r
                        if r.first_token_s is None:
                            r.first_token_s = t
                    r._ctx += 1
                    r._left -= 1
            else:  # every row was decoding (the common step): nothing but its counters
                for r in rs:
                    r._ctx += 1
                    r._left -= 1
            if finishing:  # (shape counted the rows with one token left)
                done.extend(compress(rs, map(not_, map(_LEFT, rs))))
            self.kv_used += len(rs)
            self.output_done += len(rs)
            self._last_decode = p.decode
            self._last_rows = rs
        for rid, n in p.prefill:
            r = by_id[rid]
            if r.preemptions and r._prefilled < r._high:  # computing again what it held before
                r.recomputed_tokens += min(r._prefilled + n, r._high) - r._prefilled
            r._prefilled += n
            self.kv_used += n
            self.prompt_done += n
            if r._prefilled == r._target:  # the prompt is in: this pass yields a token
                del self.prefilling[rid]
                r._phase = DECODING
                decoding[rid] = r
                r._left -= 1
                self.output_done += 1
                r._ctx = r._target + 1  # prompt (+ recomputed output) plus the new token
                if r.first_token_s is None:
                    r.first_token_s = t
                r._tt.append(t)  # (not in the batch: its times are all in _tt)
                if not r._left:
                    done.append(r)
            else:
                r._ctx = r._prefilled + 1
        if pc is not None:
            bs = self.block_size
            for rid in p.decode:
                r = by_id[rid]
                pc.register(r, (r._ctx - 1) // bs)
            for rid, _ in p.prefill:
                r = by_id[rid]
                pc.register(r, (r._ctx - 1) // bs)
        running = self.running
        for r in done:
            kv = r.prompt_tokens + r.output_tokens - 1
            self.kv_used -= kv + r._xt
            self._free(r, kv)
            self.kv_reserved -= r._reserved
            r._reserved = 0
            del decoding[r.id]
            del running[r.id]
            self._leave(r)
            r._phase = FINISHED
            r.finish_s = t
            self.finished += 1
        return done
