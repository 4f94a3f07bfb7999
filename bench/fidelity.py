"""Fidelity: how far `simulate` is from `run-real` on traces the calibration never saw.

Per model (tiny, smollm2-135m): the default calibration first, made fresh and timed (what
validate and run-real make when no profile matches: the quick grid + a short real replay of a
few policies on a small synthetic trace, fitted together; ``--profile`` uses a given one
instead), then per held-out trace and per policy one simulation and ``--repeat`` real runs,
compared as ``validate`` compares them (measured = median of the real runs; the policies' real
runs interleaved round by round, so that the machine's drift meets every policy alike). Recorded:

- the nine metrics' errors (simulated vs measured, %), their median and worst;
- the real runs' spread per metric ((max - min) / median, %), beside each error;
- the step bias: median measured/predicted over every real step (back to back, after idle),
  and the total predicted vs measured step time;
- pairwise direction: for every pair of policies on a trace and every metric where the real
  runs differ by more than their spread (the medians further apart than either policy's
  max - min), whether the simulation orders the two the same way; the share per metric; and
  the same with each policy simulated at its runs' own speed (``pairwise_speed_matched``).
- drift-adjusted: the simulation made again at the machine's speed timed before and after the
  policies' real runs (``--speed-probe``: the calibration's own replay run again, default, or
  the profile's isolated reference passes), at their mean: a prediction made without the runs'
  own timings; with ``--speed-every-run`` the machine is probed after every real run too and each
  run simulated at the mean of the probes either side of it (its own held-out line and step
  median; ``probe_tracking``: how far a run's own speed was from its probed one);
- speed-matched: the simulation made again at each real run's own speed (its total measured /
  predicted step time; the policy still plans with the profile), compared as above: the errors
  left once the machine's speed during the runs is taken out — the model's share — and the
  steps' median and mean measured/predicted at that speed.

Held-out traces (none is the replay's): for tiny the bundled real-smoke and real-mixed and
azure-conv-150 (150 consecutive requests of the Azure 2023 conversation hour, scaled); for
smollm2-135m (~20x slower passes) a seeded ``random:`` trace of 24 requests and azure-conv-24,
sized so one real run takes ~20-60 s.

Goal (issue 13): per policy, median |error| <= 5 %, worst <= 15 %, total predicted step time
within +-3 %, pairwise direction right; default calibration <= 3 minutes.

    python bench/fidelity.py [--models tiny,smollm2-135m] [--repeat 3] [--noise gc-off] [--speed-every-run]
                             [--out bench/results/fidelity.json] [--keep DIR] [--rescore DIR]

``--rescore DIR`` (DIR: an earlier run's ``--keep``) runs no real engine: it simulates again with
this checkout and the kept profiles and compares with the kept real runs, for checking a change
to the simulator against the same reality in seconds. A trace where the recording was cut off
(no ``validation.json`` beside a policy's runs) is scored from the runs that finished
(``partial_runs`` in its row; no spread, no drift probe, left out of pairwise). ``--refit`` (with ``--rescore``): the kept
profile fitted again by this checkout from its own data (the kept grid samples and replay runs),
for checking a change to the fit the same way; the step figures are then the kept real steps
against the refitted profile. (The kept real runs' policies planned with the kept profile: a
policy whose plan depends on the cost model may differ a little from its re-simulation.)
``--without TERMS`` (with ``--refit``): those cost terms left out of the refit (their features
zeroed in the kept samples and runs): an ablation, what the terms bring on the same real runs;
``--force TERMS``: candidate terms fitted even where the replay's held-out score would not keep them.
``--profile F`` (with ``--rescore``, one model): the kept runs scored against another profile
(steps included), e.g. a calibration made since with a changed grid, beside one made the old way.

Results: ``bench/results/fidelity.json`` (what it found: ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import common
from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab import traces
from schedlab.engine import blas
from schedlab.engine.models import load_model
from schedlab.policies import POLICIES, make_policy
from schedlab.sim.cost import FEATURES, LinearCostModel
from schedlab.api._validation import validate_many  # (the API's multi-policy validation: not public)

# (trace spec, seed): held out from every calibration (the replay draws its own trace)
# Long enough that a tail percentile is not one request's or one interval's luck (150
# requests on tiny, 24 on SmolLM2: its runs take ~20x longer per token); the azure-conv
# slices are production traffic (the Azure 2023 conversation hour's order, bursts and
# length mix, scaled to these models: traces/data/README.md).
TRACES = {
    "tiny": [("real-smoke", 0), ("real-mixed", 0), ("azure-conv-150", 0)],
    "smollm2-135m": [("random:n=24,input_len=80,output_len=28,range_ratio=0.5,rate=1.2", 22), ("azure-conv-24", 0)],
    "micro": [("real-smoke", 0)],  # smoke runs of this script
}
GOAL = {"median_abs_error_pct": 5.0, "max_abs_error_pct": 15.0, "total_step_time_pct": 3.0, "calibration_s": 180.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--traces", default=None, help="MODEL=spec@seed;spec@seed,... overrides (default: TRACES)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--profile",
        default=None,
        help="use this profile (one model) instead of calibrating; with "
        "--rescore: score the kept runs (their steps too) against it instead of their own",
    )
    ap.add_argument(
        "--noise",
        default=None,
        help="engine.noise settings for every run and calibration "
        "(gc-off, pin=0-1, warmup=N, malloc-keep, mlx-cache=SIZE)",
    )
    ap.add_argument(
        "--no-speed-check",
        action="store_true",
        help="skip validate's machine-speed checks (and so the drift-adjusted comparison): ~2x faster on smollm2",
    )
    ap.add_argument(
        "--speed-probe",
        default="replay",
        choices=("replay", "passes"),
        help="how validate times the machine's speed before and after the runs (drift-adjusted): the "
        "calibration's own replay run again (default), or the profile's isolated reference passes",
    )
    ap.add_argument(
        "--speed-every-run",
        action="store_true",
        help="time the machine's speed after every real run too (each run then has its own, from the "
        "probes just before and after it: drift-adjusted per run); ~1.5x the time with the replay probe",
    )
    ap.add_argument("--out", default=str(common.result_path("fidelity")))
    ap.add_argument("--keep", default=None, help="keep the run directories (and the replay's) here")
    ap.add_argument(
        "--rescore",
        default=None,
        help="a --keep directory of an earlier run: simulate again with "
        "this checkout and its kept profiles, compared with its kept real runs (no real run)",
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="with --rescore: fit each kept profile again from its "
        "kept grid samples and replay runs with this checkout's fit",
    )
    ap.add_argument(
        "--without",
        default=None,
        help="with --refit: cost terms (comma-separated) left out of the fit, "
        "their features zeroed in the kept samples and runs: what the terms bring, on the same real runs",
    )
    ap.add_argument(
        "--force",
        default=None,
        help="with --refit: candidate terms (comma-separated, "
        "analysis.runfit.CANDIDATES) fitted whether or not the replay's held-out score keeps them",
    )
    args = ap.parse_args()
    if args.noise is not None:
        from schedlab.engine.noise import ENV, Noise

        Noise.parse(args.noise)
        os.environ[ENV] = args.noise
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fidelity-"))
    overrides = _parse_traces(args.traces)
    policies = args.policies.split(",")
    out = {
        "benchmark": "fidelity",
        "goal": GOAL,
        "repeat": args.repeat,
        "noise": args.noise,
        "speed_probe": None if args.rescore else args.speed_probe,
        "speed_every_run": None if args.rescore else args.speed_every_run,
        "rev": common.git_rev(),
        "openblas_num_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
        "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads", "thread_timeout")},
        "machine": common.machine(),
        "models": {},
    }
    t_all = time.perf_counter()
    if args.refit and not args.rescore:
        raise SystemExit("--refit goes with --rescore DIR")
    if args.rescore and args.profile and (args.refit or len(args.models.split(",")) != 1):
        raise SystemExit("--rescore with --profile: one model, and no --refit")
    without = tuple(t for t in (args.without or "").split(",") if t)
    if without and not args.refit:
        raise SystemExit("--without goes with --rescore DIR --refit")
    if set(without) - set(FEATURES):
        raise SystemExit(f"--without: unknown cost term(s) {', '.join(sorted(set(without) - set(FEATURES)))}")
    from schedlab.analysis.runfit import CANDIDATES

    force = tuple(t for t in (args.force or "").split(",") if t)
    if force and not args.refit:
        raise SystemExit("--force goes with --rescore DIR --refit")
    if set(force) - set(CANDIDATES):
        raise SystemExit(
            f"--force: not a candidate term: {', '.join(sorted(set(force) - set(CANDIDATES)))} "
            f"(candidates: {', '.join(CANDIDATES)})"
        )
    if args.rescore:
        out["rescored_from"] = str(args.rescore)
        out["refit"] = bool(args.refit)
        out["without"] = list(without)
        out["force"] = list(force)
        out["profile"] = args.profile
    for model in args.models.split(","):
        if args.rescore:
            out["models"][model] = rescore_model(
                model,
                policies,
                overrides.get(model) or kept_traces(Path(args.rescore), model),
                Path(args.rescore) / model.replace("/", "_"),
                args.refit,
                without=without,
                force=force,
                profile=Path(args.profile) if args.profile else None,
            )
            continue
        out["models"][model] = run_model(
            model, policies, overrides.get(model, TRACES.get(model)), args, work / model.replace("/", "_")
        )
        _write(out, args.out, t_all)
    _write(out, args.out, t_all)
    print(format_markdown(out))
    print(f"wrote {args.out}")


def _write(out: dict, path: str, t0: float) -> None:
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    common.write_json(out, path, indent=1)


def _parse_traces(spec: str | None) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for part in (spec or "").split("|"):
        if not part.strip():
            continue
        model, _, rest = part.partition("=")
        items = []
        for t in rest.split(";"):
            name, _, seed = t.rpartition("@") if "@" in t else (t, "", "0")
            items.append((name, int(seed or 0)))
        out[model.strip()] = items
    return out


def run_model(model: str, policies: list[str], trace_specs, args, work: Path) -> dict:
    info = load_model(model)
    work.mkdir(parents=True, exist_ok=True)
    if args.profile:
        path = Path(args.profile)
        cal = {"kind": "given", "profile": str(path)}
    else:
        from schedlab.engine.calibrate import calibrate_default, write_profile

        print(f"{model}: default calibration (quick grid + real replay) ...", flush=True)
        t0 = time.perf_counter()
        prof = calibrate_default(info, progress=lambda m: print(f"  {m}", flush=True), keep=work / "replay")
        wall = time.perf_counter() - t0
        path = write_profile(prof, work / "profile.json")
        cal = _calibration(prof, path, wall)
        print(f"{model}: calibrated in {wall:.0f} s", flush=True)
    cost = LinearCostModel.from_profile(path)
    capacity = int(cost.meta.get("kv_tokens", 262144))
    res: dict = {"calibration": cal, "traces": {}}
    for spec, seed in trace_specs:
        tr = traces.load(spec, seed=seed)
        info.check_trace(tr.requests)
        key = spec if spec.startswith("real-") else f"{spec}@{seed}"
        res["traces"][key] = {}
        # the policies' real runs interleaved round by round (validate_many): drift meets them all alike
        vs = validate_many(
            {p: make_policy(p) for p in policies},
            tr,
            info,
            cost,
            capacity,
            {p: work / _safe(key) / p for p in policies},
            args.repeat,
            seed,
            {"kind": "linear", "profile": str(path)},
            lambda m: print(f"{model} {key[:40]}: {m}", flush=True),
            speed_check_runs=not args.no_speed_check,
            speed_probe=args.speed_probe,
            speed_every_run=args.speed_every_run,
        )
        for pname in policies:
            _record(res, model, key, pname, vs[pname][0])
    return _summarise(res, policies)


def kept_traces(kept: Path, model: str) -> list[tuple[str, int]]:
    """The trace specs a ``--keep`` directory's model ran (its run directories name them, as the
    bench's own TRACES do)."""
    base = kept / model.replace("/", "_")
    if not base.is_dir():
        raise SystemExit(f"{base}: not kept (was the earlier run made with --keep, and with this model?)")
    names = {d.name for d in base.iterdir() if d.is_dir() and d.name != "replay"}
    known = {_safe(s if s.startswith("real-") else f"{s}@{seed}"): (s, seed) for s, seed in TRACES.get(model, [])}
    if not names <= set(known):
        raise SystemExit(
            f"{base}: trace directories {sorted(names - set(known))} are not the bench's traces; "
            f"give --traces as the earlier run took them"
        )
    return [known[n] for n in sorted(names)]


