"""Fitting the ``vllm`` engine's factors to serving kernels' measured times, and checking them held out.

Data: medians extracted from microsoft/vidur's public profiling CSVs (MIT) by
``analysis/hardware/kernels/extract_vidur.py``. The tables are **not shipped** with schedlab:
make them from your own clone of Vidur (``analysis/hardware/kernels/README.md``) into a
directory given by ``--data DIR`` / ``SCHEDLAB_KERNEL_DATA`` (default ``.data/vidur-kernels/``
in the repository, git-ignored). Only the fitted factors (``hardware.json``), the report
(``analysis/hardware/SERVING.md``) and the recorded errors (``analysis/hardware/serving_fit.json``)
are committed; nothing at run time reads the tables. The three tables:

- ``vidur_linear.csv``: per GPU (a100, h100, a40), model and token count (1-4096, to 32768 for
  Llama 3), the median milliseconds of one layer's operations outside attention (norms, the
  QKV / output projections, rope, the MLP's up / activation / down, the residual add), as
  Vidur profiled them (cuBLAS GEMMs, one GPU).
- ``vidur_attention_a100_llama2_7b.csv``: A100, Llama-2-7B, one layer: decode attention
  (batch 1-128 x context 32-4032) and FlashAttention prefill (chunk 64-3200 x context 0-4032).
- ``vidur_models.csv``: the models' shapes (as Vidur's profiling records them) and layers.

What is fitted, and what is held out (:data:`FIT_PLAN`):

- GEMMs etc. (``linear``): e_c by token count, e_b, per-layer overhead, on two models of one
  GPU (Llama-2-7B and Llama-2-70B: two sizes separate bandwidth from the fixed cost); every
  other model on that GPU is held out (Llama-3-8B/70B, CodeLlama-34B, InternLM-20B, Qwen-72B,
  Phi-2), and the A100 factors are also checked on the H100 files (another chip).
  The GEMM tile (tokens a GEMM is rounded up to) is chosen from 1, 64, 128, 256 by the fit.
- Decode attention: fitted on power-of-two batches at the grid contexts (32, 64, 256, 512, 1024,
  2048, 3072, 4032); every other (batch, context) point is held out.
- Prefill attention: fitted on chunks 64, 128, 256, 512, 1024, 2048; chunks 80-480 off those,
  992, 1984, 2112 and 3072-3200 (beyond the fit) are held out.
- Passes (A100 Llama-2-7B, where attention was measured): prefill passes, decode passes and
  Sarathi-style mixed passes (decode rows + one chunk, up to 512 tokens) built from measured
  points, measured = layers x (linear + attention) as Vidur sums them; held out where an
  attention point in it was held out. Our prediction includes the LM head (Vidur times none;
  < 1 % of these passes).

``python -m schedlab.analysis.analytic refit-serving [--data DIR]`` fits and writes the ``engines.vllm``
blocks of ``hardware.json``, the report ``analysis/hardware/SERVING.md`` and
``analysis/hardware/serving_fit.json`` (per preset: factors, points, errors fitted and held out).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from schedlab.policies.base import PassShape

from .efficiency import ServingEfficiency
from .errors import AnalyticError
from .hardware import HARDWARE_DIR, HARDWARE_FILE, Hardware, hardware_from_preset, read_hardware_file
from .modelspec import ModelSpec, model_spec
from .serving import ServingCostModel, log_weights

#: extract_vidur.py and its README (the tables themselves are not shipped)
KERNEL_DIR = HARDWARE_DIR / "kernels"
REPO = HARDWARE_DIR.parent.parent
#: where the tables are looked for: --data DIR, else $SCHEDLAB_KERNEL_DATA, else this
DATA_ENV = "SCHEDLAB_KERNEL_DATA"
DEFAULT_DATA_DIR = REPO / ".data" / "vidur-kernels"
TABLES = ("vidur_linear.csv", "vidur_attention_a100_llama2_7b.csv", "vidur_models.csv")
#: the recorded fit (per preset: factors, points, errors), written by refit-serving
FIT_RESULTS = HARDWARE_DIR / "serving_fit.json"
OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
SOURCE_COMMIT = "7d47513363ec447a741ac5e47241580b47724fbf"
SOURCE = f"microsoft/vidur (MIT) commit {SOURCE_COMMIT[:10]}"
#: Vidur's files (at SOURCE_COMMIT) the tables' medians come from
LINEAR_FILES = "data/profiling/compute/{gpu}/meta-llama/{{{models}}}/mlp.csv"
ATTENTION_FILE = "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv"
ALL_LINEAR_FILES = "data/profiling/compute/{a100,h100}/*/*/mlp.csv"
FIT_CODE = "analysis/analytic/kernels.py, refit-serving"

#: which data each preset's factors are fitted to (see the module docstring)
FIT_PLAN = {
    "a100-80gb-sxm": {"gpu": "a100", "fit_models": ("Llama-2-7b-hf", "Llama-2-70b-hf"), "attention": "a100"},
    "h100-sxm": {"gpu": "h100", "fit_models": ("Llama-2-7b-hf", "Llama-2-70b-hf"), "attention": "borrowed"},
}
#: presets without kernel data take a fitted preset's factors (same family or nearest chip)
BORROW = {"a100-40gb-sxm": "a100-80gb-sxm", "h100-pcie": "h100-sxm", "h200": "h100-sxm", "l40s": "a100-80gb-sxm"}
#: the GPU whose files check a preset's factors on another chip
CROSS_CHECK = {"a100-80gb-sxm": "h100"}
GPU_PRESET = {"a100": "a100-80gb-sxm", "h100": "h100-sxm"}
TILES = (1, 64, 128, 256)
COMPUTE_KNOTS = (128.0, 512.0, 2048.0)
DECODE_KNOTS = (1.0, 8.0, 32.0, 128.0)
PREFILL_KNOTS = (64.0, 256.0, 1024.0, 2048.0)
DECODE_FIT_ROWS = {1, 2, 4, 8, 16, 32, 64, 128}
DECODE_FIT_KV = {32, 64, 256, 512, 1024, 2048, 3072, 4032}
PREFILL_FIT_CHUNKS = {64, 128, 256, 512, 1024, 2048}
MAX_TOKENS = 4096  # token counts compared (every file reaches 4096)


# ---------------------------------------------------------------------- data


def kernel_data_dir(data: str | Path | None = None) -> Path:
    """The directory holding the kernel tables: ``data``, else ``$SCHEDLAB_KERNEL_DATA``, else
    ``.data/vidur-kernels/``; an :class:`AnalyticError` (one line, saying how to make them) when
    a table is missing."""
    d = Path(data) if data else Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR)
    missing = [t for t in TABLES if not (d / t).is_file()]
    if missing:
        raise AnalyticError(
            f"serving-kernel tables not found in {d} (missing {', '.join(missing)}); they are not shipped: make them "
            f"with `python analysis/hardware/kernels/extract_vidur.py VIDUR_CLONE --attention ATTENTION_CSV --out {d}` "
            f"from a clone of microsoft/vidur at commit {SOURCE_COMMIT[:10]} (analysis/hardware/kernels/README.md), "
            f"or give their directory with --data DIR / {DATA_ENV}"
        )
    return d


def vidur_models(data: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Model name -> a config dict (Hugging Face field names) from Vidur's recorded shapes."""
    out = {}
    with (kernel_data_dir(data) / "vidur_models.csv").open() as fh:
        for r in csv.DictReader(fh):
            gated = r["use_gated_mlp"].strip().lower() == "true"
            out[r["model"]] = {
                "_name_or_path": r["hf_name"],
                "model_type": "llama" if gated else "phi",
                "hidden_size": int(r["n_embd"]),
                "num_hidden_layers": int(r["layers"]),
                "num_attention_heads": int(r["n_head"]),
                "num_key_value_heads": int(r["n_kv_head"]),
                "intermediate_size": int(r["n_expanded_embd"]),
                "vocab_size": int(r["vocab_size"]),
                "torch_dtype": "float16",
            }
    return out


