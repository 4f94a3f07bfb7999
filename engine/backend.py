"""MLXBackend: runs the loop's passes on a real mlx-lm model (``sim.loop.Backend``).

The loop calls ``execute(p, shape, state)`` with a pass the state machine has already
checked and *before* the state advances, so ``state.by_id[rid]`` still shows each
request's progress before the pass. ``execute`` blocks until the pass's computation is
done and returns the measured seconds; the loop reads the wall clock right after.

Where each request's KV lives:

- ``_cache[rid]``: its own list of per-layer caches (admitted and prefilling, prefilled
  and not yet decoding, or parked out of the decode batch). Prefill chunks advance it in
  place; a chunk after a chunk gives the state of one whole-prompt call. (It is mlx-lm's
  KVCache, growing by 256 slots with a copy: pre-sizing it to the request's prefill target
  was measured and made no difference, within +-5% noise, for 2048-token prompts in
  128-512-token chunks on the tiny and small presets.)
- the decode batch: one mlx-lm ``BatchKVCache`` per layer (left-padded rows), kept across
  passes as mlx-lm keeps its generation batch. Its rows mirror ``ReplicaState.batch``
  exactly: a decode pass first parks rows that are in the batch but not in the pass
  (``filter``; rare), joins rows that are not yet in it (``BatchKVCache.merge`` of their
  own caches, then ``extend``), runs ONE batched forward over all rows, then filters the
  rows that finished. After the pass the batch is exactly the pass's decode rows minus
  those that finished. A preempted request is dropped at once (``release``).

A decode row on a prompt with exactly one token left is mlx-lm's hand-off: that last
prompt token is the decode input and the pass yields the first output token.

A padded pass with several prefill chunks is one right-padded batched forward, as
mlx-lm's ``PromptProcessingBatch.prompt``: the rows' caches are merged into a
``BatchKVCache`` (left-padded to the longest context so far), the chunks are right-padded
to the longest chunk, and after the forward each row's real keys/values are sliced back
into its own cache (right-padding keys are never attended to by real tokens, which come
first; mlx-lm rolls them to the left with ``finalize`` instead, a copy the slice avoids).
An unpadded pass runs each chunk as its own forward over its own cache.

One evaluation per pass: every graph of a pass (the batched decode forward and each
prefill chunk's forward) is built lazily and evaluated by ONE ``mx.eval``. On MLX's CPU
backend that is one lazy graph executed in order by the single CPU stream's worker
thread (BLAS threads inside each matmul): it saves per-forward dispatch and
synchronisation overhead (a Python round trip and a wait per forward), not FLOPs; a mixed
pass costs about the sum of its parts (tiny preset: 16-row decode 27 ms + 256-token chunk
117 ms = 145 ms mixed). Two CPU streams (decode on one, prefill on the other, one eval)
could overlap them; measured here with 2-thread OpenBLAS on 2 cores it was no faster
(155 ms), so it is not done.

Batch-cache copies (join, park, finish, preempt) are evaluated on their own so their time
is logged (``finish()`` reports ``copy_s``). Joins, parks and finishes happen inside the
decode pass that causes them, as ``PassShape.joins``/``leaves`` charge them; a preemption's
filter happens in ``release``, at the start of the step that preempts.

Prompts: a request that carries text (a prompt or chat messages) is fed the model
tokenizer's ids for it (``traces.prompt_ids``; the trace was counted with the same tokenizer);
a request with only a token count gets seeded synthetic ids (``sampling.prompt_ids``).

Outputs stop at the request's ``output_tokens`` (its max_tokens) or, unless ``ignore_eos``, at
the model's EOS token (the backend tells the state machine with ``state.stop``). Every
request's generated token ids are kept in ``backend.tokens[rid]``.

Prefix caching (the state machine's ``PrefixCache``, ``sim.prefix``): the state decides which
blocks a request finds cached when it is admitted; its KV then starts with those tokens. The
engine copies their keys and values from the request that computed each block (its owner):
from the owner's own cache or batch row while it runs, or from the KV it left behind when it
finished or was preempted (kept while the owner still owns a cached block: the state says
when its last one is evicted). The copy is one concatenation per layer into the new
request's own mlx-lm ``KVCache``, inside the pass that first needs it (timed with it); the
rest of the prompt is then prefilled on top, so a hit saves exactly the cached tokens'
forward. With ``check`` the copied positions' token ids are compared with the owner's.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import blas as _blas  # noqa: F401  (OpenBLAS before mlx)
from .errors import EngineError
from .models import DTYPES, ROLLBACK_KINDS, ModelInfo, make_caches
from .noise import Noise
from .windowcache import WindowBatchKVCache, forget, windowed
from .sampling import PENALTY_CONTEXT, Sampling, h64, parse_sampling, prompt_ids  # noqa: F401

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache  # noqa: E402
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors  # noqa: E402

from schedlab.policies.base import Pass, PassShape, Phase  # noqa: E402
from schedlab.sim.clock import WallClock  # noqa: E402
from schedlab.sim.state import RequestState  # noqa: E402
from schedlab.traces.schema import Request  # noqa: E402

DRAFT_LAG = 4  # a draft batch row lagging more tokens than this catches up in a cache of its own

# ------------------------------------------------------------------------- caches


def _cache_arrays(caches: Iterable[Any]) -> list:
    """The arrays a pass must evaluate to leave ``caches`` computed: a plain KV cache's key and
    value buffers; any other kind's whole state (sliding windows, recurrent states, offsets)."""
    out = []
    for c in caches:
        if type(c) is KVCache or type(c) is BatchKVCache:
            if c.keys is not None:
                out.append(c.keys)
                out.append(c.values)
        else:
            out.extend(a for a in tree_flatten(c.state) if isinstance(a, mx.array))
    return out


def _merge(caches: Sequence[Any], window_batch: bool = False) -> Any:
    """One layer's caches of several requests as one batch cache: plain KV with headroom
    (``_merge_with_headroom``), a sliding window as a ``WindowBatchKVCache`` when ``window_batch`` (a
    batch that verifies drafts), any other kind as mlx-lm's batch generator merges it."""
    if type(caches[0]) is KVCache:
        return _merge_with_headroom(caches)
    if window_batch and type(caches[0]) is RotatingKVCache:
        return WindowBatchKVCache.from_rotating(caches)
    return caches[0].merge(list(caches))


