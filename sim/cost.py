"""Cost models: seconds of a pass from its shape.

``LinearCostModel`` is a sum of named terms, each a coefficient times a feature of the
pass shape. The decode and prefill terms are separate (they were fitted apart best in a
probe: R^2 0.99): a pass with both runs both graphs in one evaluation and costs the sum.

Features (seconds per unit in the coefficients):

==============  =====================================================================
d_pass          1 when the pass has decode rows (dispatch floor of a decode forward)
d_multi         1 when the pass has 2+ decode rows (BLAS leaves its matrix-vector path:
                measured here, the second row costs 3x what each later one does)
d_rows          decode rows
d_few           min(rows, FEW_ROWS) - 1: the second to the fourth decode row each cost this more
                than later ones (measured here: 0.4-0.5 ms for `tiny`, ~5 ms for SmolLM2 on top
                of a later row's 0.1-0.2 ms / 1.8 ms; BLAS's small-matrix path)
d_kv            rows x longest context: attention over the left-padded batch cache
d_ctx           longest context: per-pass work that grows with the cache, not the rows
d_kv_long       rows x (longest context - KV_KNEE), where positive: attention per token of cache
                costs more past a few hundred tokens (measured here for `tiny`: 0.5 us per row x
                token below, 1.1 us above); linear beyond, so long contexts extrapolate linearly
c_join0         1 when rows join the batch cache (merge / extend: fixed part)
c_join          rows after x longest context, when rows join (the batch cache allocated at the
                longest row and zero-filled)
c_join_row      rows joining (per-row work of a join: each row's own cache read and freed)
c_join_ctx      the joining rows' contexts, summed (merging their caches copies each row's own
                length: far below rows x longest when the prompts are heavy-tailed)
c_extend        rows after x longest context, when rows join a batch that already holds rows
                (extend: the batch and the merged newcomers are padded and concatenated; measured
                here at ~2x a merge of the same rows x context)
c_leave0        1 when rows leave the batch cache (filter: fixed part)
c_leave         rows kept x longest context, when rows leave (the copy)
c_leave_row     rows leaving (per-row work of a leave)
p_pass          prefill forwards (1 when padded, else one per chunk)
p_tokens        prefill tokens computed (rows x longest chunk when padded)
p_attn          sum of chunk x (context + chunk): prompt attention (rows x max when padded)
p_ctx           sum of chunk contexts: reading (and regrowing) a chunk's cache
p_done0         chunks that complete their prompt (head and sampling of the first token)
p_done          tokens of chunks that complete their prompt (the last layer runs in full
                for them; rows x longest when padded and any row completes)
p_done_attn     chunk x (context + chunk) of completing chunks (the last layer's attention)
p_small         each chunk's first PREFILL_SMALL tokens (rows x that when padded): a short chunk
                costs more per token than a long one (BLAS's small-matrix path; measured here for
                SmolLM2: 1 -> 16 tokens 3.6 ms per token, 16 -> 64 1.4 ms), which a line through
                the long chunks under-prices (short chat prompts ran 1.04-1.3x their prediction)
v_pass          1 when decode rows verify drafts (speculative decoding: the wider forward's fixed extra)
v_tokens        rows x most drafts of a row: the draft positions computed (the engine right-pads every
                row to the widest: k + 1 positions each)
v_attn          rows x most drafts x longest context: those positions' attention over the batch cache
s_step          1 per step (the scheduler loop's own overhead)
s_pass          passes in the step (the loop's work per pass: shape, state update, timing)
s_row           decode rows + prefill chunks in the step (bookkeeping per row)
i_wake          1 per wake: seconds from an arrival to the step it wakes an idle replica for
                (a wall clock's wake-up latency; charged before the step, not in it)
i_step          1 when the step follows a wait for an arrival (the replica sat idle: caches
                and threads are cold)
i_gap           min(idle seconds, IDLE_CAP_S) before such a step
i_after         the steps after that one: 0.5^(k-1) for the k-th step after the wake, k = 1 ..
                AFTER_WAKE_STEPS (a machine that sat idle runs its next passes slower for a while:
                measured here for `tiny`, lone decode steps 1.19-1.26x / 1.11-1.19x / ~1.07x their
                prediction one, two, three to five steps after a wake)
==============  =====================================================================

The v_ terms are what a verify pass costs beyond the decode pass of the same rows: ``calibrate``
times the two alternately at each grid point and fits the v_ terms to the difference. A profile
without them (measured before they existed) has verify passes priced by ``verify_seconds``' padded
prefill approximation instead (``prices_drafts`` False).

The pass terms are charged per pass (``pass_seconds``), the s_ terms per step
(``step_overhead_seconds``), the i_ terms once per wake of an idle replica (``idle_seconds``:
the loop calls it only then, so steps that run back to back never pay them) and on the few
steps after it (``after_wake_seconds``; only when ``i_after`` is not 0: ``has_after_wake``).
These are ``policies.base.CostModel``'s methods, which both models here implement.

Profiles are JSON written by ``calibrate``; a shipped profile is always measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from schedlab.policies.base import CostModel, PassShape, as_cost_model

from .layout import CacheLayout, LayoutError

PASS_FEATURES = (
    "d_pass",
    "d_multi",
    "d_rows",
    "d_kv",
    "d_ctx",
    "d_few",
    "d_kv_long",
    "c_join0",
    "c_join",
    "c_join_row",
    "c_join_ctx",
    "c_extend",
    "c_leave0",
    "c_leave",
    "c_leave_row",
    "p_pass",
    "p_tokens",
    "p_attn",
    "p_ctx",
    "p_done0",
    "p_done",
    "p_done_attn",
    "p_small",
    "v_pass",
    "v_tokens",
    "v_attn",
)
VERIFY_TERMS = ("v_pass", "v_tokens", "v_attn")
STEP_FEATURES = ("s_step", "s_pass", "s_row")
IDLE_FEATURES = ("i_wake", "i_step", "i_gap", "i_after")
IDLE_STEP_FEATURES = ("i_step", "i_gap")  # the ones charged inside the step (i_wake comes before it)
IDLE_CAP_S = 1.0  # idle seconds beyond this add nothing more (i_gap)
AFTER_WAKE_STEPS = 5  # i_after: the steps after a wake that pay it (halving from the first)
FEW_ROWS = 4  # d_few: rows up to this many cost extra
KV_KNEE = 512  # d_kv_long: context tokens per row past which attention costs extra
DECODE_SHAPE_TERMS = ("d_few", "d_kv_long")  # fitted only where the grid's held-out points show them
PREFILL_SMALL = 16  # p_small: a chunk's tokens up to this many cost extra
PREFILL_SHAPE_TERMS = ("p_small",)  # the same, for the prefill terms
SHAPE_TERMS = DECODE_SHAPE_TERMS + PREFILL_SHAPE_TERMS
FEATURES = PASS_FEATURES + STEP_FEATURES + IDLE_FEATURES
PROFILE_SCHEMA = "schedlab-profile/1"
DEFAULT_KV_TOKENS = (
    262_144  # KV capacity when neither --kv-tokens nor the profile gives one (a setting, not a measurement)
)


class ProfileError(ValueError):
    """A profile file that cannot be used; one line for the user."""


def pass_features(s: PassShape) -> dict[str, float]:
    """Each term's feature value for pass ``s``. There is one cost formula,
    ``LinearCostModel.pass_seconds``: with a coefficient of 1 on one term and 0 on the others
    it returns exactly that term's feature (the model is linear), so the fit and the
    prediction cannot disagree."""
    return {k: m.pass_seconds(s) for k, m in _unit_models().items()}


def shape_features(rows: int, longest: int, chunks: int, tokens: int, padded: bool) -> dict[str, float]:
    """``SHAPE_TERMS``' features of a pass of ``rows`` decode rows whose longest context is
    ``longest`` and ``chunks`` prefill chunks of ``tokens`` tokens computed (rows x the longest
    chunk when ``padded``), from ``pass_seconds`` as ``pass_features`` does. For samples and
    step tables recorded before these terms existed, which keep only those counts: exact for
    one decode pass and one chunk or one padded pass per step (every bundled policy's steps);
    several unpadded chunks are taken as of one size."""
    n = max(1, round(tokens / chunks)) if chunks > 0 and tokens > 0 else 0
    s = PassShape(
        decode_contexts=(int(longest),) * max(int(rows), 0),
        prefill=((n, 0),) * int(chunks) if n else (),
        padded=bool(padded) and n > 0,
    )
    return {k: _unit_models()[k].pass_seconds(s) for k in SHAPE_TERMS}


def step_features(n_passes: int, n_rows: int) -> dict[str, float]:
    """The step-overhead terms' features, from ``step_overhead_seconds`` in the same way."""
    return {k: _unit_models(STEP_FEATURES)[k].step_overhead_seconds(n_passes, n_rows) for k in STEP_FEATURES}


def idle_features(idle_s: float) -> dict[str, float]:
    """The after-idle terms' features of a step that followed ``idle_s`` seconds of waiting
    (the part charged inside the step, ``idle_seconds``'s second value), the same way."""
    return {k: _unit_models(IDLE_STEP_FEATURES)[k].idle_seconds(idle_s)[1] for k in IDLE_STEP_FEATURES}


def after_wake_features(k: int) -> dict[str, float]:
    """``i_after``'s feature for the ``k``-th step after a wake (``after_wake_seconds``)."""
    return {"i_after": _unit_models(("i_after",))["i_after"].after_wake_seconds(k)}


_UNIT: dict[tuple[str, ...], dict[str, "LinearCostModel"]] = {}


def _unit_models(keys: tuple[str, ...] = PASS_FEATURES) -> dict[str, "LinearCostModel"]:
    if keys not in _UNIT:
        _UNIT[keys] = {k: LinearCostModel({k: 1.0}) for k in keys}
    return _UNIT[keys]


@dataclass
class LinearCostModel(CostModel):
    """Seconds = sum of coefficient x feature: a ``policies.base.CostModel`` with every term,
    its decode runs a formula (``decode_run_seconds``)."""

    has_run_formula = True

    coefficients: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ProfileError(f"unknown cost coefficient(s): {', '.join(sorted(unknown))}")
        for k, v in self.coefficients.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ProfileError(f"cost coefficient {k} must be a finite number, got {v!r}")
        c = self.coefficients
        # unpacked once: pass_seconds is the simulator's hot path
        self._d = tuple(float(c.get(k, 0.0)) for k in PASS_FEATURES)
        self._s_step = float(c.get("s_step", 0.0))
        self._s_pass = float(c.get("s_pass", 0.0))
        self._s_row = float(c.get("s_row", 0.0))
        self._idle = tuple(float(c.get(k, 0.0)) for k in IDLE_FEATURES[:3])
        self._after = float(c.get("i_after", 0.0))
        self.has_after_wake = bool(self._after)
        self.prices_drafts = any(self._d[-len(VERIFY_TERMS) :])  # else: policies.base.verify_seconds
        try:  # a profile of a model with sliding-window or recurrent layers (``calibrate`` records it)
            self.cache_layout = CacheLayout.from_dict(self.meta.get("cache_layout"))
        except LayoutError as exc:
            raise ProfileError(f"profile: {exc}") from None

    def pass_seconds(self, s: PassShape) -> float:
        (
            d_pass,
            d_multi,
            d_rows,
            d_kv,
            d_ctx,
            d_few,
            d_kv_long,
            c_join0,
            c_join,
            c_join_row,
            c_join_ctx,
            c_extend,
            c_leave0,
            c_leave,
            c_leave_row,
            p_pass,
            p_tokens,
            p_attn,
            p_ctx,
            p_done0,
            p_done,
            p_done_attn,
            p_small,
            v_pass,
            v_tokens,
            v_attn,
        ) = self._d
        t = 0.0
        ctx = s.decode_contexts
        if ctx:
            rows = len(ctx)
            longest = max(ctx)
            kv = rows * longest
            t += d_pass + d_rows * rows + d_kv * kv + d_ctx * longest
            if rows > 1:
                t += d_multi + d_few * (min(rows, FEW_ROWS) - 1)
            if longest > KV_KNEE:
                t += d_kv_long * rows * (longest - KV_KNEE)
            if s.joins:
                t += c_join0 + c_join * kv + c_join_row * s.joins + c_join_ctx * s.join_context
                if rows > s.joins:
                    t += c_extend * kv
            if s.leaves:
                kept = max(s.batch_rows_before + s.joins - s.leaves, 0)
                t += c_leave0 + c_leave * kept * longest + c_leave_row * s.leaves
            if s.decode_drafts:
                k = max(s.decode_drafts)
                if k:
                    t += v_pass + v_tokens * rows * k + v_attn * rows * k * longest
        if s.prefill:
            if s.padded:
                n = max(c for c, _ in s.prefill)
                ctx0 = max(b for _, b in s.prefill)
                rows = len(s.prefill)
                t += p_pass + p_tokens * rows * n + p_attn * rows * n * (ctx0 + n) + p_ctx * rows * ctx0
                if p_small:
                    t += p_small * rows * min(n, PREFILL_SMALL)
                if any(s.prefill_done):
                    t += p_done0 + p_done * rows * n + p_done_attn * rows * n * (ctx0 + n)
            else:
                for c, b in s.prefill:
                    t += p_pass + p_tokens * c + p_attn * c * (b + c) + p_ctx * b
                    if p_small:
                        t += p_small * min(c, PREFILL_SMALL)
                for (c, b), d in zip(s.prefill, s.prefill_done):
                    if d:
                        t += p_done0 + p_done * c + p_done_attn * c * (b + c)
        return t

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return self._s_step + self._s_pass * n_passes + self._s_row * n_rows

    def idle_seconds(self, idle_s: float) -> tuple[float, float]:
        """(seconds from the arrival to the step, extra seconds of that step) when an arrival
        wakes a replica that sat idle for ``idle_s`` seconds."""
        i_wake, i_step, i_gap = self._idle
        return i_wake, i_step + i_gap * min(idle_s, IDLE_CAP_S)

    def after_wake_seconds(self, k: int) -> float:
        """Extra seconds of the ``k``-th step after a wake (the wake's own step is k = 0 and pays
        ``idle_seconds``): ``i_after`` x 0.5^(k-1) for k = 1 .. AFTER_WAKE_STEPS, else 0."""
        return self._after * 0.5 ** (k - 1) if 1 <= k <= AFTER_WAKE_STEPS else 0.0

    def decode_run_seconds(self, s: PassShape, k: int) -> Iterator[float]:
        """``pass_seconds`` of the ``k`` decode passes that follow ``s`` over the same rows, each
        context one longer each time, nothing joining or leaving: the same terms in the same
        order, so a run of steps costs exactly what planning them one by one would. Lazy: the
        loop stops taking them at the first arrival."""
        d_pass, d_multi, d_rows, d_kv, d_ctx, d_few, d_kv_long = self._d[:7]
        rows = len(s.decode_contexts)
        base = d_pass + d_rows * rows  # evaluated first in pass_seconds as well
        multi = d_multi + d_few * (min(rows, FEW_ROWS) - 1) if rows > 1 else None
        first = max(s.decode_contexts) + 1
        out = (base + d_kv * (rows * longest) + d_ctx * longest for longest in range(first, first + k))
        if multi is not None:
            out = (t + multi for t in out)
        if d_kv_long:
            out = (
                t + d_kv_long * rows * (longest - KV_KNEE) if longest > KV_KNEE else t
                for t, longest in zip(out, range(first, first + k))
            )
        return out

    # ------------------------------------------------------------------ profiles
    @classmethod
    def from_profile(cls, path: str | Path) -> "LinearCostModel":
        data = read_profile(path)
        return cls(dict(data["coefficients"]), meta={k: v for k, v in data.items() if k != "coefficients"})


class ScaledCostModel(CostModel):
    """Another cost model with every second multiplied by ``factor``: the same machine running
    faster or slower as a whole (``validate``'s drift-adjusted simulation uses the measured
    speed of the machine during the real runs). Its decode runs: ``pass_seconds`` pass by pass
    (the default)."""

    def __init__(self, base: Any, factor: float):
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"scale factor must be a positive number, got {factor!r}")
        self.base, self.factor = as_cost_model(base), float(factor)
        self.meta = getattr(base, "meta", {})
        self.has_after_wake = self.base.has_after_wake
        self.prices_drafts = self.base.prices_drafts
        self.cache_layout = self.base.cache_layout

    def pass_seconds(self, s: PassShape) -> float:
        return self.factor * self.base.pass_seconds(s)

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return self.factor * self.base.step_overhead_seconds(n_passes, n_rows)

    def idle_seconds(self, idle_s: float) -> tuple[float, float]:
        w, extra = self.base.idle_seconds(idle_s)
        return self.factor * w, self.factor * extra

    def after_wake_seconds(self, k: int) -> float:
        return self.factor * self.base.after_wake_seconds(k)


