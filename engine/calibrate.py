"""``calibrate``: time real passes over a grid and fit the simulator's cost model.

Every timed pass goes through the same code as a real run: a ``ReplicaState`` checks the
pass and describes its shape, ``MLXBackend.execute`` runs it (graph build, one
``mx.eval``, batch-cache copies, bookkeeping), and the state advances. Long contexts are
set up with ``MLXBackend.prime`` (KV of the right shape without a forward: timing depends
on shapes, not values), so the grid reaches 4k-token contexts in seconds.

Groups, each fitted apart (decode and prefill terms fitted apart fit best here):

- decode: steady batched decode passes, batch x context grid -> d_pass, d_rows, d_kv
- join / leave: the first pass of a batch (rows join from nothing: merge; half the batches
  heavy-tailed), newcomers joining it (extend) and a pass where rows finish (filter) ->
  c_join, c_join_row, c_join_ctx, c_extend, c_leave, on top of the decode terms
- prefill: one chunk (size x context grid), and padded multi-prompt passes -> p_pass,
  p_tokens, p_attn
- step: the real loop (``sim.loop.run_replica`` with the MLX backend on a small trace, several
  policies): step wall time minus the passes' time -> s_step, s_row
- mixed: decode rows + a prefill chunk in one pass: never fitted, only checked

A quarter of each group's grid points (seeded draw) is held out of the fit; the fit report
gives R^2 on the fitted points and median / max absolute % error on the held-out ones.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import random
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from schedlab.policies import make_policy
from schedlab.policies.base import Pass, Plan
from schedlab.sim.cost import DEFAULT_KV_TOKENS, PROFILE_SCHEMA, LinearCostModel, pass_features, step_features
from schedlab.analysis.fit import fit_profile, fit_verify, merge_rounds, report_markdown
from schedlab.analysis.samples import Sample
from schedlab.sim import run_replica as run_loop
from schedlab.sim.state import ReplicaState
from schedlab.traces.schema import Request

from .backend import MLXBackend
from .models import ModelInfo
from .noise import Noise, allocator_settings


def _verify_grid(rows: Sequence[int], contexts: Sequence[int], ks: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    return tuple((b, c, k) for b in rows for c in contexts for k in ks)


@dataclass
class Grid:
    name: str
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_reps: int
    prefill_chunks: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    prefill_reps: int
    max_attention: int  # cap on chunk x (context + chunk) for the prefill grid
    padded: tuple[tuple[int, int, int], ...]  # (rows, longest chunk, context)
    mixed: tuple[tuple[int, int, int, int], ...]  # (decode rows, their context, chunk, chunk context)
    loop_requests: int
    loop_policies: tuple[str, ...]
    rounds: int = 3  # every point is measured once per round; rounds are spread over the run
    max_decode_kv: int = 10**9  # skip decode points with batch x context above this
    # verify passes (speculative decoding), (rows, context, drafts per row): a model whose
    # caches cannot roll back drafts (recurrent state) skips them
    verify: tuple[tuple[int, int, int], ...] = ()


GRIDS = {
    "default": Grid(
        name="default",
        decode_batches=(1, 2, 3, 4, 8, 16, 32, 64),
        decode_contexts=(40, 300, 1000, 2500),
        decode_reps=3,
        prefill_chunks=(1, 16, 64, 256, 1024, 2048),
        prefill_contexts=(0, 300, 1000, 2500),
        prefill_reps=1,
        max_attention=2048 * 2100,
        padded=((2, 64, 0), (4, 256, 0), (8, 32, 500), (3, 512, 300), (6, 96, 1000), (2, 1024, 0)),
        mixed=((4, 256, 128, 0), (16, 512, 256, 0), (8, 1000, 512, 300), (32, 150, 64, 0)),
        loop_requests=16,
        loop_policies=("mlx-default", "unified"),
        # 5 rounds: on a 2-core VM whose speed drifts by +-30 % between spells (seen here,
        # with no steal time reported), a median over 3 rounds still caught a slow spell
        rounds=5,
        max_decode_kv=64 * 1000,
        verify=_verify_grid((1, 2, 4, 16), (60, 600), (1, 2, 4)),
    ),
    "quick": Grid(
        name="quick",
        decode_batches=(1, 2, 4, 16, 48),
        decode_contexts=(60, 600, 2100),
        decode_reps=3,
        prefill_chunks=(1, 32, 128, 512, 1024),
        prefill_contexts=(0, 500, 2100),
        prefill_reps=1,
        max_attention=1024 * 1600,
        padded=((2, 64, 0), (4, 256, 0), (8, 64, 300), (3, 512, 0)),
        mixed=((4, 256, 128, 0), (16, 512, 256, 0), (8, 1000, 64, 500)),
        loop_requests=12,
        loop_policies=("mlx-default",),
        rounds=2,
        max_decode_kv=48 * 2100,
        verify=_verify_grid((1, 4), (60, 600), (1, 4)),
    ),
    # Models ~100M parameters and up (SmolLM2-135M: a 512-token chunk ~1.7 s, a decode step
    # 50-130 ms on 2 cores): the shapes real runs of them reach, in a few minutes.
    "compact": Grid(
        name="compact",
        decode_batches=(1, 2, 4, 8, 16),
        decode_contexts=(40, 300, 1000),
        decode_reps=2,
        prefill_chunks=(1, 16, 64, 256, 512),
        prefill_contexts=(0, 300, 1000),
        prefill_reps=1,
        max_attention=512 * 1600,
        padded=((2, 64, 0), (4, 128, 0), (3, 256, 300)),
        mixed=((4, 256, 64, 0), (8, 300, 128, 0)),
        loop_requests=6,
        loop_policies=("mlx-default",),
        rounds=3,
        max_decode_kv=16 * 1000,
        verify=_verify_grid((1, 2, 4, 8), (40, 600), (1, 2, 4)),
    ),
}
COMPACT_ABOVE_PARAMS = 50_000_000  # models this large calibrate on the compact grid


def grid_for(info: ModelInfo, quick: bool = False) -> Grid:
    """The grid a model is calibrated on: the compact one for large models (the default and
    quick grids would take most of an hour on 2 cores), else quick or default."""
    if info.n_params > COMPACT_ABOVE_PARAMS:
        return GRIDS["compact"]
    return GRIDS["quick" if quick else "default"]


class Rig:
    """A state machine and the MLX backend, driven pass by pass as the loop drives them."""

    def __init__(self, info: ModelInfo, seed: int = 0):
        self.backend = MLXBackend(info, seed=seed, warmup=False, ignore_eos=True)  # timing: run to max_tokens
        self.n = 0

    def scenario(self, specs: Sequence[tuple[int, int]]) -> tuple[ReplicaState, list[str]]:
        reqs = []
        for prompt, output in specs:
            self.n += 1
            reqs.append(Request(f"cal{self.n}", 0.0, prompt, output))
        state = ReplicaState(reqs, 10**9, "calibrate")
        for r in state.accepted:
            state.arrive(r)
        for r in state.requests:
            self.backend.tokens.setdefault(r.id, [])
        return state, [r.id for r in reqs]

    def admit(self, state: ReplicaState, ids: Iterable[str], prime: int = 0) -> None:
        ids = list(ids)
        state.apply_admin(Plan(admit=tuple(ids)), 0.0)
        if prime:
            for rid in ids:
                r = state.by_id[rid]
                self.backend.prime(r, prime)
                state.apply_pass(Pass(prefill=((rid, prime),)), 0.0)

    def timed(self, state: ReplicaState, p: Pass) -> tuple[dict[str, float], float]:
        shape = state.shape(p)
        dt = self.backend.execute(p, shape, state)
        for r in state.apply_pass(p, 0.0):
            self.backend.release(r)
        state.step_index += 1
        return pass_features(shape), dt

    def close(self, state: ReplicaState) -> None:
        for r in state.requests:
            if r.phase.value != "finished":
                self.backend.release(r)
            self.backend.tokens.pop(r.id, None)


def _median_sample(group: str, label: str, runs: list[tuple[dict, float]]) -> Sample:
    secs = [dt for _, dt in runs]
    med = statistics.median(secs)
    feats = min(runs, key=lambda fr: abs(fr[1] - med))[0]  # features of the median run
    return Sample(group, label, feats, med, secs)


# ---------------------------------------------------------------------- measurements


def batch_contexts(batch: int, ctx: int, skewed: bool = False) -> list[int]:
    """The grid's batch of ``batch`` rows up to ``ctx`` tokens: contexts within 75-100 % of
    ``ctx``; ``skewed``: one row at ``ctx``, the others at 1/8-3/8 of it."""
    if skewed:
        return [ctx] + [max(2, ctx // 8 + (i * 37) % max(1, ctx // 4)) for i in range(1, batch)]
    return [ctx - (i * 37) % max(1, ctx // 4) for i in range(batch)]


DECODE_WARM = 5  # untimed passes between a batch forming and its steady passes


def measure_decode(
    rig: Rig, batch: int, ctx: int, reps: int, skewed: bool = False, warm: int = DECODE_WARM
) -> list[Sample]:
    """A batch forms (rows join from nothing: merge), decodes ``warm`` passes untimed, then
    ``reps`` steady passes, takes in newcomers (extend), then half its rows finish (filter):
    one sample of each.

    The passes right after a batch forms run slower than the ones that follow (measured here
    on `tiny`, 14 passes after the join, medians of 3: the first three 1.04-1.15x the ones from
    the seventh on, by the fifth within a few %); a request decodes for tens to hundreds of
    steps, most of them past that, so the steady sample skips them.

    The rows' contexts lie within 75-100 % of ``ctx``; ``skewed``: one row at ``ctx``, the
    others at 1/8-3/8 of it, as heavy-tailed prompts make them. A merge copies each row's own
    length but allocates rows x longest: only both kinds of batch tell the two costs apart."""
    newcomers = max(1, batch // 8)
    finish_at = warm + reps + 3  # join, warm, reps steady, extend, then the leave pass
    specs = [(n, finish_at if i % 2 == 0 else finish_at + 3) for i, n in enumerate(batch_contexts(batch, ctx, skewed))]
    specs += [(max(2, ctx // 2 + 1), finish_at + 3)] * newcomers
    state, ids = rig.scenario(specs)
    base, new = ids[:batch], ids[batch:]
    for rid in ids:
        rig.admit(state, [rid], prime=state.by_id[rid].prompt_tokens - 1)
    label = f"B={batch} C={ctx}" + (" skewed" if skewed else "")
    join = rig.timed(state, Pass(decode=tuple(base)))  # hand-off: the batch forms (merge)
    for _ in range(warm):
        rig.timed(state, Pass(decode=tuple(base)))
    steady = [rig.timed(state, Pass(decode=tuple(base))) for _ in range(reps)]
    extend = rig.timed(state, Pass(decode=tuple(base + new)))  # newcomers join (extend)
    leave = rig.timed(state, Pass(decode=tuple(base + new)))  # even base rows finish: filter
    rig.close(state)
    return [
        Sample("join", label + " merge", join[0], join[1], [join[1]]),
        _median_sample("decode", label, steady),
        Sample("join", f"{label} +{newcomers}", extend[0], extend[1], [extend[1]]),
        Sample("leave", label, leave[0], leave[1], [leave[1]]),
    ]


def measure_prefill(rig: Rig, chunk: int, ctx: int, reps: int, completes: bool = False) -> Sample:
    """One chunk at a context; ``completes``: it is the prompt's last chunk (yields a token)."""
    runs = []
    for _ in range(reps):
        state, (rid,) = rig.scenario([(ctx + chunk + (0 if completes else 1), 2)])
        rig.admit(state, [rid], prime=ctx)
        runs.append(rig.timed(state, Pass(prefill=((rid, chunk),))))
        rig.close(state)
    return _median_sample("prefill", f"n={chunk} c={ctx}" + (" done" if completes else ""), runs)


