"""The analytic roofline on this CPU against the real engine, next to the calibrated profile.

Issue 6's "check it where we can": on ``cpu-local`` with the engine's ``tiny`` model, how
well does the analytic model (``analysis/analytic``, factors fitted to this machine's calibration
samples) predict run-real, compared with the calibrated linear profile?

Two levels, both written to one JSON:

1. **Passes**: the bundled profile's calibration samples (real passes timed by
   ``calibrate``), predicted by the linear profile (its own fit report: a quarter held out)
   and by the roofline fitted to the same samples the same way (``fit_local``), in three
   forms: ``roofline_as_before`` (three factors, causal attention counting, no lazy prefill:
   the model as it was before this check), ``plain`` (three factors, the engine's counting)
   and ``full`` (plus attention, decode-attention, copy and copy-overhead factors: what
   ``validate --hardware cpu-local`` uses).
2. **Runs**: for every policy and trace, ``validate`` (linear profile) and ``validate
   --hardware cpu-local`` (analytic), each with ``--repeat`` real runs, interleaved policy by
   policy (the order alternates) so that a slow spell of the machine hits both alike. Per
   run: the metric errors (simulated vs measured median), their median and max, and the
   per-step error of the cost model over every real step (steps.csv's predicted_s is the
   model's own).

The machine's load average is recorded before and after every validate call: timing noise
is +-5-10 % on this 2-core machine even when idle.

    python bench/analytic_cpu_local.py [--traces real-smoke,real-mixed] [--policies all]
        [--repeat 2] [--model tiny] [--out bench/results/analytic_cpu_local.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def pass_level(model: str) -> dict:
    """Pass errors of the linear profile and of the roofline fitted to the same samples."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before anything else)
    from schedlab.engine.models import preset_config
    from schedlab.analysis.analytic import fit_efficiency
    from schedlab.analysis.analytic.hardware import DEFAULT_EFFICIENCY, Efficiency, load_hardware
    from schedlab.analysis.analytic.local import PASS_GROUPS, _errors, fit_local, shape_from_sample, split_passes
    from schedlab.analysis.analytic.modelspec import model_spec
    from schedlab.analysis.analytic.roofline import AnalyticCostModel
    from schedlab.sim.profiles import bundled_profiles

    prof = next((json.loads(p.read_text()) for p in bundled_profiles()
                 if json.loads(p.read_text()).get("model") == model), None)
    if prof is None:
        return {"error": f"no bundled profile of {model}"}
    cfg = preset_config(model)
    hw = load_hardware("cpu-local")
    block = fit_local(prof["samples"], cfg, name=model, hardware=hw)
    # the roofline as it was: three factors, causal attention, every chunk computing its head
    spec = model_spec(cfg, model)
    p0 = DEFAULT_EFFICIENCY["cpu"]
    old = AnalyticCostModel(hw, spec, 32, kv_bits=32, lazy_prefill=False, causal_skip=True,
                            efficiency=Efficiency(p0.compute, p0.bandwidth, p0.overhead_per_layer_s))
    by = {g: [(s, shape_from_sample(s)) for s in prof["samples"] if s["group"] == g] for g in PASS_GROUPS}
    fit_part, held = split_passes(by)
    res = fit_efficiency([(sh, s["seconds"]) for s, sh in fit_part], cost_model=old,
                         starts=({"bandwidth": 1.0}, {"bandwidth": 0.05, "overhead_per_layer_s": 1e-4}))
    cm = old.with_efficiency(res.efficiency)

    def errs(items):
        return _errors([(cm.pass_seconds(sh), s["seconds"]) for s, sh in items])

    as_before = {"efficiency": res.efficiency.to_dict(), "fit": errs(fit_part), "held_out_passes": errs(held),
                 "all_passes": errs([x for g in PASS_GROUPS for x in by[g]]),
                 "groups": {g: errs(by[g]) for g in PASS_GROUPS}}
    rep = prof["fit_report"]
    linear = {"all_passes": rep["all_passes"], "held_out_passes": rep["held_out_passes"],
              "groups": {g: rep[g].get("held_out") for g in ("decode", "join", "leave", "prefill", "mixed", "step")},
              "terms": len(prof["coefficients"])}
    return {"profile_date": prof.get("date"), "samples": block["samples"], "hardware_measured": {
        "peak_gflops": block["peak_gflops"], "bandwidth_gbs": block["bandwidth_gbs"], "machine": block["machine"]},
        "linear": linear, "roofline_as_before": as_before, "plain": block["models"]["plain"],
        "full": block["models"]["full"]}


def run_validate(policy: str, trace: str, model: str, repeat: int, out: Path, hardware: str | None) -> dict:
    args = [str(BIN / "validate"), "--policy", policy, "--trace", trace, "--model", model,
            "--repeat", str(repeat), "--out", str(out), "-q"]
    if hardware:
        args += ["--hardware", hardware]
    before = loadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = loadavg()
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}",
                "load_before": before, "load_after": after}
    v = json.loads((out / "validation.json").read_text())
    note = next((ln for ln in proc.stderr.splitlines() if "note:" in ln), "")
    return {
        "median_abs_error_pct": v["median_abs_error_pct"],
        "max_abs_error_pct": v["max_abs_error_pct"],
        "step_error_pct": v["step_error_pct"],
        "metrics": {k: {"sim": r["sim"], "real": r["real"], "error_pct": r["error_pct"],
                        "spread_pct": r.get("spread_pct")} for k, r in v["metrics"].items()},
        "cost_model": {k: v["cost_model"].get(k) for k in ("kind", "profile", "hardware", "factors", "factors_note")
                       if k in v["cost_model"]},
        "machine_speed": v.get("machine_speed"),
        "drift_adjusted": {k: (v.get("drift_adjusted") or {}).get(k)
                           for k in ("speed_factor", "median_abs_error_pct", "max_abs_error_pct", "step_error_pct")}
        if v.get("drift_adjusted") else None,
        "note": note.strip(),
        "wall_s": round(wall, 1),
        "load_before": before,
        "load_after": after,
    }