def kept_replay(kept: Path) -> list:
    """The replay runs a ``--keep`` run kept of its default calibration (``analysis.runfit`` runs)."""
    from schedlab.analysis.runfit import load_runs

    if not (kept / "replay").is_dir():
        raise SystemExit(f"{kept / 'replay'}: no kept replay runs")
    return load_runs(sorted(d for d in (kept / "replay").iterdir() if d.is_dir()))


def _refit(path: Path, kept: Path, without: tuple[str, ...] = (), force: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """The kept profile fitted again from its own data by this checkout: its grid samples (the
    grid's fit as the base) and the kept replay runs, as ``calibrate_default`` fits them. The
    ``without`` terms' features are zeroed in both first: every fit leaves a term whose feature
    is 0 throughout at 0."""
    from schedlab.analysis.runfit import profile_from_runs
    from schedlab.engine.calibrate import write_profile

    prof = json.loads(path.read_text())
    runs = kept_replay(kept)
    for r in runs:
        r.name = Path(r.name).name
        for k in without:
            r.cols[k] = r.cols[k] * 0.0
    for s in prof.get("samples") or []:
        for k in without:
            s["features"].pop(k, None)
    new = profile_from_runs(
        runs,
        dict(prof, coefficients=common.grid_coefficients(prof)),
        kind=prof["calibration"].get("kind", "grid+replay"),
        force=force,
    )
    out = write_profile(new, Path(tempfile.mkdtemp(prefix="fidelity-refit-")) / "profile.json")
    rr = new.get("runs_report") or {}
    return Path(out), {
        "kind": "kept, fitted again",
        "without": list(without),
        "force": list(force),
        "profile": str(path),
        "chosen": rr.get("chosen"),
        "held_out_replay": rr.get("held_out"),
        "coefficients": new["coefficients"],
    }


def _calibration(prof: dict, path: Path, wall_s: float | None) -> dict:
    """What a recording keeps of its default calibration (a re-score: the kept profile's)."""
    rr = prof.get("runs_report") or {}
    return {
        "kind": prof["calibration"].get("kind"),
        "wall_s": round(wall_s, 1) if wall_s is not None else None,
        "profile": str(path),
        "grid_rounds": (prof["calibration"].get("grid") or {}).get("rounds"),
        "chosen": rr.get("chosen"),
        "wakes": rr.get("wakes"),
        "held_out_replay": rr.get("held_out"),
        "wake": rr.get("wake"),
        "coefficients": prof["coefficients"],
    }


def rescore_model(
    model: str,
    policies: list[str],
    trace_specs,
    kept: Path,
    refit: bool = False,
    without: tuple[str, ...] = (),
    profile: Path | None = None,
    force: tuple[str, ...] = (),
) -> dict:
    """The same comparison as ``run_model`` against the real runs an earlier ``--keep`` run left
    in ``kept`` (its profile, each policy's real*/summary.json), the simulation made again by this
    checkout: a change to the simulator or the cost model, checked against the same reality in
    seconds. The step figures (bias, per-step error) are the kept run's: they describe its real
    steps against its profile, which a re-score does not change — except with ``refit`` (the
    profile fitted again from the kept calibration data): then they are the kept steps against
    the new profile."""
    from types import SimpleNamespace

    from schedlab.analysis.residuals import bias, concat
    from schedlab.analysis.runfit import load_runs, step_predictions
    from schedlab.analysis.validation import compare, step_errors
    from schedlab.analysis.residuals import run_speed
    from schedlab.api._validation import speed_matched
    from schedlab.sim import run_replica, summarize

    path = kept / "profile.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no kept profile (was the earlier run made with --keep?)")
    kept_prof = json.loads(path.read_text())
    cal = {**_calibration(kept_prof, path, kept_prof["calibration"].get("wall_s")), "kind": "kept"}
    if refit:
        path, cal = _refit(path, kept, without, force)
    elif profile is not None:  # another profile (a calibration made since): the kept runs against it
        path, cal = profile, {"kind": "given", "profile": str(profile)}
    cost = LinearCostModel.from_profile(path)
    # None: each step's own kept prediction
    coef = dict(cost.coefficients) if refit or profile is not None else None
    capacity = int(cost.meta.get("kv_tokens", 262144))
    res: dict = {"calibration": cal, "traces": {}}
    for spec, seed in trace_specs:
        tr = traces.load(spec, seed=seed)
        key = spec if spec.startswith("real-") else f"{spec}@{seed}"
        res["traces"][key] = {}
        for pname in policies:
            pdir = kept / _safe(key) / pname
            old_path = pdir / "validation.json"
            if old_path.is_file():
                old = json.loads(old_path.read_text())
            else:  # a recording cut off inside this trace: the real runs that finished, no probes
                done = sorted(d.name for d in pdir.glob("real*") if (d / "summary.json").is_file())
                if not done:
                    raise SystemExit(f"{old_path}: not kept, and no finished real run beside it")
                old = {"real_dirs": done, "partial": True}
            reals = [json.loads((pdir / d / "summary.json").read_text()) for d in old["real_dirs"]]
            sim = summarize(
                run_replica(tr.requests, make_policy(pname), cost, kv_capacity=capacity, trace_name=tr.name)
            )
            v = compare(sim, reals, policy=pname, trace=tr.name)
            kept_runs = load_runs([pdir / d for d in old["real_dirs"]])
            if coef is not None or old.get("partial"):  # the kept steps against the refit or the given
                # profile, or (a run validate never scored) against their own predictions (coef None)
                cols = concat([r.cols for r in kept_runs])
                v["step_bias"] = bias(cols, coef)
                pred = step_predictions(cols, coef)
                v["step_error_pct"] = step_errors(
                    [
                        SimpleNamespace(predicted_s=float(p), measured_s=float(m))
                        for p, m in zip(pred, cols["measured_s"])
                    ]
                )
            else:
                v["step_error_pct"] = old.get("step_error_pct")
                # the kept steps against their own predictions, as validate scored them (again:
                # the figures a newer checkout adds)
                v["step_bias"] = bias(concat([r.cols for r in kept_runs]), None) or old.get("step_bias")
            if old.get("partial"):
                v["partial_runs"] = len(reals)
            if old.get("machine_speed"):  # the drift-adjusted comparison again, at the kept probes' speeds
                _drift_again(v, old, make_policy, pname, tr, cost, capacity, reals, kept_runs, coef)
            speeds = [run_speed(r.cols, coef) for r in kept_runs]
            matched = speed_matched(make_policy(pname), tr, cost, capacity, reals, speeds, _kept_steps(kept_runs, coef))
            if matched is not None:
                v["speed_matched"] = matched
            _record(res, model, key, pname, v)
    return _summarise(res, policies)


