"""The simulator against a real server: what clients measure from ``serve``, what the server
records, and what ``simulate`` predicts for the same traffic.

Per policy and round (the policies interleaved round by round, each server a process of its
own): ``serve --policy P --profile F --port 0 --out DIR`` on the real model; a client (the
``openai`` SDK's async client, streaming, as ``vllm bench serve`` measures: TTFT to the first
content chunk, ITL between chunks) sends a text trace's requests at their arrival times;
SIGTERM; then ``simulate`` with the same profile on the trace the server wrote (``DIR/trace.json``:
the requests as they arrived, with the tokens each generated), and again at the run's own speed
(its steps' total measured over predicted seconds, as ``validate``'s speed-matched line: the
model's share, the machine's drift taken out). Recorded per run, for the nine metrics of
``validate``: the client's figures, the server's own (``DIR/summary.json``: times stamped inside
the server), the simulation's, the speed-matched simulation's; per policy the medians over rounds
and the errors of the simulations against the server and the client, and the client over the
server (what HTTP, tokenizing and streaming add).

The profile: ``--profile F``, else the default calibration (``engine.calibrate``: quick grid and
a short real replay, ~2 min for SmolLM2), made once here and used by every server.

    python bench/serve_fidelity.py [--policies mlx-default,vllm,chunked-prefill] [--rounds 2]
        [--trace sonnet:n=20,input_len=200,output_len=48,prefix_len=50,rate=1.5] [--out bench/results/serve_fidelity.json]

Needs the ``openai`` package (the client). Results: ``bench/results/serve_fidelity.json``
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from schedlab.analysis.validation import METRICS
from schedlab.sim.metrics import dist

BIN = Path(sys.executable).parent

DEFAULT_TRACE = "sonnet:n=20,input_len=200,output_len=48,prefix_len=50,rate=1.5"


def start_server(policy: str, model: str, profile: str, out: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            str(BIN / "schedlab"),
            "serve",
            "--policy",
            policy,
            "--model",
            model,
            "--profile",
            profile,
            "--port",
            "0",
            "--out",
            str(out),
            "-q",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("serve did not start: " + "".join(seen))


async def replay(url: str, model: str, requests) -> list[dict]:
    """Each request sent at its arrival time, streamed; per request its client-side times."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()

    async def one(r) -> dict:
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        sent = time.perf_counter()
        chunks, tokens = [], None
        kw = {"messages": r.chat()} if r.messages is not None else {"prompt": r.prompt}
        create = client.chat.completions.create if r.messages is not None else client.completions.create
        stream = await create(
            model=model, max_tokens=r.output_tokens, stream=True, stream_options={"include_usage": True}, **kw
        )
        async for ch in stream:
            if ch.choices:
                c = ch.choices[0]
                text = c.delta.content if r.messages is not None else c.text
                if text:
                    chunks.append(time.perf_counter())
            if ch.usage is not None:
                tokens = ch.usage.completion_tokens
        end = time.perf_counter()
        return {
            "id": r.id,
            "sent_s": sent - t0,
            "end_s": end - t0,
            "chunks_s": [c - t0 for c in chunks],
            "tokens": tokens,
        }

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        await client.close()


def client_summary(rows: list[dict]) -> dict:
    """The client's figures in summary.json's shape (vllm bench serve's definitions)."""
    ttft = [(r["chunks_s"][0] - r["sent_s"]) * 1e3 for r in rows if r["chunks_s"]]
    itl = [(b - a) * 1e3 for r in rows for a, b in zip(r["chunks_s"], r["chunks_s"][1:])]
    tpot = [
        (r["end_s"] - r["chunks_s"][0]) * 1e3 / (r["tokens"] - 1)
        for r in rows
        if r["chunks_s"] and r["tokens"] and r["tokens"] > 1
    ]
    e2e = [(r["end_s"] - r["sent_s"]) * 1e3 for r in rows]
    span = max(r["end_s"] for r in rows) - min(r["sent_s"] for r in rows)
    out_tokens = sum(r["tokens"] or 0 for r in rows)
    return {
        "ttft_ms": dist(ttft),
        "itl_ms": dist(itl),
        "tpot_ms": dist(tpot),
        "e2e_ms": dist(e2e),
        "makespan_s": span,
        "output_throughput_tok_s": out_tokens / span if span > 0 else None,
        "total_output_tokens": out_tokens,
        "finished": len(rows),
    }


