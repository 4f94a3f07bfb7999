"""Our MLX engine on an H100 (MLX's CUDA backend) against the analytic ``h100-sxm`` models.

Reads what ``bench/mlx_cuda.py`` and the CLI recorded on the device (``bench/results/mlx_cuda_h100/``)
and writes one summary, ``bench/results/mlx_cuda_h100.json``. Runs anywhere (no GPU, no mlx):
predictions come from ``analysis.analytic.predict_pass`` on the recorded pass shapes and model
configs, for the engines whose factors the ``h100-sxm`` preset has (``vllm``, ``llama.cpp``).

- ``passes``: the engine's per-pass times on a Llama-3.1-8B-shaped random-weight model (bf16) at
  the shapes of ``bench/results/gpu_h100_passes.json`` (PyTorch + cuBLAS + FA2 on an H100), side by
  side with those PyTorch times and the analytic predictions;
- ``calibration``: each calibrate sample (1B-shaped bf16, SmolLM2-135M float32), its first and
  last timed run (the first includes the kernels' just-in-time compilation), and the analytic
  prediction of its recovered shape;
- ``greedy``: engine tokens vs the single-sequence reference, per model/dtype/policy;
- ``validate``: simulated vs measured per policy (median |error| of the metrics, per-step error).

    PYTHONPATH=$PWD python bench/mlx_cuda_check.py [--results bench/results/mlx_cuda_h100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from schedlab.analysis.analytic import predict_pass  # noqa: E402
from schedlab.analysis.analytic.local import shape_from_sample  # noqa: E402

ENGINES = ("vllm", "llama.cpp")
BASE = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": True}
LLAMA_1B = dict(BASE, num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256)
# SmolLM2-135M-Instruct as the GGUF file's header gives it (engine.gguf)
SMOLLM2 = dict(BASE, num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def predict(cfg: dict, shape: dict, quant: int) -> dict[str, float]:
    out = {}
    for e in ENGINES:
        try:
            out[e] = predict_pass("h100-sxm", cfg, shape, engine=e, quant=quant) * 1e3
        except Exception as exc:  # noqa: BLE001
            out[e] = None
            out[f"{e}_error"] = str(exc)
    return out


def shape_dict(ps) -> dict:
    return {"decode": list(ps.decode_contexts), "prefill": [list(x) for x in ps.prefill]}


def passes_block(res: Path) -> dict[str, Any]:
    data = json.loads((res / "passes_llama-8b_bfloat16.json").read_text())
    torch = {p["name"]: p for p in json.loads((REPO / "bench/results/gpu_h100_passes.json").read_text())["passes"]}
    rows = []
    for p in data["passes"]:
        if "error" in p:
            continue
        shape = {"decode": p["shape"]["decode"], "prefill": p["shape"]["prefill"]}
        pred = predict(data["config"], shape, 16)
        t = torch.get(p["name"], {}).get("variants", {})
        row = {"name": p["name"], "kind": p["kind"], "mlx_ms": round(p["median_ms"], 3),
               "torch_eager_ms": round(t["eager"]["median_ms"], 3) if "eager" in t else None,
               "torch_fused_graph_ms": round(t["fused_graph"]["median_ms"], 3) if "fused_graph" in t else None,
               "predicted_ms": {k: round(v, 3) for k, v in pred.items() if isinstance(v, float)}}
        row["ratio_pred_over_mlx"] = {k: round(v / p["median_ms"], 3) for k, v in row["predicted_ms"].items()}
        if row["torch_eager_ms"]:
            row["mlx_over_torch_eager"] = round(p["median_ms"] / row["torch_eager_ms"], 3)
        if row["torch_fused_graph_ms"]:
            row["mlx_over_torch_fused_graph"] = round(p["median_ms"] / row["torch_fused_graph_ms"], 3)
        rows.append(row)
    summ = {}
    for kind in ("prefill", "decode"):
        rs = [r for r in rows if r["kind"] == kind]
        s = {"n": len(rs),
             "median_mlx_over_torch_eager": med([r.get("mlx_over_torch_eager") for r in rs]),
             "median_mlx_over_torch_fused_graph": med([r.get("mlx_over_torch_fused_graph") for r in rs])}
        for e in ENGINES:
            rat = [r["ratio_pred_over_mlx"].get(e) for r in rs]
            s[f"{e}_median_ratio_pred_over_mlx"] = med(rat)
            s[f"{e}_median_abs_err"] = med([abs(x - 1) for x in rat if x is not None])
            s[f"{e}_worst_abs_err"] = max((abs(x - 1) for x in rat if x is not None), default=None)
        summ[kind] = s
    return {"model": "llama-3.1-8b shape, random weights, bfloat16 (tied head)", "parameters": data["parameters"],
            "timing": data["timing"], "reps": data["passes"][0].get("reps"), "load_s": data["load_s"],
            "summary": summ, "passes": rows}


def calibration_block(path: Path, cfg: dict, quant: int) -> dict[str, Any]:
    prof = json.loads(path.read_text())
    rows = []
    for s in prof["samples"]:
        ps = shape_from_sample(s)
        if ps is None:
            continue
        runs = s.get("runs") or [s["seconds"]]
        pred = predict(cfg, shape_dict(ps), quant)
        last = runs[-1] * 1e3
        rows.append({"group": s["group"], "label": s["label"], "profile_ms": round(s["seconds"] * 1e3, 3),
                     "first_run_ms": round(runs[0] * 1e3, 3), "last_run_ms": round(last, 3),
                     "predicted_ms": {k: round(v, 3) for k, v in pred.items() if isinstance(v, float)},
                     "ratio_pred_over_last": {k: round(v / last, 3) for k, v in pred.items() if isinstance(v, float)}})
    summ = {}
    for g in sorted({r["group"] for r in rows}):
        rs = [r for r in rows if r["group"] == g]
        multi = [r for r in rs if r["first_run_ms"] != r["last_run_ms"]]
        s = {"n": len(rs), "median_last_run_ms": med([r["last_run_ms"] for r in rs]),
             "median_first_over_last_run": med([r["first_run_ms"] / r["last_run_ms"] for r in multi])}
        for e in ENGINES:
            rat = [r["ratio_pred_over_last"].get(e) for r in rs]
            s[f"{e}_median_ratio_pred_over_measured"] = med(rat)
        summ[g] = s
    return {"profile": path.name, "model": prof["model"], "dtype": prof["dtype"], "device": prof["device"],
            "grid": prof["calibration"]["grid"], "calibration_wall_s": prof["calibration"].get("wall_s"),
            "fit_report": {k: prof["fit_report"][k] for k in ("all_passes", "held_out_passes") if k in prof["fit_report"]},
            "analytic_quant_bits": quant, "summary": summ, "samples": rows}


def greedy_block(res: Path) -> dict[str, Any]:
    out = {}
    for f in sorted(res.glob("greedy_*.json")):
        d = json.loads(f.read_text())
        out[f.stem.removeprefix("greedy_")] = {
            "model": d["model"], "dtype": d["dtype"], "requests": d["requests"], "tokens": d["tokens"],
            "all_equal": d["all_equal"],
            "equal_requests": {k: v.get("equal_requests") for k, v in d["policies"].items()},
            "first_difference": {k: v.get("first_difference") for k, v in d["policies"].items()}}
    return out


def validate_block(res: Path, name: str) -> dict[str, Any]:
    d = json.loads((res / name / "validation.json").read_text())
    pol = {}
    for k, v in d["policies"].items():
        st = v.get("step_error_pct", {})
        ms = v.get("machine_speed", {})
        pol[k] = {"median_abs_error_pct": round(v["median_abs_error_pct"], 1),
                  "max_abs_error_pct": round(v["max_abs_error_pct"], 1),
                  "step_error_p50_pct": round(st.get("p50", float("nan")), 1),
                  "step_error_p90_pct": round(st.get("p90", float("nan")), 1),
                  "step_total_pred_vs_measured_pct": round(st.get("total_pct", float("nan")), 1),
                  "reference_passes_speed_before_after": [ms.get("before", {}).get("ratio"), ms.get("after", {}).get("ratio")]}
        per = res / name / f"{k}.json"
        if per.exists():
            pv = json.loads(per.read_text())
            pol[k]["metrics"] = pv.get("metrics") or pv.get("table") or None
    return {"trace": d["trace"], "model": d["model"], "cost_model": d["cost_model"], "policies": pol}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(REPO / "bench/results/mlx_cuda_h100"))
    ap.add_argument("--out", default=str(REPO / "bench/results/mlx_cuda_h100.json"))
    args = ap.parse_args(argv)
    res = Path(args.results)
    env = json.loads((res / "env.json").read_text())
    out = {
        "schema": "mlx-cuda-h100/1",
        "what": "schedlab's MLX engine (engine/, unchanged) on an NVIDIA H100 through MLX's CUDA backend",
        "device": {k: env.get(k) for k in ("nvidia_smi", "device_info", "platform", "python")},
        "versions": {"mlx": env["mlx"], "mlx_cuda": "mlx-cuda-13 " + env["mlx"], "mlx_lm": env["mlx_lm"],
                     "cuda_libs": "the image's torch 2.11.0+cu130 wheels (nvidia-cublas 13.1.0.3, cudnn-cu13 9.19.0.56, "
                                  "nvrtc 13.0.88, nccl-cu13 2.28.9, cufft 12.0.0.61, cusolver 12.0.4.66); driver 580.159.04"},
        "mlx_ceilings": {"gemm_bf16_8192_tflops": round(env["gemm_bf16"]["tflops"], 1),
                         "copy_gbs_read_plus_write": round(env["copy"]["gbs_read_plus_write"], 1)},
        "analytic": {"hardware": "h100-sxm", "engines": list(ENGINES),
                     "note": "h100-sxm has factors for vllm and llama.cpp only (none for mlx-lm)"},
        "greedy": greedy_block(res),
        "passes_llama_8b": passes_block(res),
        "calibration": {"llama-1b_bf16": calibration_block(res / "profile_llama-1b_bf16.json", LLAMA_1B, 16),
                        "smollm2_f32": calibration_block(res / "profile_smollm2_f32.json", SMOLLM2, 32)},
        "validate": {"llama-1b_bf16": validate_block(res, "validate_llama-1b"),
                     "smollm2_f32": validate_block(res, "validate_smollm2")},
    }
    rr = res / "runreal_smollm2_sonnet" / "summary.json"
    if rr.exists():
        out["run_real_smollm2_sonnet"] = json.loads(rr.read_text())
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    p = out["passes_llama_8b"]["summary"]
    for kind, s in p.items():
        print(f"8B {kind}: MLX/torch-eager {s['median_mlx_over_torch_eager']:.2f}, MLX/torch-fused-graph "
              f"{s['median_mlx_over_torch_fused_graph']:.2f}; vllm pred/MLX {s['vllm_median_ratio_pred_over_mlx']:.2f} "
              f"(|err| med {s['vllm_median_abs_err']:.2f}), llama.cpp pred/MLX {s['llama.cpp_median_ratio_pred_over_mlx']:.2f}")
    for name, c in out["calibration"].items():
        for g, s in c["summary"].items():
            print(f"calib {name} {g}: n={s['n']} last-run median {s['median_last_run_ms']:.2f} ms, first/last "
                  f"{s['median_first_over_last_run'] or float('nan'):.2f}, vllm pred/meas {s['vllm_median_ratio_pred_over_measured']:.2f}, "
                  f"llama.cpp {s['llama.cpp_median_ratio_pred_over_measured']:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