def _drift_again(
    v: dict, old: dict, make, pname: str, tr, cost, capacity, reals: list, kept_runs: list, coef: dict | None
) -> None:
    """A re-score's drift-adjusted comparison, from the kept probes: at the mean of the speeds
    probed before and after the runs, or (probed after every run) at each run's own, as it was
    made then. Each run's steps predicted as the kept run predicted them (by ``coef`` when the
    profile was fitted again)."""
    from schedlab.api._validation import drift_adjusted, run_factors

    ms = old["machine_speed"]
    v["machine_speed"] = ms
    run_steps = _kept_steps(kept_runs, coef)
    factors = run_factors(ms["probes"], ms["runs"]) if ms.get("probes") and ms.get("runs") else None
    adj = drift_adjusted(
        make(pname),
        tr,
        cost,
        capacity,
        ms,
        reals,
        [s for st in run_steps for s in st],
        factors,
        run_steps if factors else None,
    )
    if adj is not None:
        v["drift_adjusted"] = adj


def _kept_steps(kept_runs: list, coef: dict | None) -> list[list]:
    """Each kept real run's steps (predicted as the run predicted them, or by ``coef`` when the
    profile was fitted again, and measured), as validate's drift and speed comparisons take them."""
    from collections import namedtuple

    from schedlab.analysis.runfit import step_predictions

    Step = namedtuple("Step", "predicted_s measured_s")
    return [
        [Step(float(p), float(m)) for p, m in zip(step_predictions(r.cols, coef), r.cols["measured_s"])]
        for r in kept_runs
    ]


