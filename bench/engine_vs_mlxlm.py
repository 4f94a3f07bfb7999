"""Our engine under `mlx-default` against mlx-lm's own BatchGenerator, same model and trace.

Both run in this process, alternating A/B/A/B for ``--reps`` repetitions, on the same
model (a synthetic preset, ``tiny`` by default), the same prompt token ids and output
lengths, and the same arrival times:

- ours: ``sim.loop.run_replica(trace, MlxDefault(defaults), backend=MLXBackend(model))``, the
  real-time loop; token times are the loop's wall-clock times.
- mlx-lm: ``BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8,
  prefill_step_size=2048)`` (its defaults, which are mlx-default's); requests are inserted
  when due and ``next()`` is called in a loop; a token's time is when ``next()`` returns it.

Two scenarios on the same requests: ``trace`` (arrivals as in the trace: mostly arrival
bound) and ``burst`` (every request at 0 s: a saturated batch, where engine speed shows).
Metrics (vLLM's definitions): output throughput = output tokens / (last token - first
arrival), TTFT p50, ITL p50. The JSON has every repetition and the medians over them, the
ratios ours/theirs, and how many requests got identical greedy tokens from both.

    python bench/engine_vs_mlxlm.py [--model tiny|small|smollm2-135m] [--trace real-smoke] [--reps 5]
                                    [--scenario both|trace|burst]

Results: ``bench/results/engine_vs_mlxlm.json``, one entry per model under ``models`` (a run
replaces its model's entry and keeps the others'; ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import common
from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine import blas
from schedlab.engine.backend import MLXBackend, prompt_ids
from schedlab.engine.models import load_model

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

from schedlab import traces  # noqa: E402
from schedlab.policies.mlx_default import MlxDefault  # noqa: E402
from schedlab.sim.cost import LinearCostModel  # noqa: E402
from schedlab.sim import run_replica  # noqa: E402
from schedlab.traces.schema import Request  # noqa: E402


def metrics(arrivals: dict, times: dict, outputs: dict) -> dict:
    first = min(arrivals.values())
    last = max(t[-1] for t in times.values())
    n_out = sum(outputs.values())
    ttft = [times[k][0] - arrivals[k] for k in times]
    itl = [b - a for k in times for a, b in zip(times[k], times[k][1:])]
    return {
        "output_throughput_tok_s": n_out / (last - first),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3,
        "itl_p50_ms": float(np.percentile(itl, 50)) * 1e3 if itl else None,
        "makespan_s": last - first,
    }


def run_ours(info, requests) -> tuple[dict, dict]:
    backend = MLXBackend(info, ignore_eos=True)  # both engines run every request to its max_tokens
    res = run_replica(
        requests,
        MlxDefault(),
        LinearCostModel({}),
        kv_capacity=10**9,
        backend=backend,
        trace_name="bench",
        record_steps=False,
    )
    if res.error:
        raise SystemExit(f"our engine failed: {res.error}")
    arrivals = {r.id: r.arrival_s for r in res.requests}
    times = {r.id: list(r.token_times) for r in res.requests}
    outputs = {r.id: r.output_tokens for r in res.requests}
    m = metrics(arrivals, times, outputs)
    m["copy_s"] = backend.stats["copy_s"]
    m["warmup_s"] = backend.stats["warmup_s"]
    return m, {rid: list(t) for rid, t in backend.tokens.items()}


def warm_mlxlm(info, prompts) -> None:
    gen = BatchGenerator(info.model)
    gen.insert([p[:64] for p in prompts[:4]], max_tokens=[4] * min(4, len(prompts)))
    while True:
        _, responses = gen.next()
        if (
            not responses
            and not gen._prompt_batch.uids
            and not gen._unprocessed_sequences
            and not len(gen._generation_batch)
        ):
            break
    gen.close()


def run_mlxlm(info, requests, prompts) -> tuple[dict, dict]:
    gen = BatchGenerator(info.model)  # its defaults = mlx-default's options
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    uid_of: dict[int, str] = {}
    times: dict[str, list[float]] = {r.id: [] for r in requests}
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    left = sum(r.output_tokens for r in requests)
    nxt = 0
    t0 = time.perf_counter()
    while left > 0:
        now = time.perf_counter() - t0
        due = []
        while nxt < len(order) and requests[order[nxt]].arrival_s <= now:
            due.append(order[nxt])
            nxt += 1
        if due:
            uids = gen.insert([prompts[i] for i in due], max_tokens=[requests[i].output_tokens for i in due])
            for uid, i in zip(uids, due):
                uid_of[uid] = requests[i].id
        busy = bool(len(gen._generation_batch) or len(gen._prompt_batch) or gen._unprocessed_sequences)
        if not busy:
            time.sleep(max(0.0, requests[order[nxt]].arrival_s - (time.perf_counter() - t0)))
            continue
        _, responses = gen.next()
        t = time.perf_counter() - t0
        for resp in responses:
            rid = uid_of[resp.uid]
            times[rid].append(t)
            tokens[rid].append(int(resp.token))
            left -= 1
    gen.close()
    arrivals = {r.id: r.arrival_s for r in requests}
    outputs = {r.id: r.output_tokens for r in requests}
    return metrics(arrivals, times, outputs), tokens


def scenario(info, requests, reps_n: int) -> dict:
    """Alternate ours / mlx-lm ``reps_n`` times on ``requests``; medians and ratios."""
    prompts = [prompt_ids(0, r.id, r.prompt_tokens, info.vocab_size, r.prefix_ids) for r in requests]
    reps = {"ours": [], "mlx_lm": []}
    same_tokens = []
    for rep in range(reps_n):
        m, ours_tokens = run_ours(info, requests)
        reps["ours"].append(m)
        m2, theirs_tokens = run_mlxlm(info, requests, prompts)
        reps["mlx_lm"].append(m2)
        for who, mm in (("ours", m), ("mlx_lm", m2)):
            print(
                f"rep {rep} {who:7s} throughput {mm['output_throughput_tok_s']:.1f} tok/s  "
                f"TTFT p50 {mm['ttft_p50_ms']:.0f} ms  ITL p50 {mm['itl_p50_ms']:.1f} ms  "
                f"makespan {mm['makespan_s']:.2f} s",
                flush=True,
            )
        same_tokens.append(sum(ours_tokens[r.id] == theirs_tokens[r.id] for r in requests))

    def med(who, key):
        vals = [m[key] for m in reps[who] if m.get(key) is not None]
        return statistics.median(vals) if vals else None

    keys = ("output_throughput_tok_s", "ttft_p50_ms", "itl_p50_ms", "makespan_s")
    medians = {who: {k: med(who, k) for k in keys} for who in reps}
    ratios = {
        "throughput_ours_over_mlxlm": medians["ours"]["output_throughput_tok_s"]
        / medians["mlx_lm"]["output_throughput_tok_s"],
        "ttft_p50_ours_over_mlxlm": medians["ours"]["ttft_p50_ms"] / medians["mlx_lm"]["ttft_p50_ms"],
        "itl_p50_ours_over_mlxlm": medians["ours"]["itl_p50_ms"] / medians["mlx_lm"]["itl_p50_ms"],
    }
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=2), flush=True)
    return {
        "requests": len(requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "medians": medians,
        "ratios": ratios,
        "requests_with_identical_tokens": {"per_rep": same_tokens, "of": len(requests)},
        "runs": reps,
    }


def single_stream(info, reps_n: int, prompt_len: int = 128, n: int = 64) -> dict:
    """One request alone: our engine's decode step (ITL median) against mlx-lm's own
    single-sequence loop (``generate_step``, what ``mlx_lm.generate`` runs) on the same model
    and prompt, alternating; mlx-lm's per-token time is the median gap between its tokens."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    prompt = prompt_ids(0, "single", prompt_len, info.vocab_size)
    req = [Request("single", 0.0, prompt_len, n)]
    ours, theirs = [], []
    for _ in range(reps_n):
        m, _ = run_ours(info, req)
        ours.append(m["itl_p50_ms"])
        stamps = []
        for _tok, _ in generate_step(mx.array(prompt), info.model, max_tokens=n, sampler=make_sampler(0.0)):
            stamps.append(time.perf_counter())
        gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
        theirs.append(statistics.median(gaps))
        print(
            f"single stream: ours ITL p50 {ours[-1]:.1f} ms, mlx-lm generate_step {theirs[-1]:.1f} ms/token", flush=True
        )
    o, t = statistics.median(ours), statistics.median(theirs)
    return {
        "prompt_tokens": prompt_len,
        "output_tokens": n,
        "ours_itl_p50_ms": o,
        "mlx_lm_ms_per_token": t,
        "ours_over_mlxlm": o / t,
        "runs": {"ours": ours, "mlx_lm": theirs},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--trace", default="real-smoke")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--scenario",
        choices=("both", "trace", "burst"),
        default="both",
        help="trace: arrivals as in the trace; burst: every request at 0 s",
    )
    ap.add_argument(
        "--out",
        default=str(common.result_path("engine_vs_mlxlm")),
        help="results file: this model's entry is replaced, the other models' kept",
    )
    args = ap.parse_args()

    info = load_model(args.model)
    tr = traces.load(args.trace)
    warm_mlxlm(info, [prompt_ids(0, r.id, r.prompt_tokens, info.vocab_size) for r in tr.requests])
    scenarios = {}
    if args.scenario in ("both", "trace"):
        print(f"== {tr.name}, arrivals as in the trace", flush=True)
        scenarios["trace"] = scenario(info, tr.requests, args.reps)
    if args.scenario in ("both", "burst"):
        print(f"== {tr.name}, every request at 0 s", flush=True)
        burst = [dataclasses.replace(r, arrival_s=0.0) for r in tr.requests]
        scenarios["burst"] = scenario(info, burst, args.reps)
    print("== one request alone", flush=True)
    scenarios["single_stream"] = single_stream(info, args.reps)
    out = {
        "bench": "engine_vs_mlxlm",
        "what": "our engine under mlx-default (its default options) vs mlx-lm BatchGenerator "
        "(its defaults), same model, prompts, output lengths and arrival times; "
        "alternating ours, mlx-lm per repetition; medians over repetitions",
        "model": args.model,
        "parameters": info.n_params,
        "trace": tr.name,
        "reps": args.reps,
        "scenarios": scenarios,
        "blas": blas.info(),
        "mlx": mx.__version__,
        "platform": platform.platform(),
        "cpu_count": info.metadata()["machine"]["cpu_count"],
        "rev": common.git_rev(),
    }
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.is_file() else {}
    models = data.get("models", {})
    models[Path(args.model).name] = out
    common.write_json({"bench": "engine_vs_mlxlm", "what": out["what"], "models": models}, path)
    print(f"wrote {path} ({Path(args.model).name})")


if __name__ == "__main__":
    main()