def summarize(rows: list[dict]) -> dict:
    def med(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    def med_step(key):
        xs = [r["step_error_pct"][key] for r in rows if r.get("step_error_pct", {}).get(key) is not None]
        return statistics.median(xs) if xs else None

    adj = [r["drift_adjusted"]["median_abs_error_pct"] for r in rows
           if r.get("drift_adjusted") and r["drift_adjusted"].get("median_abs_error_pct") is not None]
    return {"policies": len(rows), "median_of_median_abs_error_pct": med("median_abs_error_pct"),
            "drift_adjusted_median_of_median_abs_error_pct": statistics.median(adj) if adj else None,
            "median_of_max_abs_error_pct": med("max_abs_error_pct"), "median_step_p50_pct": med_step("p50"),
            "median_step_p90_pct": med_step("p90"), "median_step_total_pct": med_step("total_pct")}


def table(result: dict) -> str:
    L = ["| trace | policy | linear median / max |err| % | analytic median / max |err| % | "
         "linear step p50 / p90 % | analytic step p50 / p90 % | drift-adjusted median |err| % linear / analytic |",
         "|---|---|---:|---:|---:|---:|---:|"]

    def f(x):
        return "-" if x is None else f"{x:.1f}"

    for trace, pols in result["runs"].items():
        for pol, r in pols.items():
            lin, ana = r["linear"], r["analytic"]
            if "error" in lin or "error" in ana:
                L.append(f"| {trace} | {pol} | {lin.get('error', '')} | {ana.get('error', '')} | | | |")
                continue
            L.append(f"| {trace} | {pol} | {f(lin['median_abs_error_pct'])} / {f(lin['max_abs_error_pct'])} | "
                     f"{f(ana['median_abs_error_pct'])} / {f(ana['max_abs_error_pct'])} | "
                     f"{f(lin['step_error_pct']['p50'])} / {f(lin['step_error_pct']['p90'])} | "
                     f"{f(ana['step_error_pct']['p50'])} / {f(ana['step_error_pct']['p90'])} | "
                     f"{f((lin.get('drift_adjusted') or {}).get('median_abs_error_pct'))} / "
                     f"{f((ana.get('drift_adjusted') or {}).get('median_abs_error_pct'))} |")
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="real-smoke,real-mixed")
    ap.add_argument("--policies", default="all")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "analytic_cpu_local.json")
    ap.add_argument("--work", type=Path, default=None, help="where the validate directories go (default: a temp dir)")
    ap.add_argument("--skip-runs", action="store_true", help="only the pass-level comparison")
    args = ap.parse_args()

    from schedlab.policies import POLICIES

    policies = list(POLICIES) if args.policies == "all" else [p.strip() for p in args.policies.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="analytic_cpu_local_"))
    t0 = time.time()
    result = {
        "what": "analytic roofline (validate --hardware cpu-local) vs calibrated linear profile (validate), "
                "real MLX runs on this CPU",
        "model": args.model,
        "repeat": args.repeat,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_at_start": loadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "passes": pass_level(args.model),
        "runs": {},
    }
    k = 0
    for trace in [t.strip() for t in args.traces.split(",") if t.strip()]:
        result["runs"][trace] = {}
        if args.skip_runs:
            continue
        for pol in policies:
            order = ("linear", "analytic") if k % 2 == 0 else ("analytic", "linear")
            k += 1
            row = {}
            for kind in order:
                out = work / trace / pol / kind
                print(f"[{time.time() - t0:6.0f} s] {trace} {pol} {kind}", file=sys.stderr, flush=True)
                row[kind] = run_validate(pol, trace, args.model, args.repeat, out,
                                         "cpu-local" if kind == "analytic" else None)
            result["runs"][trace][pol] = {"linear": row["linear"], "analytic": row["analytic"], "order": list(order)}
    result["summary"] = {trace: {kind: summarize([r[kind] for r in pols.values() if "error" not in r[kind]])
                                 for kind in ("linear", "analytic")}
                         for trace, pols in result["runs"].items() if pols}
    result["machine"]["load_at_end"] = loadavg()
    result["wall_s"] = round(time.time() - t0, 1)
    result["table_md"] = table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    p = result["passes"]
    if "error" not in p:
        print("pass-level (bundled profile's samples): median / max |error| %, all passes and held out")
        for kind in ("linear", "roofline_as_before", "plain", "full"):
            a, h = p[kind]["all_passes"], p[kind]["held_out_passes"]
            print(f"  {kind:20s} all {a['median_abs_pct']:5.1f} / {a['max_abs_pct']:5.1f}   "
                  f"held out {h['median_abs_pct']:5.1f} / {h['max_abs_pct']:5.1f}")
    if result["runs"] and any(result["runs"].values()):
        print(result["table_md"])
        for trace, s in result["summary"].items():
            print(trace, json.dumps(s))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
