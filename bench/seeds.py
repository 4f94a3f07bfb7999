"""The seed pull requests' headlines, reproduced in the simulator on each seed's own setup.

``docs/seeds.md`` quotes what this writes (``bench/results/seeds.json``); ``tests/test_seeds.py``
recomputes the simulated headlines at HEAD, so the page cannot drift from the code. Simulation
only, on the analytic model of the seed's hardware and model (``--hardware``, ``--model-config``):
a second or two in all::

    python bench/seeds.py                # the simulations (recorded real parts are kept)
    python bench/seeds.py --real         # and every real-engine part (000-003; minutes, a quiet machine)
    python bench/seeds.py --real 002,003 # and only those real parts

Seed 000 (mlx-lm ``BatchGenerator(prefer_prefill_when_pending=True)``; here ``prefer-prefill`` vs
``mlx-default``): Qwen3.6-35B-A3B at 4 bits on an M4 Max (``m4-max``), mlx_lm.server's
``--decode-concurrency 8 --prompt-concurrency 4 --prefill-step-size 2048`` (``completion_batch_size``,
``prefill_batch_size``, ``prefill_step_size``). The PR's matrix: N concurrent streams at 8k
(N = 2, 3, 4) and 32k (N = 2, 3) prompt tokens, N = 1 at 1k and 4k as the off-target rows;
per_decode = each request's decode rate once its first token is out, avg decode = their mean (the
PR's column), aggregate = all output tokens over the time from the first first-token to the last. The PR does not say when its
streams start nor how long they run: here they start ``GAP_S`` apart (a client opening them one
after another: a request arrives while the ones before it decode) and each asks for
``MAX_TOKENS`` tokens; ``SENSITIVITY`` reruns the 32k N = 3 row over other values of both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import machine, result_path, write_json

from schedlab.analysis.analytic import make_analytic_cost_model
from schedlab.policies import make_policy
from schedlab.sim import run_replica
from schedlab.traces.schema import Request

SEED000 = {
    "hardware": "m4-max",
    "model_config": "qwen3.6-35b-a3b",
    "quant": 4,
    "options": {"completion_batch_size": "8", "prefill_batch_size": "4", "prefill_step_size": "2048"},
    "matrix": [(2, 8192), (3, 8192), (4, 8192), (2, 32768), (3, 32768)],
    "off_target": [(1, 1024), (1, 4096)],
}
GAP_S = 2.0
MAX_TOKENS = 32
SENSITIVITY = {"gap_s": [0.5, 1.0, 2.0, 4.0], "max_tokens": [16, 32, 128, 512]}

# what PR 000 published (its "Full matrix" tables): per_decode per request, tok/s (avg decode: the mean)
PUBLISHED_000 = {
    "2x8192": {"off": [79.7, 79.8], "on": [79.6, 79.6]},
    "3x8192": {"off": [2.2, 2.2, 70.6], "on": [64.5, 64.4, 64.5]},
    "4x8192": {"off": [2.0, 3.9, 2.0, 56.6], "on": [53.7, 53.7, 53.7, 53.7]},
    "2x32768": {"off": [55.1, 51.8], "on": [60.7, 60.6]},
    "3x32768": {"off": [0.8, 0.8, 80.7], "on": [46.9, 46.8, 46.6]},
    "1x1024": {"off": [106.4], "on": [106.1]},
    "1x4096": {"off": [102.6], "on": [102.2]},
}


def decode_rates(result) -> tuple[list[float], float]:
    """(per_decode of each request in arrival order, aggregate decode tok/s)."""
    per = []
    for r in result.requests:
        t = r.token_times
        per.append((len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0)
    first = min(r.first_token_s for r in result.requests)
    last = max(r.finish_s for r in result.requests)
    return per, sum(r.generated for r in result.requests) / (last - first)


def seed000_row(n: int, ctx: int, gap_s: float = GAP_S, max_tokens: int = MAX_TOKENS, cost=None) -> dict:
    """Both policies on N streams of ``ctx`` prompt tokens, ``gap_s`` apart."""
    if cost is None:
        cost = seed000_cost()
    model, capacity = cost
    reqs = [Request(f"r{i}", i * gap_s, ctx, max_tokens) for i in range(n)]
    out = {}
    for mode, policy in (("off", "mlx-default"), ("on", "prefer-prefill")):
        res = run_replica(reqs, make_policy(policy, SEED000["options"]), model, kv_capacity=capacity)
        assert res.error is None and not res.rejected, res.error
        per, agg = decode_rates(res)
        out[mode] = {
            "per_decode": [round(x, 1) for x in per],
            "avg_decode": round(sum(per) / len(per), 1),  # the PR's "avg decode": the mean per_decode
            "aggregate": round(agg, 1),
        }
    return out


def seed000_cost():
    model, capacity, _ = make_analytic_cost_model(SEED000["hardware"], SEED000["model_config"], SEED000["quant"])
    return model, capacity


def seed000() -> dict:
    cost = seed000_cost()
    rows = {}
    for n, ctx in SEED000["off_target"] + SEED000["matrix"]:
        rows[f"{n}x{ctx}"] = seed000_row(n, ctx, cost=cost)
    # N = 2 arriving together (one prefill batch): the PR's N = 2 rows are symmetric in both modes
    rows["2x8192_together"] = seed000_row(2, 8192, 0.0, cost=cost)
    solo = rows["1x4096"]["off"]["aggregate"]
    for key, row in rows.items():
        for mode in ("off", "on"):
            m = row[mode]
            m["victim_min"] = min(m["per_decode"])
            m["fastest"] = max(m["per_decode"])
            m["victims_over_fastest"] = round(m["victim_min"] / m["fastest"], 3) if m["fastest"] else None
            m["scaling_vs_n1"] = round(m["aggregate"] / solo, 2)
        # the PR's "per_decode speedup": ON's avg decode over OFF's
        row["per_decode_speedup"] = round(row["on"]["avg_decode"] / row["off"]["avg_decode"], 2)
    sens = {}
    for gap in SENSITIVITY["gap_s"]:
        for mt in SENSITIVITY["max_tokens"]:
            r = seed000_row(3, 32768, gap, mt, cost=cost)
            sens[f"gap={gap},max_tokens={mt}"] = {
                "off_victim_min": min(r["off"]["per_decode"]),
                "off_fastest": max(r["off"]["per_decode"]),
                "on_min": min(r["on"]["per_decode"]),
                "on_max": max(r["on"]["per_decode"]),
            }
    return {
        "setup": {**SEED000, "gap_s": GAP_S, "max_tokens": MAX_TOKENS, "kv_tokens": cost[1]},
        "published": PUBLISHED_000,
        "simulated": rows,
        "sensitivity_3x32768": sens,
    }


# seed 000 on the real engine, at a scale this machine holds: SmolLM2-135M on the CPU, N = 3 streams
# of REAL_PROMPT tokens REAL_GAP_S apart, prefill chunks of REAL_STEP tokens (a chunk costs what a
# 2048-token chunk of the 35B model costs its M4 Max: many decode steps)
REAL = {
    "model": "smollm2-135m",
    # the profile the real runs plan with and the simulation of the same trace predicts with (None:
    # one calibrated at the start of the real part, ``fresh_profile``)
    "profile": None,
    "n": 3,
    "prompt": 1024,
    "gap_s": 2.0,
    "max_tokens": 32,
    "step": 256,
    "reps": 3,
}


_FRESH: dict[str, str] = {}


def fresh_profile(model: str) -> str:
    """A profile of ``model`` calibrated now (run-real's default calibration: a grid and a short
    replay), once per model and invocation: the real runs plan with it and their simulations
    predict with it, so both come from the same spell of this machine (it drifts by up to 35 %
    within minutes; a profile cached from another spell would put that drift into the comparison)."""
    if model not in _FRESH:
        import tempfile

        import schedlab

        out = Path(tempfile.mkdtemp(prefix="seeds-profile-")) / f"{model}.json"
        schedlab.calibrate(model=model, replay=True, out=out)
        _FRESH[model] = str(out)
    return _FRESH[model]


def per_decode_of(run) -> list[float]:
    """Each request's decode rate once its first token is out, in arrival order."""
    tok = run.tokens
    out = []
    for rid in run.requests["id"]:
        t = tok.loc[tok["request_id"] == rid, "time_s"].to_numpy()
        out.append(float((len(t) - 1) / (t[-1] - t[0])) if len(t) > 1 else 0.0)
    return out