def _record(res: dict, model: str, key: str, pname: str, v: dict) -> None:
    row = _row(v)
    res["traces"][key][pname] = row
    print(_line(model, key, pname, row), flush=True)


def _summarise(res: dict, policies: list[str]) -> dict:
    res["per_policy"] = {p: _per_policy([res["traces"][t][p] for t in res["traces"]]) for p in policies}
    res["pairwise"] = pairwise(res["traces"])
    res["pairwise_speed_matched"] = pairwise_speed_matched(res["traces"])
    res["overall"] = overall([row for t in res["traces"].values() for row in t.values()])
    return res


def _safe(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:60]


def _row(v: dict) -> dict:
    spreads = [r["spread_pct"] for r in v["metrics"].values() if r.get("spread_pct") is not None]
    row = {"partial_runs": v["partial_runs"]} if v.get("partial_runs") else {}
    return row | {
        "median_abs_error_pct": v["median_abs_error_pct"],
        "max_abs_error_pct": v["max_abs_error_pct"],
        "worst_metric": max(v["metrics"], key=lambda k: abs(v["metrics"][k]["error_pct"] or 0)),
        "step_error_pct": v["step_error_pct"],
        "step_bias": v.get("step_bias"),
        "real_spread_pct_median": statistics.median(spreads) if spreads else None,
        "errors_beyond_spread": sum(
            1
            for r in v["metrics"].values()
            if r.get("spread_pct") is not None and r["error_pct"] is not None and abs(r["error_pct"]) > r["spread_pct"]
        ),
        "machine_speed": v.get("machine_speed"),
        "drift_adjusted": v.get("drift_adjusted"),
        "speed_matched": v.get("speed_matched"),
        "hold_one_out": v.get("hold_one_out"),
        "metrics": {
            k: {
                "sim": r["sim"],
                "real": r["real"],
                "error_pct": r["error_pct"],
                "spread_pct": r.get("spread_pct"),
                "real_runs": r.get("real_runs"),
            }
            for k, r in v["metrics"].items()
        },
    }


