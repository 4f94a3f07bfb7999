"""schedlab side by side with Vidur: the Azure 2023 conversation hour, Llama-2-7B, one A100-80GB, Sarathi-512.

Both simulators replay the same hour (``azure2023_conv``, 19,366 requests) with the same
model, GPU and schedule, in the same run: rounds of [schedlab (each policy), Vidur], each run
a fresh process timed end to end (start-up, loading the trace, the run, the metrics), medians
over ``--repeat`` rounds. Reported side by side: wall time, peak memory and the simulated
metrics (makespan, TTFT mean/p50/p90, mean time between tokens), into
``bench/results/vs_vidur.json``. Without a measured Vidur run (no ``--vidur-python``, or its
runs failed) schedlab's side is recorded alone and no ratio is printed or written.

The schedule is Vidur 0.0.26's Sarathi scheduler (``--replica_scheduler_config_type
sarathi``, chunk 512, batch cap 128) and its trace handling, mirrored here:

- prompts and outputs are at least 1 token; a request whose prompt + output exceeds 4,096
  tokens has its **prompt** cut by the excess (``TraceReplayRequestGenerator``: ``diff =
  max(prompt + output - max_tokens, 0); prompt -= diff``; outputs are kept);
- Vidur runs a request's prompt (in chunks), then one decode iteration per output token, so
  it processes prompt + output tokens; schedlab's first output token comes from the pass
  that completes the prompt, so each request is given output + 1 tokens here (the same
  work, the same KV footprint: prompt + output), and TBT is (last - first token) / output,
  Vidur's ``decode_time_execution_plus_preemption_normalized``;
- ``sarathi-vidur`` (defined below) is Vidur's Sarathi step: every decode row first, then
  running prefills, then new requests FIFO, chunks filling 512 tokens; at most 128 requests
  hold KV; KV in blocks of 16 tokens allocated on demand (a new request needs its prompt's
  blocks plus a 1 % watermark free; a decode row one block when it crosses a block edge);
  when a decode row finds no free block the most recently arrived running request is
  preempted and recomputed later. KV capacity as Vidur computes it: (80 GiB x 0.9 - 2 bytes
  x layer parameters) / KV bytes per token, rounded down to whole 4,096-token request slots,
  7,424 blocks = 118,784 tokens for Llama-2-7B.
- ``unified`` (schedlab's bundled vLLM-v1 policy, ``-o token_budget=512 -o max_batch=128``)
  is also run: it reserves each request's whole KV footprint at admission (never
  preempts), so it admits less than Vidur on a KV-bound hour.

The cost model is the analytic ``vllm`` engine on ``a100-80gb-sxm`` with the bundled
``llama-2-7b`` config. ``--conventions vidur`` adds a diagnostic: ``sarathi-vidur`` with three
conventions of Vidur's execution-time predictor on the same kernel model (``VidurConventions``).

Vidur (optional, never in CI) runs from its own Python 3.11 venv (``pip install
vidur==0.0.26``), pointed at by ``--vidur-python`` or ``$VIDUR_PYTHON``, with a prepared cache
directory, ``--vidur-cache`` or ``$VIDUR_CACHE``: its A100 Llama-2-7B profiling data laid out
as an offline Hugging Face dataset cache (``--vidur-compute-dataset``,
``--vidur-network-dataset``) and, once trained, its random-forest predictors. Its first run
trains those predictors, ~40 minutes on 2 cores (later runs reuse them): train once before
timing (``--repeat 1``, then the real run). The runner resets ``Request.restart()``'s
per-stage counters, which the 0.0.26 wheel leaves set (it crashes on the first recompute
preemption otherwise).

    python bench/vs_vidur.py [--repeat 3] [--vidur-python ~/vidur-venv/bin/python --vidur-cache DIR]
        [--conventions vidur] [--head N]
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
from schedlab import traces
from schedlab.policies import make_policy
from schedlab.policies.base import Pass, Plan
from schedlab.policies.vllm import Vllm
from schedlab.sim import run_replica, summarize
from schedlab.traces.schema import Request, Trace

MAX_TOKENS = 4096
CHUNK = 512
BATCH_CAP = 128
BLOCK = 16
WATERMARK = 0.01
POLICIES = ("sarathi-vidur", "unified")
COMPUTE_DATASET = "local/vidur-repo-a100-llama-2-7b-hf"
NETWORK_DATASET = "local/vidur-repo-a100-pairwise-nvlink"

# ---------------------------------------------------------------------- the workload


def vidur_clip(prompt: int, output: int, max_tokens: int = MAX_TOKENS) -> tuple[int, int]:
    """Vidur 0.0.26's TraceReplayRequestGenerator: >= 1 each, then the prompt loses the excess."""
    p, d = max(int(prompt), 1), max(int(output), 1)
    p -= max(p + d - max_tokens, 0)
    return p, d