def alternate(cases: dict, reps: int, measure, *, trace, model: str, profile: str, keep: Path | None = None) -> dict:
    """``cases`` (``{key: (policy, options, max_concurrency)}``) on the real engine, ``reps`` rounds,
    the cases alternating within each round (this machine drifts: each case sees every spell), all
    planning with ``profile``; then each simulated on the same trace with the same profile.
    ``measure(key, run)``: a run's figures, a list (one per request) or a dict. Per key: ``runs``
    (each real run's figures, in round order), ``median`` and ``spread`` ((max - min) / median; 0
    where the median is 0) of each figure over the rounds, ``simulated`` (the simulation's figures)
    and, with ``keep``, ``saved`` (each real run's directory, ``keep/KEY-ROUND``)."""
    import statistics

    import schedlab

    out = {key: {"runs": [], "saved": []} for key in cases}
    for rep in range(reps):
        for key, (policy, opts, conc) in cases.items():
            real = schedlab.run_real(
                policy, trace, model=model, options=opts, profile=profile, max_concurrency=conc, ignore_eos=True
            )
            assert real.error is None, real.error
            out[key]["runs"].append(measure(key, real))
            if keep is not None:
                out[key]["saved"].append(str(real.save(keep / f"{key}-{rep}")))

    def per_figure(runs: list, fn):
        if isinstance(runs[0], dict):
            return {k: fn([r[k] for r in runs]) for k in runs[0]}
        return [fn([r[i] for r in runs]) for i in range(len(runs[0]))]

    for key, (policy, opts, conc) in cases.items():
        case = out[key]
        case["median"] = per_figure(case["runs"], statistics.median)
        case["spread"] = per_figure(
            case["runs"], lambda v: (max(v) - min(v)) / statistics.median(v) if statistics.median(v) else 0.0
        )
        sim = schedlab.simulate(policy, trace, options=opts, profile=profile, max_concurrency=conc)
        case["simulated"] = measure(key, sim)
    return out


