"""The analytic model of *this* machine's engine: fit ``cpu-local``'s factors to calibration samples.

``calibrate`` times real passes of the MLX engine and stores each as a sample: its group,
its label, the linear cost model's features of the pass and the measured seconds. The
roofline needs the pass's *shape*, not those features; every shape the calibration grid
times (decode batches with joins and leaves, single prefill chunks, padded multi-prompt
chunks, mixed passes) is recovered from the features exactly, as far as the roofline reads
it (rows and longest context of the decode batch, whether rows join, how many are kept
after a leave; each chunk's size, context and whether it completes its prompt). Each
recovered shape is checked: its features must give back the stored ones, or the sample is
skipped and counted.

:func:`fit_local` then fits the roofline's factors to those samples, the same way the
linear model is fitted: a quarter of each group held out (the same seeded draw,
``analysis.fit.split``), mixed passes only predicted, and the per-step overhead taken from the
real loop's ``step`` samples (their median). It fits two models side by side and reports
both:

- ``plain``: the three-factor roofline (compute, bandwidth, per-layer overhead), what a
  published-figure fit gives;
- ``full``: plus the optional factors (attention and decode attention rates, batch-cache
  copy rate and per-copy overhead; see ``efficiency.Efficiency``).

The result is the ``analytic_cpu_local`` block ``calibrate --analytic`` writes into a
profile, and :func:`efficiency_from_block` turns it back into a cost model. No mlx here.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

from schedlab.policies.base import PassShape

from .efficiency import Efficiency
from .errors import AnalyticError
from .fit import OPTIONAL_PARAMS, fit_efficiency
from .hardware import CPU_LOCAL, DEFAULT_EFFICIENCY, Hardware, load_hardware, machine_key
from .modelspec import model_spec
from .roofline import AnalyticCostModel

BLOCK_KEY = "analytic_cpu_local"
BLOCK_SCHEMA = "schedlab-analytic-local/1"
PASS_GROUPS = ("decode", "join", "leave", "prefill", "padded", "mixed")
#: starting points besides the prior: the alternating fit finds a local optimum, and on a
#: CPU whose caches hold the weights the memory term may never bind (start it at full speed)
_STARTS = (
    {"bandwidth": 1.0},
    {"bandwidth": 1.0, "overhead_per_layer_s": 2e-3, "compute": 0.1},
    {"bandwidth": 0.05, "overhead_per_layer_s": 1e-4},
)


def _get(sample: Any, key: str) -> Any:
    return sample.get(key) if isinstance(sample, Mapping) else getattr(sample, key)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def shape_from_sample(sample: Any) -> PassShape | None:
    """The pass shape a calibration sample timed, recovered from its features (None when the
    sample is not a pass, or its features do not pin a shape down)."""
    from schedlab.sim.cost import pass_features

    group = _get(sample, "group")
    f = dict(_get(sample, "features") or {})
    if group not in PASS_GROUPS:
        return None
    g = lambda k: float(f.get(k, 0.0))  # noqa: E731
    decode: tuple[int, ...] = ()
    before = joins = leaves = join_ctx = 0
    if g("d_pass"):
        rows, longest = int(round(g("d_rows"))), int(round(g("d_ctx")))
        if rows < 1 or longest < 1:
            return None
        decode = (longest,) * rows
        before = rows
        if g("c_join0"):
            # rows joining: c_join_row counts them (samples stored before it existed: say 1)
            joins = int(round(g("c_join_row"))) if "c_join_row" in f else 1
            before = rows - joins
            join_ctx = int(round(g("c_join_ctx")))
        if g("c_leave0"):
            kept = int(round(g("c_leave") / longest))
            leaves = before + joins - kept
            if leaves < 1:
                return None
    prefill: tuple[tuple[int, int], ...] = ()
    done: tuple[bool, ...] = ()
    padded = False
    if g("p_pass"):
        tokens, attn, ctx = g("p_tokens"), g("p_attn"), g("p_ctx")
        if tokens <= 0:
            return None
        if group == "padded":  # rows x (n, c): tokens = r n, ctx = r c, attn = r n (c + n)
            x = ctx / tokens
            n = int(round(attn / (tokens * (1.0 + x))))
            if n < 1:
                return None
            r = int(round(tokens / n))
            c = int(round(x * n))
            prefill, padded = ((n, c),) * r, True
            done = (bool(g("p_done0")),) + (False,) * (r - 1)
        else:
            if not _close(g("p_pass"), 1.0):  # several unpadded chunks: sizes not recoverable
                return None
            prefill = ((int(round(tokens)), int(round(ctx))),)
            done = (bool(g("p_done0")),)
    if not decode and not prefill:
        return None
    shape = PassShape(decode, prefill, padded, before, joins, leaves, done, join_ctx)
    back = pass_features(shape)
    for k in (
        "c_join_row",
        "c_leave_row",
        "c_join_ctx",
        "c_extend",
    ):  # terms newer than the sample: not in its features
        if k not in f:
            back.pop(k, None)
    if any(not _close(back.get(k, 0.0), float(f.get(k, 0.0))) for k in set(back) | set(f)):
        return None
    return shape


def _errors(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """pairs: (predicted, measured) -> n, median/max |error| %, mean error % (analysis.fit's keys)."""
    if not pairs:
        return {"n": 0}
    errs = [100.0 * (p - m) / m for p, m in pairs]
    a = sorted(abs(e) for e in errs)
    return {
        "n": len(errs),
        "median_abs_pct": statistics.median(a),
        "max_abs_pct": a[-1],
        "mean_pct": statistics.fmean(errs),
    }


def split_passes(by: Mapping[str, Sequence[Any]]) -> tuple[list[Any], list[Any]]:
    """(fitted, held out) passes by group, as the linear fit splits them (``analysis.fit.split``):
    a quarter of each decode/join/leave group and of the prefill + padded chunks held out;
    mixed passes never fitted, only predicted."""
    from schedlab.analysis.fit import split

    fit_part: list[Any] = []
    held: list[Any] = []
    for g in ("decode", "join", "leave"):
        a, b = split(list(by[g]))
        fit_part += a
        held += b
    a, b = split(list(by["prefill"]) + list(by["padded"]))
    return fit_part + a, held + b + list(by["mixed"])


def fit_local(
    samples: Iterable[Any],
    config: Mapping[str, Any],
    *,
    name: str = "model",
    quant: int = 32,
    kv_bits: int = 32,
    hardware: Hardware | None = None,
    prior: Efficiency | None = None,
) -> dict[str, Any]:
    """The ``analytic_cpu_local`` block: fitted factors for ``config``'s model on this CPU.

    ``samples``: calibration samples (profile JSON dicts or ``analysis.fit.Sample``), with the
    ``step`` group for the per-step overhead. ``hardware``: the measured ``cpu-local``
    preset (default: measured now or from the cache). Raises ``AnalyticError`` (one line)
    when fewer than four pass samples can be used.
    """
    from schedlab.analysis.fit import split

    hw = hardware or load_hardware(CPU_LOCAL)
    spec = model_spec(config, name)
    prior = prior or DEFAULT_EFFICIENCY["cpu"]
    base = AnalyticCostModel(hw, spec, quant, kv_bits=kv_bits, efficiency=prior)
    samples = list(samples)
    by: dict[str, list[tuple[Any, PassShape]]] = {g: [] for g in PASS_GROUPS}
    skipped = 0
    steps = []
    for s in samples:
        group = _get(s, "group")
        secs = float(_get(s, "seconds"))
        if group == "step":
            steps.append(s)
            continue
        shape = shape_from_sample(s) if secs > 0 else None
        if shape is None:
            skipped += 1
            continue
        by[group].append((s, shape))
    fit_part, held = split_passes(by)
    if len(fit_part) < 4:
        raise AnalyticError(
            f"the analytic fit needs at least 4 pass samples it can read, got {len(fit_part)} ({skipped} skipped)"
        )
    step_fit = split(steps)[0] if steps else []
    step_s = statistics.median([float(_get(s, "seconds")) for s in step_fit]) if step_fit else prior.step_overhead_s
    step_s = max(0.0, step_s)
    fit_samples = [
        {"shape": sh, "seconds": float(_get(s, "seconds")), "label": str(_get(s, "label"))} for s, sh in fit_part
    ]
    engine = "mlx (CPU)"
    models: dict[str, Any] = {}
    for kind, optional in (("plain", ()), ("full", OPTIONAL_PARAMS)):
        # plain: the three factors alone, the optional ones unset
        pr = prior if kind == "full" else Efficiency(prior.compute, prior.bandwidth, prior.overhead_per_layer_s)
        res = fit_efficiency(
            fit_samples,
            cost_model=base.with_efficiency(pr),
            prior=pr,
            optional=optional,
            engine=engine,
            source=f"fit_local on {len(fit_samples)} calibration passes of {name}",
            starts=_STARTS,
        )
        eff = replace(res.efficiency, step_overhead_s=step_s)
        cm = base.with_efficiency(eff)

        def pairs(items):
            return [(cm.pass_seconds(sh), float(_get(s, "seconds"))) for s, sh in items]

        groups = {g: _errors(pairs(by[g])) for g in PASS_GROUPS}
        models[kind] = {
            "efficiency": eff.to_dict(),
            "fitted": list(res.fitted),
            "notes": list(res.notes),
            "fit": _errors(pairs(fit_part)),
            "held_out_passes": _errors(pairs(held)),
            "all_passes": _errors(pairs([x for g in PASS_GROUPS for x in by[g]])),
            "groups": groups,
        }
    return {
        "schema": BLOCK_SCHEMA,
        "hardware": CPU_LOCAL,
        "machine": machine_key(),
        "peak_gflops": hw.peak("fp32") / 1e9,
        "bandwidth_gbs": hw.bandwidth / 1e9,
        "model": name,
        "quant_bits": quant,
        "kv_bits": kv_bits,
        "lazy_prefill": base.lazy_prefill,
        "causal_skip": base.causal_skip,
        "step_overhead_s": step_s,
        "samples": {
            "passes": sum(len(v) for v in by.values()),
            "fitted": len(fit_part),
            "held_out": len(held),
            "steps": len(steps),
            "skipped": skipped,
        },
        "efficiency": models["full"]["efficiency"],
        "models": models,
    }


def efficiency_from_block(
    block: Mapping[str, Any], hw: Hardware | None = None, kind: str = "full"
) -> tuple[Hardware, Efficiency]:
    """(hardware, efficiency) as the block was fitted: the peak and bandwidth it measured
    (the factors are fractions of those), and the factors of ``kind`` (full or plain)."""
    if not isinstance(block, Mapping) or block.get("schema") != BLOCK_SCHEMA:
        raise AnalyticError(f"not an {BLOCK_KEY} block (schema {BLOCK_SCHEMA})")
    try:
        eff = Efficiency.from_dict(block["models"][kind]["efficiency"] if "models" in block else block["efficiency"])
        peak = float(block["peak_gflops"]) * 1e9
        bw = float(block["bandwidth_gbs"]) * 1e9
    except (KeyError, TypeError, ValueError) as exc:
        raise AnalyticError(f"bad {BLOCK_KEY} block: {exc}") from None
    hw = hw or load_hardware(CPU_LOCAL)
    return replace(hw, peak_flops={"fp32": peak}, bandwidth=bw, efficiency=eff), eff


def block_mismatch(block: Mapping[str, Any], name: str, quant: int, kv_bits: int) -> str | None:
    """Why an ``analytic_cpu_local`` block does not fit this model (None when it does)."""
    if not isinstance(block, Mapping) or block.get("schema") != BLOCK_SCHEMA:
        return f"no {BLOCK_KEY} block of schema {BLOCK_SCHEMA}"
    for what, theirs, ours in (
        ("model", block.get("model"), name),
        ("weight bits", block.get("quant_bits"), quant),
        ("KV bits", block.get("kv_bits"), kv_bits),
    ):
        if theirs != ours:
            return f"its {what} is {theirs!r}, here {ours!r}"
    return None