def measure_padded(rig: Rig, rows: int, longest: int, ctx: int, reps: int, completes: bool = False) -> Sample:
    runs = []
    rng = random.Random(rows * 1_000_003 + longest * 1009 + ctx)  # same shapes in every round
    for _ in range(reps):
        chunks = [longest] + [rng.randint(max(1, longest // 4), longest) for _ in range(rows - 1)]
        ctxs = [ctx] + [rng.choice((0, ctx)) for _ in range(rows - 1)]
        state, ids = rig.scenario([(c + n + (0 if completes else 1), 2) for n, c in zip(chunks, ctxs)])
        state.apply_admin(Plan(admit=tuple(ids)), 0.0)
        for rid, c in zip(ids, ctxs):
            if c:
                rig.backend.prime(state.by_id[rid], c)
                state.apply_pass(Pass(prefill=((rid, c),)), 0.0)
        runs.append(rig.timed(state, Pass(prefill=tuple(zip(ids, chunks)), padded=True)))
        rig.close(state)
    return _median_sample("padded", f"rows={rows} n<={longest} c={ctx}" + (" done" if completes else ""), runs)


def measure_mixed(rig: Rig, batch: int, ctx: int, chunk: int, cctx: int, reps: int, completes: bool = False) -> Sample:
    state, ids = rig.scenario([(ctx, reps + 4)] * batch + [(cctx + chunk + (0 if completes else 1), 2)] * reps)
    dec, pre = ids[:batch], ids[batch:]
    rig.admit(state, dec, prime=ctx - 1)
    rig.timed(state, Pass(decode=tuple(dec)))  # join first: the mixed passes are steady
    runs = []
    for rid in pre:
        rig.admit(state, [rid], prime=cctx)
        runs.append(rig.timed(state, Pass(decode=tuple(dec), prefill=((rid, chunk),))))
    rig.close(state)
    return _median_sample("mixed", f"B={batch} C={ctx} + n={chunk} c={cctx}" + (" done" if completes else ""), runs)


def measure_verify(rig: Rig, batch: int, ctx: int, k: int, reps: int, warm: int = 3) -> list[Sample]:
    """A batch of ``batch`` rows near ``ctx`` (``batch_contexts``) forms and decodes ``warm``
    passes untimed; then ``reps`` times a plain decode pass of its rows and a verify pass of the
    same rows, ``k`` drafts each (speculative decoding: k + 1 positions per row, the rejected
    ones rolled back), alternately: the sample ``verify`` and its pair ``verify_base`` (the
    plain passes), which the fit subtracts (the v_ terms are what verifying adds to the decode
    pass of the same rows, timed in the same seconds of the machine's drift).

    The drafts are the row's last token repeated: what a verify costs depends on how many
    positions it computes, not on whether they are accepted, except for the roll-back, which
    here rejects all of them in every row (one trim; rows accepting different numbers also
    re-justify the batch, a copy the c_ terms' size: not in the v_ terms)."""
    specs = [(n, warm + 1 + (reps + 1) * (k + 2) + 2) for n in batch_contexts(batch, ctx)]
    state, ids = rig.scenario(specs)
    for rid in ids:
        rig.admit(state, [rid], prime=state.by_id[rid].prompt_tokens - 1)
    backend = rig.backend
    seq = backend.tokens
    backend.given_drafts = lambda p, st: {rid: [seq[rid][-1]] * d for rid, d in zip(p.decode, p.draft) if d}
    try:
        for i in range(warm + 1):  # the batch forms (merge), then steady passes, the last a verify
            # (from the first verify on, a sliding window's layers keep their verify form: both
            # timed passes below run on it)
            rig.timed(state, Pass(decode=tuple(ids), draft=(k,) * batch if i == warm else ()))
        plain, verify = [], []
        for _ in range(reps):
            plain.append(rig.timed(state, Pass(decode=tuple(ids))))
            verify.append(rig.timed(state, Pass(decode=tuple(ids), draft=(k,) * batch)))
    finally:
        backend.given_drafts = None
    rig.close(state)
    label = f"B={batch} C={ctx} k={k}"
    return [_median_sample("verify", label, verify), _median_sample("verify_base", label, plain)]


class _StepRecorder:
    """Wraps the backend in a real loop run: the passes' own time per step."""

    def __init__(self, backend: MLXBackend):
        self.b = backend
        self.acc = 0.0
        self.per_step: list[float] = []

    def __getattr__(self, name):  # everything else is the backend's
        return getattr(self.b, name)

    def execute(self, p, shape, state):
        dt = self.b.execute(p, shape, state)
        self.acc += dt
        return dt

    def on_step(self, state):
        self.per_step.append(self.acc)
        self.acc = 0.0


def loop_trace(n: int, seed: int) -> list[Request]:
    """A small busy trace: chat-sized prompts arriving faster than they are served."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(8.0)
        reqs.append(Request(f"loop{seed}-{i}", round(t, 4), rng.randint(16, 192), rng.randint(8, 40)))
    return reqs


def measure_step_overhead(info: ModelInfo, grid: Grid, seed: int) -> list[Sample]:
    """Step wall time minus pass time in the real loop: planning, state, SimPy, clock."""
    samples = []
    for k, name in enumerate(grid.loop_policies):
        rec = _StepRecorder(MLXBackend(info, seed=seed, ignore_eos=True))
        reqs = loop_trace(grid.loop_requests, seed + k)
        res = run_loop(
            reqs,
            make_policy(name),
            LinearCostModel({}),
            kv_capacity=10**9,
            backend=rec,
            trace_name="calibrate-loop",
            on_step=rec.on_step,
        )
        if res.error:
            raise RuntimeError(res.error)
        per_step: dict[int, list] = {}
        for s, _, _, _, p in res.passes:
            per_step.setdefault(s, []).append(p)
        for st, passes_s in zip(res.steps, rec.per_step):
            ps = per_step.get(st.index, [])
            over = st.measured_s - passes_s
            feats = step_features(len(ps), sum(len(p.decode) + len(p.prefill) for p in ps))
            samples.append(Sample("step", f"{name} step {st.index}", feats, over, [over]))
    return samples


# ---------------------------------------------------------------------- driver


def calibrate(
    info: ModelInfo,
    grid: Grid,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    budget_s: float | None = None,
    loop: bool = True,
) -> dict[str, Any]:
    """Measure the grid on ``info``'s model and return the profile (a JSON-able dict).

    ``budget_s``: stop starting new rounds once another round would pass this many seconds
    (at least one round is measured: a slow model gets fewer rounds, not fewer points).
    ``loop``: also time the real loop's per-step overhead (the step group)."""
    with Noise.from_env().active():  # the same pinning / collector as the real runs (engine.noise)
        return _calibrate(info, grid, seed=seed, progress=progress, budget_s=budget_s, loop=loop)


def _calibrate(info: ModelInfo, grid: Grid, *, seed: int, progress, budget_s, loop) -> dict[str, Any]:
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    rng = random.Random(seed)
    rig = Rig(info, seed=seed)
    # warm-up: the first forwards of a process are slow; run one of each kind, untimed
    for _ in range(2):
        measure_decode(rig, 4, 64, 2)
        measure_prefill(rig, 64, 64, 1)
        measure_padded(rig, 2, 32, 0, 1)
    jobs: list[tuple[str, Callable[[], list[Sample]]]] = []
    for k, b in enumerate(grid.decode_batches):
        for j, c in enumerate(grid.decode_contexts):
            if b * c <= grid.max_decode_kv:
                skew = b > 2 and (k + j) % 2 == 1  # half the batches heavy-tailed, checkerboard
                jobs.append(
                    (
                        f"decode B={b} C={c}" + (" skewed" if skew else ""),
                        lambda b=b, c=c, s=skew: measure_decode(rig, b, c, grid.decode_reps, s),
                    )
                )
    for k, n in enumerate(grid.prefill_chunks):
        for j, c in enumerate(grid.prefill_contexts):
            if n * (c + n) <= grid.max_attention:
                done = (k + j) % 2 == 1  # half the grid completes its prompt, checkerboard
                jobs.append(
                    (
                        f"prefill n={n} c={c}" + (" done" if done else ""),
                        lambda n=n, c=c, d=done: [measure_prefill(rig, n, c, grid.prefill_reps, d)],
                    )
                )
    for k, (rows, n, c) in enumerate(grid.padded):
        jobs.append(
            (
                f"padded rows={rows} n={n} c={c}" + (" done" if k % 2 else ""),
                lambda rows=rows, n=n, c=c, d=bool(k % 2): [measure_padded(rig, rows, n, c, grid.prefill_reps, d)],
            )
        )
    for k, (b, c, n, cc) in enumerate(grid.mixed):
        jobs.append(
            (
                f"mixed B={b} C={c} n={n} c={cc}" + (" done" if k % 2 else ""),
                lambda b=b, c=c, n=n, cc=cc, d=bool(k % 2): [measure_mixed(rig, b, c, n, cc, grid.prefill_reps, d)],
            )
        )
    if info.rolls_back:  # (drafts roll back from plain KV and sliding windows, not recurrent state)
        for b, c, k in grid.verify:
            jobs.append((f"verify B={b} C={c} k={k}", lambda b=b, c=c, k=k: measure_verify(rig, b, c, k, 2)))
    # Every point once per round, each round in a fresh random order: a slow spell of the
    # machine (steal time, other load) then touches one round of a point, not all of it.
    per_job: dict[int, list[list[Sample]]] = {i: [] for i in range(len(jobs))}
    total = len(jobs) * grid.rounds
    done = 0
    rounds_done = 0
    for rnd in range(grid.rounds):
        elapsed = time.perf_counter() - t_start
        if budget_s is not None and rnd and elapsed + elapsed / rnd > budget_s:
            say(f"round {rnd + 1} would pass the {budget_s:.0f} s budget: {rnd} round(s) measured")
            break
        rounds_done += 1
        order = list(range(len(jobs)))
        rng.shuffle(order)
        for i in order:
            done += 1
            say(f"[{done}/{total}] round {rnd + 1}: {jobs[i][0]}")
            per_job[i].append(jobs[i][1]())
    samples = [merge_rounds(rounds) for i in range(len(jobs)) for rounds in zip(*per_job[i])]
    if loop:
        say("real loop: per-step overhead")
        samples += measure_step_overhead(info, grid, seed)
    coef, report = fit_profile(samples)
    meta = info.metadata()
    # a model with sliding-window or recurrent layers: what one request's cache holds (the
    # simulator's memory accounting reads it; absent, every layer is full attention)
    layout = {} if info.plain_kv else {"cache_layout": meta["cache_layout"]}
    return {
        "schema": PROFILE_SCHEMA,
        "model": meta["model"],
        "dtype": meta["dtype"],
        "parameters": meta["parameters"],
        "kv_tokens": DEFAULT_KV_TOKENS,
        **layout,
        "blas": _blas_key(meta.get("blas") or {}),
        "mlx": meta["mlx"],
        "mlx_lm": meta["mlx_lm"],
        "device": meta["device"],
        "machine": meta["machine"],
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "allocator": Noise.from_env().allocator(),
        "calibration": {
            "grid": grid.name,
            "seed": seed,
            "samples": len(samples),
            "rounds": rounds_done,
            "decode_warm": DECODE_WARM,
            "wall_s": round(time.perf_counter() - t_start, 1),
        },
        "coefficients": coef,
        "fit_report": report,
        "samples": [s.to_json() for s in samples],
    }


def add_verify_terms(
    info: ModelInfo,
    profile: dict[str, Any],
    grid: Grid,
    *,
    seed: int = 0,
    rounds: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``profile`` (a calibration of ``info``'s model on this machine) with verify terms: the
    grid's verify points measured now (``measure_verify``, every point once per round, rounds in
    fresh random orders) and only the v_ terms fitted (``analysis.fit.fit_verify``); every other
    coefficient is kept. For a profile measured before verify passes were part of the grid."""
    if not info.rolls_back:
        raise ValueError(f"{info.name}: its caches cannot roll back drafts, so it has no verify passes to time")
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    with Noise.from_env().active():
        rig, rng = Rig(info, seed=seed), random.Random(seed)
        for _ in range(2):  # warm-up, untimed
            measure_verify(rig, 2, 40, 2, 1)
        per: list[list[list[Sample]]] = [[] for _ in grid.verify]
        n = rounds or grid.rounds
        for rnd in range(n):
            order = list(range(len(grid.verify)))
            rng.shuffle(order)
            for j, i in enumerate(order):
                b, c, k = grid.verify[i]
                say(f"[{rnd * len(order) + j + 1}/{n * len(order)}] round {rnd + 1}: verify B={b} C={c} k={k}")
                per[i].append(measure_verify(rig, b, c, k, 2))
    samples = [merge_rounds(same) for rounds_ in per for same in zip(*rounds_)]
    got, report = fit_verify(samples, profile["coefficients"])
    out = dict(profile)
    out["coefficients"] = {**profile["coefficients"], **got}
    out["fit_report"] = {**(profile.get("fit_report") or {}), **report}
    keep = [s for s in profile.get("samples") or [] if s.get("group") not in ("verify", "verify_base")]
    out["samples"] = keep + [s.to_json() for s in samples]
    out["verify_calibration"] = {
        "grid": grid.name,
        "points": len(grid.verify),
        "rounds": n,
        "seed": seed,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return out


def _blas_key(b: dict[str, Any]) -> dict[str, Any]:
    keep = ("name", "threads", "thread_timeout", "path", "config", "active")
    return {k: b[k] for k in keep if k in b}


def write_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """The profile JSON, and its fit report as markdown beside it (same name, .md)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    path.with_suffix(".md").write_text(report_markdown(profile))
    return path


# ---------------------------------------------------------------------- the machine's speed now


_DECODE_LABEL = re.compile(r"^B=(\d+) C=(\d+)$")
_PREFILL_LABEL = re.compile(r"^n=(\d+) c=(\d+)( done)?$")


def speed_points(profile: dict[str, Any], per_kind: int = 3) -> list[tuple[str, tuple, float]]:
    """A few of the profile's own grid points to time again: steady decode batches of a few
    rows at short context, and single prefill chunks of tens to hundreds of tokens, the passes
    a short real run is made of. (kind, arguments, seconds in the profile)."""
    dec, pre = [], []
    for smp in profile.get("samples") or []:
        label, secs = str(smp.get("label", "")), smp.get("seconds")
        if not isinstance(secs, (int, float)) or secs <= 0:
            continue
        m = _DECODE_LABEL.match(label)
        if smp.get("group") == "decode" and m and 2 <= int(m[1]) <= 16 and int(m[2]) <= 700:
            dec.append(("decode", (int(m[1]), int(m[2])), float(secs)))
        m = _PREFILL_LABEL.match(label)
        if smp.get("group") == "prefill" and m and 16 <= int(m[1]) <= 512 and int(m[2]) <= 600:
            pre.append(("prefill", (int(m[1]), int(m[2]), bool(m[3])), float(secs)))

    def spread(xs):  # smallest, middle, largest: not all of one size
        xs = sorted(xs, key=lambda x: x[2])
        if len(xs) <= per_kind:
            return xs
        return [xs[round(i * (len(xs) - 1) / (per_kind - 1))] for i in range(per_kind)]

    return spread(dec) + spread(pre)


def decode_warm(profile: dict[str, Any]) -> int:
    """The untimed passes the profile's grid ran before each steady decode sample
    (``measure_decode``): 0 for profiles calibrated before it skipped any, so that they are
    timed again as they were measured."""
    cal = profile.get("calibration") or {}
    grid = cal.get("grid") if isinstance(cal.get("grid"), dict) else cal
    return int(grid.get("decode_warm", 0) or 0)


def speed_check(info: ModelInfo, profile: dict[str, Any], rounds: int = 3, seed: int = 0) -> dict[str, Any] | None:
    """How fast this machine runs the profile's passes *now*: a few of its grid points timed
    again (``speed_points``, each the median over ``rounds`` spread runs) against the seconds
    the profile stored. ``ratio`` > 1: the machine is slower now than when it was calibrated.

    A shared machine's speed drifts (a 2-core VM here ran the same passes 1.3x slower than 20
    minutes earlier, with nothing else running): a validation error of that size is the
    machine, not the cost model. None when the profile has no such points. A few seconds."""
    points = speed_points(profile)
    if not points:
        return None
    warm = decode_warm(profile)
    t0 = time.perf_counter()
    rig = Rig(info, seed=seed)
    measure_decode(rig, 4, 64, 2)  # warm-up, untimed
    measure_prefill(rig, 64, 0, 1)
    runs: list[list[float]] = [[] for _ in points]
    for _ in range(rounds):
        for i, (kind, args, _) in enumerate(points):
            if kind == "decode":
                smp = next(x for x in measure_decode(rig, args[0], args[1], 3, warm=warm) if x.group == "decode")
            else:
                smp = measure_prefill(rig, args[0], args[1], 1, args[2])
            runs[i].append(smp.seconds)
    ratios = [(kind, statistics.median(r) / secs) for (kind, _, secs), r in zip(points, runs)]

    def med(kind=None):
        xs = [x for k, x in ratios if kind is None or k == kind]
        return round(statistics.median(xs), 4) if xs else None

    return {
        "ratio": med(),
        "decode": med("decode"),
        "prefill": med("prefill"),
        "points": len(points),
        "rounds": rounds,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def grid_coefficients(profile: dict[str, Any]) -> dict[str, float] | None:
    """The grid's own fit of a profile (its stored samples): what ``calibrate_default`` drew its
    replay's trace from. None when the profile keeps no samples."""
    samples = [Sample.from_json(x) for x in profile.get("samples") or []]
    return fit_profile(samples)[0] if samples else None


def replay_speed_check(
    info: ModelInfo, profile: dict[str, Any], *, policy: str = "mlx-default"
) -> dict[str, Any] | None:
    """How fast this machine runs a default calibration's own replay *now*: its trace (drawn again
    from the profile's grid, as the calibration drew it) run by ``policy`` in the real loop, the
    steps' total measured over predicted seconds under the profile. ``ratio`` > 1: slower than
    the profile says. Unlike ``speed_check``'s isolated passes, these steps run in the regime
    of a real run (the loop, sampling, joins, idle gaps), and the profile was fitted to their
    mean, so at calibration time the ratio is ~1. None unless the profile is a default
    calibration (``grid+replay``) with its samples. ~``replay_s`` seconds (8). The trace and
    the engine take the calibration's seed, whatever the validation's."""
    if not has_replay(profile):
        return None
    cal = profile["calibration"]
    seed = int((cal.get("grid") or {}).get("seed") or 0)
    from schedlab.analysis.residuals import run_speed
    from schedlab.sim.features import step_table

    t0 = time.perf_counter()
    trace = replay_trace(LinearCostModel(grid_coefficients(profile)), float(cal.get("replay_s") or 8.0), seed)
    res = _replay_run(info, trace, policy, LinearCostModel(dict(profile["coefficients"])), seed)
    table = None if res.error else step_table(res)
    ratio = run_speed(table) if table else None
    if not ratio:
        return None
    return {
        "ratio": round(ratio, 4),
        "kind": "replay",
        "policy": policy,
        "requests": len(trace),
        "seed": seed,
        "steps": len(table["step"]),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def has_replay(profile: dict[str, Any] | None) -> bool:
    """Whether a profile is a default calibration (grid + replay) whose replay can be run again."""
    return (
        bool(profile)
        and (profile.get("calibration") or {}).get("kind") == "grid+replay"
        and bool(profile.get("samples"))
    )


# ---------------------------------------------------------------------- matching profiles


def profile_mismatch(meta: dict[str, Any], info: ModelInfo) -> str | None:
    """Why a profile was not measured on this model and machine (None when it was)."""
    here = info.metadata()
    checks = [
        ("model", meta.get("model"), here["model"]),
        ("dtype", meta.get("dtype"), here["dtype"]),
        ("parameters", meta.get("parameters"), here["parameters"]),
        ("BLAS", (meta.get("blas") or {}).get("name"), here["blas"].get("name")),
        ("BLAS threads", (meta.get("blas") or {}).get("threads"), here["blas"].get("threads")),
        ("CPU count", (meta.get("machine") or {}).get("cpu_count"), here["machine"].get("cpu_count")),
        ("processor", (meta.get("machine") or {}).get("processor"), here["machine"].get("processor")),
        # the same core count and architecture can be another CPU (a Xeon and an EPYC VM ran the
        # same passes 1.6x apart here), and OpenBLAS picks its kernels by CPU
        ("CPU model", (meta.get("machine") or {}).get("cpu_model"), here["machine"].get("cpu_model")),
        ("BLAS build", (meta.get("blas") or {}).get("config"), here["blas"].get("config")),
        # malloc-keep / mlx-cache change what a join costs (engine.noise)
        ("allocator settings", allocator_settings(meta.get("allocator")), Noise.from_env().allocator()),
        # sliding windows or recurrent state: a profile without the layout would count them as none
        ("cache layout", meta.get("cache_layout"), None if info.plain_kv else here["cache_layout"]),
    ]
    for what, theirs, ours in checks:
        if theirs != ours:
            return f"the profile's {what} is {theirs!r}, here it is {ours!r}"
    return None


def _cache_dir() -> Path:
    import os

    base = os.environ.get("SCHEDLAB_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "schedlab") / "profiles"


def cached_profile_path(info: ModelInfo) -> Path:
    """Where ``find_or_calibrate`` caches its calibration of this model (one per model)."""
    return _cache_dir() / f"{Path(str(info.name)).name}-{info.dtype}-{info.n_params}.json"


def candidate_profiles(info: ModelInfo) -> list[Path]:
    """The bundled profiles, then this model's cached calibration when there is one."""
    from schedlab.sim.profiles import bundled_profiles

    cached = cached_profile_path(info)
    return bundled_profiles() + ([cached] if cached.is_file() else [])


def find_or_calibrate(
    profile: str | None, info: ModelInfo, out: Path | None, say: Callable[[str], None]
) -> tuple[Path, str | None]:
    """The profile to simulate with: the one given, else the bundled default when it was
    measured on this model and machine, else a cached calibration of this model and machine,
    else a fresh default calibration (``calibrate_default``: the quick grid and a short real
    replay fitted together; cached, and written to OUT/profile.json with ``out``)."""
    from schedlab.sim.cost import read_profile
    from schedlab.sim.profiles import resolve_profile

    if profile is not None:
        path = resolve_profile(profile)
        why = profile_mismatch(read_profile(path), info)
        return path, (f"{path.name} was not measured on this model and machine: {why}" if why else None)
    for path in candidate_profiles(info):
        try:
            if profile_mismatch(read_profile(path), info) is None:
                return path, None
        except Exception:  # a broken cache file: ignore it, calibrate anew
            continue
    say("no profile matches this model and machine: calibrating first (quick grid + a short real replay)")
    prof = calibrate_default(info, progress=say)
    path = None
    try:
        path = write_profile(prof, cached_profile_path(info))
    except OSError:
        if out is None:
            import tempfile

            out = Path(tempfile.mkdtemp(prefix="schedlab-profile-"))
    if out is not None:
        path = write_profile(prof, Path(out) / "profile.json")
    return path, f"calibrated for {info.name} on this machine (quick grid + real replay): {path}"


# ---------------------------------------------------------------------- the analytic model's factors


def analytic_bits(info: ModelInfo) -> tuple[int, int]:
    """(weight bits, KV bits) of the engine's model as the analytic model counts them: the
    dtype's width, or a quantised checkpoint's ``quantization.bits`` for the weights."""
    width = 32 if info.dtype == "float32" else 16
    q = info.config.get("quantization") or info.config.get("quantization_config") or {}
    bits = q.get("bits") if isinstance(q, dict) else None
    return (int(bits) if isinstance(bits, int) and not isinstance(bits, bool) else width), width


def fit_analytic(samples: Iterable[Any], info: ModelInfo) -> dict[str, Any]:
    """The ``analytic_cpu_local`` profile block: the ``cpu-local`` roofline's factors fitted to
    calibration samples of ``info``'s model on this machine (``analysis.analytic.local.fit_local``:
    each pass's shape is recovered from its features, a quarter held out as the linear fit
    does, both the plain three-factor roofline and the one with attention and copy factors).
    ``samples``: ``Sample`` objects or the profile JSON's sample dicts."""
    from schedlab.analysis.analytic.local import fit_local

    bits, kv_bits = analytic_bits(info)
    rows = [s.to_json() if isinstance(s, Sample) else s for s in samples]
    return fit_local(rows, info.config, name=str(info.name), quant=bits, kv_bits=kv_bits)


# ---------------------------------------------------------------------- fitting to real runs


# ---------------------------------------------------------------------- the default calibration


REPLAY_POLICIES = ("mlx-default", "chunked-prefill", "unified")
# The replay ends with this many requests that each arrive alone at an idle replica, after idle
# gaps of WAKE_GAPS_S (the after-idle terms i_step / i_gap need wakes of several lengths; a slow
# model's replay of a few requests otherwise holds one wake a run, its first step); a replay
# shorter than WAKE_SCALE_S has its gaps shortened in proportion
WAKE_TAIL = 4
WAKE_GAPS_S = (0.3, 1.2, 0.6, 0.9)
WAKE_SCALE_S = 8.0


def replay_trace(
    cost: LinearCostModel, seconds: float, seed: int, load: float = 0.6, max_prompt: int = 256
) -> list[Request]:
    """A small synthetic trace for a real replay: chat-sized prompts (16..max_prompt tokens) and
    outputs (8..48), arriving alone or in bursts of 2-4 (rows join and leave the batch; the
    replica sits idle in between), as many as keep the replica busy ``load`` of ``seconds``
    under ``cost`` (simulated with the unified policy); then ``WAKE_TAIL`` short requests, each
    arriving ``WAKE_GAPS_S`` after the one before is predicted to end (wakes of an idle replica
    after known gaps, whatever the model's speed; shortened in proportion below ``WAKE_SCALE_S``
    of replay)."""
    from schedlab.sim import Deployment, run

    def make(n: int) -> list[Request]:
        rng = random.Random(seed)
        reqs, t, i = [], 0.0, 0
        gap = seconds / max(n, 1)
        while i < n:
            t += rng.expovariate(1.0) * gap * (2.5 if rng.random() < 0.3 else 1.0)
            for _ in range(min(n - i, rng.choice((1, 1, 1, 2, 3, 4)))):
                p = int(round(math.exp(rng.uniform(math.log(16), math.log(max_prompt)))))
                reqs.append(Request(f"replay{seed}-{i}", round(t, 4), p, rng.randint(8, 48)))
                i += 1
        span = reqs[-1].arrival_s or 1.0
        return [
            Request(r.id, round(r.arrival_s * 0.85 * seconds / span, 4), r.prompt_tokens, r.output_tokens) for r in reqs
        ]

    def sim(reqs: list[Request]):
        return run(Deployment.one(make_policy("unified"), cost, kv_capacity=10**9), reqs, trace_name="replay")

    def ends(reqs: list[Request]) -> float:
        return max(r.finish_s for r in sim(reqs).requests)

    n = 8
    for _ in range(4):
        res = sim(make(n))
        busy = sum(st.predicted_s for st in res.steps) or 1e-3
        n = int(min(400, max(4, round(n * load * seconds / busy))))
    reqs = make(n)
    rng = random.Random(seed + 1)
    t = ends(reqs)
    for k in range(WAKE_TAIL):
        rid, prompt, out = f"replay{seed}-{n + k}", rng.randint(16, 48), rng.randint(2, 4)
        t += WAKE_GAPS_S[k % len(WAKE_GAPS_S)] * min(1.0, seconds / WAKE_SCALE_S)
        reqs.append(Request(rid, round(t, 4), prompt, out))
        t += ends([Request(rid, 0.0, prompt, out)])  # (served alone: its own time)
    return reqs


def _replay_run(info: ModelInfo, trace: list[Request], policy: str, cost: LinearCostModel, seed: int):
    """One real run of a replay trace (no KV limit), as the default calibration runs it."""
    return run_loop(
        trace, make_policy(policy), cost, kv_capacity=10**9, backend=MLXBackend(info, seed=seed), trace_name="replay"
    )


def record_replay(
    info: ModelInfo,
    cost: LinearCostModel,
    out: Path,
    *,
    seconds: float = 8.0,
    policies: Sequence[str] = REPLAY_POLICIES,
    seed: int = 0,
    max_prompt: int = 256,
    say: Callable[[str], None] = lambda m: None,
) -> list[Path]:
    """Real runs of ``policies`` on a ``replay_trace`` (each ~``seconds``, prompts up to
    ``max_prompt`` tokens), written as run directories under ``out`` (features.parquet
    included). Returns their paths."""
    from schedlab.sim.metrics import summarize
    from schedlab.sim.output import write_run

    trace = replay_trace(cost, seconds, seed, max_prompt=max_prompt)
    dirs = []
    for k, name in enumerate(policies):
        say(f"replay: {name} on {len(trace)} requests (~{seconds:.0f} s)")
        res = _replay_run(info, trace, name, cost, seed + k)
        if res.error:
            raise RuntimeError(res.error)
        dirs.append(write_run(Path(out) / name, res, summarize(res), meta={"replay_seed": seed}))
    return dirs


def calibrate_default(
    info: ModelInfo,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    replay_s: float = 8.0,
    grid_budget_s: float = 100.0,
    keep: Path | None = None,
) -> dict[str, Any]:
    """The calibration ``validate`` and ``run-real`` make when no profile matches: the quick grid
    (``grid_for``: the compact one for large models; rounds cut to ``grid_budget_s``),
    then a real replay of a few bundled policies on a small synthetic trace (``replay_s`` each),
    fitted together (``profile_from_runs``): the grid gives the shapes, the replay how the real
    loop runs them. ``keep``: where the replay's run directories go (else a temporary one)."""
    import tempfile

    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    grid = grid_for(info, quick=True)
    prof = calibrate(info, grid, seed=seed, progress=say, budget_s=grid_budget_s, loop=False)
    from schedlab.analysis.runfit import load_runs, profile_from_runs

    with tempfile.TemporaryDirectory(prefix="schedlab-replay-") as tmp:
        out = Path(keep) if keep is not None else Path(tmp)
        dirs = record_replay(
            info, LinearCostModel(dict(prof["coefficients"])), out, seconds=replay_s, seed=seed, say=say
        )
        runs = load_runs(dirs)
        for r in runs:
            r.name = Path(r.name).name
        say("fitting the grid and the replay together")
        full = profile_from_runs(runs, prof, kind="grid+replay", wall_s=time.perf_counter() - t0)
    full["calibration"]["replay_s"] = replay_s
    return full