def seed000_real() -> dict:
    """Both policies on the real engine, alternating, ``reps`` times; the simulation of the same
    trace with the profile the real runs planned with, and with one fitted to the other policy's
    real runs, beside them."""
    import tempfile

    import schedlab
    from schedlab.traces.schema import Trace

    c = REAL
    reqs = [Request(f"r{i}", i * c["gap_s"], c["prompt"], c["max_tokens"]) for i in range(c["n"])]
    trace = Trace("seed000-real", "", reqs)
    opts = dict(SEED000["options"], prefill_step_size=str(c["step"]))
    out = {"setup": {**c, "options": opts}, "policies": {}}
    work = Path(tempfile.mkdtemp(prefix="seed000-real-"))
    profile = c["profile"] or fresh_profile(c["model"])
    cases = {policy: (policy, opts, None) for policy in ("mlx-default", "prefer-prefill")}
    got = alternate(
        cases, c["reps"], lambda _, run: per_decode_of(run), trace=trace, model=c["model"], profile=profile, keep=work
    )
    for policy, case in got.items():
        # beside the grid profile's prediction, one fitted to the other policy's real runs of this spell
        # (on top of the grid's fit): nothing of the predicted policy's own runs is in it
        other = [d for p, o in got.items() if p != policy for d in o["saved"]]
        held_out = schedlab.calibrate(from_runs=other, grid=profile, out=work / f"without-{policy}.json")
        sim_held = per_decode_of(schedlab.simulate(policy, trace, options=opts, profile=held_out))
        med, simulated = case["median"], case["simulated"]
        out["policies"][policy] = {
            "real_per_decode_median": [round(x, 1) for x in med],
            "real_per_decode_runs": [[round(x, 1) for x in r] for r in case["runs"]],
            "real_spread_pct": [round(100 * x, 1) for x in case["spread"]],
            "simulated_per_decode": [round(x, 1) for x in simulated],
            "sim_error_pct": [round(100 * (s / m - 1), 1) if m else None for s, m in zip(simulated, med)],
            "simulated_fitted_to_the_other_policy_per_decode": [round(x, 1) for x in sim_held],
            "fitted_error_pct": [round(100 * (s / m - 1), 1) if m else None for s, m in zip(sim_held, med)],
        }
    out["profile"] = Path(str(profile)).name
    return out


# Seed 001 (mlx-lm's continuous-batching runtime vs static ``batch_generate``): Llama-3.1-8B, 8
# requests of 128 prompt tokens and 64 output tokens, at client concurrency 1, 2, 4, 8. The PR names
# no machine: the M4 Max preset here. Its static batch returns whole (nothing streamed): a request's
# first token reaches the client with its last, so its TTFT is our end-to-end latency.
SEED001 = {"hardware": "m4-max", "model_config": "llama-3.1-8b", "n": 8, "prompt": 128, "max_tokens": 64}
PUBLISHED_001 = {
    "continuous_ttft_s": {"1": 0.29, "2": 0.34, "4": 0.49, "8": [0.52, 0.55]},
    "static_ttft_s": 3.04,
    "static_throughput_tok_s": [168, 169],
    "continuous_throughput_tok_s": [90, 152],
}