def _per_policy(rows: list[dict]) -> dict:
    """Over the traces: median of the median |error|, worst |error|, total step time error."""
    pred = sum((r["step_bias"] or {}).get("predicted_s", 0.0) for r in rows)
    meas = sum((r["step_bias"] or {}).get("measured_s", 0.0) for r in rows)
    out = {
        "median_abs_error_pct": statistics.median(r["median_abs_error_pct"] for r in rows),
        "max_abs_error_pct": max(r["max_abs_error_pct"] for r in rows),
        "total_step_time_pct": 100.0 * (pred - meas) / meas if meas else None,
        "step_bias_median": statistics.median(r["step_bias"]["median"] for r in rows if r.get("step_bias"))
        if any(r.get("step_bias") for r in rows)
        else None,
        # the mean of the steps' measured/predicted (a fit aims at the mean step: residuals.bias)
        "step_bias_mean": statistics.median(
            r["step_bias"]["mean"] for r in rows if (r.get("step_bias") or {}).get("mean")
        )
        if any((r.get("step_bias") or {}).get("mean") for r in rows)
        else None,
    }
    adj = [a for r in rows if (a := _applied_adjustment(r))]
    if adj:
        out["drift_adjusted"] = {
            "median_abs_error_pct": statistics.median(a["median_abs_error_pct"] for a in adj),
            "max_abs_error_pct": max(a["max_abs_error_pct"] for a in adj),
        }
        per_run = [a for a in adj if a.get("step_ratio_median") is not None]
        if per_run:  # each run at its own probed speed
            out["drift_adjusted"]["step_ratio_median"] = statistics.median(a["step_ratio_median"] for a in per_run)
            held = [a["hold_one_out"] for a in per_run if a.get("hold_one_out")]
            if held:
                out["drift_adjusted"]["hold_one_out"] = {
                    "sim_median_pct": statistics.median(h["sim_median_pct"] for h in held),
                    "real_median_pct": statistics.median(h["real_median_pct"] for h in held),
                }
    sm = [r["speed_matched"] for r in rows if r.get("speed_matched")]
    if sm:
        speeds = [f for a in sm for f in a["speeds"]]
        out["speed_matched"] = {
            "median_abs_error_pct": statistics.median(a["median_abs_error_pct"] for a in sm),
            "max_abs_error_pct": max(a["max_abs_error_pct"] for a in sm),
            "speed_min": min(speeds),
            "speed_max": max(speeds),
        }
    return out


def _applied_adjustment(row: dict) -> dict | None:
    """A row's drift-adjusted comparison where validate applied one (the machine's speed explained
    the steps' bias in direction); None where it did not."""
    a = row.get("drift_adjusted")
    return a if a and a.get("median_abs_error_pct") is not None else None


