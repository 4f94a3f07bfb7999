"""The analytic GPU model against real passes: predicted vs measured pass times on an H100.

Reads what ``bench/gpu_kernels.py`` measured on a real GPU (``bench/results/gpu_h100_passes.json``:
Llama-3.1-8B-shaped forward passes, bf16, PyTorch with cuBLAS GEMMs and FlashAttention-2) and
predicts every pass with whatever ``analysis.analytic`` is importable when this runs
(``make_analytic_cost_model(hardware, model_config, quant, engine=engine)``, default ``h100-sxm``,
``llama-3.1-8b``, 16 bits, the preset's default engine: ``vllm`` on NVIDIA presets), so that a refit of the presets can be re-checked by running it
again. Per pass: measured ms (each variant), predicted ms, ratio predicted / measured,
|error| = |ratio - 1|, which roofline term binds, the pass at unit efficiency (datasheet peaks,
and the machine's measured ceilings) and the fraction of peak the real pass reached. Summary:
median and worst |error| by kind (prefill, decode) and variant. Also fits the roofline's
factors to these passes (``fit_efficiency``), as information for a refit; nothing is written
to the presets.

Variants (see ``bench/gpu_kernels.py``): ``fused_graph`` (the default primary: fused
element-wise ops and CUDA graphs, the closest to a vLLM-class engine), ``graph``, ``eager``.

    PYTHONPATH=$PWD python bench/gpu_check.py [--measured bench/results/gpu_h100_passes.json]
        [--hardware h100-sxm] [--model-config llama-3.1-8b] [--quant 16] [--engine vllm|llama.cpp] [--variant fused_graph]
        [--out bench/results/gpu_h100_check.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from schedlab.analysis.analytic import make_analytic_cost_model  # noqa: E402
from schedlab.policies.base import PassShape  # noqa: E402

VARIANTS = ("fused_graph", "graph", "eager")


def pass_shape(entry: dict[str, Any]) -> PassShape:
    s = entry["pass_shape"]
    if "decode_rows" in s:
        return PassShape(decode_contexts=(int(s["decode_context"]),) * int(s["decode_rows"]))
    return PassShape(prefill=tuple((int(n), int(b)) for n, b in s["prefill"]),
                     prefill_done=tuple(bool(x) for x in s.get("prefill_done", ())))


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def unit_terms(cost: Any, shape: PassShape) -> tuple[float, float, float, str]:
    """(FLOPs, bytes, forwards, bound) of a pass, summed over its forwards."""
    flops = byts = 0.0
    n = 0
    bounds = []
    for f in cost.forwards(shape):
        flops += cost.flops(f)
        byts += cost.bytes(f) + f.extra_bytes
        bounds.append(cost.bound(f))
        n += 1
    return flops, byts, float(n), "/".join(sorted(set(bounds)))


def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    errs = [(r["abs_err"][key], r["name"]) for r in rows if key in r["abs_err"]]
    ratios = [r["ratio"][key] for r in rows if key in r["ratio"]]
    if not errs:
        return {}
    worst = max(errs)
    return {"n": len(errs), "median_abs_err": statistics.median(e for e, _ in errs),
            "worst_abs_err": worst[0], "worst_pass": worst[1], "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}


def fits(cost: Any, rows: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    """The roofline's factors fitted to these passes (information only)."""
    from schedlab.analysis.analytic import fit_efficiency

    samples = [{"shape": r["_shape"], "seconds": r["measured_ms"][variant] / 1e3, "label": r["name"]}
               for r in rows if variant in r["measured_ms"]]
    out: dict[str, Any] = {"variant": variant, "points": len(samples)}
    # decode attention is left tied to the others: it is bound by the KV read, which the bytes
    # term already counts (fitted on its own it only turns the max into a sum)
    for name, optional in (("plain", ()), ("with_prefill_attention", ("attention",))):
        try:
            res = fit_efficiency(samples, cost_model=cost, optional=optional, engine="PyTorch bf16 + FA2",
                                 source="bench/results/gpu_h100_passes.json")
            e = res.efficiency
            block = {"compute": e.compute, "bandwidth": e.bandwidth,
                     "overhead_per_layer_s": e.overhead_per_layer_s}
            for k in optional:
                block[k] = getattr(e, k)
            out[name] = {"efficiency": block, "fitted": list(res.fitted), "max_abs_residual": res.max_abs_residual,
                         "rms_residual": res.rms_residual,
                         "residuals": {r["label"]: round(r["rel"], 4) for r in res.residuals}}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default=str(REPO / "bench" / "results" / "gpu_h100_passes.json"))
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model-config", default="llama-3.1-8b")
    ap.add_argument("--quant", type=int, default=16)
    ap.add_argument("--engine", default=None, help="whose factors (vllm, llama.cpp, mlx-lm; default: the preset's)")
    ap.add_argument("--variant", default="fused_graph", choices=VARIANTS, help="the primary measured variant")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_h100_check.json"))
    ap.add_argument("--no-fit", action="store_true")
    args = ap.parse_args(argv)

    meas = json.loads(Path(args.measured).read_text())
    cost, _kv, meta = make_analytic_cost_model(args.hardware, args.model_config, args.quant, engine=args.engine)
    peak, bw = cost.peak, cost.hardware.bandwidth
    ceil = meas.get("ceilings", {})
    m_peak = ceil.get("gemm_bf16", {}).get("tflops_median", 0.0) * 1e12
    m_bw = ceil.get("read", {}).get("tbps_median", 0.0) * 1e12

    rows: list[dict[str, Any]] = []
    for e in meas["passes"]:
        shape = pass_shape(e)
        pred = cost.pass_seconds(shape) * 1e3
        flops, byts, nfw, bound = unit_terms(cost, shape)
        unit_ms = max(flops / peak, byts / bw) * 1e3
        r: dict[str, Any] = {
            "name": e["name"], "kind": e["kind"], "rows": e.get("rows"), "tokens": e.get("tokens"),
            "context": e.get("context"), "predicted_ms": pred, "bound": bound,
            "gflop": flops / 1e9, "gbytes": byts / 1e9,
            "roofline_datasheet_ms": unit_ms,
            "roofline_measured_ceilings_ms": (max(flops / m_peak, byts / m_bw) * 1e3 if m_peak and m_bw else None),
            "measured_ms": {}, "ratio": {}, "abs_err": {}, "fraction_of_datasheet_roofline": {}, "_shape": shape,
        }
        for v in VARIANTS:
            x = e["variants"].get(v, {})
            if "median_ms" in x:
                r["measured_ms"][v] = x["median_ms"]
                r["ratio"][v] = pred / x["median_ms"]
                r["abs_err"][v] = abs(pred / x["median_ms"] - 1)
                r["fraction_of_datasheet_roofline"][v] = unit_ms / x["median_ms"]
        rows.append(r)

    summary = {v: {k: summarize([r for r in rows if r["kind"] == k], v) for k in ("prefill", "decode", "all")
                   if k != "all"} for v in VARIANTS}
    for v in VARIANTS:
        summary[v]["all"] = summarize(rows, v)
    result: dict[str, Any] = {
        "schema": "schedlab-gpu-check/1",
        "about": "analytic roofline predictions vs real H100 passes (bench/gpu_kernels.py); "
                 "ratio = predicted / measured, abs_err = |ratio - 1|",
        "measured_file": str(Path(args.measured).resolve().relative_to(REPO)) if Path(args.measured).resolve().is_relative_to(REPO) else args.measured,
        "measured_env": {k: meas.get("env", {}).get(k) for k in ("gpu", "torch", "cuda_runtime", "sm_count")},
        "measured_ceilings": {"gemm_bf16_tflops": m_peak / 1e12, "read_tbps": m_bw / 1e12,
                              "copy_tbps_read_plus_write": ceil.get("copy", {}).get("tbps_read_plus_write_median")},
        "cost_model": {"hardware": args.hardware, "model_config": args.model_config, "quant": args.quant,
                       "git": git_rev(), "peak_tflops": peak / 1e12, "bandwidth_tbps": bw / 1e12,
                       "engine": cost.hardware.engine or meta.get("engine"),
                       "efficiency_applied": meta.get("efficiency_applied") or meta.get("serving_efficiency"),
                       "style": meta.get("style"),
                       "step_overhead_s": cost.efficiency.step_overhead_s},
        "primary_variant": args.variant,
        "summary": summary,
        "passes": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }
    if not args.no_fit:
        result["fitted_to_these_passes"] = {v: fits(cost, rows, v) for v in (args.variant, "eager")}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    v = args.variant
    eff = meta.get("efficiency_applied") or meta.get("serving_efficiency") or {}
    print(f"{args.hardware}, engine {cost.hardware.engine or '-'} (e_c {eff.get('compute')}, e_b {eff.get('bandwidth')}, "
          f"o {eff.get('overhead_per_layer_s')} s/layer) vs {meas.get('env', {}).get('gpu')}; measured = {v}")
    print(f"{'pass':26s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s} {'eager':>8s} {'roofline':>8s} {'bound':>7s}")
    for r in rows:
        mm = r["measured_ms"].get(v, float("nan"))
        print(f"{r['name']:26s} {mm:9.2f} {r['predicted_ms']:9.2f} {r['ratio'].get(v, float('nan')):6.2f} "
              f"{r['measured_ms'].get('eager', float('nan')):8.2f} {r['roofline_datasheet_ms']:8.2f} {r['bound']:>7s}")
    for k in ("prefill", "decode", "all"):
        s = summary[v].get(k) or {}
        if s:
            print(f"{k:8s} median |err| {s['median_abs_err']:6.1%}  worst {s['worst_abs_err']:6.1%} ({s['worst_pass']})  "
                  f"median ratio {s['median_ratio']:.2f}")
    for name, f in (result.get("fitted_to_these_passes", {}).get(v) or {}).items():
        if isinstance(f, dict) and "efficiency" in f:
            print(f"fit {name}: {json.dumps({k: round(x, 6) for k, x in f['efficiency'].items()})} "
                  f"max|res| {f['max_abs_residual']:.1%}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
