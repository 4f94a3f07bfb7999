"""Step cost: where a real step's wall time goes, in the loop and in isolation, per step kind.

A real run's step (``measured_s``: from the previous step's end to this one's) is the loop's own
work (the policy's plan, the state machine's admissions, shapes and updates, the logs, SimPy's
hop on the wall clock) plus its passes (``execute``: Python around the forward, the one MLX
evaluation, sampling and the token hand-over). The calibration times passes alone, back to back,
and adds ``s_step`` for the loop. This bench splits each real step into those parts, and times
the very same passes again in isolation (a calibration rig driving the same state machine pass by
pass, no loop, no idle gaps), right after each real run, alternating, so that the machine's drift
meets both alike:

- ``loop``: the step's parts (medians per kind, ms): ``plan``, ``admin`` (apply_admin and the
  releases it asks for), ``shape``, ``execute`` split into ``host`` (Python) and ``eval`` (MLX
  evaluations), ``apply`` (apply_pass and its releases), ``rest`` (the step's time none of these
  holds: logs, hooks, the clock and SimPy);
- ``in_loop_vs_isolated``: each pass's ``execute`` time in the loop / the same pass isolated;
- ``isolated_vs_predicted``: the isolated pass / the profile's prediction of it;
- ``measured_vs_predicted``: the real step / the loop's prediction of it (what validate's step
  bias reports).

The product of the last two ratios' sources is the whole story: a step ratio above 1 with the
in-loop passes equal to the isolated ones is the calibration's (or the machine's speed since),
not the loop's. Step kinds: ``decode 1`` (one row), ``decode n``, ``prefill``, ``mixed``; prefixed
``after idle`` (the replica waited for an arrival right before) or ``batch change`` (rows join
or leave).

    python bench/step_cost.py [--models tiny,smollm2-135m] [--policies mlx-default,unified]
                              [--rounds 3] [--profile F] [--out bench/results/step_cost.json]

Held-out trace (never the calibration's): isolated short requests with idle gaps (one to three
rows decoding), the regime where a few-ms step makes a per-step cost matter most.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import common
from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab import traces
from schedlab.analysis.residuals import step_kinds
from schedlab.engine import backend as backend_mod
from schedlab.engine.backend import MLXBackend
from schedlab.engine.calibrate import Rig, calibrate_default, write_profile
from schedlab.engine.models import load_model
from schedlab.policies import make_policy
from schedlab.policies.base import Plan
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.features import step_table
from schedlab.sim import run_replica as run_loop

TRACES = {
    "tiny": ("random:n=24,input_len=216,output_len=27,range_ratio=0.8,rate=1.5", 39),
    "smollm2-135m": ("random:n=16,input_len=160,output_len=20,range_ratio=0.8,rate=0.7", 39),
    "micro": ("random:n=6,input_len=40,output_len=8,range_ratio=0.5,rate=4", 1),  # smoke runs
}
PARTS = ("plan", "admin", "shape", "host", "eval", "apply", "rest")


class _Eval:
    """``mlx.core`` for the backend module, with ``eval`` timed (everything else passed through)."""

    def __init__(self, mx, sink: list) -> None:
        self._mx, self._sink = mx, sink

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def eval(self, *args):
        t0 = time.perf_counter()
        out = self._mx.eval(*args)
        self._sink[0] += time.perf_counter() - t0
        return out


class Parts:
    """Per step index, seconds spent in each part (wrapping the objects' bound methods)."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PARTS, 0.0))
        self.eval_s = [0.0]

    def wrap(self, obj, name: str, part: str, state) -> None:
        fn = getattr(obj, name)
        by_step = self.by_step

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                by_step[state.step_index][part] += time.perf_counter() - t0

        setattr(obj, name, timed)


def instrumented_run(info, reqs, policy_name: str, cost, seed: int):
    """One real run with every step split into its parts; returns (result, Parts)."""
    parts = Parts()
    be = MLXBackend(info, seed=seed, ignore_eos=True)
    policy = make_policy(policy_name)
    real_mx = backend_mod.mx
    real_start = be.start

    def start(state, requests):
        real_start(state, requests)  # (warm-up first, untimed)
        parts.wrap(policy, "plan", "plan", state)
        parts.wrap(state, "apply_admin", "admin", state)
        parts.wrap(state, "shape", "shape", state)
        parts.wrap(state, "apply_pass", "apply", state)
        real_execute = be.execute

        def execute(p, shape, st):
            parts.eval_s[0] = 0.0
            t0 = time.perf_counter()
            dt = real_execute(p, shape, st)
            row = parts.by_step[st.step_index]
            row["eval"] += parts.eval_s[0]
            row["host"] += time.perf_counter() - t0 - parts.eval_s[0]
            return dt

        be.execute = execute
        backend_mod.mx = _Eval(real_mx, parts.eval_s)

    be.start = start
    try:
        res = run_loop(reqs, policy, cost, kv_capacity=10**9, backend=be, trace_name="step-cost")
    finally:
        backend_mod.mx = real_mx
    if res.error:
        raise SystemExit(f"{policy_name}: {res.error}")
    return res, parts


def isolated(rig: Rig, reqs, res) -> list[float]:
    """The run's passes again, back to back on the calibration rig: each pass's execute seconds."""
    from schedlab.sim.state import ReplicaState

    by_id = {r.id: r for r in reqs}
    state = ReplicaState([by_id[r.id] for r in reqs], 10**9, "isolated")
    for r in state.accepted:
        state.arrive(r)
    for r in state.requests:
        rig.backend.tokens.setdefault(r.id, [])
    admitted: set[str] = set()
    out = []
    for p in res.passes.columns[4]:
        new = [rid for rid in list(p.decode) + [rid for rid, _ in p.prefill] if rid not in admitted]
        if new:
            state.apply_admin(Plan(admit=tuple(new)), 0.0)
            admitted.update(new)
        out.append(rig.timed(state, p)[1])
    rig.close(state)
    return out


def _med(xs):
    return round(statistics.median(xs), 4) if xs else None


def run_model(model: str, policies: list[str], rounds: int, profile: str | None, work: Path) -> dict:
    info = load_model(model)
    if profile is None:
        print(f"{model}: default calibration ...", flush=True)
        t0 = time.perf_counter()
        prof = calibrate_default(info, progress=lambda m: print(f"  {m}", flush=True))
        profile = str(write_profile(prof, work / f"{model}.profile.json"))
        print(f"{model}: calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    cost = LinearCostModel.from_profile(profile)
    spec, seed = TRACES[model]
    reqs = traces.load(spec, seed=seed).requests
    rig = Rig(info, seed=1)
    isolated(rig, reqs, instrumented_run(info, reqs, policies[0], cost, 0)[0])  # warm both paths, untimed
    rows: dict[str, list[dict]] = defaultdict(list)
    for rnd in range(rounds):
        for name in policies:
            print(f"{model}: round {rnd + 1}/{rounds}: {name}", flush=True)
            res, parts = instrumented_run(info, reqs, name, cost, rnd)
            iso = isolated(rig, reqs, res)
            cols = step_table(res)
            p_step, _, p_start, p_end, _ = res.passes.columns
            loop_pass = defaultdict(list)
            iso_pass = defaultdict(list)
            pred_pass = defaultdict(list)
            for j, (st, a, b) in enumerate(zip(p_step, p_start, p_end)):
                loop_pass[st].append(b - a)
                iso_pass[st].append(iso[j])
                pred_pass[st].append(cost.pass_seconds(res.shapes[j]))
            kinds = step_kinds(cols)  # (validate --residuals' kinds)
            for i in range(len(cols["step"])):
                st = int(cols["step"][i])
                row = {k: float(cols[k][i]) for k in ("measured_s", "predicted_s", "passes_s")}
                part = parts.by_step[st]
                named = sum(part[k] for k in PARTS if k != "rest")
                part["rest"] = row["measured_s"] - named
                row.update({f"{k}_s": part[k] for k in PARTS})
                row["loop_pass_s"] = sum(loop_pass[st])
                row["iso_pass_s"] = sum(iso_pass[st])
                row["pred_pass_s"] = sum(pred_pass[st])
                row["round"] = rnd
                rows[f"{name}|{kinds[i]}"].append(row)
    out: dict = {"trace": f"{spec}@{seed}", "profile": profile, "policies": {}}
    for key in sorted(rows):
        name, kind = key.split("|")
        rs = rows[key]
        out["policies"].setdefault(name, {})[kind] = {
            "steps": len(rs),
            "measured_ms": _med([r["measured_s"] * 1e3 for r in rs]),
            "predicted_ms": _med([r["predicted_s"] * 1e3 for r in rs]),
            "parts_ms": {k: _med([r[f"{k}_s"] * 1e3 for r in rs]) for k in PARTS},
            "loop_ms": _med([(r["measured_s"] - r["loop_pass_s"]) * 1e3 for r in rs]),
            "predicted_loop_ms": _med([(r["predicted_s"] - r["pred_pass_s"]) * 1e3 for r in rs]),
            "in_loop_vs_isolated": _med([r["loop_pass_s"] / r["iso_pass_s"] for r in rs]),
            "isolated_vs_predicted": _med([r["iso_pass_s"] / r["pred_pass_s"] for r in rs]),
            "measured_vs_predicted": _med([r["measured_s"] / r["predicted_s"] for r in rs]),
            "per_round_in_loop_vs_isolated": [
                _med([r["loop_pass_s"] / r["iso_pass_s"] for r in rs if r["round"] == k]) for k in range(rounds)
            ],
        }
    return out


def format_table(model: str, res: dict) -> str:
    lines = [
        f"{model} ({res['trace']}): medians per step kind, ms; ratios of medians per step",
        f"{'policy':<12} {'kind':<24} {'n':>5} {'meas':>7} {'pred':>7} "
        + " ".join(f"{k:>6}" for k in PARTS)
        + f" {'loop':>6} {'p.loop':>6} {'loop/iso':>8} {'iso/pred':>8} {'meas/pred':>9}",
    ]
    for name, kinds in res["policies"].items():
        for kind, r in kinds.items():
            lines.append(
                f"{name:<12} {kind:<24} {r['steps']:>5} {r['measured_ms']:>7.3f} {r['predicted_ms']:>7.3f} "
                + " ".join(f"{r['parts_ms'][k]:>6.3f}" for k in PARTS)
                + f" {r['loop_ms']:>6.3f} {r['predicted_loop_ms']:>6.3f} {r['in_loop_vs_isolated']:>8.3f}"
                f" {r['isolated_vs_predicted']:>8.3f} {r['measured_vs_predicted']:>9.3f}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--policies", default="mlx-default,unified")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None, help="use this profile (one model) instead of calibrating")
    ap.add_argument("--out", default=str(common.result_path("step_cost")))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="step-cost-"))
    out = {
        "benchmark": "step_cost",
        "rounds": args.rounds,
        "rev": common.git_rev(),
        "machine": common.machine(),
        "models": {},
    }
    t0 = time.perf_counter()
    for model in args.models.split(","):
        res = run_model(model, args.policies.split(","), args.rounds, args.profile, work)
        out["models"][model] = res
        print(format_table(model, res), flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"wrote {common.write_json(out, args.out)}")


if __name__ == "__main__":
    main()