def overall(rows: list[dict]) -> dict:
    """Over every (trace, policy) row of a model: the median of the rows' median |error| and of
    their worst, plain, drift-adjusted and speed-matched, and how many rows meet the goal each
    way."""

    def agg(get):
        got = [(get(r)["median_abs_error_pct"], get(r)["max_abs_error_pct"]) for r in rows if get(r)]
        if not got:
            return None
        return {
            "rows": len(got),
            "median_of_median_abs_error_pct": statistics.median(m for m, _ in got),
            "median_of_max_abs_error_pct": statistics.median(w for _, w in got),
            "rows_median_within_goal": sum(1 for m, _ in got if m <= GOAL["median_abs_error_pct"]),
            "rows_max_within_goal": sum(1 for _, w in got if w <= GOAL["max_abs_error_pct"]),
        }

    out = {"plain": agg(lambda r: r)}
    da = agg(_applied_adjustment)
    if da:  # the simulation at the speed timed before and after the runs: a prediction, unlike the next
        out["drift_adjusted"] = da
    sm = agg(lambda r: r.get("speed_matched"))
    if sm:
        out["speed_matched"] = sm
        speeds = [f for r in rows if r.get("speed_matched") for f in r["speed_matched"]["speeds"]]
        med = [
            r["speed_matched"]["step_ratio_median"]
            for r in rows
            if (r.get("speed_matched") or {}).get("step_ratio_median")
        ]
        if med:  # the steps against their predictions at each run's own speed
            out["speed_matched"]["step_ratio_median_min"] = min(med)
            out["speed_matched"]["step_ratio_median_max"] = max(med)
            out["speed_matched"]["rows_step_ratio_within_5pct"] = sum(abs(x - 1.0) <= 0.05 for x in med)
        out["run_speeds"] = {
            "min": min(speeds),
            "median": statistics.median(speeds),
            "max": max(speeds),
            "runs": len(speeds),
        }
    hoo = hold_one_out_overall(rows)
    if hoo:
        out["hold_one_out"] = hoo
    # how well the probes around each run tell its speed: the run's own (its steps' measured over
    # predicted total) over the mean of the probes just before and after it
    track = [
        own / probed
        for r in rows
        if (a := _applied_adjustment(r)) and a.get("speeds") and r.get("speed_matched")
        for own, probed in zip(r["speed_matched"]["speeds"], a["speeds"])
    ]
    if track:
        out["probe_tracking"] = {
            "runs": len(track),
            "own_over_probed_median": statistics.median(track),
            "own_over_probed_min": min(track),
            "own_over_probed_max": max(track),
            "runs_within_10pct": sum(abs(t - 1.0) <= 0.10 for t in track),
        }
    held = [a for r in rows if (a := _applied_adjustment(r)) and a.get("hold_one_out")]
    if held:  # each run simulated at the speed probed just before and after it
        steps = [a["step_ratio_median"] for a in held]
        out["hold_one_out_drift_adjusted"] = _held_out_over_rows([a["hold_one_out"] for a in held]) | {
            "step_ratio_median_min": min(steps),
            "step_ratio_median_max": max(steps),
            "rows_step_ratio_within_5pct": sum(abs(x - 1.0) <= 0.05 for x in steps),
        }
    return out


def hold_one_out_overall(rows: list[dict]) -> dict | None:
    """Over the rows (each with its metrics' ``sim`` and ``real_runs``): every real run held out
    against the others' median, the simulation's error beside a real run's own
    (``analysis.validation.hold_one_out``) — median over the rows of each row's median and worst
    over metrics, and in how many rows the simulation is no further off than a real run."""
    from schedlab.analysis.validation import repeat_summary

    return _held_out_over_rows([h for h in (repeat_summary(r["metrics"]) for r in rows) if h])


def _held_out_over_rows(got: list[dict]) -> dict | None:
    """Rows' hold-one-out summaries (``repeat_summary``) put together: the median over the rows of
    each one's median and worst, and how many rows have the simulation no further off than a run."""
    if not got:
        return None
    med = statistics.median
    return {
        "rows": len(got),
        "sim_median_pct": med(h["sim_median_pct"] for h in got),
        "sim_worst_pct": med(h["sim_max_pct"] for h in got),
        "real_median_pct": med(h["real_median_pct"] for h in got),
        "real_worst_pct": med(h["real_max_pct"] for h in got),
        "rows_sim_median_within_real": sum(h["sim_median_pct"] <= h["real_median_pct"] for h in got),
        "rows_sim_worst_within_real": sum(h["sim_max_pct"] <= h["real_max_pct"] for h in got),
    }


