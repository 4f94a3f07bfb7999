"""Speculative decoding served: ``schedlab serve --speculative`` against ``mlx_lm.server --draft-model``,
as a user measures servers: the same checkpoint, the same BLAS, the same client and requests, alternating.

Why. ``mlx_lm.server`` turns continuous batching off when it is given a draft model: in mlx-lm
0.32.2, ``mlx_lm/server.py`` line 460 (``ModelProvider._load``) sets ``is_batchable = draft_model
is None``, and a request that is not batchable is served alone (``_serve_single``, line 905: one
request at a time, the others queued). So a server there gets either speculation or batching;
``schedlab serve --speculative`` verifies drafts for every decode row of a batch. This bench
measures both, side by side, at concurrency 1 (where batching does not matter) and above.

What runs (``--servers``; default all, each started fresh per round):

- ``mlx_lm``: ``mlx_lm.server --model CKPT`` (continuous batching, its defaults; its prompt
  cache on, as shipped);
- ``mlx_lm-draft``: ``mlx_lm.server --model CKPT --draft-model CKPT --num-draft-tokens K``;
- ``serve-draft``: ``schedlab serve --policy unified --speculative draft:model=CKPT,k=K``;
- ``serve-ngram``: ``schedlab serve --policy unified --speculative ngram:k=K`` (n-gram prompt
  lookup, no draft model);
- ``serve``: ``schedlab serve --policy unified``.

CKPT is SmolLM2-135M (``--model``) exported once with ``schedlab export-mlx MODEL CKPT --dtype
float32``; mlx_lm.server is started through ``serve_vs_mlxlm``'s wrapper (OpenBLAS loaded before
mlx, as in serve; the BLAS in use recorded per run), serve plans with the bundled SmolLM2 profile
(``--profile``), prefix caching off (its default). The draft of both draft servers is CKPT
itself: the only draft we have with SmolLM2-135M's tokenizer is SmolLM2-135M. A self-draft:
every greedy draft is accepted, and each draft token costs a full forward of the target model.
So the draft rows measure the batching and the overhead of speculation (drafting, verifying,
rolling back), not a speed-up from a small draft; a small draft would only lower the drafting
cost, the same for both servers. The n-gram row is the one where speculation can pay here.

The load: the copy-heavy workload (``copy:n=N,lines=L``, as ``bench/speculative.py``; each
request asks SmolLM2 to repeat L sonnet lines verbatim, its max_tokens its trace output length,
the quoted lines' token count; ``--max-tokens`` caps it for smoke runs), sent to
``/v1/chat/completions``, streamed (``stream_options.include_usage``: output tokens from the
servers' usage), greedy (``temperature`` 0), ``--requests`` requests per concurrency of
``--concurrency`` (disjoint prompts per level, the same for every server and round), by a closed
loop of C clients in this process (httpx, asyncio: a client sends its next request when its
previous one ends); ``--warmup`` other requests first, untimed. The servers' order alternates
per round (listed order on even rounds, reversed on odd ones); medians over ``--rounds``.

End of sequence (``--eos``). SmolLM2 often ends a copy early (6 of 8 copy prompts checked
stopped before their max_tokens, two after 13 and 17 of 49 and 36), so by default every request
runs to its max_tokens. How: ``ignore`` (default) gives mlx_lm.server OpenAI's ``logit_bias`` of
-100 on the EOS ids (it has no ``ignore_eos``) and serve vLLM's ``ignore_eos``: serve's
speculation verifies plain greedy rows only (``engine/backend.py`` ``_propose``), and a row with
a logit bias is not one, so a bias would turn its speculation off.
The two mechanisms differ past the point where the model would stop (mlx_lm.server takes the
runner-up token there, serve the EOS and goes on), so texts are compared both with plain
mlx_lm.server's (``texts_equal_mlx_lm``) and with the same server family's plain run
(``texts_equal_plain``: mlx_lm-draft against mlx_lm, serve-* against serve), which use the same
mechanism. ``bias``: ``logit_bias`` for every server (the same body; serve's rows then do not
speculate: its drafts counters stay 0). ``stop``: neither; each request ends at EOS or max_tokens.

Recorded per server, concurrency and round: output throughput (output tokens over the run's
wall time, first request sent to last one done), TPOT p50 (per request (last chunk - first
chunk) / (tokens - 1)), TTFT p50 (first chunk with text), ITL p50 (every gap between chunks with
text, pooled over requests, as vLLM), E2EL p50, wall, output tokens, the server's CPU seconds,
mlx_lm.server's prompt-cache hits (usage ``cached_tokens``), each request's text digest (the
texts themselves in round 0), the texts' agreement above, and for serve the spec-decode counters
of its /metrics (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, per position), read before and after each run (the run's share).
A server or configuration that fails (start, readiness, a request's error) is recorded with its
error text and its log's tail; the others go on. Summary: per server and concurrency the medians
over rounds, the round-to-round spread ((max - min) / median), and ratios against
``mlx_lm-draft`` (and ``mlx_lm``) at the same concurrency.

    python bench/spec_vs_mlxlm.py [--rounds 3] [--concurrency 1,4] [--requests 8] [--k 4] [--lines 4]
        [--servers mlx_lm,mlx_lm-draft,serve-draft,serve-ngram,serve] [--eos ignore|bias|stop]
        [--server-cpus 0-1] [--checkpoint DIR] [--work DIR]
    python bench/spec_vs_mlxlm.py --rounds 1 --requests 2 --concurrency 1 --max-tokens 8 --out /tmp/x.json  # smoke

Results: ``bench/results/spec_vs_mlxlm.json``, rewritten after every round; the servers' logs stay
under ``--work``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common
from serve_vs_mlxlm import (
    BIN,
    MLX_LM_WRAPPER,
    Server,
    export_checkpoint,
    launch,
    serve_profile,
    tokenizer_and_eos,
    wait_ready,
)

SERVERS = ("mlx_lm", "mlx_lm-draft", "serve-draft", "serve-ngram", "serve")
REF = "mlx_lm-draft"  # the ratios' reference
PLAIN_OF = {
    "mlx_lm": "mlx_lm",
    "mlx_lm-draft": "mlx_lm",
    "serve-draft": "serve",
    "serve-ngram": "serve",
    "serve": "serve",
}
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
KEYS = ("output_throughput_tok_s", "tpot_ms_p50", "ttft_ms_p50", "itl_ms_p50", "e2el_ms_p50", "wall_s")
LOWER_IS_BETTER = {"tpot_ms_p50", "ttft_ms_p50", "itl_ms_p50", "e2el_ms_p50", "wall_s"}


def server_cmds(args, ckpt: Path, model_name: str) -> dict[str, tuple[list[str], bool]]:
    """name -> (command, listens on a port chosen here)."""
    pin = ["taskset", "-c", args.server_cpus] if args.server_cpus else []
    mlx = [*pin, sys.executable, "-c", MLX_LM_WRAPPER, "--model", str(ckpt), "--host", "127.0.0.1"]
    serve = [*pin, str(BIN / "schedlab"), "serve", "--policy", "unified", "--model", str(ckpt),
             "--served-model-name", model_name, "--port", "0", "-q"]  # fmt: skip
    if args.profile:
        serve += ["--profile", args.profile]
    k = str(args.k)
    cmds = {
        "mlx_lm": (mlx, True),
        "mlx_lm-draft": ([*mlx, "--draft-model", str(ckpt), "--num-draft-tokens", k], True),
        "serve-draft": ([*serve, "--speculative", f"draft:model={ckpt},k={k}"], False),
        "serve-ngram": ([*serve, "--speculative", f"ngram:k={k}"], False),
        "serve": (serve, False),
    }
    return {name: cmds[name] for name in args.server_list}


# ------------------------------------------------------------------------------- client


def request_body(server: str, model: str, text: str, max_tokens: int, eos: str, eos_ids: list[int]) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if eos == "bias" or (eos == "ignore" and server.startswith("mlx_lm")):
        body["logit_bias"] = {str(t): -100 for t in eos_ids}
    elif eos == "ignore":
        body["ignore_eos"] = True  # vLLM's extension, serve's too (a bias would turn its speculation off)
    return body


async def one_request(client, url: str, body: dict, t_run: float) -> dict:
    """One streamed request: each chunk with text's arrival time, the text, the server's usage."""
    import httpx

    t0 = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    usage, error = None, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:1000].decode(errors='replace')}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    ev = json.loads(data)
                    if ev.get("error"):
                        error = json.dumps(ev["error"])[:1000]
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or ():
                        content = (ch.get("delta") or {}).get("content")
                        if content:
                            times.append(now)
                            parts.append(content)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:1000]
    t1 = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens")
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {
        "sent_s": round(t0 - t_run, 4),
        "e2el_ms": (t1 - t0) * 1e3,
        "ttft_ms": (times[0] - t0) * 1e3 if times else None,
        "tpot_ms": (times[-1] - times[0]) * 1e3 / (tokens - 1) if times and tokens and tokens > 1 else None,
        "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
        "chunks": len(times),
        "tokens": tokens,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": cached,
        "text": "".join(parts),
    }
    if error or usage is None:
        out["error"] = error or "no usage in the stream"
    return out


async def closed_loop(url: str, bodies: list[tuple[str, dict]], c: int, timeout: float) -> tuple[dict, float]:
    """``c`` clients, each sending its next request (in order) when its previous one ends. The
    results by request id, and the wall time from the first request sent to the last one done."""
    import httpx

    todo = list(bodies)
    results: dict[str, dict] = {}
    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t_run = time.perf_counter()

        async def worker():
            while todo:
                rid, body = todo.pop(0)
                results[rid] = await one_request(client, url, body, t_run)

        await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.perf_counter() - t_run
    return results, wall


def spec_counters(url: str) -> dict | None:
    """serve's spec-decode counters from its /metrics (the cumulative values), or None where it
    has none (mlx_lm.server has no /metrics)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return None

    def values(name: str) -> list[tuple[str, float]]:
        pat = rf"^{re.escape(name)}(?:_total)?\{{([^}}]*)\}} (\S+)$"
        return [(m.group(1), float(m.group(2))) for m in re.finditer(pat, text, re.M)]

    out: dict = {name: sum(v for _, v in values(name)) for name in SPEC}
    pos: dict[int, float] = {}
    for labels, v in values(PER_POS):
        m = re.search(r'position="(\d+)"', labels)
        if m:
            pos[int(m.group(1))] = pos.get(int(m.group(1)), 0.0) + v
    out[PER_POS] = [pos[i] for i in sorted(pos)]
    return out


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    out = {name: after[name] - before[name] for name in SPEC}
    b, a = before[PER_POS], after[PER_POS]
    out[PER_POS] = [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a)]
    drafts, draft_tokens, accepted = (out[n] for n in SPEC)
    out["acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
    out["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None  # vLLM's: 1 + accepted per draft
    return out


def version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def med(values) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure(srv: Server, args, model: str, reqs, c: int, eos_ids: list[int], keep_texts: bool) -> dict:
    """One closed-loop run of ``reqs`` at concurrency ``c`` against a started server."""
    bodies = [(r.id, request_body(srv.name, model, text, mt, args.eos, eos_ids)) for r, text, mt in reqs]
    before, cpu0 = spec_counters(srv.url), srv.cpu_s()
    results, wall = asyncio.run(closed_loop(srv.url, bodies, c, args.request_timeout))
    cpu1, after = srv.cpu_s(), spec_counters(srv.url)
    srv._check_alive()
    ok = [r for r in results.values() if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    run = {
        "requests": len(reqs),
        "completed": len(ok),
        "output_tokens": tokens,
        "tokens_per_request": {rid: r["tokens"] for rid, r in results.items()},
        "wall_s": wall,
        "output_throughput_tok_s": tokens / wall if ok else None,
        "tpot_ms_p50": med(r["tpot_ms"] for r in ok),
        "ttft_ms_p50": med(r["ttft_ms"] for r in ok),
        "itl_ms_p50": med(x for r in ok for x in r["itl_ms"]),
        "e2el_ms_p50": med(r["e2el_ms"] for r in ok),
        "chunks_per_token": sum(r["chunks"] for r in ok) / tokens if tokens else None,
        "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "server_cpu_s": round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None,
        "spec_decode": counters_delta(before, after),
        "digests": {rid: digest(r["text"]) for rid, r in results.items()},
    }
    errors = {rid: r["error"] for rid, r in results.items() if "error" in r}
    if errors:
        run["errors"] = errors
        run["log_tail"] = srv.log.read_text()[-3000:]
    if keep_texts:
        run["texts"] = {rid: r["text"] for rid, r in results.items()}
    return run


def compare_texts(rd: dict, conc: list[int]) -> None:
    """Each run's texts against plain mlx_lm.server's and its own plain sibling's, same round and
    concurrency: the share of requests whose texts are equal (None: no reference ran)."""
    for name, runs in rd["runs"].items():
        for c in conc:
            run = runs.get("concurrency", {}).get(str(c))
            if not run or "digests" not in run:
                continue
            for key, ref in (("texts_equal_mlx_lm", "mlx_lm"), ("texts_equal_plain", PLAIN_OF[name])):
                other = rd["runs"].get(ref, {}).get("concurrency", {}).get(str(c))
                if not other or "digests" not in other:
                    run[key] = None
                    continue
                same = [run["digests"][rid] == d for rid, d in other["digests"].items() if rid in run["digests"]]
                run[key] = sum(same) / len(same) if same else None


# ------------------------------------------------------------------------------- summary


def summarize(rounds: list[dict], names: list[str], conc: list[int]) -> dict:
    out: dict = {}
    for name in names:
        out[name] = {}
        for c in conc:
            runs = [rd["runs"].get(name, {}).get("concurrency", {}).get(str(c)) for rd in rounds]
            runs = [r for r in runs if r and "errors" not in r and r.get("output_throughput_tok_s")]
            s: dict = {"rounds": len(runs)}
            for key in KEYS:
                vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
                m = med(vals)
                s[key] = m
                s[key + "_spread"] = (max(vals) - min(vals)) / m if vals and m else None
            for key in ("texts_equal_mlx_lm", "texts_equal_plain"):
                s[key] = med(r.get(key) for r in runs)
            sd = [r["spec_decode"] for r in runs if r.get("spec_decode")]
            if sd:
                s["spec_decode"] = {
                    "acceptance_rate": med(x["acceptance_rate"] for x in sd),
                    "mean_acceptance_length": med(x["mean_acceptance_length"] for x in sd),
                    "drafts": med(x[SPEC[0]] for x in sd),
                    "draft_tokens": med(x[SPEC[1]] for x in sd),
                    "accepted_tokens": med(x[SPEC[2]] for x in sd),
                }
            out[name][str(c)] = s
    for ref in (REF, "mlx_lm"):
        for name in names:
            for c in conc:
                s, r = out[name][str(c)], out.get(ref, {}).get(str(c), {})
                s[f"vs_{ref}"] = {
                    key: (s[key] / r[key] if isinstance(s[key], (int, float)) and r.get(key) else None) for key in KEYS
                }
    return out


def report(summary: dict) -> None:
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    for name, per_c in summary.items():
        for c, s in per_c.items():
            v = s.get(f"vs_{REF}", {})
            print(
                f"C={c:<2s} {name:13s} {f(s['output_throughput_tok_s'], '7.2f')} tok/s "
                f"(x{f(v.get('output_throughput_tok_s'), '.2f')} vs {REF})  TPOT {f(s['tpot_ms_p50'], '6.1f')} ms  "
                f"TTFT {f(s['ttft_ms_p50'], '7.0f')} ms  ITL {f(s['itl_ms_p50'], '6.1f')} ms  spread "
                f"{f(s['output_throughput_tok_s_spread'], '.2f')}  texts=mlx_lm {f(s['texts_equal_mlx_lm'], '.2f')}"
                f" =plain {f(s['texts_equal_plain'], '.2f')}"
                + (
                    f"  accept {f(s['spec_decode']['acceptance_rate'], '.2f')}"
                    if s.get("spec_decode") and s["spec_decode"]["draft_tokens"]
                    else ""
                )
            )


# ------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="exported to --checkpoint with export-mlx, float32")
    ap.add_argument("--checkpoint", type=Path, default=None, help="the exported directory (exported there when "
                    "missing; default: WORK/checkpoint)")  # fmt: skip
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify (both servers)")
    ap.add_argument("--lines", type=int, default=4, help="sonnet lines each prompt asks to repeat")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens (smoke runs)")
    ap.add_argument("--eos", choices=("ignore", "bias", "stop"), default="ignore", help="see the docstring")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests to each server after start")
    ap.add_argument("--profile", default=None, help="serve's --profile (default: the bundled smollm2-135m-cpu "
                    "for smollm2-135m; 'none': serve's own choice)")  # fmt: skip
    ap.add_argument("--server-cpus", default=None, help="taskset -c list for every server (default: none)")
    ap.add_argument("--request-timeout", type=float, default=1800.0, help="per request, s")
    ap.add_argument("--seed", type=int, default=0, help="the copy trace's")
    ap.add_argument("--work", type=Path, default=None, help="checkpoint and server logs (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=common.result_path("spec_vs_mlxlm"))
    args = ap.parse_args()

    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = sorted(set(args.server_list) - set(SERVERS))
    if bad or not args.server_list:
        raise SystemExit(f"--servers: of {', '.join(SERVERS)}, got {args.servers!r}")
    conc = [int(c) for c in args.concurrency.split(",")]
    args.profile = serve_profile(args.profile, args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="spec-vs-mlxlm-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work: {work}", file=sys.stderr, flush=True)
    t_all = time.perf_counter()

    ckpt = (args.checkpoint or work / "checkpoint").resolve()
    config = export_checkpoint(args.model, ckpt)
    model_name = str(ckpt)  # what every server answers to (mlx_lm.server: the path it loaded)
    tok, eos_ids = tokenizer_and_eos(ckpt, config)

    from schedlab import traces
    from schedlab.engine import blas

    # the requests: disjoint per concurrency, the same for every server and round; warm-up apart
    n = args.requests
    spec = f"copy:n={n * len(conc)},lines={args.lines}"
    trace = traces.load(spec, seed=args.seed, tokenizer=tok)
    warm_trace = traces.load(f"copy:n={max(args.warmup, 1)},lines={args.lines}", seed=args.seed + 1, tokenizer=tok)

    def rows(reqs):
        cap = args.max_tokens or 1 << 30
        return [(r, r.messages[-1][1], min(r.output_tokens, cap)) for r in reqs]

    sets = {c: rows(trace.requests[i * n : (i + 1) * n]) for i, c in enumerate(conc)}
    warm = rows(warm_trace.requests)[: args.warmup]
    cmds = server_cmds(args, ckpt, model_name)
    names = list(cmds)
    rounds: list[dict] = []

    def record(complete: bool) -> None:
        common.write_json(
            {
                "bench": "spec_vs_mlxlm",
                "what": "speculative decoding served: mlx_lm.server (plain, --draft-model) against schedlab serve "
                "(unified: plain, --speculative draft and ngram) on the copy-heavy workload, the same float32 "
                "checkpoint, OpenBLAS in both, greedy; closed loops at each concurrency; servers alternating per "
                "round; medians over rounds",
                "complete": complete,
                "notes": {
                    "mlx_lm_draft_no_batching": "mlx-lm 0.32.2 mlx_lm/server.py:460 `is_batchable = draft_model is "
                    "None`: with --draft-model every request is served alone (_serve_single), the others queued",
                    "self_draft": "both draft servers draft with the target checkpoint itself (the only draft with "
                    "SmolLM2-135M's tokenizer here): every greedy draft is accepted and each draft token costs a "
                    "target forward; the draft rows measure batching and speculation's overhead, not a small "
                    "draft's speed-up",
                    "eos": {
                        "ignore": "mlx_lm.server: logit_bias -100 on the EOS ids; serve: ignore_eos (a logit bias "
                        "would turn serve's speculation off: it verifies plain greedy rows only)",
                        "bias": "logit_bias -100 on the EOS ids for every server (serve does not speculate then)",
                        "stop": "each request ends at EOS or max_tokens",
                    }[args.eos],
                },
                "model": args.model,
                "checkpoint": {"dir": str(ckpt), "dtype": "float32", "config": config},
                "k": args.k,
                "eos": args.eos,
                "eos_ids": eos_ids,
                "workload": {
                    "spec": spec,
                    "seed": args.seed,
                    "description": trace.description,
                    "requests_per_concurrency": n,
                    "max_tokens_cap": args.max_tokens,
                    "max_tokens": {str(c): [mt for _, _, mt in sets[c]] for c in conc},
                    "prompt_tokens": {str(c): [r.prompt_tokens for r, _, _ in sets[c]] for c in conc},
                    "warmup": len(warm),
                },
                "concurrency": conc,
                "client": "closed loop of C asyncio clients in the bench process (httpx), streamed chat completions",
                "servers": {name: shlex.join(cmd) for name, (cmd, _) in cmds.items()},
                "server_cpus": args.server_cpus,
                "versions": {p: version(p) for p in ("mlx", "mlx-lm", "schedlab", "httpx")},
                "blas_bench_process": blas.info(),
                "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT")},
                "rounds_asked": args.rounds,
                "rounds": rounds,
                "summary": summarize(rounds, names, conc),
                "work": str(work),
                "wall_s": round(time.perf_counter() - t_all, 1),
            },
            args.out,
            indent=1,
        )

    current: list[Server] = []

    def on_term(signum, frame):  # stop the servers on SIGTERM as on Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        for k in range(args.rounds):
            order = names if k % 2 == 0 else names[::-1]
            rd: dict = {"round": k, "order": order, "runs": {}}
            rounds.append(rd)
            for name in order:
                srv = launch(name, cmds, work / f"r{k}-{name}.server.log")
                current.append(srv)
                runs: dict = {}
                rd["runs"][name] = runs
                try:
                    t = time.monotonic()
                    srv.start()
                    runs["ready_s"] = round(time.monotonic() - t + wait_ready(srv, model_name), 1)
                    if warm:
                        w = measure(srv, args, model_name, warm, 1, eos_ids, False)
                        if "errors" in w:
                            raise RuntimeError(f"warm-up failed: {json.dumps(w['errors'])[:2000]}")
                    runs["blas"] = srv.blas()
                    runs["concurrency"] = {}
                    for c in conc:
                        run = measure(srv, args, model_name, sets[c], c, eos_ids, keep_texts=k == 0)
                        runs["concurrency"][str(c)] = run
                        sd = run["spec_decode"]
                        print(
                            f"round {k} {name:13s} C={c}: {run['output_throughput_tok_s'] or 0:.2f} tok/s, TPOT p50 "
                            f"{run['tpot_ms_p50'] or 0:.1f} ms, TTFT p50 {run['ttft_ms_p50'] or 0:.0f} ms, "
                            f"{run['output_tokens']} tokens in {run['wall_s']:.1f} s"
                            + (f", drafts {sd[SPEC[0]]:.0f} accepted {sd[SPEC[2]]:.0f}/{sd[SPEC[1]]:.0f}" if sd else "")
                            + (f", {len(run['errors'])} errors" if run.get("errors") else ""),
                            file=sys.stderr,
                            flush=True,
                        )
                except RuntimeError as exc:  # one server's failure is recorded; the others go on
                    runs["error"] = str(exc)[-3000:]
                    print(f"round {k} {name}: FAILED: {str(exc)[-1000:]}", file=sys.stderr, flush=True)
                finally:
                    runs["exit_code"] = srv.stop()
                    current.remove(srv)
            compare_texts(rd, conc)
            record(complete=False)
    finally:
        for srv in current:
            srv.stop()
    record(complete=True)
    print(f"wrote {args.out}")
    report(summarize(rounds, names, conc))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: the servers were stopped; the results file has the rounds done")