def workload(name: str = "azure2023_conv", head: int = 0) -> tuple[Trace, list[tuple[float, int, int]]]:
    """The trace as schedlab runs it (output + 1, see the module docstring) and Vidur's rows
    (``head``: only the first N requests)."""
    tr = traces.load(name)
    reqs, rows = [], []
    for r in tr.requests:
        p, d = vidur_clip(r.prompt_tokens, r.output_tokens)
        if p < 1:
            raise SystemExit(f"request {r.id}: output {d} alone exceeds {MAX_TOKENS} tokens")
        reqs.append(Request(id=r.id, arrival_s=r.arrival_s, prompt_tokens=p, output_tokens=d + 1))
        rows.append((r.arrival_s, r.prompt_tokens, r.output_tokens))
    if head:
        reqs, rows = reqs[:head], rows[:head]
    return Trace(name=f"{tr.name} (vidur-clipped)", description=tr.description, requests=reqs), rows


def vidur_kv_blocks(model) -> int:
    """Vidur's MemoryPlanner + BaseReplicaScheduler: blocks of 16 tokens in whole 4096-token slots."""
    per_layer = model.attn_params + model.dense_mlp_params
    params = per_layer * model.layers
    available = 80 * 1024**3 * (1 - 0.1)
    kv_per_token = 2 * 2 * model.head_dim * model.kv_heads * model.layers
    tokens = int((available - 2 * params) // kv_per_token)
    return (MAX_TOKENS // BLOCK) * (tokens // MAX_TOKENS)


# ---------------------------------------------------------------------- Vidur's Sarathi, as a schedlab policy


@dataclass
class SarathiVidur:
    """Vidur 0.0.26's Sarathi replica scheduler (see the module docstring)."""

    name = "sarathi-vidur"
    num_blocks: int = 7424
    chunk_size: int = CHUNK
    batch_size_cap: int = BATCH_CAP
    block_size: int = BLOCK
    watermark_fraction: float = WATERMARK
    repeats: bool = True  # Plan.repeat on decode-only steps (False: every step planned; the same run)
    alloc: dict = field(default_factory=dict)  # request id -> blocks held
    used: int = 0
    preemptions: int = 0

    def _free(self, rid: str) -> None:
        self.used -= self.alloc.pop(rid, 0)

    def plan(self, view) -> Plan:
        bs = self.block_size
        watermark = int(self.watermark_fraction * self.num_blocks)
        alive = set(view.decoding.ids()) | set(view.prefilling.ids())
        for rid in [r for r in self.alloc if r not in alive]:  # finished since the last step
            self._free(rid)
        preempt: list[str] = []
        decode: list[str] = []
        running = sorted(list(view.decoding), key=lambda r: r.arrival_s)
        alloc = self.alloc
        for r in running:  # after repeats: the blocks those steps took (as they took them) are held
            have = alloc.get(r.id, 0)
            if r.kv_tokens > have * bs:
                alloc[r.id] = full = -(-r.kv_tokens // bs)
                self.used += full - have
        i = 0
        while i < len(running):
            if len(decode) >= self.batch_size_cap:
                break
            r = running[i]
            need = 1 if r.kv_tokens + 1 > self.alloc.get(r.id, 0) * bs else 0
            while need and self.num_blocks - self.used < 1:
                victim = running.pop()  # the most recently arrived running request
                self._free(victim.id)
                preempt.append(victim.id)
                self.preemptions += 1
                if victim is r:
                    break
            else:
                if need:
                    self.alloc[r.id] += 1
                    self.used += 1
                decode.append(r.id)
                i += 1
                continue
            break
        budget = self.chunk_size - len(decode)
        chunks = []
        for r in view.prefilling:
            if budget <= 0:
                break
            n = min(r.remaining_prompt, budget)
            chunks.append((r.id, n))
            budget -= n
        admit = []
        preempted = set(preempt)
        for r in view.waiting:
            if budget <= 0 or len(self.alloc) >= self.batch_size_cap:
                break
            if r.id in preempted:
                continue
            need = -(-r.remaining_prompt // bs)  # a preempted request recomputes prompt + output so far
            if self.num_blocks - self.used - need < watermark:
                break
            self.alloc[r.id] = need
            self.used += need
            admit.append(r.id)
            n = min(r.remaining_prompt, budget)
            chunks.append((r.id, n))
            budget -= n
        passes = (Pass(decode=tuple(decode), prefill=tuple(chunks)),) if decode or chunks else ()
        repeat = 0
        if self.repeats and decode and not chunks and not preempt:
            # the same rows decode again while their new blocks fit (the head of the waiting
            # queue, refused now for the batch cap or the watermark, stays refused: blocks only
            # shrink), counted as vLLM's policy counts them; plan() catches the blocks up after
            offsets = [(r.kv_tokens + 1) % bs for r in running[: len(decode)]]
            repeat = Vllm._repeat(offsets, self.num_blocks - self.used, bs)
        return Plan(admit=tuple(admit), preempt=tuple(preempt), passes=passes, repeat=repeat)


# ---------------------------------------------------------------------- Vidur's predictor conventions (a diagnostic)


class VidurConventions:
    """The same kernel model, with three conventions of Vidur 0.0.26's execution-time predictor
    (``sklearn_execution_time_predictor``) that are not in the kernels' medians: decode
    attention at the batch's mean context rounded up to ``kv_cache_prediction_granularity``
    (0.0.26's default 256), prefill contexts rounded up likewise, and +10 % on decode / prefill
    attention when more than one request shares it (``attention_*_batching_overhead_fraction``).
    Run as ``--conventions vidur`` to see how much of the gap they explain."""

    def __init__(self, base, granularity: int = 256, batching_overhead: float = 0.1) -> None:
        self.base, self.g, self.f = base, granularity, batching_overhead

    def pass_seconds(self, shape) -> float:
        b, g = self.base, self.g
        ctx, chunks = shape.decode_contexts, shape.prefill
        rows = len(ctx)
        tokens = rows + sum(n for n, _ in chunks)
        if not tokens:
            return 0.0
        t = b.linear_seconds(tokens) + b.head_seconds(rows + len(chunks))
        if rows:
            avg = -(-int(sum(ctx) / rows) // g) * g
            t += b.decode_attention_seconds(rows, rows * avg) * (1 + self.f if rows > 1 else 1)
        if chunks:
            t += sum(b.prefill_attention_seconds(n, -(-x // g) * g) for n, x in chunks) * (
                1 + self.f if len(chunks) > 1 else 1
            )
        return t

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return 0.0


# ---------------------------------------------------------------------- runs


def cost_model():
    """The analytic A100 model, its KV blocks as Vidur counts them, and its meta."""
    from schedlab.analysis.analytic import make_analytic_cost_model

    cost, _, meta = make_analytic_cost_model("a100-80gb-sxm", "llama-2-7b", None)
    return cost, vidur_kv_blocks(cost.model), meta


def simulate(policy: str, tr: Trace, cost, blocks: int) -> tuple[dict, object]:
    """One schedlab run: its figures as Vidur reports them, and the policy (its preemptions)."""
    pol = (
        SarathiVidur(num_blocks=blocks)
        if policy == "sarathi-vidur"
        else make_policy("unified", {"token_budget": str(CHUNK), "max_batch": str(BATCH_CAP)})
    )
    s = summarize(
        run_replica(tr.requests, pol, cost, kv_capacity=blocks * BLOCK, trace_name=tr.name, record_steps=False)
    )
    return {
        "makespan_s": s["makespan_s"],
        "finished": s["finished"],
        "rejected": s["rejected"],
        "ttft_s": {k: v / 1e3 for k, v in s["ttft_ms"].items() if v is not None},
        "tbt_ms": {k: v for k, v in s["tpot_ms"].items() if v is not None},
        "e2e_s": {"mean": s["e2e_ms"]["mean"] / 1e3},
        "preemptions": getattr(pol, "preemptions", 0),
        "error": s.get("error"),
    }, pol


def child(policy: str, head: int) -> None:
    """One timed schedlab run in this (fresh) process: everything after start-up, printed as JSON."""
    t0 = time.perf_counter()
    tr, _ = workload(head=head)
    cost, blocks, _ = cost_model()
    gc.collect()
    t1 = time.perf_counter()
    figures, _ = simulate(policy, tr, cost, blocks)
    loop = time.perf_counter() - t1
    print(
        json.dumps(
            dict(
                figures,
                policy=policy,
                loop_s=loop,
                in_process_s=time.perf_counter() - t0,
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            )
        )
    )


def run_schedlab(policy: str, head: int) -> dict:
    """One schedlab run as a fresh process, timed end to end (start-up included, as Vidur's)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", policy, "--head", str(head)], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"schedlab {policy} failed: {proc.stderr.strip()[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), wall_s=wall)


RUNNER = r"""
import resource, sys, time
from vidur.entities import request as _rq
_restart = _rq.Request.restart
def _fixed(self):
    _restart(self)
    self._num_stage_processed_tokens = 0
    self._is_prefill_stage_complete = False
_rq.Request.restart = _fixed
from vidur.main import main
sys.argv = ["vidur"] + sys.argv[1:]
main()
print("VIDUR_PEAK_MIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def vidur_command(python: str, cache: Path, trace: Path, out: Path, runner: Path, args) -> list[str]:
    """Vidur 0.0.26's command line for this workload (option names of the wheel's config)."""
    p = "--random_forrest_execution_time_predictor_config"  # (Vidur's spelling)
    return [
        python,
        str(runner),
        "--seed",
        "42",
        "--replica_config_model_name",
        "meta-llama/Llama-2-7b-hf",
        "--replica_config_device",
        "a100",
        "--replica_config_network_device",
        "a100_pairwise_nvlink",
        "--replica_config_tensor_parallel_size",
        "1",
        "--replica_config_num_pipeline_stages",
        "1",
        "--cluster_config_num_replicas",
        "1",
        "--global_scheduler_config_type",
        "round_robin",
        "--replica_scheduler_config_type",
        "sarathi",
        "--sarathi_scheduler_config_chunk_size",
        str(CHUNK),
        "--sarathi_scheduler_config_batch_size_cap",
        str(BATCH_CAP),
        "--request_generator_config_type",
        "trace_replay",
        "--trace_request_generator_config_trace_file",
        str(trace),
        "--trace_request_generator_config_date",
        "2023-11-16",
        "--trace_request_generator_config_prefill_scale_factor",
        "1",
        "--trace_request_generator_config_decode_scale_factor",
        "1",
        "--trace_request_generator_config_time_scale_factor",
        "1",
        "--trace_request_generator_config_max_tokens",
        str(MAX_TOKENS),
        "--execution_time_predictor_config_type",
        "random_forrest",
        f"{p}_cache_dir",
        str(cache),
        f"{p}_model_profiling_dataset",
        args.vidur_compute_dataset,
        f"{p}_network_profiling_dataset",
        args.vidur_network_dataset,
        f"{p}_prediction_max_tokens_per_request",
        str(MAX_TOKENS),
        f"{p}_prediction_max_prefill_chunk_size",
        str(MAX_TOKENS),
        f"{p}_prediction_max_batch_size",
        str(BATCH_CAP),
        "--metrics_config_output_dir",
        str(out),
        "--no-metrics_config_store_plots",
        "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_write_json_trace",
        *shlex.split(args.vidur_args or ""),
    ]


def run_vidur(rows, workdir: Path, args) -> dict:
    """One Vidur run (its own interpreter), timed end to end; its figures from request_metrics.csv."""
    import numpy as np

    trace = workdir / "azure2023_conv_vidur.csv"
    if not trace.exists():
        with trace.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
            for a, p, d in rows:
                w.writerow(["2023-11-16", f"{a:.6f}", p, d])
    runner = workdir / "run_vidur.py"
    runner.write_text(RUNNER)
    out = workdir / f"out-{time.time_ns()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        vidur_command(args.vidur_python, Path(args.vidur_cache), trace, out, runner, args),
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout)[-2000:], "wall_s": wall}
    peak = next(
        (float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("VIDUR_PEAK_MIB")), None
    )
    metrics = sorted(out.rglob("request_metrics.csv"))
    if not metrics:
        return {"error": f"no request_metrics.csv under {out}", "wall_s": wall}
    with metrics[-1].open() as fh:
        recs = list(csv.DictReader(fh))

    def col(name):
        return np.array([float(r[name]) for r in recs if r.get(name) not in (None, "")])

    ttft, e2e = col("prefill_e2e_time"), col("request_e2e_time")
    tbt = col("decode_time_execution_plus_preemption_normalized") * 1e3
    arrived = np.array([a for a, _, _ in rows])
    makespan = None
    if len(e2e) == len(arrived):  # request ids follow arrival order
        makespan = float((np.sort(arrived) + e2e).max() - arrived.min())
    return {
        "wall_s": wall,
        "peak_rss_mib": peak,
        "makespan_s": makespan,
        "finished": len(recs),
        "ttft_s": {
            "mean": float(ttft.mean()),
            "p50": float(np.percentile(ttft, 50)),
            "p90": float(np.percentile(ttft, 90)),
            "p99": float(np.percentile(ttft, 99)),
        },
        "tbt_ms": {"mean": float(tbt.mean()), "p50": float(np.percentile(tbt, 50))},
        "e2e_s": {"mean": float(e2e.mean())},
    }


def median_of(runs: list[dict]) -> dict:
    """The run whose wall time is the median, with every run's wall time and the median beside it
    (the simulated figures are deterministic: every run gives the same)."""
    walls = [r["wall_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return dict(mid, wall_s=statistics.median(walls), wall_s_runs=walls)


def compare(ours: dict, vidur: dict) -> dict:
    """schedlab's figures relative to Vidur's (+0.05: 5 % higher), and how many times faster."""

    def rel(a, b):
        return None if a is None or not b else a / b - 1

    return {
        "makespan": rel(ours["makespan_s"], vidur["makespan_s"]),
        "ttft_mean": rel(ours["ttft_s"].get("mean"), vidur["ttft_s"]["mean"]),
        "ttft_p50": rel(ours["ttft_s"].get("p50"), vidur["ttft_s"]["p50"]),
        "ttft_p90": rel(ours["ttft_s"].get("p90"), vidur["ttft_s"]["p90"]),
        "tbt_mean": rel(ours["tbt_ms"].get("mean"), vidur["tbt_ms"]["mean"]),
        "times_faster": vidur["wall_s"] / ours["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds of [schedlab's runs, Vidur's run]; medians")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--head", type=int, default=0, help="only the first N requests (a quick check; writes nothing)")
    ap.add_argument(
        "--vidur-python",
        default=os.environ.get("VIDUR_PYTHON"),
        help="python of a venv with vidur==0.0.26 (default $VIDUR_PYTHON)",
    )
    ap.add_argument(
        "--vidur-cache",
        default=os.environ.get("VIDUR_CACHE"),
        help="Vidur's prepared cache directory: its profiling data as an offline HF dataset cache and "
        "its trained predictors (default $VIDUR_CACHE)",
    )
    ap.add_argument("--vidur-compute-dataset", default=COMPUTE_DATASET)
    ap.add_argument("--vidur-network-dataset", default=NETWORK_DATASET)
    ap.add_argument("--vidur-args", default="", help="extra Vidur options")
    ap.add_argument(
        "--conventions",
        default="",
        choices=("", "vidur"),
        help="'vidur': also simulate sarathi-vidur with Vidur's predictor conventions (a diagnostic)",
    )
    ap.add_argument("--out", default=str(common.result_path("vs_vidur")))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.head)
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES):
        raise SystemExit(f"--policies: one of {', '.join(POLICIES)}")
    if args.vidur_python and not args.vidur_cache:
        raise SystemExit("--vidur-python needs --vidur-cache (or $VIDUR_CACHE): Vidur's prepared cache directory")
    if args.vidur_cache and not Path(args.vidur_cache).is_dir():
        raise SystemExit(f"--vidur-cache {args.vidur_cache}: no such directory")
    if args.repeat < 1:
        raise SystemExit("--repeat: at least 1")

    tr, rows = workload(head=args.head)
    cost, blocks, meta = cost_model()
    clipped = sum(1 for r, (_, p, _d) in zip(tr.requests, rows) if r.prompt_tokens != max(p, 1))
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    vidur_runs: list[dict] = []
    workdir = Path(tempfile.mkdtemp(prefix="vs_vidur_")) if args.vidur_python else None
    for k in range(args.repeat):  # rounds: schedlab's runs, then Vidur's
        for p in policies:
            r = run_schedlab(p, args.head)
            runs[p].append(r)
            print(
                f"round {k} schedlab {p}: {r['wall_s']:.2f} s wall (loop {r['loop_s']:.2f} s), makespan "
                f"{r['makespan_s']:,.0f} s, TTFT mean {r['ttft_s'].get('mean', float('nan')):.1f} s, "
                f"TBT mean {r['tbt_ms'].get('mean', float('nan')):.1f} ms",
                flush=True,
            )
        if workdir is not None:
            v = run_vidur(rows, workdir, args)
            vidur_runs.append(v)
            print(
                f"round {k} vidur: "
                + (
                    f"failed after {v['wall_s']:.1f} s: {v['error'][-400:]}"
                    if "error" in v
                    else f"{v['wall_s']:.2f} s wall, makespan {v['makespan_s']:,.0f} s"
                ),
                flush=True,
            )

    schedlab = {p: median_of(rs) for p, rs in runs.items()}
    vidur = median_of(vidur_runs) if vidur_runs and not any("error" in v for v in vidur_runs) else None
    diagnostic = None
    if args.conventions == "vidur":
        d, _ = simulate("sarathi-vidur", tr, VidurConventions(cost), blocks)
        diagnostic = dict(d, what=VidurConventions.__doc__.split("\n\n")[0].replace("\n", " "))
    out = {
        "benchmark": "vs_vidur",
        "rev": common.git_rev(),
        "machine": common.machine(),
        "repeat": args.repeat,
        "workload": {
            "trace": "azure2023_conv",
            "requests": len(tr.requests),
            "prompts_clipped": clipped,
            "model": "llama-2-7b (fp16)",
            "hardware": "a100-80gb-sxm",
            "engine": "vllm",
            "schedule": f"Sarathi: chunk {CHUNK}, batch cap {BATCH_CAP}, KV {blocks} blocks of {BLOCK} "
            f"({blocks * BLOCK} tokens, Vidur's formula)",
            "output_tokens": "trace output + 1 per request (Vidur decodes every output token after the prompt)",
        },
        "cost_model": {k: meta[k] for k in ("cost_model", "engine", "hardware") if k in meta},
        "timing": "each run a fresh process, wall time end to end; rounds of [schedlab's runs, Vidur's run]; medians",
        "schedlab": schedlab,
        "vidur": vidur,
        "vidur_runs": vidur_runs or None,
        "vs_vidur": {p: compare(r, vidur) for p, r in schedlab.items()} if vidur else None,
        "diagnostic_vidur_conventions": diagnostic,
        "diagnostic_vs_vidur": compare(dict(diagnostic, wall_s=float("nan")), vidur) if diagnostic and vidur else None,
        "goal": "makespan, TTFT and mean TBT within 10 % of Vidur's, at >= 3x its speed",
    }
    if out["diagnostic_vs_vidur"]:
        del out["diagnostic_vs_vidur"]["times_faster"]
    _report(out)
    if args.head:
        print("(--head: nothing written)")
        return None
    common.write_json(out, args.out)
    print(f"wrote {args.out}")
    return None


def _report(out: dict) -> None:
    v = out["vidur"]
    print(
        f"\n{'':16s} {'wall s':>8s} {'peak MiB':>9s} {'makespan s':>11s} {'TTFT mean/p50/p90 s':>22s} {'TBT mean ms':>12s}"
    )
    rows = [(p, r) for p, r in out["schedlab"].items()] + ([("vidur", v)] if v else [])
    for name, r in rows:
        t = r["ttft_s"]
        print(
            f"{name:16s} {r['wall_s']:8.2f} {r.get('peak_rss_mib') or float('nan'):9.0f} {r['makespan_s']:11,.0f} "
            f"{t.get('mean', float('nan')):7.1f}/{t.get('p50', float('nan')):6.1f}/{t.get('p90', float('nan')):6.1f} "
            f"{r['tbt_ms'].get('mean', float('nan')):12.1f}"
        )
    if not v:
        why = "its runs failed" if out["vidur_runs"] else "not run (--vidur-python, --vidur-cache)"
        print(f"Vidur: {why}: no comparison, no speed ratio")
        return
    for p, c in out["vs_vidur"].items():
        print(
            f"{p} vs Vidur: makespan {c['makespan']:+.1%}, TTFT mean {c['ttft_mean']:+.1%}, TBT mean "
            f"{c['tbt_mean']:+.1%}; {c['times_faster']:.1f}x faster (medians of {out['repeat']} runs each, alternating)"
        )


if __name__ == "__main__":
    main()