def simulations(policy: str, served: Path, profile: str, speed: float) -> tuple[dict, dict]:
    """Summaries of the served trace simulated as ``simulate`` does it, and again at ``speed``
    (every pass and the scheduler's work that many times the profile's seconds, the policy
    planning with the profile: ``validate``'s speed-matched)."""
    import schedlab
    from schedlab.sim import run_replica as run_loop, summarize
    from schedlab.sim.backend import SimBackend

    cm = schedlab.cost_model(profile)
    tr = schedlab.load_trace(str(served / "trace.json"))
    return tuple(
        summarize(
            run_loop(
                tr.requests,
                schedlab.policy(policy),
                cm.model,
                kv_capacity=cm.kv_tokens,
                trace_name=tr.name,
                block_size=16,
                backend=SimBackend(cm.model, time_scale=f),
            )
        )
        for f in (1.0, speed)
    )


def figures(summary: dict) -> dict:
    return {key: common.value(summary, path) for key, path, _ in METRICS}


def err(a, b):
    return None if a is None or not b else 100.0 * (a - b) / b


def score(pol: str, k: int, out: Path, profile: str, client: dict, finished: int, tokens: int) -> dict:
    """One run's record: the client's figures (``client``: the nine metrics; ``finished``
    requests, output ``tokens``), the server's and the simulations' (plain, and at the run's own
    speed) from its run directory ``out``."""
    server = json.loads((out / "summary.json").read_text())
    bias = json.loads((out / "meta.json").read_text())["step_bias"]  # the server's steps, as run-real records them
    speed = bias["measured_s"] / bias["predicted_s"]  # the run's own speed (api.run_speed's figure)
    sim, matched = simulations(pol, out, profile, speed)
    return {
        "round": k,
        "dir": out.name,
        "client": client,
        "server": figures(server),
        "sim": figures(sim),
        "speed_matched": figures(matched),
        "speed": round(speed, 4),
        "finished": {"client": finished, "server": server["finished"], "sim": sim["finished"]},
        "output_tokens": {"client": tokens, "server": server["total_output_tokens"], "sim": sim["total_output_tokens"]},
        "step_bias": bias["median"],
    }


