"""Speculative decoding: when n-gram drafts pay, on the real engine and in simulation.

The workload is copy-heavy (``copy:n=N,lines=L``: each prompt asks SmolLM2-135M-Instruct to
repeat a few sonnet lines verbatim, each request's output those lines' tokens), where the drafts
of n-gram prompt lookup find their continuations in the prompt.

Real engine, at each load of ``--loads`` (``NAME:N:GAP``: N requests arriving GAP seconds apart;
default ``low:3:7``, one request at a time, ``busy:6:1``, five or six rows in the batch, and
``heavy:12:0.25``, twelve), run
with ``unified`` alone and wrapped in ``Speculative`` at each k of
``--ks``, greedy, EOS ignored (every request its full output), alternating (plain, k1, k2, ...
then the next round, the order reversed on odd rounds: this machine drifts), ``--rounds``
rounds; per configuration the medians of TPOT, ITL (one gap per chunk a client receives, as vLLM
records it), output throughput, and the acceptance (vLLM's counters). The engine runs the
policies directly (``sim.run_replica`` with ``MLXBackend``; no calibration: the cost model is not
used to plan here).

Simulation: the same workload on a profile of this machine, measured first (``calibrate``'s
compact grid for SmolLM2, verify passes included: a verify pass timed beside the plain decode
pass of the same rows; ``--profile`` gives one instead), the acceptance profile measured by the
real runs (per position, ``accepted_per_position``), plain and each k. The machine's speed is
timed against the profile's own passes before and after each load's real runs
(``engine.calibrate.speed_check``, as ``validate`` does) and the simulation is given both raw
and scaled by that speed (the drift-adjusted simulation), and raw without the verify terms (a
verify pass priced as a padded prefill of its drafts, what a profile without them gets); each
request draws from its own measured acceptance (``Acceptance.from_requests``), and once more raw
from the pooled one (``pooled_acceptance``: the requests of this workload accept very differently).
Each speculative simulation runs with ``--seeds`` seeds of its acceptance draws and keeps the
median one (the seeds' spread beside it: a few dozen verify steps per request make one seed's
draws noisy).
Compared
per configuration: the
simulated TPOT over the real one, and the simulated TPOT gain over the real gain, each beside
the real runs' round-to-round spread (the machine's repeat error). Then the crossover: ``vllm``
with and without k = 2 across request rates, up to far past capacity, where the verify
positions take the token budget and the pass time that prefill and more rows would have had.

    python bench/speculative.py [--rounds 3] [--ks 2,4] [--loads low:3:7,busy:6:1,heavy:12:0.25] [--profile P] [--out ...]

Results: ``bench/results/speculative.json`` (``docs/policies.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import common


def _real_runs(args, reqs, info):
    from schedlab.engine.backend import MLXBackend
    from schedlab.policies import make_policy
    from schedlab.policies.speculative import Speculative
    from schedlab.sim import run_replica, summarize
    from schedlab.sim.cost import LinearCostModel

    configs = [("plain", 0)] + [(f"k{k}", k) for k in args.ks]
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    tokens: dict[str, dict] = {}
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for name, k in order:
            pol = make_policy("unified") if not k else Speculative(make_policy("unified"), k=k)
            backend = MLXBackend(info, ignore_eos=True)
            t0 = time.perf_counter()
            res = run_replica(reqs, pol, LinearCostModel({}), kv_capacity=16384, backend=backend)
            wall = time.perf_counter() - t0
            if res.error:
                raise SystemExit(f"{name}: {res.error}")
            s = summarize(res)
            runs[name].append(
                {
                    "round": rnd,
                    "wall_s": wall,
                    "tpot_ms_p50": s["tpot_ms"]["p50"],
                    "itl_ms_p50": s["itl_ms"]["p50"],
                    "output_throughput_tok_s": s["output_throughput_tok_s"],
                    "makespan_s": s["makespan_s"],
                    "speculative": s.get("speculative"),
                    "speculative_requests": res.speculative_requests,
                }
            )
            tokens.setdefault(name, dict(backend.tokens))
            print(name, rnd, f"tpot {s['tpot_ms']['p50']:.1f} ms itl {s['itl_ms']['p50']:.1f} ms", flush=True)
    same = all(tokens[name] == tokens["plain"] for name in tokens)
    return runs, same


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _range(vals: list[float]) -> float:
    """Max less min over the median: the spread of rounds, or of seeds."""
    return (max(vals) - min(vals)) / statistics.median(vals)


def _spread(rows: list[dict], key: str) -> float:
    return _range([r[key] for r in rows])


def _simulated(reqs, runs, ks, cost, per_request=True, seeds=1):
    from schedlab.policies import make_policy
    from schedlab.policies.speculative import Speculative
    from schedlab.sim import Deployment, run, summarize
    from schedlab.sim.speculation import Acceptance

    out = {}
    for name, k in [("plain", 0)] + [(f"k{k}", k) for k in ks]:
        if k:
            first = runs[name][0]  # (per position, from vLLM's counters; per request, each its own)
            if per_request:
                acc = Acceptance.from_requests(first["speculative"], first["speculative_requests"])
            else:
                acc = Acceptance.from_counters(first["speculative"])
            deps = [
                Deployment.one(
                    Speculative(make_policy("unified"), k=k),
                    cost,
                    kv_capacity=16384,
                    acceptance=dataclasses.replace(acc, seed=seed),
                )
                for seed in range(seeds)
            ]
        else:
            acc, deps = None, [Deployment.one(make_policy("unified"), cost, kv_capacity=16384)]
        ss = [summarize(run(dep, reqs)) for dep in deps]  # (the acceptance draws' seeds: the median one kept)
        tpots = [x["tpot_ms"]["p50"] for x in ss]
        s = ss[tpots.index(statistics.median_low(tpots))]
        out[name] = {
            "tpot_ms_p50": s["tpot_ms"]["p50"],
            "tpot_ms_p50_seeds": tpots,
            "itl_ms_p50": s["itl_ms"]["p50"],
            "output_throughput_tok_s": s["output_throughput_tok_s"],
            "acceptance": list(acc.accept) if acc else None,
            "propose": acc.propose if acc else None,
            "per_request": {rid: list(a) for rid, a in acc.per_request.items()} if acc and acc.per_request else None,
        }
    return out


def _crossover(trace, acceptance, rates, k, cost):
    from schedlab.policies import make_policy
    from schedlab.policies.speculative import Speculative
    from schedlab.sim import Deployment, run, summarize
    from schedlab.sim.speculation import Acceptance
    from schedlab import traces

    rows = []
    for rate in rates:
        tr = traces.to_rate(trace, rate)
        plain = summarize(run(Deployment.one(make_policy("vllm"), cost, kv_capacity=16384), tr.requests))
        acc = Acceptance(acceptance)
        dep = Deployment.one(Speculative(make_policy("vllm"), k=k), cost, kv_capacity=16384, acceptance=acc)
        spec = summarize(run(dep, tr.requests))
        rows.append(
            {
                "rate_rps": rate,
                "plain_tpot_ms_p50": plain["tpot_ms"]["p50"],
                "spec_tpot_ms_p50": spec["tpot_ms"]["p50"],
                "plain_ttft_ms_p50": plain["ttft_ms"]["p50"],
                "spec_ttft_ms_p50": spec["ttft_ms"]["p50"],
                "plain_throughput_tok_s": plain["output_throughput_tok_s"],
                "spec_throughput_tok_s": spec["output_throughput_tok_s"],
                "tpot_gain": plain["tpot_ms"]["p50"] / spec["tpot_ms"]["p50"],
            }
        )
        print("rate", rate, f"tpot gain {rows[-1]['tpot_gain']:.2f}", flush=True)
    return rows


def _profile(args, info) -> tuple[dict, str]:
    """The profile the simulations use: ``--profile``, or one measured now (the compact grid,
    verify passes included). With how it was made."""
    if args.profile:
        return json.loads(open(args.profile).read()), f"given: {args.profile}"
    from schedlab.engine.calibrate import calibrate, grid_for

    t0 = time.perf_counter()
    prof = calibrate(info, grid_for(info), progress=lambda m: print("calibrate", m, flush=True))
    if args.save_profile:  # (a later run on the same machine may take it: --profile)
        from schedlab.engine.calibrate import write_profile

        print("wrote", write_profile(prof, args.save_profile), flush=True)
    return prof, f"calibrated in this run ({prof['calibration']['grid']} grid, {time.perf_counter() - t0:.0f} s)"


def _summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for key, rows in runs.items():
        spec = rows[0]["speculative"]
        out[key] = {
            "tpot_ms_p50": _median(rows, "tpot_ms_p50"),
            "tpot_spread": _spread(rows, "tpot_ms_p50"),
            "itl_ms_p50": _median(rows, "itl_ms_p50"),
            "output_throughput_tok_s": _median(rows, "output_throughput_tok_s"),
            "makespan_s": _median(rows, "makespan_s"),
            "acceptance_rate": spec["acceptance_rate"] if spec else None,
            "mean_acceptance_length": spec["mean_acceptance_length"] if spec else None,
        }
    for key in out:
        if key != "plain":
            gains = [p["tpot_ms_p50"] / r["tpot_ms_p50"] for p, r in zip(runs["plain"], runs[key])]
            out[key]["tpot_gain"] = out["plain"]["tpot_ms_p50"] / out[key]["tpot_ms_p50"]
            out[key]["tpot_gain_per_round"] = gains
            out[key]["tpot_gain_spread"] = _range(gains)
            out[key]["itl_ratio"] = out["plain"]["itl_ms_p50"] / out[key]["itl_ms_p50"]
    return out


def _compare(real: dict[str, dict], sim: dict[str, dict]) -> dict[str, dict]:
    """Per configuration: simulated over real TPOT, and simulated over real TPOT gain, each with
    the real runs' round-to-round spread beside it (within: |ratio - 1| <= that spread)."""
    out = {}
    for key, r in real.items():
        s = sim[key]
        row = {"tpot_sim_over_real": s["tpot_ms_p50"] / r["tpot_ms_p50"], "real_tpot_spread": r["tpot_spread"]}
        row["tpot_within_repeat_error"] = abs(row["tpot_sim_over_real"] - 1) <= r["tpot_spread"]
        if key != "plain":
            row["gain_sim_over_real"] = s["tpot_gain"] / r["tpot_gain"]
            row["sim_gain_seeds_spread"] = s["tpot_gain_seeds_spread"]  # (the simulation's own draws)
            row["real_gain_spread"] = r["tpot_gain_spread"]
            row["gain_within_repeat_error"] = abs(row["gain_sim_over_real"] - 1) <= r["tpot_gain_spread"]
        out[key] = row
    return out