def seed001() -> dict:
    import schedlab
    from schedlab.traces.schema import Trace

    c = SEED001
    trace = Trace("seed001", "", [Request(f"q{i}", 0.0, c["prompt"], c["max_tokens"]) for i in range(c["n"])])
    where = {"hardware": c["hardware"], "model_config": c["model_config"]}
    st = schedlab.simulate("static", trace, options={"batch_size": c["n"]}, **where).summary
    out = {
        "setup": c,
        "published": PUBLISHED_001,
        "static": {
            "ttft_whole_s": round(st["e2e_ms"]["p50"] / 1000, 2),  # the batch returns whole
            "throughput_tok_s": round(st["output_throughput_tok_s"], 1),
        },
        "continuous": {},
    }
    for conc in (1, 2, 4, 8):
        co = schedlab.simulate("mlx-default", trace, max_concurrency=conc, **where).summary
        out["continuous"][str(conc)] = {
            "ttft_p50_s": round(co["ttft_ms"]["p50"] / 1000, 2),
            "throughput_tok_s": round(co["output_throughput_tok_s"], 1),
        }
    return out


# seed 001 on the real engine: SmolLM2-135M on this CPU, the seed's own shape (8 requests of 128
# prompt and 64 output tokens; static ``batch_size=8`` returning the batch whole, continuous
# ``mlx-default`` at client concurrency 1, 2, 4, 8), ``reps`` alternating rounds; the simulation of
# each with the profile the real runs planned with.
REAL001 = {"model": "smollm2-135m", "n": 8, "prompt": 128, "max_tokens": 64, "reps": 3}


def seed001_real() -> dict:
    from schedlab.traces.schema import Trace

    c = REAL001
    trace = Trace("seed001-real", "", [Request(f"q{i}", 0.0, c["prompt"], c["max_tokens"]) for i in range(c["n"])])
    cases = {"static": ("static", {"batch_size": c["n"]}, None)}
    cases.update({f"continuous_{k}": ("mlx-default", {}, k) for k in (1, 2, 4, 8)})
    profile = fresh_profile(c["model"])

    def figures(key: str, run) -> dict:
        s = run.summary
        ttft = s["e2e_ms"]["p50"] if key == "static" else s["ttft_ms"]["p50"]  # a static batch returns whole
        return {"ttft_p50_s": round(ttft / 1000, 3), "throughput_tok_s": round(s["output_throughput_tok_s"], 1)}

    got = alternate(cases, c["reps"], figures, trace=trace, model=c["model"], profile=profile)
    out: dict = {"setup": c, "cases": {}, "profile": Path(str(profile)).name}
    for key, case in got.items():
        med = {k: round(v, 3) for k, v in case["median"].items()}
        out["cases"][key] = {"real_median": med, "real_runs": case["runs"], "simulated": case["simulated"]}
    return out


# Seed 002 (openinfer: scheduler-level chunked prefill for the hybrid Qwen3.5): decoding requests'
# inter-token latency while long prompts arrive, one unified step per prompt ("chunking off": the
# whole prompt and every decode row in one forward) against a per-step budget of 1024 tokens (the
# PR's default). The PR measured Qwen3.5-4B on an A100 and an RTX 5070 Ti; its 4B config is not
# bundled: Qwen3.5-27B (the same layer pattern, 3 Gated DeltaNet layers : 1 full attention) on the
# ``a100-80gb-sxm`` preset stands in. The load (the PR's "mixed" profile: background chats of 1,024
# prompt tokens, long prompts among them): background requests of 1,024 prompt and 256 output
# tokens, Poisson at ``qps`` for 60 s, and 6 long prompts (8k or 12k, 16 output tokens) 10 s apart
# from 5 s. ITL: every gap between a background request's tokens.
SEED002 = {
    "hardware": "a100-80gb-sxm",
    "model_config": "qwen3.5-27b",
    "background": {"prompt": 1024, "max_tokens": 256, "seconds": 60.0},
    "long": {"count": 6, "first_s": 5.0, "every_s": 10.0, "max_tokens": 16},
    "one_step_budget": 16384,
    "chunked_budget": 1024,
    "qps": [1.0, 2.0],
    "long_prompt": [8192, 12288],
}
# what the PR published: no chunked-vs-off figures for Qwen3.5 (only "improves p99 ITL; slightly raises
# p50 in a minority of cases"); chunking off on Qwen3 (its p99 ITL) and on Qwen3.5 (the freeze "shows
# in max, not p99")
PUBLISHED_002 = {
    "qwen3_off_p99_itl_ms": {"8192": 1161, "12288": 3270},
    "qwen35_off": "the freeze lands just under the 1% p99 knee (shows in max, not p99)",
    "chunked": "improves p99 ITL; slightly raises p50 in a minority of cases",
}