def pairwise(by_trace: dict, order_by: str = "sim") -> dict:
    """Per metric: of the policy pairs whose real runs differ by more than their spread, the
    share the simulation orders the same way, and how many of the others it calls equal
    (``tied``: the two policies made the same simulated schedule; counted as not right).
    ``simulated_equal``: every pair the simulation calls equal, considered or not; in ``all``,
    ``null_pass_share``: how often the spread test passes two policies whose real runs are
    identically distributed (``spread_test_null_share``, at the runs' usual count) — what the
    share of simulated-equal pairs that pass it would be if those pairs were equal for real.
    ``order_by``: the metric row's key whose value orders the pair (``sim``: the simulation as
    made; ties are always judged on ``sim``, the schedule the simulation made)."""
    counts: dict[str, list[int]] = {}
    n_runs: list[int] = []
    for rows in by_trace.values():
        for a, b in itertools.combinations(sorted(rows), 2):
            for m, ra in rows[a]["metrics"].items():
                rb = rows[b]["metrics"][m]
                if None in (ra["real"], rb["real"], ra["sim"], rb["sim"], ra.get(order_by), rb.get(order_by)):
                    continue
                c = counts.setdefault(m, [0, 0, 0, 0])
                equal = abs(ra["sim"] - rb["sim"]) <= 1e-9 * max(abs(ra["sim"]), abs(rb["sim"]))
                c[3] += equal
                runs = min(len(ra.get("real_runs") or []), len(rb.get("real_runs") or []))
                if runs < 2:
                    continue  # one real run (a recording cut off): no spread to tell a difference by
                n_runs.append(runs)
                spread = max(_abs_spread(ra), _abs_spread(rb))
                diff = ra["real"] - rb["real"]
                if abs(diff) <= spread or diff == 0:
                    continue
                c[1] += 1
                if equal:
                    c[2] += 1
                elif (ra[order_by] - rb[order_by]) * diff > 0:
                    c[0] += 1
    out = {
        m: {"right": r, "considered": n, "share": r / n if n else None, "tied": t, "simulated_equal": e}
        for m, (r, n, t, e) in counts.items()
    }
    tot = [sum(c[i] for c in counts.values()) for i in range(4)]
    runs = int(statistics.median(n_runs)) if n_runs else 0
    out["all"] = {
        "right": tot[0],
        "considered": tot[1],
        "share": tot[0] / tot[1] if tot[1] else None,
        "tied": tot[2],
        "simulated_equal": tot[3],
        "runs": runs,
        "null_pass_share": spread_test_null_share(runs) if runs >= 2 else None,
    }
    return out


def pairwise_speed_matched(by_trace: dict) -> dict:
    """``pairwise`` with each policy's simulation made again at its real runs' own speeds (the
    rows' ``speed_matched`` errors): which orderings the model gets wrong once the machine's
    speed during each policy's runs is taken out. A pair the simulation made the same schedule
    for stays tied (not right): the runs' speeds alone would otherwise order it."""
    rows = {}
    for t, tv in by_trace.items():
        rows[t] = {}
        for p, row in tv.items():
            errs = (row.get("speed_matched") or {}).get("error_pct") or {}
            rows[t][p] = {
                "metrics": {
                    m: r
                    | {
                        "sim_speed_matched": None
                        if errs.get(m) is None or r["real"] is None
                        else r["real"] * (1.0 + errs[m] / 100.0)
                    }
                    for m, r in row["metrics"].items()
                }
            }
    return pairwise(rows, order_by="sim_speed_matched")


