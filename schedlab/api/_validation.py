"""What ``validate`` does under its API function (private to the API package: not part of the
public API, which is ``schedlab.validate``): the policies' simulations and interleaved real runs
with the machine's speed timed around them (``validate_many``), the comparisons made again with
the machine's speed taken out (``drift_adjusted``, ``speed_matched``), and the cost model of both
sides (``validation_cost``, ``analytic_cost``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import opt
from ._base import Log, fail, policy_options
from .profiles import ProfileLike, profile_path
from .runs import Run, real_dir_name


def validate_many(
    pols: Mapping[str, Any],
    tr,
    info,
    cost,
    capacity,
    dirs: Mapping[str, Path | None],
    repeat: int,
    seed: int,
    cost_meta: dict,
    say,
    speed_check_runs: bool = True,
    speed_probe: str = "passes",
    speed_every_run: bool = False,
    speculative: dict | None = None,
    acceptance: Any = None,
) -> dict[str, tuple[dict, Run, list[Run]]]:
    """Policies side by side: each one's simulation, then the real runs round by round — run k
    of every policy before run k + 1 of any — and the machine's speed timed once before the
    first round and once after the last. This machine's speed drifts by tens of percent within
    minutes: one policy's runs after another's would compare the two policies at two speeds of
    the machine; interleaved, every policy meets the same spells. Then, per policy, the
    comparison (validation.json's content, written under its directory when given), its
    simulated run and its real runs.

    ``speed_check_runs``: time the machine's speed before and after (``machine_speed``,
    ``drift_adjusted``); ``speed_probe``: how: ``"passes"`` (the profile's reference passes,
    isolated: ``engine.calibrate.speed_check``) or ``"replay"`` (a default calibration's own
    replay run again by one policy in the real loop: ``replay_speed_check``; the reference passes
    where the profile has no replay); ``speed_every_run``: timed after every real run too, so
    that each run has its own speed (the mean of the probes just before and just after it): this
    machine's speed moves in spells of seconds to minutes, which one probe before the first round
    and one after the last cannot follow.

    The real runs plan and predict with the same cost model as the simulation: the policy
    sees the same estimates on both sides, and steps.parquet's predicted_s (the per-step error)
    is that model's, analytic with ``hardware``.

    ``speculative`` (``parse_speculative``'s answer; the policies already wrap in
    ``Speculative``): the real runs' rows verify drafts, and the simulations draw their accepted
    drafts from ``acceptance`` (an ``Acceptance``), or, without one, from the real runs' own
    counters (``Acceptance.from_counters`` of every real run's added up): the simulations are
    then made after the real runs. Each comparison gains ``speculative``
    (``analysis.speculation.compare_acceptance``)."""
    if speed_probe not in ("passes", "replay"):
        raise ValueError(f"speed_probe: 'passes' or 'replay', not {speed_probe!r}")
    job = _Validation(pols, tr, info, cost, capacity, dirs, repeat, seed, cost_meta, say, speculative, acceptance)
    later = speculative is not None and acceptance is None  # (drawn from what the real runs measure)
    sims = None if later else job.simulate()
    ref = _speed_reference(cost_meta, info) if speed_check_runs else None
    probes = _SpeedProbes(info, ref, seed, speed_probe, speed_every_run, pols)
    probes.before(say)
    reals = job.real_rounds(probes)
    probes.after()
    if later:
        job.acceptance = measured_acceptance(reals, int(speculative["seed"]))
        sims = job.simulate()
    return {name: job.compare(name, sims[name], reals[name], probes) for name in pols}


def measured_acceptance(reals: Mapping[str, list[Run]], seed: int):
    """The acceptance profile the real runs of every policy measured, their spec-decode counters
    added up (greedy runs of one trace: the same tokens under every policy)."""
    from schedlab.sim.speculation import Acceptance, SpeculationError, pooled_counters

    counters = pooled_counters([r._summary.get("speculative") for runs in reals.values() for r in runs])
    try:
        return Acceptance.from_counters(counters or {"drafts": 0, "accepted_per_position": []}, seed,
                                        "the real runs' spec-decode counters")  # fmt: skip
    except SpeculationError:
        fail(f"{opt('speculative')}: the real runs verified no drafts: no acceptance to simulate (give accept=)", 2)


class _SpeedProbes:
    """The machine's speed, timed against the profile ``ref`` (none timed without one): before
    the first real run and after the last, or (``every``) after every real run too, each run
    then bracketed by the probes just before and just after it."""

    def __init__(self, info, ref: dict | None, seed: int, probe: str, every: bool, names):
        from schedlab.engine.calibrate import has_replay

        self.info = info
        self.ref = ref
        self.seed = seed
        self.replay = probe == "replay" and has_replay(ref)
        self.every = ref is not None and every
        self.speed: dict[str, Any] = {}
        self.probes: list = []  # in the order timed
        self.brackets: dict[str, list[tuple[int, int]]] = {name: [] for name in names}  # per real run

    def _time(self):
        from schedlab.engine.calibrate import replay_speed_check, speed_check

        got = replay_speed_check(self.info, self.ref) if self.replay else None
        return got if got is not None else speed_check(self.info, self.ref, seed=self.seed)

    def before(self, say) -> None:
        if self.ref is None:
            return
        say(
            ("running the profile's replay again" if self.replay else "timing the profile's reference passes")
            + (
                " (the machine's speed now, and again after every real run)"
                if self.every
                else " (the machine's speed now)"
            )
        )
        self.speed["before"] = self._time()
        self.probes.append(self.speed["before"])

    def after_run(self, name: str) -> None:
        if self.every:
            self.probes.append(self._time())
            self.brackets[name].append((len(self.probes) - 2, len(self.probes) - 1))

    def after(self) -> None:
        if self.ref is None:
            return
        self.speed["after"] = self.probes[-1] if self.every else self._time()
        if self.every:
            self.speed["probes"] = self.probes

    def machine_speed(self, name: str) -> dict:
        """validation.json's ``machine_speed`` for policy ``name``."""
        return dict(self.speed, runs=self.brackets[name]) if self.every else self.speed

    def run_factors(self, name: str) -> list[float] | None:
        return run_factors(self.probes, self.brackets[name]) if self.every else None


@dataclass
class _Validation:
    """The policies' simulations, their real runs, and each policy's comparison of the two."""

    pols: Mapping[str, Any]
    tr: Any
    info: Any
    cost: Any
    capacity: Any
    dirs: Mapping[str, Path | None]
    repeat: int
    seed: int
    cost_meta: dict
    say: Callable[[str], Any]
    speculative: dict | None = None
    acceptance: Any = None
    metas: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, pol in self.pols.items():
            self.metas[name] = {
                "cost_model": self.cost_meta,
                "kv_tokens": self.capacity,
                "seed": self.seed,
                "policy_options": policy_options(pol),
            }

    def simulate(self) -> dict[str, Run]:
        from schedlab.sim import Deployment, run
        from schedlab.sim.metrics import summarize

        sims: dict[str, Run] = {}
        for name, pol in self.pols.items():
            meta = self.metas[name]
            if self.acceptance is not None:
                meta = dict(meta, acceptance=self.acceptance.describe())
            self.say(f"{pol.name}: simulating")
            deployment = Deployment.one(pol, self.cost, kv_capacity=self.capacity, acceptance=self.acceptance)
            sim_res = run(deployment, self.tr.requests, trace_name=self.tr.name)
            sims[name] = Run(sim_res, summarize(sim_res), meta)
            if self.dirs.get(name) is not None:
                sims[name].save(self.dirs[name] / "sim")
        return sims

    def real_rounds(self, probes: _SpeedProbes) -> dict[str, list[Run]]:
        """The real runs, round by round: run k of every policy before run k + 1 of any."""
        from schedlab.engine.backend import MLXBackend
        from schedlab.sim import run_replica as run_loop
        from schedlab.sim.metrics import summarize

        reals: dict[str, list[Run]] = {name: [] for name in self.pols}
        for k in range(self.repeat):
            for name, pol in self.pols.items():
                self.say(f"{pol.name}: real run {k + 1}/{self.repeat}")
                res = run_loop(
                    self.tr.requests,
                    pol,
                    self.cost,
                    kv_capacity=self.capacity,
                    backend=MLXBackend(self.info, seed=self.seed, ignore_eos=True),
                    trace_name=self.tr.name,
                )
                real = Run(res, summarize(res), self.metas[name])
                if self.dirs.get(name) is not None:
                    real.save(self.dirs[name] / real_dir_name(k))
                if res.error:
                    fail(f"{pol.name}: real run stopped: {res.error}")
                reals[name].append(real)
                probes.after_run(name)
        return reals

    def compare(self, name: str, sim: Run, reals: list[Run], probes: _SpeedProbes) -> tuple[dict, Run, list[Run]]:
        """(validation.json's content, written under the policy's directory when given, the
        simulated run, the real runs)."""
        import json

        from schedlab.analysis.residuals import bias, concat, residual_table, step_split
        from schedlab.analysis.validation import compare as compare_runs
        from schedlab.sim.features import step_table

        pol, tr, cost, capacity, acc = self.pols[name], self.tr, self.cost, self.capacity, self.acceptance
        summaries = [r._summary for r in reals]
        steps = [st for r in reals for st in r._result.steps]
        v = compare_runs(sim._summary, summaries, policy=pol.name, trace=tr.name, real_steps=steps)
        tables = [step_table(r._result) for r in reals]
        feats = concat(tables)
        v["step_bias"] = bias(feats)
        v["residuals"] = residual_table(feats)
        v["step_split"] = step_split(feats, getattr(cost, "coefficients", None))
        run_steps = [r._result.steps for r in reals]
        if probes.ref is not None:
            v["machine_speed"] = probes.machine_speed(name)
            factors = probes.run_factors(name)
            adj = drift_adjusted(pol, tr, cost, capacity, probes.speed, summaries, steps, factors, run_steps, acc)
            if adj is not None:
                v["drift_adjusted"] = adj
        matched = speed_matched(pol, tr, cost, capacity, summaries, [run_speed(t) for t in tables], run_steps, acc)
        if matched is not None:
            v["speed_matched"] = matched
        if self.speculative is not None:
            from schedlab.analysis.speculation import compare_acceptance

            sim_spec = sim._summary.get("speculative")
            v["speculative"] = compare_acceptance(
                sim_spec, [s.get("speculative") for s in summaries], acc.accept, acc.source or "accept="
            )
        v["model"] = self.info.name
        v["cost_model"] = self.cost_meta
        v["sim_dir"] = "sim"
        v["real_dirs"] = [real_dir_name(k) for k in range(self.repeat)]
        if self.dirs.get(name) is not None:
            (self.dirs[name] / "validation.json").write_text(json.dumps(v, indent=2) + "\n")
        return v, sim, reals


def drift_explains(speed_factor: float, step_ratio: float | None) -> bool:
    """Whether the machine's measured speed (its reference work's time over the time the profile
    gives it: above 1, slower than at calibration) explains the real steps' bias (their measured
    over predicted seconds) in direction: both above 1 or both below. When the machine ran faster
    while the steps ran slower than predicted (or the reverse), the bias is a cost the model does
    not see, and scaling the simulation by the machine's speed would only widen it."""
    return step_ratio is not None and (speed_factor - 1.0) * (step_ratio - 1.0) > 0


def run_factors(probes: list, brackets: list[tuple[int, int]]) -> list[float] | None:
    """Each real run's speed from the probes timed around it (``brackets``: the indices of the
    probe just before and just after it): the mean of their ratios. None where one is missing."""
    out = []
    for i, j in brackets:
        got = [p["ratio"] for p in (probes[i], probes[j]) if p and p.get("ratio")]
        if len(got) != 2:
            return None
        out.append(sum(got) / 2)
    return out or None


def drift_adjusted(
    pol,
    tr,
    cost,
    capacity,
    speed: dict,
    reals: list,
    steps: list,
    factors: list[float] | None = None,
    run_steps: list[list] | None = None,
    acceptance: Any = None,
) -> dict | None:
    """The simulation again with every pass scaled by the machine's measured speed during the
    real runs, compared with the same real runs: how far the model is once the machine's drift
    is taken out; only where that speed explains the real steps' bias in direction
    (``drift_explains``; else ``applied`` False, with both ratios). Reported beside the plain
    comparison, never instead of it.

    The speed: the mean of the before/after probes' ratios. With ``factors`` (one per real run,
    ``run_factors``: probed just before and just after it) and ``run_steps`` (each run's steps):
    one simulation per run at its own speed (the policy planning with the profile, as in the real
    run: only the passes' seconds scaled), compared per metric by their median; each run held out
    against the others' simulations (``hold_one_out``); each run's steps against their
    predictions at its speed (``step_ratio_median``). The speeds come from probes, not from the
    runs' own steps: a per-step cost the model misses still shows (unlike ``speed_matched``).
    ``acceptance``: the simulations' acceptance profile, when the policy drafts."""
    from schedlab.analysis.validation import compare as compare_runs, median_summary, repeat_summary
    from schedlab.sim import Deployment, run
    from schedlab.sim.cost import ScaledCostModel
    from schedlab.sim.metrics import summarize

    if factors is not None and (run_steps is None or len(factors) != len(reals) or len(run_steps) != len(reals)):
        raise ValueError("drift_adjusted: one speed and one step list per real run")
    ratios = [r["ratio"] for r in (speed.get("before"), speed.get("after")) if r and r.get("ratio")]
    if not ratios and not factors:
        return None
    factor = sum(factors) / len(factors) if factors else sum(ratios) / len(ratios)
    timed = [(s.predicted_s, s.measured_s) for s in steps if s.predicted_s and s.measured_s and s.measured_s > 0]
    step_ratio = sum(m for _, m in timed) / sum(p for p, _ in timed) if timed else None
    if not drift_explains(factor, step_ratio):
        return {"speed_factor": factor, "step_ratio": step_ratio, "applied": False}
    out: dict[str, Any] = {"speed_factor": factor, "step_ratio": step_ratio, "applied": True}
    if factors is None:
        scaled_model = Deployment.one(pol, ScaledCostModel(cost, factor), kv_capacity=capacity, acceptance=acceptance)
        res = run(scaled_model, tr.requests, trace_name=tr.name)
        scaled = [s._replace(predicted_s=s.predicted_s * factor) for s in steps]
        c = compare_runs(summarize(res), reals, policy=pol.name, trace=tr.name, real_steps=scaled)
    else:
        sims = at_speeds(pol, tr, cost, capacity, factors, acceptance)
        scaled = [s._replace(predicted_s=s.predicted_s * f) for f, st in zip(factors, run_steps) for s in st]
        c = compare_runs(median_summary(sims), reals, policy=pol.name, trace=tr.name, real_steps=scaled)
        per = [compare_runs(one, reals, policy=pol.name, trace=tr.name)["metrics"] for one in sims]
        out["speeds"] = [round(f, 4) for f in factors]
        out["step_ratio_median"] = (scaled_step_bias(factors, run_steps) or {}).get("median")
        out["hold_one_out"] = repeat_summary(
            {k: dict(r, sim_runs=[p[k]["sim"] for p in per]) for k, r in c["metrics"].items()}
        )
    return out | {
        "median_abs_error_pct": c["median_abs_error_pct"],
        "max_abs_error_pct": c["max_abs_error_pct"],
        "step_error_pct": c["step_error_pct"],
        "error_pct": {k: r["error_pct"] for k, r in c["metrics"].items()},
    }


def run_speed(cols, coef: Mapping[str, float] | None = None) -> float | None:
    """A real run's own speed against its cost model (``analysis.residuals.run_speed``): its
    steps' total measured seconds over their total predicted seconds, from its step table."""
    from schedlab.analysis.residuals import run_speed as speed

    return speed(cols, coef)


def speed_matched(
    pol, tr, cost, capacity, reals: list, speeds: list, run_steps: list[list] | None = None, acceptance: Any = None
) -> dict | None:
    """The comparison again with the simulation made at each real run's own speed (``run_speed``:
    the one number a real run tells about the machine as a whole while it ran; the policy still
    plans with the cost model, as it did in the real run): per metric the median of those
    simulations against the median of the real runs, as the plain comparison takes it. On a
    shared machine that speed moves by tens of percent between identical runs minutes apart;
    this takes it out, so what remains is the model's — the order and shape of the steps, the
    queueing they cause — while the speeds are reported beside it. Reported beside the plain
    comparison, never instead of it. With ``run_steps`` (each run's steps): the steps' median
    and mean measured/(predicted x their run's speed), ``step_ratio_median``/``_mean``: what is
    left of the per-step error once each run's speed is known exactly. ``acceptance``: the
    simulations' acceptance profile, when the policy drafts."""
    from schedlab.analysis.validation import compare as compare_runs, median_summary

    if not reals or len(speeds) != len(reals) or any(f is None for f in speeds):
        return None
    sims = at_speeds(pol, tr, cost, capacity, speeds, acceptance)
    c = compare_runs(median_summary(sims), reals, policy=pol.name, trace=tr.name)
    out = {
        "speeds": [round(f, 4) for f in speeds],
        "median_abs_error_pct": c["median_abs_error_pct"],
        "max_abs_error_pct": c["max_abs_error_pct"],
        "error_pct": {k: r["error_pct"] for k, r in c["metrics"].items()},
    }
    got = scaled_step_bias(speeds, run_steps) if run_steps is not None and len(run_steps) == len(speeds) else None
    if got:
        out["step_ratio_median"], out["step_ratio_mean"] = got["median"], got["mean"]
    return out


def at_speeds(pol, tr, cost, capacity, factors: list[float], acceptance: Any = None) -> list[dict]:
    """The simulation's summary at each speed factor: every pass's seconds scaled by it, the
    policy planning with ``cost`` (as in the real run); ``acceptance``: when the policy drafts."""
    from schedlab.sim import run_replica as run_loop
    from schedlab.sim.backend import SimBackend
    from schedlab.sim.metrics import summarize

    return [
        summarize(
            run_loop(
                tr.requests,
                pol,
                cost,
                kv_capacity=capacity,
                trace_name=tr.name,
                backend=SimBackend(cost, time_scale=f, acceptance=acceptance),
            )
        )  # fmt: skip
        for f in factors
    ]


def scaled_step_bias(factors: list[float], run_steps: list[list]) -> dict[str, float] | None:
    """The median and mean of every real step's measured / (predicted x its run's speed factor);
    None without a timed step."""
    ratios = sorted(
        s.measured_s / (s.predicted_s * f)
        for f, st in zip(factors, run_steps)
        for s in st
        if s.predicted_s and s.measured_s and s.measured_s > 0
    )
    return {"median": ratios[len(ratios) // 2], "mean": sum(ratios) / len(ratios)} if ratios else None


def _speed_reference(cost_meta: dict, info=None) -> dict | None:
    """The measured profile the speed check times against (None for an analytic model, and for a
    profile of another model than ``info``'s: its passes' times are that model's, and this model's
    time against them would be read as the machine's speed)."""
    import json

    path = cost_meta.get("profile")  # analytic: only cpu-local factors fitted to a profile name one
    if not path:
        return None
    try:
        prof = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(prof, dict) or not prof.get("samples"):
        return None
    if info is not None:
        here = info.metadata()
        if any(prof.get(k) != here.get(k) for k in ("model", "dtype", "parameters")):
            return None
    return prof


def validation_cost(profile: ProfileLike, hardware, kv_tokens, info, out: Path | None, log: Log):
    """(cost model, KV capacity, description) for both sides of the validation.

    Without ``hardware``: the linear model of a measured profile (``find_or_calibrate``).
    With it: the analytic roofline of the engine's model (its config; the dtype's width for
    weights and KV) on that hardware preset. On ``cpu-local`` its factors are the ones fitted
    to this model on this machine where a matching profile has them (``calibrate
    --analytic``), else fitted now to a matching profile's stored samples, else the priors;
    one note says which.
    """
    from schedlab.sim.cost import DEFAULT_KV_TOKENS

    if hardware:
        cost, meta = analytic_cost(hardware, info)
        log("note", meta["factors_note"])
        return cost, kv_tokens or DEFAULT_KV_TOKENS, meta
    from schedlab.sim.cost import LinearCostModel
    from schedlab.engine.calibrate import find_or_calibrate

    given = None if profile is None else str(profile_path(profile))
    path, note = find_or_calibrate(given, info, out, lambda msg: log("progress", msg))
    if note:
        log("note", note)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens or int(cost.meta.get("kv_tokens", DEFAULT_KV_TOKENS))
    return cost, capacity, {"kind": "linear", "profile": str(path)}


def _matching_profiles(info):
    """Profiles measured on this model and machine: bundled ones, then calibrate's cache."""
    import json

    from schedlab.engine.calibrate import candidate_profiles, profile_mismatch

    for path in candidate_profiles(info):
        try:
            prof = json.loads(path.read_text())
            if isinstance(prof, dict) and profile_mismatch(prof, info) is None:
                yield path, prof
        except Exception:  # a broken file is no match
            continue


def analytic_cost(hardware: str, info):
    """(analytic cost model, description) of ``info``'s model on ``hardware``."""
    from schedlab.engine.calibrate import analytic_bits
    from schedlab.analysis.analytic import analytic_from_config, load_hardware
    from schedlab.analysis.analytic.local import BLOCK_KEY, block_mismatch, efficiency_from_block, fit_local

    bits, kv_bits = analytic_bits(info)
    hw = load_hardware(hardware)
    name = str(info.name)
    factors, source = "preset", f"{hw.name}'s preset factors ({hw.efficiency.basis}); not measured on this machine"
    fitted_from = None
    if hw.name == "cpu-local":
        factors, source = (
            "prior",
            (
                f"no profile of {name} measured on this machine: cpu-local's prior factors "
                f"(fit them with calibrate --analytic)"
            ),
        )
        for path, prof in _matching_profiles(info):
            block = prof.get(BLOCK_KEY)
            why = block_mismatch(block, name, bits, kv_bits) if block is not None else "none"
            if block is not None and why is None:
                hw, _ = efficiency_from_block(block, hw)
                factors, source = "fitted", f"cpu-local factors fitted for {name} on this machine, from {path}"
                fitted_from = path
                break
            if isinstance(prof.get("samples"), list) and prof["samples"]:
                try:
                    block = fit_local(prof["samples"], info.config, name=name, quant=bits, kv_bits=kv_bits, hardware=hw)
                except ValueError:
                    continue
                hw, _ = efficiency_from_block(block, hw)
                factors, source = (
                    "fitted-now",
                    (f"cpu-local factors fitted now to the samples of {path} (store them with calibrate --analytic)"),
                )
                fitted_from = path
                break
    cost = analytic_from_config(hw, info.config, bits, name=name, kv_bits=kv_bits)
    meta = {
        "kind": "analytic",
        "hardware": hw.name,
        "factors": factors,
        "factors_note": source,
        "analytic": cost.meta(),
    }
    if fitted_from is not None:  # the profile whose passes the factors were fitted to
        meta["profile"] = str(fitted_from)
    return cost, meta