def mixed_load(qps: float, long_prompt: int, bg: dict, long: dict, seed: int = 0) -> list[Request]:
    """Background chats at ``qps`` (Poisson, seeded) and ``long['count']`` long prompts among them."""
    import random

    rng = random.Random(seed)
    reqs, t = [], 0.0
    while t < bg["seconds"]:
        reqs.append(Request(f"bg{len(reqs)}", round(t, 4), bg["prompt"], bg["max_tokens"]))
        t += rng.expovariate(qps)
    for j in range(long["count"]):
        reqs.append(Request(f"long{j}", long["first_s"] + j * long["every_s"], long_prompt, long["max_tokens"]))
    return sorted(reqs, key=lambda r: r.arrival_s)


def background_itl(run, prefix: str = "bg") -> dict:
    """p50 / p99 / max of the gaps between each background request's tokens, ms."""
    import numpy as np

    tok = run.tokens
    gaps = [np.diff(g["time_s"].to_numpy()) for rid, g in tok.groupby("request_id") if str(rid).startswith(prefix)]
    itl = np.concatenate(gaps) * 1000
    return {
        "p50": round(float(np.percentile(itl, 50)), 1),
        "p99": round(float(np.percentile(itl, 99)), 1),
        "max": round(float(itl.max()), 1),
    }