@functools.lru_cache(maxsize=None)
def spread_test_null_share(runs: int, draws: int = 200_000, seed: int = 0) -> float:
    """The share of pairs of policies whose ``runs`` real runs each are drawn from one and the
    same distribution (normal: the test is scale-free) that ``pairwise``'s test still counts as
    different: their medians further apart than either set's max - min. With 3 runs ~6 %: the
    goal's "every pair that differs by more than the runs' spread" holds some equal pairs,
    whose order no simulation can get right but by chance."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((draws, runs))
    b = rng.standard_normal((draws, runs))
    spread = np.maximum(np.ptp(a, axis=1), np.ptp(b, axis=1))
    return float(np.mean(np.abs(np.median(a, axis=1) - np.median(b, axis=1)) > spread))


def _abs_spread(r: dict) -> float:
    runs = r.get("real_runs") or []
    return (max(runs) - min(runs)) if len(runs) > 1 else 0.0


def _line(model, key, pname, r) -> str:
    sb = r["step_bias"] or {}
    return (
        f"{model:12s} {key[:28]:28s} {pname:16s} median |err| {r['median_abs_error_pct']:5.1f}%  max "
        f"{r['max_abs_error_pct']:5.1f}% ({r['worst_metric']})  step bias {sb.get('median', float('nan')):.3f} "
        f"(mean {sb.get('mean', float('nan')):.3f}) "
        f"total {sb.get('total_pct', float('nan')):+.1f}%  "
        + (
            f"spread {r['real_spread_pct_median']:5.1f}%"
            if r["real_spread_pct_median"] is not None
            else f"{r.get('partial_runs', 1)} real run, no spread"
        )
    )


def format_markdown(out: dict) -> str:
    lines = []
    for model, res in out["models"].items():
        cal = res["calibration"]
        lines.append(
            f"\n{model}: calibration {cal.get('kind')}"
            + (f" in {cal['wall_s']} s" if cal.get("wall_s") is not None else f" ({cal.get('profile')})")
        )
        keys = list(res["traces"])
        head = (
            "| policy | "
            + " | ".join(f"{_short(k)} median / max |err| %" for k in keys)
            + " | step bias (meas/pred) | total step time % | real spread % (median) | speed-matched median / max |err| % |"
        )
        lines += [head, "|---|" + "---:|" * (len(keys) + 4)]
        for p, agg in res["per_policy"].items():
            cells = [
                f"{res['traces'][k][p]['median_abs_error_pct']:.1f} / {res['traces'][k][p]['max_abs_error_pct']:.1f}"
                for k in keys
            ]
            spreads = [
                res["traces"][k][p]["real_spread_pct_median"]
                for k in keys
                if res["traces"][k][p]["real_spread_pct_median"] is not None
            ]
            lines.append(
                f"| {p} | "
                + " | ".join(cells)
                + f" | {_n(agg.get('step_bias_median'), 3)} | {_n(agg.get('total_step_time_pct'), 1, True)} | "
                + (f"{statistics.median(spreads):.1f}" if spreads else "-")
                + " | "
                + (
                    f"{agg['speed_matched']['median_abs_error_pct']:.1f} / {agg['speed_matched']['max_abs_error_pct']:.1f}"
                    if agg.get("speed_matched")
                    else "-"
                )
                + " |"
            )
        ov = res.get("overall") or {}
        for what in ("plain", "drift_adjusted", "speed_matched"):
            o = ov.get(what)
            if o:
                lines.append(
                    f"{what.replace('_', '-')}: median over the {o['rows']} rows of their median |error| "
                    f"{o['median_of_median_abs_error_pct']:.1f} %, of their worst "
                    f"{o['median_of_max_abs_error_pct']:.1f} %; median within the goal in "
                    f"{o['rows_median_within_goal']}, worst in {o['rows_max_within_goal']}"
                )
        h = ov.get("hold_one_out")
        if h:
            lines.append(
                f"each real run held out against the others' median (median over {h['rows']} rows): the "
                f"simulation {h['sim_median_pct']:.1f} % / worst {h['sim_worst_pct']:.1f} %, a real run "
                f"{h['real_median_pct']:.1f} % / {h['real_worst_pct']:.1f} % (the machine's repeat error); the "
                f"simulation no further off than a real run in {h['rows_sim_median_within_real']} rows "
                f"(worst: {h['rows_sim_worst_within_real']})"
            )
        h = ov.get("hold_one_out_drift_adjusted")
        if h:
            lines.append(
                f"drift-adjusted per run (each run simulated at the speed probed just before and after it; "
                f"{h['rows']} rows): held out, the simulation {h['sim_median_pct']:.1f} %, a real run "
                f"{h['real_median_pct']:.1f} %; no further off than a real run in "
                f"{h['rows_sim_median_within_real']} rows; step median measured/predicted "
                f"{h['step_ratio_median_min']:.3f}-{h['step_ratio_median_max']:.3f}, within 1 +- 0.05 in "
                f"{h['rows_step_ratio_within_5pct']} rows"
            )
        t = ov.get("probe_tracking")
        if t:
            lines.append(
                f"the probes around a run against its own speed ({t['runs']} runs): "
                f"{t['own_over_probed_median']:.2f}x (median), {t['own_over_probed_min']:.2f}-"
                f"{t['own_over_probed_max']:.2f}x; within 10 % in {t['runs_within_10pct']}"
            )
        if ov.get("run_speeds"):
            rs = ov["run_speeds"]
            lines.append(
                f"real runs' own speed (measured / predicted step time): {rs['min']:.2f}-{rs['max']:.2f}x, "
                f"median {rs['median']:.2f}x over {rs['runs']} runs"
            )
        pw = res["pairwise"]
        lines.append(
            "pairwise direction right: "
            + ", ".join(f"{m} {v['right']}/{v['considered']}" for m, v in pw.items() if v["considered"])
            + (f" ({pw['all']['tied']} of the others simulated as equal)" if (pw.get("all") or {}).get("tied") else "")
        )
        pws = (res.get("pairwise_speed_matched") or {}).get("all") or {}
        if pws.get("considered"):
            lines.append(
                f"pairwise direction right, speed-matched (each policy simulated at its runs' own speed): "
                f"{pws['right']}/{pws['considered']} (plain {pw['all']['right']}/{pw['all']['considered']})"
            )
        if (pw.get("all") or {}).get("simulated_equal") and pw["all"].get("null_pass_share") is not None:
            a = pw["all"]
            lines.append(
                f"pairs the simulation calls equal: {a['simulated_equal']}, of which {a['tied']} "
                f"({100 * a['tied'] / a['simulated_equal']:.1f} %) pass the real-spread test; two policies "
                f"whose {a['runs']} runs are identically distributed pass it "
                f"{100 * a['null_pass_share']:.1f} % of the time"
            )
    return "\n".join(lines)


def _short(key: str) -> str:
    """A trace's column label: a random spec by its seed, a named trace by its name."""
    if key.startswith("random:"):
        return "random@" + key.rsplit("@", 1)[-1]
    return key.rsplit("@", 1)[0]


def _n(x, d, sign=False):
    return "-" if x is None else (f"{x:+.{d}f}" if sign else f"{x:.{d}f}")


if __name__ == "__main__":
    main()