def aggregate(runs: dict[str, list[dict]]) -> dict:
    per_policy = {}
    for pol, rs in runs.items():
        med = {
            side: {
                key: statistics.median(r[side][key] for r in rs if r[side][key] is not None) for key, _, _ in METRICS
            }
            for side in ("client", "server", "sim", "speed_matched")
        }
        e = {
            "sim_vs_client": {k: err(med["sim"][k], med["client"][k]) for k in med["sim"]},
            "sim_vs_server": {k: err(med["sim"][k], med["server"][k]) for k in med["sim"]},
            "speed_matched_vs_server": {k: err(med["speed_matched"][k], med["server"][k]) for k in med["sim"]},
            "client_vs_server": {k: err(med["client"][k], med["server"][k]) for k in med["sim"]},
        }
        per_policy[pol] = {
            "median": med,
            "error_pct": e,
            "median_abs_error_pct": {
                name: statistics.median(abs(v) for v in d.values() if v is not None) for name, d in e.items()
            },
            "max_abs_error_pct": {name: max(abs(v) for v in d.values() if v is not None) for name, d in e.items()},
            "runs": rs,
        }
    return per_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policies", default="mlx-default,vllm,chunked-prefill")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", help="cost profile (default: the default calibration, made here)")
    ap.add_argument(
        "--rescore",
        metavar="JSON",
        help="run no server: score a recorded result's runs again from "
        "their run directories (beside its profile, while they exist)",
    )
    ap.add_argument("--out", default=str(common.result_path("serve_fidelity")))
    args = ap.parse_args()
    if args.rescore:
        rec = json.loads(Path(args.rescore).read_text())
        work = Path(rec["profile"]).parent
        runs = {
            pol: [
                score(
                    pol,
                    r["round"],
                    work / r.get("dir", f"{pol}-{r['round']}"),
                    rec["profile"],
                    r["client"],
                    r["finished"]["client"],
                    r["output_tokens"]["client"],
                )
                for r in v["runs"]
            ]
            for pol, v in rec["per_policy"].items()
        }
        rec["per_policy"] = aggregate(runs)
        rec["rescored"] = True
        return report(rec, args.out)
    t_all = time.perf_counter()

    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    import schedlab
    from schedlab.engine.models import load_model

    info = load_model(args.model)
    tr = schedlab.load_trace(args.trace, seed=args.seed, tokenizer=info.tokenizer)
    work = Path(tempfile.mkdtemp(prefix="serve-fidelity-"))
    calibration = None
    profile = args.profile
    if profile is None:
        from schedlab.engine.calibrate import calibrate_default, write_profile

        t = time.perf_counter()
        profile = str(work / "profile.json")
        write_profile(calibrate_default(info, progress=lambda m: print(f"  calibrate: {m}", file=sys.stderr)), profile)
        calibration = {"kind": "grid+replay", "wall_s": round(time.perf_counter() - t, 1)}
    del info  # the servers load their own

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for k in range(args.rounds):
        for pol in policies:
            out = work / f"{pol}-{k}"
            proc, url = start_server(pol, args.model, profile, out)
            try:
                rows = asyncio.run(replay(url, args.model, tr.requests))
            finally:
                proc.send_signal(signal.SIGTERM)
                stdout, stderr = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise SystemExit(f"serve --policy {pol} exited {proc.returncode}: {stderr}")
            c = client_summary(rows)
            run = score(pol, k, out, profile, figures(c), c["finished"], c["total_output_tokens"])
            runs[pol].append(run)
            print(
                f"round {k} {pol:16s} TTFT p50 client {run['client']['ttft_ms.p50']:.0f} / server "
                f"{run['server']['ttft_ms.p50']:.0f} / sim {run['sim']['ttft_ms.p50']:.0f} ms, makespan "
                f"{run['client']['makespan_s']:.2f} / {run['server']['makespan_s']:.2f} / "
                f"{run['sim']['makespan_s']:.2f} s, speed {run['speed']:.3f}",
                file=sys.stderr,
            )
    result = {
        "benchmark": "serve_fidelity",
        "model": args.model,
        "trace": args.trace,
        "seed": args.seed,
        "requests": len(tr.requests),
        "rounds": args.rounds,
        "profile": profile,
        "calibration": calibration,
        "machine": common.machine(),
        "rev": common.git_rev(),
        "per_policy": aggregate(runs),
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    report(result, args.out)


def report(result: dict, out: str) -> None:
    common.write_json(result, out, indent=1)
    print(
        f"{'policy':16s} {'sim vs client':>16s} {'sim vs server':>16s} {'matched vs server':>18s} "
        f"{'client vs server':>18s}   (median / worst |error| %)   runs' speed"
    )
    for pol, v in result["per_policy"].items():
        m, w = v["median_abs_error_pct"], v["max_abs_error_pct"]
        print(
            f"{pol:16s} {m['sim_vs_client']:7.1f} / {w['sim_vs_client']:5.1f}  {m['sim_vs_server']:7.1f} / "
            f"{w['sim_vs_server']:5.1f}  {m['speed_matched_vs_server']:9.1f} / {w['speed_matched_vs_server']:5.1f}  "
            f"{m['client_vs_server']:9.1f} / {w['client_vs_server']:5.1f}   "
            + " ".join(f"{r['speed']:.3f}" for r in v["runs"])
        )


if __name__ == "__main__":
    main()