def _merge_with_headroom(caches: Sequence[Any]) -> BatchKVCache:
    """``BatchKVCache.merge`` that leaves room for the next tokens.

    mlx-lm's merge allocates exactly the longest row, so the very next decode step has to
    grow the batch cache (a concatenate copying every row: as much as the merge itself).
    Allocating up to the next 256-slot step past the longest row in the same zeros() costs
    nothing extra and removes that copy. Rows are laid out exactly as mlx-lm lays them
    (left padding; ``_idx`` = longest row), so extend/filter/masks work unchanged.
    """
    lengths = [c.size() for c in caches]
    longest = max(lengths)
    if longest == 0:
        return BatchKVCache([0] * len(caches))
    step = BatchKVCache.step
    slots = (longest // step + 1) * step
    ref = next(c for c in caches if c.keys is not None)
    _, heads, _, dk = ref.keys.shape
    dv = ref.values.shape[3]
    keys = mx.zeros((len(caches), heads, slots, dk), dtype=ref.keys.dtype)
    values = mx.zeros((len(caches), heads, slots, dv), dtype=ref.values.dtype)
    for i, (n, c) in enumerate(zip(lengths, caches)):
        if n:
            p = longest - n
            keys[i : i + 1, :, p:longest] = c.keys[..., :n, :]
            values[i : i + 1, :, p:longest] = c.values[..., :n, :]
    out = BatchKVCache([longest - n for n in lengths])
    out.keys, out.values = keys, values
    out.offset = out.offset + longest
    out._idx = longest
    return out


def _rollback(caches: Sequence[Any], rejected: Sequence[int]) -> None:
    """Drop row i's last ``rejected[i]`` positions from a batch's caches (lazy): what every row
    lost is trimmed, the rest rolled out to the left, each row's kept tokens right-justified
    again (mlx-lm's own roll, ``BatchKVCache.finalize``)."""
    m = min(rejected)
    for c in caches:
        if m:
            c.trim(m)
        if max(rejected) > m:
            c._right_padding = mx.array([r - m for r in rejected])
            c.finalize()


@functools.lru_cache(maxsize=4)
def _load_draft(spec: str, dtype: str) -> ModelInfo:
    """A draft model, loaded once per process (a served replica's runs share it)."""
    from .models import load_model

    return load_model(spec, dtype=dtype if dtype in DTYPES else "auto")


def check_draft(target: ModelInfo, draft: ModelInfo) -> None:
    """One-line ``EngineError`` unless ``draft`` can propose tokens for ``target``: the target's
    vocabulary (as many tokens; the same ones where both have a tokenizer) and plain KV caches
    (a rejected draft's KV is rolled back, which a sliding window or a recurrent state cannot do)."""

    def vocab(info):
        tok = getattr(info.tokenizer, "tokenizer", None)
        return tok.get_vocab(with_added_tokens=True) if tok is not None else None

    same = draft.vocab_size == target.vocab_size
    if same and target.tokenizer is not None and draft.tokenizer is not None:
        same = vocab(draft) == vocab(target)
    if not same:
        raise EngineError(
            f"draft model {draft.name} ({draft.vocab_size} tokens) does not share model {target.name}'s vocabulary "
            f"({target.vocab_size} tokens): a draft model proposes the target's token ids, so it needs its tokenizer"
        )
    if not draft.plain_kv:
        raise EngineError(
            f"{draft._not_plain()}: a draft model's rejected drafts are rolled back, which those caches cannot do"
        )


def _encode_caches(caches: Sequence[Any]) -> tuple[list, list[np.ndarray], list[str]]:
    """A request's caches as JSON plus arrays (``kvfile.write_caches``): each cache object as its
    class and attributes (mlx-lm's caches keep all their state in attributes: buffers, offsets,
    the window's write index, recurrent states), every array replaced by its index."""
    arrays: list[np.ndarray] = []
    dtypes: list[str] = []

    def enc(v):
        if isinstance(v, mx.array):
            dtype = str(v.dtype).split(".")[-1]
            arrays.append(np.asarray(v.view(mx.uint16) if dtype in ("bfloat16", "float16") else v))
            dtypes.append(dtype)
            return {"a": len(arrays) - 1}
        if isinstance(v, (list, tuple)):
            return {"t" if isinstance(v, tuple) else "l": [enc(x) for x in v]}
        if hasattr(v, "__dict__") and type(v).__module__ == KVCache.__module__:
            return {"c": type(v).__name__, "d": {k: enc(x) for k, x in vars(v).items()}}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise EngineError(f"a cache holds a {type(v).__name__}, which the KV hand-off cannot carry")

    return [enc(c) for c in caches], arrays, dtypes


def _decode_caches(caches: list, arrays: Sequence[np.ndarray], dtypes: Sequence[str]) -> list[Any]:
    """The cache objects ``_encode_caches`` wrote."""
    import mlx_lm.models.cache as cache_mod

    def dec(v):
        if isinstance(v, dict):
            if "a" in v:
                a = mx.array(arrays[v["a"]])
                return a.view(getattr(mx, dtypes[v["a"]])) if a.dtype == mx.uint16 else a
            if "l" in v:
                return [dec(x) for x in v["l"]]
            if "t" in v:
                return tuple(dec(x) for x in v["t"])
            cls = getattr(cache_mod, v["c"])
            obj = cls.__new__(cls)
            obj.__dict__.update({k: dec(x) for k, x in v["d"].items()})
            return obj
        return v

    return [dec(c) for c in caches]


def _prime_cache(c: Any, probe: Any, n: int) -> list:
    """Lay out cache ``c`` as a prefill of ``n`` tokens leaves it, with random values (calibration:
    timing depends on shapes only). ``probe``: the same layer's cache after a 2-token forward,
    whose arrays give the shapes and dtypes. Returns the arrays to evaluate."""
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    if isinstance(c, CacheList):
        return [a for x, p in zip(c.caches, probe.caches) for a in _prime_cache(x, p, n)]
    if isinstance(c, ArraysCache):  # a fixed-size state: its size does not depend on n
        c.cache = [None if a is None else mx.random.normal(a.shape).astype(a.dtype) for a in probe.cache]
        return [a for a in c.cache if a is not None]
    _, heads, _, dk = probe.keys.shape
    dv, dtype = probe.values.shape[3], probe.keys.dtype
    if isinstance(c, RotatingKVCache):  # at most the window, its write index where n left it
        slots = min(n, c.max_size)
        c.offset, c._idx = n, slots
    else:
        slots = -(-n // KVCache.step) * KVCache.step
        c.offset = n
    c.keys = mx.random.normal((1, heads, slots, dk)).astype(dtype)
    c.values = mx.random.normal((1, heads, slots, dv)).astype(dtype)
    return [c.keys, c.values]


# ------------------------------------------------------------------------- sampling

_OWN_SEED = h64("a request's own seed")  # (its draws never meet those seeded by a request id)


@functools.lru_cache(maxsize=256)
def _processors(s: Sampling) -> list:
    """mlx-lm's logits processors for ``s``: logit bias, then the penalties it sets."""
    return make_logits_processors(
        dict(s.logit_bias) or None,
        s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        PENALTY_CONTEXT,
        s.presence_penalty or None,
        PENALTY_CONTEXT,
        s.frequency_penalty or None,
        PENALTY_CONTEXT,
    )


def _gumbel(s: Sampling, rid: str, index: int, vocab: int) -> np.ndarray:
    """The Gumbel noise of request ``rid``'s ``index``-th token: from its own seed and the index
    only, or (without one) from the run's seed, its id and the index."""
    mask = (1 << 64) - 1
    if s.request_seed is not None:
        rng = np.random.default_rng([s.request_seed & mask, _OWN_SEED, index])
    else:
        rng = np.random.default_rng([s.seed & mask, h64(rid), index])
    return rng.gumbel(size=vocab)


def _logprobs(lazy: tuple) -> tuple[float, list[tuple[int, float]]]:
    """One row of ``MLXBackend._lp_lazy`` (evaluated): its token's log-probability and its ``k``
    most likely alternatives, best first."""
    chosen, top, val, j, k = lazy
    pairs: list[tuple[int, float]] = []
    if k and top is not None:
        pairs = sorted(zip(top[j].tolist(), val[j].tolist()), key=lambda p: (-p[1], p[0]))[:k]
    return float(chosen[j, 0].item()), pairs


# ------------------------------------------------------------------------- backend


class EngineStateError(RuntimeError):
    """The engine and the state machine disagree: a bug, never bad input."""


class MLXBackend:
    """Executes passes on an mlx-lm model and returns their measured seconds (wall clock).

    ``warmup``: before the clock starts, throwaway passes of the run's shapes (True: the longest
    known prompt's chunk, padded batches and decode batches up to 8 rows, what a measured run
    wants), of small shapes only ("light": what a server wants, ready seconds sooner; on a GPU
    only, whose kernels are compiled at their first call: on the CPU none), or none."""

    mode = "real"

    def __init__(
        self,
        model_info: ModelInfo,
        sampling: Any = "greedy",
        seed: int = 0,
        *,
        warmup: bool | str = True,
        check: bool = True,
        ignore_eos: bool = False,
        noise: Noise | None = None,
    ):
        self.info = model_info
        self.noise = noise if noise is not None else Noise.from_env()
        self._noise_saved = None
        self.model = model_info.model
        self.sampling = parse_sampling(sampling)
        self.seed = int(seed)
        if warmup not in (True, False, "light"):
            raise ValueError(f"warmup is True, False or 'light', got {warmup!r}")
        self.warmup = warmup
        self.check = check
        self.ignore_eos = ignore_eos
        self.eos = frozenset(() if ignore_eos else (model_info.eos_token_ids or ()))
        self.stopped: set[str] = set()  # requests that ended at EOS
        self.no_eos: set[str] = set()  # requests that generate past EOS (a served request's ignore_eos)
        self.vocab = model_info.vocab_size
        self.n_layers = model_info.n_layers
        self.plain_kv = model_info.plain_kv  # every layer a plain KVCache (else mlx-lm's batch caches)
        # what a request's caches hold besides the KV that grows: the replica counts it (sim.layout)
        self.cache_layout = None if self.plain_kv else model_info.layout
        self._hidden = model_info.hidden
        self._head = model_info.head
        self.tokens: dict[str, list[int]] = {}  # generated ids per request
        # called with (request id, token id) as each token is made, on the engine's thread, before
        # the pass returns (a server streams it from there: at the pass's end, not the step's); a
        # true result makes that token the request's last (a stop string, a client gone), as EOS does
        self.on_token: Callable[..., Any] | None = None
        # a request's own sampling (a served request's temperature, top_p, seed, logprobs, ...), by
        # id: set before it arrives, removed when it ends; any other request samples as ``sampling``.
        # A request that asks for logprobs gets them as on_token's third argument: (its token's
        # log-probability, [(id, log-probability)] of the most likely alternatives, best first)
        self.request_sampling: dict[str, Sampling] = {}
        self._lp_lazy: dict[str, tuple] = {}  # logprobs of this pass's tokens (lazy, until emitted)
        self._seq: dict[str, list[int]] = {}  # prompt ids + generated ids (made on first use)
        self._kv: dict[str, int] = {}  # tokens in each request's KV (own cache or batch row)
        self._cache: dict[str, list[Any]] = {}  # own per-layer caches (not in the batch)
        self._batch: list[BatchKVCache] | None = None
        self._rows: list[str] = []  # batch row order
        # once a pass verifies drafts, the batch keeps sliding-window layers as plain slots cut
        # to the window (``WindowBatchKVCache``: rejected drafts roll back as from full attention)
        self._windowed = False
        self._prefix = None  # the state's PrefixCache, when prefix caching is on
        self._bs = 1
        # KV left by finished or preempted requests that still own cached blocks:
        # rid -> (per layer (keys, values) of its first n tokens, n, their token ids)
        self._retained: dict[str, tuple[list[tuple[Any, Any]], int, list[int]]] = {}
        # prefill and decode apart (``serve --prefill P --decode D``): a request named in
        # ``export_kv`` writes its prompt's KV to the file named there when it finishes (a prefill
        # replica's request: one token), ``exported`` says what was written; a request given to
        # ``expect_kv`` starts from the KV of such a file (it arrives with that KV: its state's
        # ``kv_transferred``), copied into its own cache at its first pass
        self.export_kv: dict[str, str] = {}
        self.exported: dict[str, dict[str, Any]] = {}
        self._imports: dict[str, np.ndarray] = {}
        # speculative decoding with a draft model (``use_draft``): its caches, as the target's are
        # kept: a batch of the rows drafting now (``_dbatch``, rows ``_drows``), a cache of its own
        # for a row out of it; ``_dkv``: the tokens each holds, those of the target's KV (all but
        # the last draft after a verify that accepted every draft: it goes in with the next ones)
        self.draft: ModelInfo | None = None
        self._dcache: dict[str, list[Any]] = {}
        self._dbatch: list[BatchKVCache] | None = None
        self._drows: list[str] = []
        self._dkv: dict[str, int] = {}
        self._dsteps = 0  # the draft steps of the pass now running (0: none)
        # drafts given rather than found: ``(pass, state) -> {request id: draft tokens}`` in place of
        # the drafter (``calibrate`` times verify passes of drafts it chooses); None: the drafter's
        self.given_drafts: Callable[[Pass, Any], dict[str, list[int]]] | None = None
        self.stats = {
            "passes": 0,
            "forwards": 0,
            "decode_rows": 0,
            "prefill_tokens": 0,
            "padded_prefill_tokens": 0,
            "joins": 0,
            "leaves": 0,
            "parks": 0,
            "copy_s": 0.0,
            "execute_s": 0.0,
            "warmup_s": 0.0,
            "preemptions": 0,
            "cached_tokens_loaded": 0,
            "kv_exported_tokens": 0,
            "kv_export_s": 0.0,
            "kv_imported_tokens": 0,
            "kv_import_s": 0.0,
        }

    # ------------------------------------------------------------------ protocol
    def make_clock(self) -> WallClock:
        return WallClock()

    def start(self, state, requests=None) -> None:
        """Check the known requests against the model and warm up (before the clock starts)."""
        requests = list(requests or ())
        self.info.check_trace(requests)
        self._noise_saved = self.noise.enter()  # pinning, collector off (engine.noise): until finish()
        self._prefix = getattr(state, "prefix", None)
        self._bs = getattr(state, "block_size", 1)
        if self._prefix is not None:
            self.info.check_prefix_caching()
            if self._prefix.token_keys is None:  # a text prompt's blocks are keyed by its token ids
                self._prefix.token_keys = self._text_keys
            self._prefix.on_owner_gone = self._owner_gone
        # a light warm-up is for a device that compiles its kernels at their first call (Metal,
        # CUDA); the CPU's first passes cost what later ones do (bench/results/serve_ready.json)
        if self.warmup and not (self.warmup == "light" and mx.default_device() == mx.cpu):
            t0 = time.perf_counter()
            light = self.warmup == "light"
            for _ in range(max(self.noise.warmup, 1)):
                self._warm_up(max((r.prompt_tokens for r in requests), default=64), light=light)
            self.stats["warmup_s"] = time.perf_counter() - t0

    def step_overhead(self, predicted_s: float) -> float:
        return 0.0  # the scheduler's own time is in the wall clock already

    def execute(self, p: Pass, shape: PassShape, state) -> float:
        t0 = time.perf_counter()
        by_id = state.by_id
        if self._prefix is not None or self._imports:
            self._load_cached(p, state)
        if self.check and (p.prefill or shape.joins or shape.leaves or len(p.decode) != len(self._rows)):
            # (a steady decode pass, the last pass's rows each one token further, cannot change
            # what the check compares: it runs where rows join, leave, park or prefill)
            self._check(p, state)
        targets: list = []
        decode = None
        finishing: list[str] = []
        drafts = (self.given_drafts or self._propose)(p, state) if p.draft else None
        if drafts and not self._windowed:
            self._windowed = True  # (from now on: the batch's sliding layers as WindowBatchKVCache)
            if self._batch:
                self._batch = [windowed(c) for c in self._batch]
        if p.decode:
            decode = self._decode_graph(p.decode, by_id, drafts)
            targets.append(decode[0])
            targets.extend(_cache_arrays(self._batch))
        chunks = []
        if p.prefill:
            if p.padded and len(p.prefill) > 1:
                chunks = [self._padded_graph(p.prefill, by_id)]
            else:
                chunks = [self._chunk_graph(rid, n, by_id[rid]) for rid, n in p.prefill]
            for rids, tok, arrays in chunks:
                if tok is not None:
                    targets.append(tok)
                targets.extend(arrays)
        for lazy in self._lp_lazy.values():  # (logprobs asked for: part of the same evaluation)
            targets.extend(a for a in lazy[:3] if a is not None)
        mx.eval(targets)  # ONE evaluation for the whole pass
        accepted: dict[str, int] = {}
        if decode is not None and drafts:
            accepted = self._verified(decode[0].tolist(), drafts, state)
            if self._dsteps:
                self._draft_rollback(accepted)
        elif decode is not None:
            toks = decode[0].tolist()
            for rid, t in zip(self._rows, toks):
                self._kv[rid] += 1
                self._emit(rid, t, state)
        if decode is not None:
            self.stats["decode_rows"] += len(self._rows)
            self.stats["forwards"] += 1
            finishing = [
                rid
                for rid in p.decode  # at max_tokens, or stopped at EOS just now
                if by_id[rid].generated + 1 + accepted.get(rid, 0) >= by_id[rid].output_tokens
            ]
        for rids, tok, _ in chunks:
            if tok is not None:
                for rid, t in zip(rids, tok.tolist()):
                    self._emit(rid, t, state)
        self.stats["forwards"] += 1 if p.padded and len(p.prefill) > 1 else len(p.prefill)
        self.stats["prefill_tokens"] += shape.prefill_tokens
        self.stats["padded_prefill_tokens"] += shape.padded_prefill_tokens
        if finishing:
            # with a prefix cache their KV may be copied later, and one to export is written at
            # release: keep it (release decides)
            kept = [rid for rid in finishing if self._prefix is not None or rid in self.export_kv]
            if kept:
                self._leave(kept, park=True)
            if len(kept) < len(finishing):
                self._leave([rid for rid in finishing if rid not in kept])
        # own caches of requests finishing in a prefill chunk (output_tokens == 1) go in release
        self.stats["passes"] += 1
        dt = time.perf_counter() - t0
        self.stats["execute_s"] += dt
        return dt

    def release(self, r) -> None:
        """Free a request's KV: finished (already out of the batch) or preempted."""
        rid = r.id
        if self._prefix is not None:
            self._retain(rid)
        path = self.export_kv.pop(rid, None)
        if path is not None and r.phase is Phase.FINISHED:
            self._export(r, path)
        self._imports.pop(rid, None)
        self._cache.pop(rid, None)
        if rid in self._rows:
            self._leave([rid])
        if self.draft is not None:
            self._draft_drop(rid)
        self._kv[rid] = 0
        if r.phase is Phase.FINISHED:
            self._seq.pop(rid, None)  # prompt ids are not needed again (tokens[rid] stays)
        else:
            self.stats["preemptions"] += 1

    def finish(self) -> dict[str, Any]:
        if self._noise_saved is not None:
            self.noise.leave(self._noise_saved)
            self._noise_saved = None
        meta = self.info.metadata()
        if self.plain_kv:
            layers, kv_heads, head_dim, dtype = self.kv_layout()
            meta["kv_bytes_per_token"] = (
                layers * 2 * kv_heads * head_dim * np.dtype(dtype.replace("bfloat16", "float16")).itemsize
            )
        else:  # only the full-attention layers' KV grows with the context (engine.models.cache_layout)
            meta["kv_bytes_per_token"] = meta["cache_layout"]["kv_bytes_per_token"]
        meta["noise"] = self.noise.describe()
        meta["engine"] = {
            "sampling": self.sampling.describe(),
            "prompt_seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "eos_token_ids": sorted(self.eos),
            "stopped_at_eos": len(self.stopped),
            "one_eval_per_pass": True,
            **({"draft_model": self.draft.name} if self.draft is not None else {}),
            "head_on_needed_positions_only": self.info.fast_head,
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()},
        }
        return meta

    def prime(self, r, n: int, state=None) -> None:
        """Calibration only: give request ``r`` ``n`` prompt tokens of KV without a forward.

        Timing does not depend on the values, only on the shapes, so ``calibrate`` sets up
        long contexts this way in milliseconds instead of prefilling them for minutes. The
        cache is laid out as a real prefill leaves it (mlx-lm's ``KVCache``: 256-slot
        steps, ``offset`` = n; a sliding window's ``RotatingKVCache`` holds at most its window;
        a recurrent ``ArraysCache`` state has its fixed shape). The caller advances the state
        machine by the same chunk.
        """
        if n < 1 or n >= r.prefill_target:
            raise ValueError("prime() fills 1 .. target-1 tokens (the last one needs a real pass)")
        self._ids(r)
        caches = self._own_cache(r.id)
        if self._kv[r.id]:
            raise ValueError(f"request {r.id} already holds KV")
        if not self.plain_kv:
            arrays = []
            for c, shape in zip(caches, self._state_shapes()):
                arrays += _prime_cache(c, shape, n)
            mx.eval(arrays)
            self._kv[r.id] = n
            return
        _, kv_heads, head_dim, dtype = self.kv_layout()
        dtype = getattr(mx, dtype)
        slots = -(-n // KVCache.step) * KVCache.step
        shape = (1, kv_heads, slots, head_dim)
        arrays = []
        for c in caches:
            c.keys = mx.random.normal(shape).astype(dtype)
            c.values = mx.random.normal(shape).astype(dtype)
            c.offset = n
            arrays += [c.keys, c.values]
        mx.eval(arrays)
        self._kv[r.id] = n

    def _state_shapes(self) -> list:
        """Each layer's cache after a 2-token forward (what ``prime`` copies the shapes of)."""
        if getattr(self, "_shapes", None) is None:
            caches = make_caches(self.model, self.n_layers)
            self._hidden(mx.array([[1, 2]], dtype=mx.uint32), caches)
            mx.eval(_cache_arrays(caches))
            self._shapes = caches
        return self._shapes

    # ------------------------------------------------------------------ inspection
    @property
    def batch_rows(self) -> list[str]:
        """Requests in the decode batch cache, in row order."""
        return list(self._rows)

    def holds(self, rid: str) -> bool:
        """Whether the engine holds any KV for ``rid`` (own cache or a batch row)."""
        return rid in self._cache or rid in self._rows

    def kv_arrays(self, rid: str) -> list[tuple[Any, Any]]:
        """Per layer, ``rid``'s keys and values, shape (1, kv_heads, tokens, head_dim)."""
        n = self._kv.get(rid, 0)
        if rid in self._rows:
            i = self._rows.index(rid)
            return [
                (c.keys[i : i + 1, :, c._idx - n : c._idx], c.values[i : i + 1, :, c._idx - n : c._idx])
                for c in self._batch
            ]
        if rid in self._cache:
            return [(c.keys[..., :n, :], c.values[..., :n, :]) for c in self._cache[rid]]
        raise KeyError(f"the engine holds no KV for request {rid}")

    # ------------------------------------------------------------------ prefix caching
    def _retain(self, rid: str) -> None:
        """Keep the KV of a request that is leaving (finished or preempted) while it owns
        cached blocks another request may hit."""
        n = self._kv.get(rid, 0)
        if not n or not self._prefix.owned.get(rid):
            self._retained.pop(rid, None)
            return
        if rid in self._rows:
            self._leave([rid], park=True)
        caches = self._cache.get(rid)
        if caches is None:
            return
        kv = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in caches]
        self._retained[rid] = (kv, n, list(self._seq[rid][:n]))

    def _owner_gone(self, rid: str) -> None:
        self._retained.pop(rid, None)

    def _source(self, owner: str, end: int, state):
        """(per-layer (keys, values), token ids) holding ``owner``'s first ``end`` tokens."""
        if self.holds(owner) and self._kv.get(owner, 0) >= end:
            return self.kv_arrays(owner), self._seq.get(owner)
        kept = self._retained.get(owner)
        if kept is not None and kept[1] >= end:
            return kept[0], kept[2]
        raise EngineStateError(
            f"step {state.step_index}: cached block of request {owner} up to token {end} is not held by the engine"
        )

    def _load_cached(self, p: Pass, state) -> None:
        """Requests admitted with a cached prefix get its KV before their first pass."""
        by_id = state.by_id
        for rid in [rid for rid, _ in p.prefill] + [rid for rid in p.decode if rid not in self._rows]:
            r = by_id[rid]
            if r.phase is not Phase.PREFILLING or not r.prefilled or self._kv.get(rid, 0) or rid in self._cache:
                continue
            if rid in self._imports:
                self._import(r, state)
            else:
                self._load(r, state)

    def _load(self, r, state) -> None:
        bs = self._bs
        pc = self._prefix
        n = r.prefilled
        k = n // bs
        hashes = pc.chain(r, k)[:k]
        ids = self._ids(r)
        parts: list[list[tuple[Any, Any]]] = []
        j = 0
        while j < k:  # runs of blocks computed by the same owner
            owner, j0 = pc.owner[hashes[j]]
            if j0 != j:
                raise EngineStateError(f"step {state.step_index}: request {r.id} block {j} is cached as block {j0}")
            e = j + 1
            while e < k and pc.owner[hashes[e]][0] == owner:
                e += 1
            arrays, src_ids = self._source(owner, e * bs, state)
            lo, hi = j * bs, e * bs
            if self.check and src_ids is not None and list(src_ids[lo:hi]) != ids[lo:hi]:
                raise EngineStateError(
                    f"step {state.step_index}: request {r.id} tokens {lo}..{hi} differ from "
                    f"those of request {owner}, whose cached blocks it was given"
                )
            parts.append([(kk[..., lo:hi, :], vv[..., lo:hi, :]) for kk, vv in arrays])
            j = e
        caches = [KVCache() for _ in range(self.n_layers)]
        for layer, c in enumerate(caches):
            ks = [part[layer][0] for part in parts]
            vs = [part[layer][1] for part in parts]
            c.update_and_fetch(
                ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2),
                vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2),
            )
        self._timed_copy(_cache_arrays(caches))
        self._cache[r.id] = caches
        self._kv[r.id] = n
        self.stats["cached_tokens_loaded"] += n

    # ------------------------------------------------------------------ KV hand-off
    def kv_layout(self) -> tuple[int, int, int, str]:
        """(layers, KV heads, head dim, dtype) of this model's KV: what a KV file must match."""
        cfg = self.info.config
        heads = cfg.get("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return self.n_layers, int(kv_heads), int(head_dim), self.info.activation_dtype

    def expect_kv(self, rid: str, head: dict[str, Any], kv: np.ndarray) -> None:
        """Request ``rid`` will arrive with the KV of a file (``engine.kvfile.read``): its token ids
        are the header's (the prompt's and its first token), its prompt's KV these arrays. An
        ``EngineError`` if they do not fit this model (checked before it is submitted)."""
        if not self.plain_kv or not isinstance(kv, np.ndarray):
            kinds = [c.get("c") if isinstance(c, dict) else None for c in head.get("caches") or ()]
            if isinstance(kv, np.ndarray) or kinds != list(self.info.cache_kinds):
                raise EngineError(
                    f"the KV given holds {', '.join(map(str, kinds)) or 'plain KV'} caches, this model's are "
                    f"{', '.join(self.info.cache_kinds)} (prefill and decode replicas must run the same model)"
                )
            self._seq[rid] = [int(i) for i in head["ids"]]
            self.tokens[rid] = []
            self._imports[rid] = (head, kv)
            return
        layers, kv_heads, head_dim, dtype = self.kv_layout()
        want = (layers, 2, kv_heads, kv.shape[3], head_dim)
        if tuple(kv.shape) != want or head["dtype"] != dtype:
            raise EngineError(
                f"the KV given is {head['dtype']} of shape {tuple(kv.shape)}, but this model's is {dtype} of "
                f"shape {want} (prefill and decode replicas must run the same model and dtype)"
            )
        self._seq[rid] = [int(i) for i in head["ids"]]
        self.tokens[rid] = []
        self._imports[rid] = kv

    def drop_kv(self, rid: str) -> None:
        """Forget what ``export_kv`` and ``expect_kv`` were told of ``rid``: it was never submitted."""
        self.export_kv.pop(rid, None)
        if self._imports.pop(rid, None) is not None:
            self._seq.pop(rid, None)
            self.tokens.pop(rid, None)

    def _export(self, r, path: str) -> None:
        """Write finished request ``r``'s prompt KV and its ids to ``path`` (``engine.kvfile``)."""
        from . import kvfile

        t0 = time.perf_counter()
        n = self._kv.get(r.id, 0)
        if n != r.prompt_tokens:
            raise EngineStateError(f"request {r.id} holds {n} KV tokens at its end, its prompt is {r.prompt_tokens}")
        if not self.plain_kv:  # sliding windows, recurrent states: the caches go whole
            head, arrays, dtypes = _encode_caches(self._cache[r.id])
            size = kvfile.write_caches(path, self._seq[r.id][: n + 1], n, head, arrays, dtypes)
            dt = time.perf_counter() - t0
            self.exported[r.id] = {"path": path, "tokens": n, "bytes": size, "export_s": round(dt, 6)}
            self.stats["kv_exported_tokens"] += n
            self.stats["kv_export_s"] += dt
            return
        _, _, _, dtype = self.kv_layout()
        bits = dtype in kvfile.SIXTEEN_BIT  # (numpy has no bfloat16: their bits go)
        # numpy views of the whole cache buffers (no copy), each layer's first n positions written
        # straight to the file: one copy (slicing in MLX first is a strided copy, 2-3x slower here)
        layers = []
        for c in self._cache[r.id]:
            k, v = (np.asarray(a.view(mx.uint16) if bits else a)[0, :, :n] for a in (c.keys, c.values))
            layers.append((k, v))
        size = kvfile.write(path, self._seq[r.id][: n + 1], layers, dtype)
        dt = time.perf_counter() - t0
        self.exported[r.id] = {"path": path, "tokens": n, "bytes": size, "export_s": round(dt, 6)}
        self.stats["kv_exported_tokens"] += n
        self.stats["kv_export_s"] += dt

    def _import(self, r, state) -> None:
        """Copy the KV ``expect_kv`` was given into ``r``'s own cache (before its first pass)."""
        t0 = time.perf_counter()
        kv = self._imports.pop(r.id)
        if isinstance(kv, tuple):  # a model's whole caches (``_export``'s other kind)
            head, arrays = kv
            n = int(head["tokens"])
            if n != r.prefilled:
                raise EngineStateError(
                    f"step {state.step_index}: request {r.id} arrived with {r.prefilled} KV tokens in the state, "
                    f"{n} in its file"
                )
            caches = _decode_caches(head["caches"], arrays, [d for _, d in head["arrays"]])
            self._timed_copy(_cache_arrays(caches))
            self._cache[r.id] = caches
            self._kv[r.id] = n
            self.stats["kv_imported_tokens"] += n
            self.stats["kv_import_s"] += time.perf_counter() - t0
            return
        n = kv.shape[3]
        if n != r.prefilled:
            raise EngineStateError(
                f"step {state.step_index}: request {r.id} arrived with {r.prefilled} KV tokens in the state, "
                f"{n} in its file"
            )
        _, _, _, dtype = self.kv_layout()
        a = mx.array(kv)
        if a.dtype == mx.uint16:
            a = a.view(getattr(mx, dtype))
        caches = [KVCache() for _ in range(self.n_layers)]
        for layer, c in enumerate(caches):
            c.update_and_fetch(a[layer, 0][None], a[layer, 1][None])
        self._timed_copy(_cache_arrays(caches))
        self._cache[r.id] = caches
        self._kv[r.id] = n
        self.stats["kv_imported_tokens"] += n
        self.stats["kv_import_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, rid: str, token: int, state=None) -> bool:
        """Hand out ``rid``'s next token; whether it is its last (its EOS, or the client said
        so): with ``state``, the state machine is told (``stop``)."""
        token = int(token)
        self._seq[rid].append(token)
        self.tokens[rid].append(token)
        lazy = self._lp_lazy.pop(rid, None)
        if self.on_token is None:
            last = False
        elif lazy is None:
            last = self.on_token(rid, token)
        else:
            last = self.on_token(rid, token, _logprobs(lazy))
        eos = token in self.eos and rid not in self.no_eos
        if eos and state is not None:
            state.stop(rid)  # this token is its last
            self.stopped.add(rid)
        elif last and state is not None:
            state.stop(rid)
        return eos or bool(last)

    def _expected_kv(self, r) -> int:
        if r.phase is Phase.DECODING:
            return r.prompt_tokens + r.generated - 1
        return r.prefilled

    def _check(self, p: Pass, state) -> None:
        if set(self._rows) != state.batch:
            raise EngineStateError(
                f"step {state.step_index}: engine batch rows {sorted(self._rows)} differ from the "
                f"state machine's {sorted(state.batch)}"
            )
        for rid in list(p.decode) + [rid for rid, _ in p.prefill]:
            r = state.by_id[rid]
            have = self._kv.get(rid, 0)
            if have != self._expected_kv(r):
                raise EngineStateError(
                    f"step {state.step_index}: request {rid} holds {have} KV "
                    f"tokens in the engine, {self._expected_kv(r)} in the state"
                )
            if len(self._ids(r)) != r.prompt_tokens + r.generated:
                raise EngineStateError(f"step {state.step_index}: request {rid} token count differs")

    def _ids(self, r) -> list[int]:
        """Prompt ids + generated ids of request ``r`` (prompt ids made on first use)."""
        seq = self._seq.get(r.id)
        if seq is None:
            req = self._text_request(r)
            if req is not None:
                seq = self._text_ids(r, req)
            else:
                seq = prompt_ids(self.seed, r.id, r.prompt_tokens, self.vocab, r.prefix_ids)
            seq += self.tokens.setdefault(r.id, [])
            self._seq[r.id] = seq
        return seq

    def write_texts(self, path, requests) -> None:
        """texts.jsonl: per request its generated ids, their text (with a tokenizer) and why it
        ended (``stop``: EOS; ``length``: max_tokens), in the order of ``requests``."""
        import json

        tok = self.info.tokenizer
        with open(path, "w") as f:
            for r in requests:
                ids = self.tokens.get(r.id, [])
                row = {
                    "id": r.id,
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": len(ids),
                    "finish_reason": ("stop" if r.id in self.stopped else "length" if r.finish_s is not None else None),
                    "text": tok.decode([t for t in ids if t not in self.eos]) if tok is not None else None,
                    "token_ids": ids,
                }
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _text_keys(self, r) -> list[int] | None:
        """The prefix cache's keys for request ``r``: a text prompt's token ids (two prompts that
        share a head share its blocks, as served chats share a system prompt); None for a request
        of counts only, which the cache keys by its ``prefix_ids`` (the ids ``_ids`` makes for it
        share exactly those)."""
        return self._ids(r)[: r.prompt_tokens] if self._text_request(r) is not None else None

    def _text_request(self, r):
        """``r``'s request if its prompt is text this model can tokenize, else None (a request
        of counts only, or a model without a tokenizer: it runs the counts)."""
        req = getattr(r, "request", None)
        if req is not None and getattr(req, "has_text", False) and self.info.tokenizer is not None:
            return req
        return None

    def _text_ids(self, r, req) -> list[int]:
        """The model tokenizer's ids for a request's text (its count must be the trace's)."""
        from schedlab import traces

        ids = list(traces.prompt_ids(req, self.info.tokenizer))
        if len(ids) != r.prompt_tokens:
            raise EngineError(
                f"request {r.id}: its text is {len(ids)} tokens for model {self.info.name}'s "
                f"tokenizer but the trace says {r.prompt_tokens} (load the trace with this "
                f"model's tokenizer: traces.load(..., tokenizer=..., recount=True))"
            )
        return ids

    def _own_cache(self, rid: str) -> list[Any]:
        c = self._cache.get(rid)
        if c is None:
            c = make_caches(self.model, self.n_layers)
            self._cache[rid] = c
            self._kv[rid] = 0
        return c

    def _timed_copy(self, arrays: list) -> None:
        t = time.perf_counter()
        mx.eval(arrays)
        self.stats["copy_s"] += time.perf_counter() - t

    def _sample(self, logits, rids: Sequence[str]):
        """Token ids (lazy) from rows of logits, one row per request in ``rids``, each sampled as
        its own ``Sampling`` says (``request_sampling``, else the run's ``sampling``).

        Rows that are a plain argmax (greedy, no penalties, no logprobs) take it of these very
        logits, as when every row is. The others get mlx-lm's logits processors on their own
        recent tokens, then go in groups of equal settings: greedy ones take the argmax, sampled
        ones are filtered (mlx-lm's ``apply_top_p``/``apply_min_p``/``apply_top_k`` on the
        log-softmax) and drawn with their own Gumbel noise (``_gumbel``): row by row the result
        is the same whichever rows share the pass. Logprobs asked for are left, lazy, in
        ``_lp_lazy`` for ``execute`` to evaluate with the pass and ``_emit`` to hand over."""
        specs = [self.request_sampling.get(rid, self.sampling) for rid in rids]
        if all(s.plain for s in specs):
            return mx.argmax(logits, axis=-1)
        n, vocab = len(rids), logits.shape[-1]
        x = logits.astype(mx.float32)
        if any(s.processed for s in specs):
            rows = []
            for i, (rid, s) in enumerate(zip(rids, specs)):
                row = x[i : i + 1]
                if s.processed:
                    recent = mx.array(self._seq.get(rid, [])[-PENALTY_CONTEXT:], dtype=mx.int32)
                    for process in _processors(s):
                        row = process(recent, row)
                rows.append(row)
            x = mx.concatenate(rows, axis=0)
        parts, where, at = [], [0] * n, 0
        if any(s.plain for s in specs):
            parts.append(mx.argmax(logits, axis=-1))
            where, at = list(range(n)), n
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(specs):
            if not s.plain:
                groups.setdefault((0.0,) if s.greedy else (s.temperature, s.top_p, s.min_p, s.top_k), []).append(i)
        for idx in groups.values():
            s = specs[idx[0]]
            xs = x if len(idx) == n else x[mx.array(idx)]
            want = [(j, i, specs[i].logprobs) for j, i in enumerate(idx) if specs[i].logprobs is not None]
            lp = xs - mx.logsumexp(xs, axis=-1, keepdims=True) if want or s.filtered else None
            if s.greedy:
                tok = mx.argmax(xs, axis=-1)
            else:
                y = xs
                if s.filtered:  # mlx-lm's make_sampler chain, on the log-probabilities
                    y = lp
                    if s.top_p < 1.0:
                        y = apply_top_p(y, s.top_p)
                    if s.min_p > 0.0:
                        y = apply_min_p(y, s.min_p)
                    if 0 < s.top_k < vocab:
                        y = apply_top_k(y, s.top_k)
                noise = np.empty((len(idx), vocab), dtype=np.float32)
                for j, i in enumerate(idx):
                    noise[j] = _gumbel(specs[i], rids[i], len(self.tokens[rids[i]]), vocab)
                tok = mx.argmax(y / s.temperature + mx.array(noise), axis=-1)
            if want:
                chosen = mx.take_along_axis(lp, tok[:, None].astype(mx.int32), axis=-1)
                k = min(max(k for *_, k in want), vocab)
                top = val = None
                if k > 0:
                    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
                    val = mx.take_along_axis(lp, top, axis=-1)
                for j, i, ki in want:
                    self._lp_lazy[rids[i]] = (chosen, top, val, j, ki)
            for j, i in enumerate(idx):
                where[i] = at + j
            at += len(idx)
            parts.append(tok)
        if len(parts) == 1 and where == list(range(n)):
            return parts[0]
        return mx.concatenate(parts)[mx.array(where)]

    # ------------------------------------------------------------------ decode batch
    def _leave(self, rids: Sequence[str], park: bool = False) -> None:
        """Remove rows from the batch (filter); ``park`` keeps their KV in own caches."""
        gone = set(rids)
        keep = [i for i, rid in enumerate(self._rows) if rid not in gone]
        arrays = []
        if park:
            for i, rid in enumerate(self._rows):
                if rid in gone:
                    caches = []
                    for c in self._batch:
                        if type(c) is not BatchKVCache:  # a sliding window, a recurrent state: mlx-lm's own
                            caches.append(c.extract(i))
                            continue
                        kc = KVCache()
                        pad = c._idx - self._kv[rid]
                        kc.keys = c.keys[i : i + 1, :, pad : c._idx]
                        kc.values = c.values[i : i + 1, :, pad : c._idx]
                        kc.offset = self._kv[rid]
                        caches.append(kc)
                    self._cache[rid] = caches
                    arrays += _cache_arrays(caches)
            self.stats["parks"] += len(gone)
        self.stats["leaves"] += len(gone)
        if not keep:  # filter([]) raises in mlx-lm; an empty batch is no batch
            self._batch = None
            self._rows = []
            if arrays:
                self._timed_copy(arrays)
            return
        for c in self._batch:
            c.filter(keep)
        self._rows = [self._rows[i] for i in keep]
        self._timed_copy(arrays + _cache_arrays(self._batch))

    def _join(self, rids: Sequence[str]) -> None:
        """Merge the rows' own caches into a batch cache and extend the batch with it."""
        per_layer = [[self._cache[rid][layer] for rid in rids] for layer in range(self.n_layers)]
        merged = [_merge(cs, self._windowed) for cs in per_layer]
        if self._batch is None:
            self._batch = merged
        else:
            for c, m in zip(self._batch, merged):
                c.extend(m)
        for rid in rids:
            del self._cache[rid]
        self._rows = self._rows + list(rids)
        self.stats["joins"] += len(rids)
        self._timed_copy(_cache_arrays(self._batch))

    def _regroup(self, batch: str, rows: Sequence[str], leave: Callable[..., None]) -> list[str]:
        """Park the rows of a batch (its row list: attribute ``batch``) that are not in ``rows``
        (``leave(rids, park=True)``); returns the rows of ``rows`` not in it, to join it."""
        wanted = set(rows)
        parked = [rid for rid in getattr(self, batch) if rid not in wanted]
        if parked:
            leave(parked, park=True)
        present = set(getattr(self, batch))
        return [rid for rid in rows if rid not in present]

    def _decode_graph(self, rows: Sequence[str], by_id, drafts: dict[str, list[int]] | None = None):
        """Park/join rows, then the batched decode forward (lazy). Returns (tokens,). With
        ``drafts`` (a row's draft tokens by id), every row's input is its next token and its
        drafts, right-padded to the longest (k + 1 positions), and the tokens are each
        position's greedy choice, (rows, K + 1)."""
        joining = self._regroup("_rows", rows, self._leave)
        if joining:
            for rid in joining:
                self._ids(by_id[rid])
                self._own_cache(rid)  # a 1-token prompt hands off with no KV
            self._join(joining)
        seq, kv = self._seq, self._kv
        if self._windowed:
            forget(self._batch)
        if drafts:
            width = 1 + max(map(len, drafts.values()))
            rows_in = [[seq[rid][kv[rid]], *drafts.get(rid, ())] for rid in self._rows]
            inputs = mx.array([row + [0] * (width - len(row)) for row in rows_in], dtype=mx.uint32)
            h = self._hidden(inputs, self._batch)
            return (mx.argmax(self._head(h), axis=-1),)
        inputs = mx.array([seq[rid][kv[rid]] for rid in self._rows], dtype=mx.uint32)
        h = self._hidden(inputs[:, None], self._batch)
        logits = self._head(h[:, -1, :])
        return (self._sample(logits, self._rows),)

    # ------------------------------------------------------------------ speculative decoding
    def _propose(self, p: Pass, state) -> dict[str, list[int]] | None:
        """Each verify row's draft tokens, up to its ``draft`` count: n-gram prompt lookup over
        its prompt and output (``ngram_drafts``), or the draft model's (``use_draft``). None when
        no row has any, or when a row of the pass samples (only greedy rows verify drafts yet:
        their accepted tokens are exactly the tokens decoding one at a time gives)."""
        if not any(p.draft):
            return None
        if not all(self.request_sampling.get(rid, self.sampling).plain for rid in p.decode):
            for rid, k in zip(p.decode, p.draft):
                if k:
                    state.accept(rid, 0, 0)  # (a sampled row in the pass: none verifies drafts)
            return None
        if not self.info.rolls_back:
            kind = next(k for k in self.info.cache_kinds if k not in ROLLBACK_KINDS)
            raise EngineError(
                f"speculative decoding rolls rejected drafts back, which the model's {kind} caches "
                "(recurrent state) cannot do: run it without --speculative"
            )
        if self.draft is not None:
            out = self._draft_propose([(rid, k) for rid, k in zip(p.decode, p.draft) if k], state.by_id)
        else:
            out = {}
            for rid, k in zip(p.decode, p.draft):
                if k:
                    found = ngram_drafts(self._ids(state.by_id[rid]), k)
                    if found:
                        out[rid] = found
                    else:
                        state.accept(rid, 0, 0)  # (nothing to verify: a plain row)
        self.stats["draft_tokens"] = self.stats.get("draft_tokens", 0) + sum(map(len, out.values()))
        return out or None

    def _verified(self, toks: list[list[int]], drafts: dict[str, list[int]], state) -> dict[str, int]:
        """Hand out each verify row's tokens: its accepted drafts (those equal to the target's
        own choice at their position) and the target's next one, up to an EOS or a client's
        stop; tell the state machine what each accepted (``accept``); roll the batch's KV back
        to the tokens kept. Returns the accepted drafts by row."""
        width = len(toks[0])
        accepted, rejected = {}, []
        for rid, out in zip(self._rows, toks):
            proposed = drafts.get(rid, ())
            a = 0
            while a < len(proposed) and proposed[a] == out[a]:
                a += 1
            for j, t in enumerate(out[: a + 1]):
                if self._emit(rid, t):
                    if t in self.eos and rid not in self.no_eos:
                        self.stopped.add(rid)
                    a = j
                    if proposed:
                        state.accept(rid, a, len(proposed))
                    state.stop(rid)
                    break
            else:
                if proposed:
                    state.accept(rid, a, len(proposed))
            accepted[rid] = a
            self._kv[rid] += 1 + a
            rejected.append(width - 1 - a)
        self.stats["accepted_tokens"] = self.stats.get("accepted_tokens", 0) + sum(accepted.values())
        _rollback(self._batch, rejected)
        self._timed_copy(_cache_arrays(self._batch))
        return accepted

    # ------------------------------------------------------------------ draft model
    def use_draft(self, model: Any, cost: Any = None) -> None:
        """Propose drafts with a draft model (speculative decoding's ``draft`` method: the loop
        calls this for a policy that has one): ``model``, a loaded ``ModelInfo`` or what
        ``load_model`` takes (loaded at this model's dtype). ``cost``, its cost model, is a
        simulation's (the draft's passes are measured here). An ``EngineError`` (one line) unless it
        shares this model's vocabulary and keeps plain KV caches (its rejected drafts roll back)."""
        info = model if isinstance(model, ModelInfo) else _load_draft(str(model), self.info.dtype)
        check_draft(self.info, info)
        self.draft = info

    def _draft_propose(self, rows: Sequence[tuple[str, int]], by_id) -> dict[str, list[int]]:
        """Each ``(row, k)``'s k drafts from the draft model: its greedy tokens after the row's
        own, K batched decode steps of the draft over the rows (K: their most drafts; a row of
        fewer keeps its first ones). Each row's draft cache first catches up with the target's KV:
        a row new to the draft batch prefills what it lacks in a cache of its own and joins
        (``_draft_batch``); a row in it feeds what it lacks with its next token in the first step,
        the rows right-padded to the widest as a verify's are. One evaluation."""
        t0 = time.perf_counter()
        for rid, _ in rows:
            self._ids(by_id[rid])
        self._draft_batch([rid for rid, _ in rows])
        d, seq, kv, dkv = self.draft, self._seq, self._kv, self._dkv
        lags = [kv[rid] - dkv[rid] for rid in self._drows]
        width = 1 + max(lags)
        x = [seq[rid][dkv[rid] : kv[rid] + 1] + [0] * (width - 1 - lag) for rid, lag in zip(self._drows, lags)]
        h = d.hidden(mx.array(x, dtype=mx.uint32), self._dbatch)
        last = h[:, -1, :] if width == 1 else h[mx.arange(len(lags)), mx.array(lags)]
        tok = mx.argmax(d.head(last), axis=-1)
        if width > 1:
            _rollback(self._dbatch, [width - 1 - lag for lag in lags])  # (the padding's KV)
        steps = max(k for _, k in rows)
        toks = [tok]
        for _ in range(steps - 1):
            h = d.hidden(tok[:, None], self._dbatch)
            tok = mx.argmax(d.head(h[:, -1, :]), axis=-1)
            toks.append(tok)
        out = mx.stack(toks, axis=1)
        mx.eval(out, _cache_arrays(self._dbatch))
        for rid in self._drows:
            dkv[rid] = kv[rid] + steps  # its next token and all drafts but the last
        self._dsteps = steps
        self.stats["draft_forwards"] = self.stats.get("draft_forwards", 0) + steps
        self.stats["draft_s"] = self.stats.get("draft_s", 0.0) + time.perf_counter() - t0
        drafted = dict(zip(self._drows, out.tolist()))
        return {rid: drafted[rid][:k] for rid, k in rows}

    def _draft_batch(self, rids: Sequence[str]) -> None:
        """Make the draft batch's rows ``rids``: rows not drafting now leave it for caches of
        their own; rows joining it first prefill there the tokens of the target's KV their draft
        cache lacks (all of them at a row's first drafts), then are merged in (lazy). A row of
        the batch that lags more than ``DRAFT_LAG`` tokens (it decoded without drafts meanwhile:
        a pass with a sampled row) leaves and joins again so, not to pad every row to its lag."""
        stale = [rid for rid in self._drows if self._kv[rid] - self._dkv[rid] > DRAFT_LAG]
        if stale:
            self._draft_leave(stale, park=True)
        joining = self._regroup("_drows", rids, self._draft_leave)
        if not joining:
            return
        d = self.draft
        for rid in joining:
            caches = self._dcache.get(rid)
            if caches is None:
                caches = self._dcache[rid] = make_caches(d.model, d.n_layers)
                self._dkv[rid] = 0
            start, n = self._dkv[rid], self._kv[rid]
            if n > start:
                d.hidden(mx.array([self._seq[rid][start:n]], dtype=mx.uint32), caches)
                self._dkv[rid] = n
        own = [self._dcache.pop(rid) for rid in joining]
        merged = [_merge([c[layer] for c in own]) for layer in range(d.n_layers)]
        if self._dbatch is None:
            self._dbatch = merged
        else:
            for c, m in zip(self._dbatch, merged):
                c.extend(m)
        self._drows = self._drows + joining

    def _draft_leave(self, rids: Sequence[str], park: bool = False) -> None:
        """Remove rows from the draft batch; ``park`` keeps their draft KV in caches of their own."""
        gone = set(rids)
        keep = [i for i, rid in enumerate(self._drows) if rid not in gone]
        arrays = []
        for i, rid in enumerate(self._drows):
            if rid not in gone:
                continue
            if park:
                self._dcache[rid] = [c.extract(i) for c in self._dbatch]
                arrays += _cache_arrays(self._dcache[rid])
            else:
                self._dkv.pop(rid, None)
        if keep:
            for c in self._dbatch:
                c.filter(keep)
            arrays += _cache_arrays(self._dbatch)
        else:
            self._dbatch = None
        self._drows = [self._drows[i] for i in keep]
        self._timed_copy(arrays)

    def _draft_rollback(self, accepted: dict[str, int]) -> None:
        """After a verify, each draft batch row keeps the draft KV of the tokens the target kept:
        its next token and its accepted drafts (all but the last when it accepted every one)."""
        steps, rejected = self._dsteps, []
        for rid in self._drows:
            drop = steps - 1 - min(accepted.get(rid, 0), steps - 1)
            rejected.append(drop)
            self._dkv[rid] -= drop
        _rollback(self._dbatch, rejected)
        self._timed_copy(_cache_arrays(self._dbatch))
        self._dsteps = 0

    def _draft_drop(self, rid: str) -> None:
        """Forget request ``rid``'s draft KV (it finished, was preempted or cancelled)."""
        self._dcache.pop(rid, None)
        if rid in self._drows:
            self._draft_leave([rid])
        self._dkv.pop(rid, None)

    # ------------------------------------------------------------------ prefill
    def _chunk_graph(self, rid: str, n: int, r):
        """One chunk as its own forward over the request's own cache (lazy)."""
        caches = self._own_cache(rid)
        start = self._kv[rid]
        x = mx.array([self._ids(r)[start : start + n]], dtype=mx.uint32)
        h = self._hidden(x, caches)
        self._kv[rid] = start + n
        tok = None
        if start + n == r.prefill_target:  # the prompt is in: this pass yields a token
            tok = self._sample(self._head(h[:, -1, :]), [rid])
        return [rid], tok, _cache_arrays(caches)

    def _padded_graph(self, chunks: Sequence[tuple[str, int]], by_id):
        """One right-padded batched forward over several chunks (lazy)."""
        rids = [rid for rid, _ in chunks]
        ns = [n for _, n in chunks]
        caches = [self._own_cache(rid) for rid in rids]
        starts = [self._kv[rid] for rid in rids]
        longest = max(ns)
        rows = []
        for rid, n, s in zip(rids, ns, starts):
            ids = self._ids(by_id[rid])[s : s + n]
            rows.append(ids + [0] * (longest - n))
        x = mx.array(rows, dtype=mx.uint32)
        if not self.plain_kv:
            h, arrays = self._padded_generic(rids, ns, starts, caches, x)
        else:
            batch = [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(self.n_layers)]
            h = self._hidden(x, batch)
            # slice each row's real keys/values back into its own cache
            base = max(starts)
            arrays = []
            for i, (rid, n, s) in enumerate(zip(rids, ns, starts)):
                own = []
                for bc in batch:
                    kc = KVCache()
                    kc.keys = bc.keys[i : i + 1, :, base - s : base + n]
                    kc.values = bc.values[i : i + 1, :, base - s : base + n]
                    kc.offset = s + n
                    own.append(kc)
                self._cache[rid] = own
                self._kv[rid] = s + n
                arrays += _cache_arrays(own)
        done = [i for i, (rid, n, s) in enumerate(zip(rids, ns, starts)) if s + n == by_id[rid].prefill_target]
        tok = None
        if done:
            sel = h[mx.array(done), mx.array([ns[i] - 1 for i in done])]
            tok = self._sample(self._head(sel), [rids[i] for i in done])
        return [rids[i] for i in done], tok, arrays

    def _padded_generic(self, rids, ns, starts, caches, x):
        """The padded forward of a model with other cache kinds, as mlx-lm's prompt batch runs it:
        the rows' caches merged per layer, told each row's real length (``prepare``: a recurrent
        state does not advance over a row's right padding, a sliding window does not keep it),
        the forward, ``finalize`` (padding rolled out), then each row's cache extracted."""
        batch = [caches[0][layer].merge([c[layer] for c in caches]) for layer in range(self.n_layers)]
        longest = x.shape[1]
        if any(n != longest for n in ns):
            for c in batch:
                c.prepare(lengths=list(ns), right_padding=[longest - n for n in ns])
        h = self._hidden(x, batch)
        for c in batch:
            c.finalize()
        arrays = []
        for i, (rid, n, s) in enumerate(zip(rids, ns, starts)):
            own = [c.extract(i) for c in batch]
            self._cache[rid] = own
            self._kv[rid] = s + n
            arrays += _cache_arrays(own)
        return h, arrays

    # ------------------------------------------------------------------ warm-up
    def _warm_up(self, longest: int, light: bool = False) -> None:
        """Throwaway passes of representative shapes: allocation and first-call costs. ``light``:
        every kind of pass once at small shapes (a chunk, a padded batch, decode batches that grow,
        shrink and carry a chunk), the first-call costs without the allocations of large ones."""
        chunk = 16 if light else int(min(max(longest, 16), 1024))
        vocab = self.vocab
        rng = np.random.default_rng(12345)

        def _Fake(rid, prompt, output):  # a request of its own, never seen by the state machine
            return RequestState(Request(rid, 0.0, prompt, output), -1)

        saved = (self._batch, self._rows)
        self._batch, self._rows = None, []
        fakes = {}
        for i, n in enumerate((chunk, 12, 8) if light else (chunk, 96, 64, 48, 40, 32, 24, 16)):
            rid = f"\x00warm{i}"
            fakes[rid] = _Fake(rid, n + 1, 4)
            self._seq[rid] = rng.integers(0, vocab, n + 8).tolist()
            self.tokens[rid] = []
        ids = list(fakes)
        try:
            # an unpadded chunk (the longest prompt, capped), then a padded batch of chunks
            _, tok, arrays = self._chunk_graph(ids[0], chunk, fakes[ids[0]])
            mx.eval(arrays)
            rest = ids[1:]
            out = self._padded_graph([(rid, fakes[rid].prompt_tokens - 1) for rid in rest], fakes)
            mx.eval(out[2])
            # decode batches growing then shrinking: extend/filter and several batch sizes
            for k in (1, len(ids)) if light else (1, 2, 4, 8, len(ids)):
                (tok,) = self._decode_graph(ids[:k], fakes)
                mx.eval(tok, _cache_arrays(self._batch))
                for rid in self._rows:
                    self._kv[rid] += 1
                    self._emit(rid, 0)
            for k in (1,) if light else (4, 1):  # (light has 3 rows: leaving from the 4th would leave none)
                self._leave(self._rows[k:])
                (tok,) = self._decode_graph(self._rows, fakes)
                mx.eval(tok, _cache_arrays(self._batch))
                for rid in self._rows:
                    self._kv[rid] += 1
                    self._emit(rid, 0)
            # a mixed pass: decode + a completing chunk in one evaluation
            extra = "\x00warm-mixed"
            fakes[extra] = _Fake(extra, 33, 2)
            self._seq[extra] = rng.integers(0, vocab, 40).tolist()
            self.tokens[extra] = []
            (tok,) = self._decode_graph(self._rows, fakes)
            _, t2, arrays = self._chunk_graph(extra, 33, fakes[extra])
            mx.eval(tok, t2, arrays, _cache_arrays(self._batch))
            if self.draft is not None:  # the draft model's prefill, batch and steps
                self._draft_propose([(rid, 2) for rid in ids[:3]], fakes)
                self._dsteps = 0
        finally:
            for rid in fakes:
                if self.draft is not None:
                    self._draft_drop(rid)
                self._lp_lazy.pop(rid, None)
                self._seq.pop(rid, None)
                self.tokens.pop(rid, None)
                self._kv.pop(rid, None)
                self._cache.pop(rid, None)
            self._batch, self._rows = saved
            for key in (
                "forwards",
                "decode_rows",
                "prefill_tokens",
                "padded_prefill_tokens",
                "joins",
                "leaves",
                "parks",
            ):
                self.stats[key] = 0
            self.stats["copy_s"] = 0.0
            if self.draft is not None:
                self.stats["draft_forwards"], self.stats["draft_s"] = 0, 0.0


# ------------------------------------------------------------------------- reference


def ngram_drafts(ids: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """vLLM's n-gram prompt lookup: the up to ``k`` tokens that followed the latest earlier
    occurrence of the longest suffix of ``ids`` (``max_n`` down to ``min_n`` tokens) found
    before it; none when no suffix recurs."""
    n_ids = len(ids)
    for n in range(min(max_n, n_ids - 1), min_n - 1, -1):
        tail = list(ids[n_ids - n :])
        first = tail[0]
        for start in range(n_ids - n - 1, -1, -1):
            if ids[start] == first and list(ids[start : start + n]) == tail:
                return list(ids[start + n : start + n + k])
    return []


def reference_tokens(model_info: ModelInfo, prompt: Sequence[int], n: int) -> list[int]:
    """The model alone on ``prompt``: whole-prompt forward, then ``n`` greedy tokens.

    Uses the model's own mlx-lm caches (``make_cache``: plain KV, sliding windows, recurrent
    states) and its full ``__call__`` (logits for every position), batch of one: nothing of the
    engine's batching, chunking or head slicing.
    """
    model = model_info.model
    cache = make_caches(model, model_info.n_layers)
    logits = model(mx.array([list(prompt)], dtype=mx.uint32), cache=cache)
    out: list[int] = []
    for _ in range(n):
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        t = int(tok.item())
        out.append(t)
        if len(out) == n:
            break
        logits = model(mx.array([[t]], dtype=mx.uint32), cache=cache)
    return out