def _one_load(args, info, item: str, prof: dict) -> dict:
    from schedlab import traces
    from schedlab.engine.calibrate import speed_check
    from schedlab.engine.tokenizer import preset_tokenizer
    from schedlab.sim.cost import LinearCostModel, ScaledCostModel

    name, n, gap = item.split(":")
    trace = traces.load(f"copy:n={n},lines={args.lines}", tokenizer=preset_tokenizer())
    reqs = [dataclasses.replace(r, arrival_s=i * float(gap)) for i, r in enumerate(trace.requests)]
    before = speed_check(info, prof)
    runs, same = _real_runs(args, reqs, info)
    after = speed_check(info, prof)
    summary = _summary(runs)
    cost = LinearCostModel(prof["coefficients"])
    speed = statistics.median([x["ratio"] for x in (before, after) if x and x.get("ratio")] or [1.0])
    sims = {}
    approx = LinearCostModel({k: v for k, v in prof["coefficients"].items() if not k.startswith("v_")})
    models = (
        ("raw", cost, True),
        ("drift_adjusted", ScaledCostModel(cost, speed), True),
        ("without_verify_terms", approx, True),
        ("pooled_acceptance", cost, False),
    )
    for label, model, per_request in models:
        sim = _simulated(reqs, runs, args.ks, model, per_request, args.seeds)
        for key in sim:
            if key != "plain":
                sim[key]["tpot_gain"] = sim["plain"]["tpot_ms_p50"] / sim[key]["tpot_ms_p50"]
                gains = [sim["plain"]["tpot_ms_p50"] / x for x in sim[key]["tpot_ms_p50_seeds"]]
                sim[key]["tpot_gain_seeds_spread"] = _range(gains)
        sims[label] = {"runs": sim, "compare": _compare(summary, sim)}
        print(name, label, json.dumps(sims[label]["compare"]), flush=True)
    return {
        "requests": int(n),
        "gap_s": float(gap),
        "trace": trace.description,
        "tokens_equal_without_speculation": same,
        "speed_check": {"before": before, "after": after, "ratio_used": speed},
        "real": {"runs": runs, "summary": summary},
        "simulated": sims,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ks", default="2,4")
    ap.add_argument(
        "--loads", default="low:3:7,busy:6:1,heavy:12:0.25", help="NAME:N:GAP,...: N requests GAP seconds apart"
    )
    ap.add_argument("--lines", type=int, default=4, help="sonnet lines each prompt asks to repeat")
    ap.add_argument("--seeds", type=int, default=9, help="the simulation's acceptance draws: seeds, the median kept")
    ap.add_argument("--profile", help="a profile of this machine (default: calibrate SmolLM2 first, ~7 min)")
    ap.add_argument("--save-profile", help="where to write the profile calibrated first (default: not kept)")
    ap.add_argument("--out", default=str(common.result_path("speculative")))
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]

    from schedlab import traces
    from schedlab.engine.models import load_model
    from schedlab.engine.tokenizer import preset_tokenizer
    from schedlab.sim.cost import LinearCostModel

    info = load_model("smollm2-135m")
    prof, how = _profile(args, info)
    loads = {item.split(":")[0]: _one_load(args, info, item, prof) for item in args.loads.split(",")}
    best = min(args.ks)
    big = traces.load("copy:n=64,lines=4,rate=1", tokenizer=preset_tokenizer())  # (Poisson: its rate can be set)
    rates = [0.05, 0.2, 0.5, 1, 2, 4, 8, 16, 32]
    first = next(iter(loads.values()))
    accept = first["simulated"]["raw"]["runs"][f"k{best}"]["acceptance"]
    crossover = _crossover(big, accept, rates, best, LinearCostModel(prof["coefficients"]))
    verify = {k: prof["fit_report"].get(k) for k in ("verify", "verify_passes")}
    common.write_json(
        {
            "bench": "speculative",
            "what": "n-gram speculative decoding (unified) on a copy-heavy workload, SmolLM2-135M on this CPU: real "
            "runs at each load alternating plain and each k, medians over rounds; the simulation of the same runs "
            "on a profile of this machine (raw and drift-adjusted) with the acceptance they measured; the "
            "simulated crossover across load (vllm)",
            "rounds": args.rounds,
            "seeds": args.seeds,
            "ks": args.ks,
            "profile": {"how": how, "date": prof.get("date"), "coefficients": prof["coefficients"], "fit": verify},
            "loads": loads,
            "crossover": {"policy": "vllm", "k": best, "rows": crossover},
        },
        args.out,
    )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