def vidur_spec(model: str, data: str | Path | None = None) -> ModelSpec:
    return model_spec(vidur_models(data)[model], model)


def linear_table(
    gpu: str | None = None, data: str | Path | None = None
) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(gpu, model) -> [(tokens, seconds of one layer's non-attention ops)], tokens <= MAX_TOKENS."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    with (kernel_data_dir(data) / "vidur_linear.csv").open() as fh:
        for r in csv.DictReader(fh):
            if gpu and r["gpu"] != gpu:
                continue
            t = int(r["num_tokens"])
            if t > MAX_TOKENS:
                continue
            ms = sum(float(r[f"{op}_ms"]) for op in OPS if r[f"{op}_ms"] not in ("", None))
            out.setdefault((r["gpu"], r["model"]), []).append((t, ms * 1e-3))
    for v in out.values():
        v.sort()
    return out


def attention_table(data: str | Path | None = None) -> dict[str, dict[tuple[int, int], float]]:
    """'decode': (batch, context) -> seconds; 'prefill': (chunk, context) -> seconds (one layer)."""
    out: dict[str, dict[tuple[int, int], float]] = {"decode": {}, "prefill": {}}
    with (kernel_data_dir(data) / "vidur_attention_a100_llama2_7b.csv").open() as fh:
        for r in csv.DictReader(fh):
            s = float(r["median_ms"]) * 1e-3
            if r["kind"] == "decode":
                out["decode"][(int(r["batch_size"]), int(r["kv_cache_size"]))] = s
            else:
                out["prefill"][(int(r["prefill_chunk_size"]), int(r["kv_cache_size"]))] = s
    return out


def bare_hardware(preset: str) -> Hardware:
    data = read_hardware_file()
    return hardware_from_preset(
        preset,
        {k: v for k, v in data["presets"][preset].items() if k not in ("efficiency", "engines", "default_engine")},
    )


# ---------------------------------------------------------------------- fits


def _nnls(X, y):
    from schedlab.sim.cost import nnls

    return nnls(X, y)


@dataclass
class LinearFit:
    tile: int
    compute: tuple[float, ...]
    bandwidth: float
    overhead_per_layer_s: float


def _lin_terms(spec: ModelSpec, hw: Hardware, tokens: int, tile: int) -> tuple[float, float, float]:
    """(padded tokens, GEMM seconds per layer at peak, weight seconds per layer at peak bandwidth)."""
    per_layer = spec.active_matmul_params() / spec.layers
    tq = -(-tokens // tile) * tile
    return tq, 2.0 * per_layer * tq / hw.peak(), 2.0 * per_layer / hw.bandwidth


def fit_linear(
    samples: Sequence[tuple[ModelSpec, int, float]], hw: Hardware, tile: int, max_iter: int = 40
) -> LinearFit:
    """e_c (at COMPUTE_KNOTS), e_b, overhead per layer: relative least squares, NNLS with the
    compute/memory side of every sample alternated until stable (as fit_efficiency does)."""
    import numpy as np

    K = len(COMPUTE_KNOTS)
    terms = [_lin_terms(m, hw, t, tile) for m, t, _ in samples]
    y = np.array([s for _, _, s in samples])
    u = np.full(K, 1 / 0.6)
    ub, o = 1 / 0.7, 0.0
    prev = None
    for _ in range(max_iter):
        X = np.zeros((len(samples), K + 2))
        side = []
        for i, (tq, c, m) in enumerate(terms):
            w = log_weights(tq, COMPUTE_KNOTS)
            comp = sum(wt * u[j] for j, wt in w) * c >= ub * m
            side.append(comp)
            if comp:
                for j, wt in w:
                    X[i, j] = wt * c
            else:
                X[i, K] = m
            X[i, K + 1] = 1.0
        key = tuple(side)
        if key == prev:
            break
        prev = key
        Xw = X / y[:, None]
        shift = np.r_[np.ones(K + 1), 0.0]  # inverse efficiencies = 1 + v, v >= 0
        rhs = np.ones(len(y)) - Xw @ shift
        cols = np.where(Xw.any(axis=0))[0]
        sol = np.zeros(K + 2)
        sol[cols] = _nnls(Xw[:, cols], rhs)
        v = sol + shift
        ident = [j for j in range(K) if j in cols]
        for j in range(K):  # an unidentified knot takes its nearest identified neighbour's value
            u[j] = v[j] if j in ident else (v[min(ident, key=lambda k: abs(k - j))] if ident else u[j])
        ub = v[K] if K in cols else ub
        o = v[K + 1]
    return LinearFit(tile, tuple(float(1 / x) for x in u), float(1 / ub), float(o))


def predict_linear(fit: LinearFit, spec: ModelSpec, hw: Hardware, tokens: int) -> float:
    from .serving import inv_interp

    tq, c, m = _lin_terms(spec, hw, tokens, fit.tile)
    c *= inv_interp(tq, COMPUTE_KNOTS, fit.compute)
    m /= fit.bandwidth
    return fit.overhead_per_layer_s + max(c, m)


def fit_decode_attention(
    points: Mapping[tuple[int, int], float], spec: ModelSpec, hw: Hardware
) -> tuple[tuple[float, ...], float, float]:
    """(e_d at DECODE_KNOTS, overhead per layer, per-row seconds) from (rows, context) -> seconds."""
    import numpy as np

    K = len(DECODE_KNOTS)
    kvb = spec.kv_dim * 2.0  # fp16 bytes per token per layer
    keys = sorted(points)
    X = np.zeros((len(keys), K + 2))
    y = np.array([points[k] for k in keys])
    for i, (rows, ctx) in enumerate(keys):
        m = rows * ctx * kvb / hw.bandwidth
        for j, w in log_weights(rows, DECODE_KNOTS):
            X[i, j] = w * m
        X[i, K] = 1.0
        X[i, K + 1] = rows
    Xw = X / y[:, None]
    shift = np.r_[np.ones(K), 0.0, 0.0]
    sol = _nnls(Xw, np.ones(len(y)) - Xw @ shift) + shift
    return tuple(float(1 / x) for x in sol[:K]), float(sol[K]), float(sol[K + 1])


def fit_prefill_attention(
    points: Mapping[tuple[int, int], float], spec: ModelSpec, hw: Hardware
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(e_x, e_y at PREFILL_KNOTS, overhead per layer) from (chunk, context) -> seconds."""
    import numpy as np

    K = len(PREFILL_KNOTS)
    k = 4.0 * spec.heads * spec.head_dim / hw.peak()
    keys = sorted(points)
    X = np.zeros((len(keys), 2 * K + 1))
    y = np.array([points[kk] for kk in keys])
    for i, (n, b) in enumerate(keys):
        for j, w in log_weights(n, PREFILL_KNOTS):
            X[i, j] = w * k * n * b
            X[i, K + j] = w * k * n * (n + 1) / 2.0
        X[i, 2 * K] = 1.0
    Xw = X / y[:, None]
    shift = np.r_[np.ones(2 * K), 0.0]
    cols = np.where(Xw.any(axis=0))[0]
    sol = np.zeros(2 * K + 1)
    sol[cols] = _nnls(Xw[:, cols], (np.ones(len(y)) - Xw @ shift))
    sol += shift
    return (tuple(float(1 / x) for x in sol[:K]), tuple(float(1 / x) for x in sol[K : 2 * K]), float(sol[2 * K]))


# ---------------------------------------------------------------------- errors


def _stats(errs: Sequence[float]) -> dict[str, Any]:
    a = sorted(abs(e) for e in errs)
    if not a:
        return {"n": 0}
    mid = len(a) // 2
    med = a[mid] if len(a) % 2 else (a[mid - 1] + a[mid]) / 2
    return {
        "n": len(a),
        "median_abs": round(med, 4),
        "worst_abs": round(a[-1], 4),
        "mean_signed": round(sum(errs) / len(errs), 4),
    }


@dataclass
class PresetKernelFit:
    preset: str
    serving: ServingEfficiency
    points: dict[str, int]
    errors: dict[str, dict[str, Any]]  # group -> stats (fit / held-out), computed here
    per_model: dict[str, dict[str, Any]] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _linear_samples(table, gpu: str, models: Sequence[str], data=None) -> list[tuple[ModelSpec, int, float]]:
    specs = {m: vidur_spec(m, data) for m in models}
    return [(specs[m], t, s) for m in models for t, s in table[(gpu, m)]]


def _attention_split(att):
    dec_fit = {k: v for k, v in att["decode"].items() if k[0] in DECODE_FIT_ROWS and k[1] in DECODE_FIT_KV}
    dec_out = {k: v for k, v in att["decode"].items() if k not in dec_fit}
    pre_fit = {k: v for k, v in att["prefill"].items() if k[0] in PREFILL_FIT_CHUNKS}
    pre_out = {k: v for k, v in att["prefill"].items() if k not in pre_fit}
    return dec_fit, dec_out, pre_fit, pre_out


def measured_passes(data: str | Path | None = None) -> list[dict[str, Any]]:
    """A100 Llama-2-7B passes built from measured kernels (seconds as Vidur sums them).

    Each: shape, measured_s, held_out (an attention point in it was held out), kind.
    """
    lin = dict(linear_table("a100", data)[("a100", "Llama-2-7b-hf")])
    att = attention_table(data)
    _, dec_out, _, pre_out = _attention_split(att)
    L = vidur_spec("Llama-2-7b-hf", data).layers
    out = []
    for (n, b), s in sorted(att["prefill"].items()):
        if n in lin:
            out.append(
                {
                    "kind": "prefill",
                    "shape": PassShape(prefill=((n, b),)),
                    "measured_s": L * (lin[n] + s),
                    "held_out": (n, b) in pre_out,
                }
            )
    for (r, c), s in sorted(att["decode"].items()):
        if r in lin:
            out.append(
                {
                    "kind": "decode",
                    "shape": PassShape(decode_contexts=(c,) * r),
                    "measured_s": L * (lin[r] + s),
                    "held_out": (r, c) in dec_out,
                }
            )
    # Sarathi-style mixed passes: decode rows + one chunk, at most 512 tokens, on a deterministic grid
    chunks = sorted(k for k in att["prefill"] if k[0] <= 512)
    decs = sorted(k for k in att["decode"] if k[0] in (8, 16, 32, 48, 64, 96, 128))
    for i, (r, c) in enumerate(decs):
        for j, (n, b) in enumerate(chunks):
            if (i * 7 + j) % 23 or r + n > 512 or (r + n) not in lin:
                continue
            out.append(
                {
                    "kind": "mixed",
                    "shape": PassShape(decode_contexts=(c,) * r, prefill=((n, b),)),
                    "measured_s": L * (lin[r + n] + att["decode"][(r, c)] + att["prefill"][(n, b)]),
                    "held_out": (r, c) in dec_out or (n, b) in pre_out,
                }
            )
    return out


#: the passes the brief quotes (A100, Llama-2-7B): measured sums of Vidur's kernels
EXAMPLES = (
    ("512-token prefill", PassShape(prefill=((512, 0),))),
    ("2048-token prefill", PassShape(prefill=((2048, 0),))),
    ("64-row decode at context 1536", PassShape(decode_contexts=(1536,) * 64)),
)


def _example_measured(shape: PassShape, data: str | Path | None = None) -> float:
    """Vidur's kernel sum for an example (decode attention interpolated between measured contexts)."""
    lin = dict(linear_table("a100", data)[("a100", "Llama-2-7b-hf")])
    att = attention_table(data)
    L = 32
    if shape.prefill:
        ((n, b),) = shape.prefill
        return L * (lin[n] + att["prefill"][(n, b)])
    rows, ctx = len(shape.decode_contexts), shape.decode_contexts[0]
    lo = max(c for (r, c) in att["decode"] if r == rows and c <= ctx)
    hi = min(c for (r, c) in att["decode"] if r == rows and c >= ctx)
    a = 0.0 if hi == lo else (ctx - lo) / (hi - lo)
    d = (1 - a) * att["decode"][(rows, lo)] + a * att["decode"][(rows, hi)]
    return L * (lin[rows] + d)


def fit_preset_kernels(
    preset: str, attention: ServingEfficiency | None = None, data: str | Path | None = None
) -> PresetKernelFit:
    """Fit one preset's ``vllm`` factors (FIT_PLAN) and compute its errors, fitted and held out."""
    plan = FIT_PLAN[preset]
    gpu = plan["gpu"]
    hw = bare_hardware(preset)
    table = linear_table(data=data)
    shapes = vidur_models(data)
    models = sorted(m for g, m in table if g == gpu)
    fit_models = plan["fit_models"]
    train = _linear_samples(table, gpu, fit_models, data)
    best = None
    for tile in TILES:
        lf = fit_linear(train, hw, tile)
        err = sum((predict_linear(lf, m, hw, t) / s - 1) ** 2 for m, t, s in train)
        if best is None or err < best[0] - 1e-12:
            best = (err, lf)
    lf = best[1]
    errors: dict[str, dict[str, Any]] = {}
    per_model = {}
    fit_e, out_e = [], []
    for m in models:
        spec = vidur_spec(m, data)
        e = [predict_linear(lf, spec, hw, t) / s - 1 for t, s in table[(gpu, m)]]
        per_model[m] = dict(_stats(e), role="fit" if m in fit_models else "held out")
        (fit_e if m in fit_models else out_e).extend(e)
    errors["linear, fitted models"] = _stats(fit_e)
    errors["linear, held-out models"] = _stats(out_e)
    g2 = CROSS_CHECK.get(preset)
    if g2:
        if True:
            hw2 = bare_hardware(GPU_PRESET[g2])
            e2 = [
                predict_linear(lf, vidur_spec(m, data), hw2, t) / s - 1
                for (g, m), rows in table.items()
                if g == g2
                for t, s in rows
            ]
            errors[f"linear, {g2} files with these factors (another chip)"] = _stats(e2)
    points = {"linear": len(train)}
    notes = [f"GEMM tile {lf.tile} tokens chosen from {', '.join(map(str, TILES))} (least fitted error)"]
    if plan["attention"] == gpu:
        att = attention_table(data)
        dec_fit, dec_out, pre_fit, pre_out = _attention_split(att)
        spec7 = vidur_spec("Llama-2-7b-hf", data)
        e_d, o_d, r_d = fit_decode_attention(dec_fit, spec7, hw)
        e_x, e_y, o_p = fit_prefill_attention(pre_fit, spec7, hw)
        points.update({"decode_attention": len(dec_fit), "prefill_attention": len(pre_fit)})
        att_src = (
            f"fitted to {len(dec_fit)} decode and {len(pre_fit)} prefill attention kernel medians (A100, "
            f"Llama-2-7B) of {ATTENTION_FILE}"
        )
    else:
        if attention is None:
            raise AnalyticError(f"{preset}: attention factors are borrowed; give the fitted preset's")
        a = attention
        e_d, o_d, r_d = a.decode_attention, a.decode_overhead_per_layer_s, a.decode_per_row_s
        e_x, e_y, o_p = a.prefill_context, a.prefill_causal, a.prefill_overhead_per_layer_s
        att_src = "borrowed from a100-80gb-sxm (no attention kernel data for this chip: fractions of peak carried over)"
        notes.append("attention factors borrowed from a100-80gb-sxm: unchecked on this chip")
    serving = ServingEfficiency(
        gemm_tile_tokens=lf.tile,
        compute_tokens=COMPUTE_KNOTS,
        compute=lf.compute,
        bandwidth=lf.bandwidth,
        overhead_per_layer_s=lf.overhead_per_layer_s,
        decode_rows=DECODE_KNOTS,
        decode_attention=e_d,
        decode_overhead_per_layer_s=o_d,
        decode_per_row_s=r_d,
        prefill_chunks=PREFILL_KNOTS,
        prefill_context=e_x,
        prefill_causal=e_y,
        prefill_overhead_per_layer_s=o_p,
        basis="fitted",
        engine="vllm (cuBLAS GEMMs, FlashAttention, paged decode attention) as profiled by Vidur",
        source=(
            f"{SOURCE}; our fit ({FIT_CODE}): GEMMs etc. fitted to {len(train)} per-layer kernel sums "
            f"(medians) of {' and '.join(fit_models)} on {gpu}, "
            + LINEAR_FILES.format(
                gpu=gpu, models=",".join(shapes[m]["_name_or_path"].split("/")[-1] for m in fit_models)
            )
            + f" (num_tensor_parallel_workers 1); attention: {att_src}"
        ),
    )
    res = PresetKernelFit(preset, serving, points, errors, per_model, notes=notes)
    if plan["attention"] == gpu:
        _attention_and_pass_errors(res, hw, data)
    return res


def _attention_and_pass_errors(res: PresetKernelFit, hw: Hardware, data=None) -> None:
    att = attention_table(data)
    dec_fit, dec_out, pre_fit, pre_out = _attention_split(att)
    cm = ServingCostModel(hw, vidur_spec("Llama-2-7b-hf", data), serving=res.serving)
    L = cm.model.layers
    for name, pts, fn in (
        ("decode attention", (dec_fit, dec_out), lambda k: cm.decode_attention_seconds(k[0], k[0] * k[1])),
        ("prefill attention", (pre_fit, pre_out), lambda k: cm.prefill_attention_seconds(*k)),
    ):
        for label, p in zip(("fitted", "held out"), pts):
            res.errors[f"{name}, {label}"] = _stats([fn(k) / L / s - 1 for k, s in p.items()])
    passes = measured_passes(data)
    for kind in ("prefill", "decode", "mixed"):
        for label, ho in (("in-sample", False), ("held out", True)):
            e = [
                cm.pass_seconds(p["shape"]) / p["measured_s"] - 1
                for p in passes
                if p["kind"] == kind and p["held_out"] == ho
            ]
            res.errors[f"passes ({kind}), {label}"] = _stats(e)
    res.errors["passes (all), held out"] = _stats(
        [cm.pass_seconds(p["shape"]) / p["measured_s"] - 1 for p in passes if p["held_out"]]
    )
    res.points["passes"] = len(passes)
    real = ServingCostModel(hw, _llama2_7b(), serving=res.serving)  # the bundled config (vocab 32000)
    old = _published(hw.name)
    for label, shape in EXAMPLES:
        meas = _example_measured(shape, data)
        pred = real.pass_seconds(shape)
        res.examples.append(
            {
                "pass": label,
                "measured_s": round(meas, 5),
                "predicted_s": round(pred, 5),
                "rel": round(pred / meas - 1, 4),
                "llama.cpp_factors_s": round(old.pass_seconds(shape), 5) if old else None,
            }
        )


def _llama2_7b() -> ModelSpec:
    from .modelspec import load_model_config

    name, cfg = load_model_config("llama-2-7b")
    return model_spec(cfg, name)


def _published(preset: str):
    """The preset's published-figure (llama.cpp) cost model of Llama-2-7B, style 'fused', for comparison."""
    from .roofline import AnalyticCostModel

    data = read_hardware_file()
    p = data["presets"][preset]
    if not p.get("efficiency"):
        return None
    hw = hardware_from_preset(preset, {k: v for k, v in p.items() if k not in ("engines", "default_engine")})
    return AnalyticCostModel(hw, _llama2_7b(), style="fused")


def fit_record(results: Mapping[str, PresetKernelFit]) -> dict[str, Any]:
    """What ``analysis/hardware/serving_fit.json`` records: per preset the fitted factors, points,
    errors (fitted and held out; the held-out summary: median and worst) and the quoted passes."""
    presets = {}
    for name, r in results.items():
        held = {k: v for k, v in r.errors.items() if "held out" in k or "another chip" in k}
        top = r.errors.get("passes (all), held out") or r.errors.get("linear, held-out models")
        presets[name] = {
            "factors": r.serving.to_dict(),
            "points": r.points,
            "notes": r.notes,
            "held_out": {
                "headline": "passes (all), held out"
                if "passes (all), held out" in r.errors
                else "linear, held-out models",
                "median_abs": top["median_abs"],
                "worst_abs": top["worst_abs"],
                "n": top["n"],
            },
            "errors": r.errors,
            "held_out_groups": sorted(held),
            "per_model": r.per_model,
            "examples": r.examples,
        }
    return {
        "schema": "schedlab-serving-fit/1",
        "about": "the vllm engine's factors fitted to serving-kernel medians; errors = predicted / measured - 1",
        "generated_by": "python -m schedlab.analysis.analytic refit-serving --data DIR",
        "source": {
            "repository": "microsoft/vidur (MIT)",
            "commit": SOURCE_COMMIT,
            "files": [ALL_LINEAR_FILES, ATTENTION_FILE],
            "extracted_by": "analysis/hardware/kernels/extract_vidur.py (medians; tables not shipped)",
            "fit": FIT_CODE,
        },
        "presets": presets,
        "borrowed": dict(BORROW),
    }


def refit_serving(write: bool = True, data: str | Path | None = None) -> dict[str, PresetKernelFit]:
    """Fit every preset in FIT_PLAN, borrow for the rest; (``write``) update hardware.json's
    ``engines.vllm`` blocks and ``default_engine``, and write SERVING.md and
    ``analysis/hardware/serving_fit.json``. ``data``: the tables' directory (:func:`kernel_data_dir`)."""
    data = kernel_data_dir(data)
    results: dict[str, PresetKernelFit] = {}
    results["a100-80gb-sxm"] = fit_preset_kernels("a100-80gb-sxm", data=data)
    results["h100-sxm"] = fit_preset_kernels("h100-sxm", attention=results["a100-80gb-sxm"].serving, data=data)
    if write:
        data = read_hardware_file()
        for name, res in results.items():
            block = res.serving.to_dict()
            block["fit"] = {"points": res.points, "errors": res.errors, "notes": res.notes}
            p = data["presets"][name]
            p.setdefault("engines", {})["vllm"] = block
            p["default_engine"] = "vllm"
        for name, src in BORROW.items():
            block = {k: v for k, v in data["presets"][src]["engines"]["vllm"].items() if k != "fit"}
            block.update(
                basis="borrowed",
                source=f"no serving-kernel data for this chip; borrowed from {src}, whose source: {block['source']}",
            )
            block["from"] = src
            p = data["presets"][name]
            p.setdefault("engines", {})["vllm"] = block
            p["default_engine"] = "vllm"
        HARDWARE_FILE.write_text(json.dumps(data, indent=2) + "\n")
        (HARDWARE_DIR / "SERVING.md").write_text(serving_report(results))
        FIT_RESULTS.write_text(json.dumps(fit_record(results), indent=1) + "\n")
        from .fit import presets_report

        (HARDWARE_DIR / "PRESETS.md").write_text(presets_report(data))
    return results


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def serving_report(results: Mapping[str, PresetKernelFit]) -> str:
    L = [
        "# Serving-engine (`vllm`) factors",
        "",
        "Generated by `python -m schedlab.analysis.analytic refit-serving --data DIR` from the serving-kernel tables (not",
        "shipped: `kernels/README.md` says how to make them from a clone of Vidur); do not edit by hand. The same",
        "figures, machine-readable: `analysis/hardware/serving_fit.json`.",
        "",
        "The `vllm` engine's cost model (`analysis/analytic/serving.py`) sums, per layer, the GEMMs (a roofline with",
        "e_c by token count, the token count rounded up to the GEMM tile, e_b and a fixed cost), decode attention",
        "(memory-bound, e_d by rows, plus fixed and per-row costs) and FlashAttention prefill (e_x on the chunk's keys",
        "into the cache, e_y on its causal triangle, by chunk, plus a fixed cost). The factors are fitted to",
        "serving kernels' measured medians: Vidur's public profiling of vLLM-style kernels (cuBLAS, FlashAttention),",
        f"{SOURCE}, `{ALL_LINEAR_FILES}` and `{ATTENTION_FILE}`",
        "(see `kernels/README.md`). Errors are predicted / measured - 1, computed by `analysis.analytic.kernels`",
        "(the tests recompute them where the tables are present). *Held out*: models, batches, contexts and chunk",
        "sizes never fitted (see the module docstring of `analysis/analytic/kernels.py` for the split).",
        "",
    ]
    L += [
        "| preset | fitted to | GEMM tile | e_c at 128 / 512 / 2048 tokens | e_b | overhead/layer | decode e_d at 1 / 8 / 32 / 128 rows | prefill e_x / e_y at chunk 64 / 256 / 1024 / 2048 |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for name, r in results.items():
        s = ServingEfficiency.from_dict(r.serving.to_dict())  # as recorded (hardware.json, serving_fit.json)
        fitted_to = ", ".join(f"{k} {v}" for k, v in r.points.items() if k != "passes")
        if "decode_attention" not in r.points:
            fitted_to += " (attention borrowed from a100-80gb-sxm)"
        L.append(
            f"| {name} | {fitted_to} | {s.gemm_tile_tokens} | "
            f"{' / '.join(f'{x:.3f}' for x in s.compute)} | {s.bandwidth:.3f} | {s.overhead_per_layer_s * 1e6:.1f} us | "
            f"{' / '.join(f'{x:.3f}' for x in s.decode_attention)} (+{s.decode_overhead_per_layer_s * 1e6:.1f} us, "
            f"+{s.decode_per_row_s * 1e9:.0f} ns/row) | {' / '.join(f'{x:.2f}' for x in s.prefill_context)}; "
            f"{' / '.join(f'{x:.2f}' for x in s.prefill_causal)} (+{s.prefill_overhead_per_layer_s * 1e6:.1f} us) |"
        )
    L += ["", "Borrowed (no serving-kernel data for the chip):", ""]
    for name, src in BORROW.items():
        L.append(f"- {name} <- {src}")
    L += ["", "## Errors", ""]
    for name, r in results.items():
        L += [f"### {name}", ""]
        for n in r.notes:
            L.append(f"- {n}")
        if r.examples:
            L += [
                "",
                "Passes: layers x (linear + attention) as Vidur sums its kernels, prefill, decode and Sarathi-style",
                "mixed passes built from measured points (`measured_passes`); *in-sample*: every attention point in",
                "it was fitted (the linear part is in-sample for Llama-2-7B throughout).",
            ]
        L += ["", "| what | points | median \\|err\\| | worst \\|err\\| | mean (signed) |", "|---|---:|---:|---:|---:|"]
        for k, st in r.errors.items():
            if st.get("n"):
                L.append(
                    f"| {k} | {st['n']} | {_pct(st['median_abs'])} | {_pct(st['worst_abs'])} | {_pct(st['mean_signed'])} |"
                )
        L += [
            "",
            "| model (linear layers, all token counts <= 4096) | role | points | median \\|err\\| | worst \\|err\\| |",
            "|---|---|---:|---:|---:|",
        ]
        for m, st in r.per_model.items():
            L.append(f"| {m} | {st['role']} | {st['n']} | {_pct(st['median_abs'])} | {_pct(st['worst_abs'])} |")
        if r.examples:
            L += [
                "",
                "| pass (Llama-2-7B) | measured kernel sum (ms) | predicted (ms) | error | llama.cpp factors, one forward (ms) |",
                "|---|---:|---:|---:|---:|",
            ]
            for ex in r.examples:
                old = ex["llama.cpp_factors_s"]
                L.append(
                    f"| {ex['pass']} | {ex['measured_s'] * 1e3:.1f} | {ex['predicted_s'] * 1e3:.1f} | {_pct(ex['rel'])} | "
                    f"{'-' if old is None else f'{old * 1e3:.1f}'} |"
                )
        L.append("")
    return "\n".join(L)