def seed002() -> dict:
    import schedlab
    from schedlab.traces.schema import Trace

    c = SEED002
    where = {"hardware": c["hardware"], "model_config": c["model_config"]}
    rows = {}
    for qps in c["qps"]:
        for long_prompt in c["long_prompt"]:
            trace = Trace("seed002", "", mixed_load(qps, long_prompt, c["background"], c["long"]))
            row = {}
            for mode, budget in (("one_step", c["one_step_budget"]), ("chunked", c["chunked_budget"])):
                res = schedlab.simulate("unified", trace, options={"token_budget": budget}, **where)
                assert res.error is None and not res.rejected, res.error
                long_ttft = [r for r in res.requests.itertuples() if str(r.id).startswith("long")]
                row[mode] = {
                    "itl_ms": background_itl(res),
                    "long_ttft_p50_ms": round(float(sorted(r.ttft_ms for r in long_ttft)[len(long_ttft) // 2]), 1),
                    "throughput_tok_s": round(res.summary["output_throughput_tok_s"], 1),
                }
            rows[f"qps={qps:g},long={long_prompt}"] = row
    return {"setup": c, "published": PUBLISHED_002, "simulated": rows}


# seed 002 on the real engine, at a scale this machine holds: micro-qwen3_5 (mlx-lm's own qwen3_5
# classes, Gated DeltaNet and full attention, seeded random weights: engine/families.py) on the CPU.
# Background requests of 128 prompt and 64 output tokens at 4 req/s for 6 s, three prompts of 3,072
# tokens 2 s apart from 1 s (this preset's context is 4,096); one step per prompt against a budget of
# 256 tokens (a chunk costs this model on this CPU about what a 1,024-token chunk costs the 27B on an
# A100: several decode steps); ``reps`` alternating rounds.
REAL002 = {
    "model": "micro-qwen3_5",
    "qps": 4.0,
    "long_prompt": 3072,
    "background": {"prompt": 128, "max_tokens": 64, "seconds": 6.0},
    "long": {"count": 3, "first_s": 1.0, "every_s": 2.0, "max_tokens": 4},
    "one_step_budget": 16384,
    "chunked_budget": 256,
    "reps": 3,
}


def seed002_real() -> dict:
    """Both budgets on the real engine, alternating; the simulation of the same trace with the
    profile the real runs planned with (calibrated at the start: ``fresh_profile``), beside them."""
    from schedlab.traces.schema import Trace

    c = REAL002
    trace = Trace("seed002-real", "", mixed_load(c["qps"], c["long_prompt"], c["background"], c["long"]))
    modes = {"one_step": c["one_step_budget"], "chunked": c["chunked_budget"]}
    cases = {mode: ("unified", {"token_budget": budget}, None) for mode, budget in modes.items()}
    profile = fresh_profile(c["model"])
    got = alternate(
        cases, c["reps"], lambda _, run: background_itl(run), trace=trace, model=c["model"], profile=profile
    )
    out: dict = {"setup": c, "modes": {}, "profile": Path(str(profile)).name}
    for mode, case in got.items():
        out["modes"][mode] = {
            "real_itl_ms_median": {k: round(v, 1) for k, v in case["median"].items()},
            "real_itl_ms_runs": case["runs"],
            "simulated_itl_ms": case["simulated"],
        }
    return out


# Seed 004 (vllm-metal: unified prefill + decode in one forward): ``vllm bench serve`` sonnet 1024/128,
# 100 prompts at 10 req/s, max concurrency 32, Qwen3-0.6B. The PR names no machine: the M4 Max and
# the M1 presets here. The scheduler is vLLM's v1 (decode rows first, then prefill chunks within
# max_num_batched_tokens) before and after; what the PR changed is the model runner: before, each
# step ran its prefill chunks and its decode rows as two forwards (``unified -o separate=true``) and
# recomputed a continuing prompt's earlier chunks from position 0 (the O(n^2) it fixed:
# ``RecomputeChunks`` below prices a chunk of n tokens after s as s + n tokens from 0). The PR
# does not give max_num_batched_tokens: 512 and 2048. The roofline's ``fused`` style: a pass is one
# forward over a paged KV cache (weights read once per pass), as vllm-metal's varlen kernel runs it. Sonnet prompts are cut with SmolLM2's
# tokenizer (Qwen3's is not at hand): each prompt is 1,024 tokens here, 1,012 on average there.
SEED004 = {
    "model_config": "qwen3-0.6b",
    "hardware": ["m4-max", "m1"],
    "budget": [512, 2048],
    "trace": "sonnet:n=100,input_len=1024,output_len=128,rate=10",
    "max_concurrency": 32,
    "style": "fused",
}
PUBLISHED_004 = {  # the PR's three `vllm bench serve` outputs
    "unified": {"output_throughput_tok_s": 63.81, "ttft_mean_ms": 11537.56, "tpot_mean_ms": 406.60},
    "phase_separated_recompute": {"output_throughput_tok_s": 39.62, "ttft_mean_ms": 17453.35, "tpot_mean_ms": 652.37},
    "mlx_lm_path": {"output_throughput_tok_s": 36.90, "ttft_mean_ms": 87405.18, "tpot_mean_ms": 50.72},
}


class RecomputeChunks:
    """A cost model whose prefill chunks recompute their prompt from position 0: a chunk of n
    tokens after s is priced as s + n tokens with nothing before (vllm-metal's runner before the
    PR). Not a general wrapper: it forwards only ``pass_seconds``, ``step_overhead_seconds`` and
    ``cache_layout``; a cost model's other terms (``idle_seconds``, ``after_wake_seconds``, a
    ``decode_run_seconds`` formula, ``meta``) take ``CostModel``'s defaults, not the wrapped
    model's. Exact for what it wraps here, the analytic roofline (``fused`` style), which has none
    of those terms of its own (its KV capacity is passed apart: ``kv_tokens``)."""

    def __init__(self, inner):
        self.inner = inner
        self.cache_layout = getattr(inner, "cache_layout", None)

    def pass_seconds(self, shape):
        if shape.prefill:
            shape = shape._replace(prefill=tuple((n + before, 0) for n, before in shape.prefill))
        return self.inner.pass_seconds(shape)

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return self.inner.step_overhead_seconds(n_passes, n_rows)


def seed004() -> dict:
    import schedlab
    from schedlab.engine.tokenizer import preset_tokenizer
    from schedlab.traces import load

    c = SEED004
    trace = load(c["trace"], tokenizer=preset_tokenizer())
    rows = {}
    for hw in c["hardware"]:
        cost, capacity, _ = make_analytic_cost_model(hw, c["model_config"], None, style=c["style"])
        for budget in c["budget"]:
            row = {}
            for mode, opts, model in (
                ("unified", {"token_budget": budget}, cost),
                ("phase_separated", {"token_budget": budget, "separate": True}, cost),
                ("phase_separated_recompute", {"token_budget": budget, "separate": True}, RecomputeChunks(cost)),
            ):
                policy = make_policy("unified", {**opts, "max_batch": 256})
                res = schedlab.simulate(
                    policy, trace, cost=model, kv_tokens=capacity, max_concurrency=c["max_concurrency"]
                )
                assert res.error is None and not res.rejected, res.error
                s = res.summary
                row[mode] = {
                    "output_throughput_tok_s": round(s["output_throughput_tok_s"], 1),
                    "ttft_mean_ms": round(s["ttft_ms"]["mean"], 1),
                    "tpot_mean_ms": round(s["tpot_ms"]["mean"], 1),
                }
            u, before = row["unified"], row["phase_separated_recompute"]
            row["vs_recompute"] = {
                "throughput_x": round(u["output_throughput_tok_s"] / before["output_throughput_tok_s"], 2),
                "ttft_change_pct": round(100 * (u["ttft_mean_ms"] / before["ttft_mean_ms"] - 1), 1),
                "tpot_change_pct": round(100 * (u["tpot_mean_ms"] / before["tpot_mean_ms"] - 1), 1),
            }
            row["vs_separate_throughput_x"] = round(
                u["output_throughput_tok_s"] / row["phase_separated"]["output_throughput_tok_s"], 2
            )
            rows[f"{hw},budget={budget}"] = row
    p = PUBLISHED_004
    published_vs = {
        "throughput_x": round(
            p["unified"]["output_throughput_tok_s"] / p["phase_separated_recompute"]["output_throughput_tok_s"], 2
        ),
        "ttft_change_pct": round(
            100 * (p["unified"]["ttft_mean_ms"] / p["phase_separated_recompute"]["ttft_mean_ms"] - 1), 1
        ),
        "tpot_change_pct": round(
            100 * (p["unified"]["tpot_mean_ms"] / p["phase_separated_recompute"]["tpot_mean_ms"] - 1), 1
        ),
    }
    prompt = [r.prompt_tokens for r in trace.requests]
    return {
        "setup": {**c, "prompt_tokens_mean": round(sum(prompt) / len(prompt), 1)},
        "published": {**p, "vs_recompute": published_vs},
        "simulated": rows,
    }


# Seed 003 (mlxcel-xla: a continuous-batching scheduler; B slots serve N > B requests and a queued
# request is admitted mid-stream into the slot a finished one frees): every request's stream equals
# its single-sequence reference, whenever it was admitted and whichever requests shared its batch. A
# correctness claim, so on the real engine: ``slots`` (``n_slots`` = B), SmolLM2-135M, greedy, EOS
# ignored. N requests at time 0: request i's prompt is the first ``prompt_lines[i]`` lines of sonnet i
# (``sonnet.txt``, counted by SmolLM2's tokenizer), its cap ``caps[i]`` tokens (12..39 in a shuffled
# order: the slots free at staggered steps); case (B, N) serves the first N. A request's reference is
# that request alone on the same engine (a one-request trace), itself checked against the model alone
# (mlx-lm's plain cache, batch of one: nothing of the engine). ``half_full`` (B, n): B slots, only the
# first n requests; their streams must equal theirs in the case with B slots (a full batch).
REAL003 = {
    "model": "smollm2-135m",
    "cases": [[3, 6], [4, 8]],
    "caps": [12, 31, 19, 39, 27, 15, 35, 23],
    "prompt_lines": [3, 9, 1, 6, 12, 4, 8, 2],
    "half_full": [4, 2],
}
# what PR 003 published: admits, how many of them mid-stream, every stream equal to its reference
PUBLISHED_003 = {
    "B=3,N=6": {"admits": 6, "mid_stream": 3, "all_equal": True, "device": "CPU (IREE local-task)"},
    "B=4,N=8": {"admits": 8, "mid_stream": 4, "all_equal": True, "device": "CUDA GB10"},
}


def seed003_requests(caps, prompt_lines) -> list[Request]:
    """Request ``s{i}``: the first ``prompt_lines[i]`` lines of sonnet i as text, ``caps[i]`` tokens."""
    from schedlab.traces import sonnet_lines

    lines = sonnet_lines()
    return [
        Request(f"s{i}", 0.0, None, cap, prompt="".join(lines[14 * i : 14 * i + n]))
        for i, (cap, n) in enumerate(zip(caps, prompt_lines))
    ]


def admissions(run) -> dict[str, bool]:
    """Per request admitted, in admission order: whether it was admitted mid-stream, i.e. another
    request had its first token before the step that prefills it and still decoded in that step or a
    later one. From the run's passes (steps, not clock times), so a simulation gives it too."""
    p = run.passes.assign(request_id=lambda d: d["request_id"].astype(str))
    pre = p[p["kind"] == "prefill"].groupby("request_id")["step"]
    admitted, first_token = pre.min(), pre.max()  # (its last prompt chunk gives its first token)
    last_decode = p[p["kind"] == "decode"].groupby("request_id")["step"].max()
    return {
        r: any(first_token[q] < s <= last_decode.get(q, -1) for q in admitted.index if q != r)
        for r, s in admitted.sort_values(kind="stable").items()
    }


def token_streams(run) -> dict[str, list[int]]:
    """A real run's generated token ids per request."""
    return {str(row.id): [int(t) for t in row.token_ids] for row in run.texts.itertuples()}


def seed003_real(config: dict | None = None, engine=None) -> dict:
    """Every case of ``config`` (default ``REAL003``) under ``slots`` on the real engine, each request
    alone beside it, and the half-full batch; the simulator's admissions of the same traces."""
    import dataclasses

    import schedlab
    from schedlab.engine.backend import reference_tokens
    from schedlab.traces import Trace, prompt_ids

    c = config or REAL003
    if engine is None:  # (slots reads no cost model: whichever profile, none is calibrated for it)
        engine = schedlab.load_engine(model=c["model"], ignore_eos=True, no_calibrate=True)
    pool = seed003_requests(c["caps"], c["prompt_lines"])

    def slots(n_slots: int, reqs: list[Request], name: str):
        backend = engine.make_backend()
        backend.warmup = False  # (its throwaway passes take seconds a run and change no token; nothing is timed)
        run = engine.run(make_policy("slots", {"n_slots": str(n_slots)}), Trace(name, "", reqs), backend=backend)
        assert run.error is None, run.error
        return run

    used = pool[: max(n for _, n in c["cases"])]
    refs = {r.id: token_streams(slots(1, [r], f"seed003-alone-{r.id}"))[r.id] for r in used}
    tok = engine.info.tokenizer
    model_alone = {r.id: reference_tokens(engine.info, prompt_ids(r, tok), r.output_tokens) for r in used}
    out: dict = {
        "setup": c,
        "published": PUBLISHED_003,
        "alone_equals_model_alone": all(refs[r.id] == model_alone[r.id] for r in used),
        "distinct_references": len({tuple(t) for t in refs.values()}),
        "cases": {},
    }
    full: dict[int, dict[str, list[int]]] = {}
    for b, n in c["cases"]:
        reqs = pool[:n]
        run = slots(b, reqs, f"seed003-B{b}-N{n}")
        got, adm = token_streams(run), admissions(run)
        counted = {str(i): int(p) for i, p in zip(run.requests["id"], run.requests["prompt_tokens"])}
        counted_reqs = [dataclasses.replace(r, prompt=None, prompt_tokens=counted[r.id]) for r in reqs]
        sim = schedlab.simulate("slots", Trace(f"seed003-B{b}-N{n}", "", counted_reqs), options={"n_slots": b})
        sim_adm = admissions(sim)
        equal = [r.id for r in reqs if got[r.id] == refs[r.id]]
        out["cases"][f"B={b},N={n}"] = {
            "prompt_tokens": [counted[r.id] for r in reqs],
            "caps": [r.output_tokens for r in reqs],
            "admits": len(adm),
            "mid_stream": sum(adm.values()),
            "admitted_mid_stream": [r for r, mid in adm.items() if mid],
            "streams_equal_reference": len(equal),
            "all_equal": len(equal) == n,
            "tokens_compared": sum(len(got[r.id]) for r in reqs),
            "simulated": {"admits": len(sim_adm), "mid_stream": sum(sim_adm.values())},
        }
        full[b] = got
    b, n = c["half_full"]
    half = token_streams(slots(b, pool[:n], f"seed003-half-B{b}-N{n}"))
    out["half_full"] = {
        "n_slots": b,
        "requests": n,
        "equal_full_batch": all(half[r.id] == full[b][r.id] for r in pool[:n]),
        "equal_reference": all(half[r.id] == refs[r.id] for r in pool[:n]),
    }
    return out


REAL_PARTS = {"000": seed000_real, "001": seed001_real, "002": seed002_real, "003": seed003_real}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(result_path("seeds")))
    ap.add_argument(
        "--real",
        nargs="?",
        const=",".join(REAL_PARTS),
        default="",
        help="also these seeds on the real engine, comma-separated (default: all of "
        f"{','.join(REAL_PARTS)}; minutes, a quiet machine); the recorded real parts of the others are kept",
    )
    args = ap.parse_args()
    chosen = [x for x in args.real.split(",") if x]
    if unknown := sorted(set(chosen) - set(REAL_PARTS)):
        ap.error(f"--real: no real part for seed {', '.join(unknown)} (choose from {', '.join(REAL_PARTS)})")
    data = {
        "bench": "seeds",
        "machine": machine(),
        "seed000": seed000(),
        "seed001": seed001(),
        "seed002": seed002(),
        "seed004": seed004(),
    }
    old = Path(args.out)
    prev = json.loads(old.read_text()) if old.exists() else {}
    for seed, fn in REAL_PARTS.items():
        key = f"seed{seed}_real"
        if seed in chosen:
            data[key] = fn()
            data[f"{key}_machine"] = machine()
        elif key in prev:  # (a real part takes minutes and a quiet machine to make again)
            data[key] = prev[key]
            if f"{key}_machine" in prev:
                data[f"{key}_machine"] = prev[f"{key}_machine"]
    write_json(data, args.out)
    for key, row in data["seed000"]["simulated"].items():
        print(
            f"000 {key:8s} off {row['off']['per_decode']} agg {row['off']['aggregate']}  on {row['on']['per_decode']}"
        )


if __name__ == "__main__":
    main()