def read_profile(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ProfileError(f"profile {path} is a directory, not a profile JSON (calibrate --out writes one)")
    if not p.is_file():
        raise ProfileError(f"profile not found: {path}")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"profile {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
        raise ProfileError(f"profile {path} has no 'coefficients' object")
    if data.get("schema", PROFILE_SCHEMA) != PROFILE_SCHEMA:
        raise ProfileError(f"profile {path} has schema {data.get('schema')!r}, expected {PROFILE_SCHEMA}")
    for k, v in data["coefficients"].items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ProfileError(f"profile {path}: cost coefficient {k} must be a finite number >= 0, got {v!r}")
    if "kv_tokens" in data:
        kv = data["kv_tokens"]
        if not isinstance(kv, (int, float)) or isinstance(kv, bool) or not math.isfinite(kv) or kv != int(kv) or kv < 1:
            raise ProfileError(f"profile {path}: kv_tokens must be an integer >= 1, got {kv!r}")
        data["kv_tokens"] = int(kv)
    return data


# ---------------------------------------------------------------------- fitting


def nnls(a, b, max_iter: int | None = None):
    """Non-negative least squares (Lawson-Hanson active set), numpy only."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= ~(np.abs(x) < tol)
            passive &= x > 0
        w = a.T @ (b - a @ x)
    return x


def fit_linear(
    rows: Sequence[Mapping[str, float]],
    seconds: Sequence[float],
    names: Sequence[str],
    *,
    relative: bool = True,
    scale_by: Sequence[float] | None = None,
) -> dict[str, float]:
    """Fit non-negative coefficients for ``names`` to measured seconds.

    ``relative`` weights each sample by 1/seconds, so a 5 ms decode step counts as much as
    a 2 s prefill (we care about percent error per step, not absolute seconds). When the
    targets are residuals (a part of a pass whose other part is already fitted), give the
    whole pass's seconds as ``scale_by``: a residual can be near zero or negative.
    """
    import numpy as np

    if len(rows) != len(seconds) or not rows:
        raise ValueError("fit needs one or more (features, seconds) samples")
    a = np.array([[float(r.get(k, 0.0)) for k in names] for r in rows])
    y = np.asarray(seconds, dtype=float)
    ref = np.asarray(scale_by if scale_by is not None else seconds, dtype=float)
    if relative and np.any(ref <= 0):
        raise ValueError("relative fit needs positive seconds")
    w = 1.0 / ref if relative else np.ones_like(y)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns to unit scale
    x = nnls(a / scale * w[:, None], y * w)
    return {k: float(v / s) for k, v, s in zip(names, x, scale)}
