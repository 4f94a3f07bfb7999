"""``schedlab serve`` (each bundled policy) against ``mlx_lm.server``, as a user measures servers:
the same checkpoint, the same BLAS, the same load client and the same requests, alternating.

What runs. SmolLM2-135M (``--model``) is exported once with ``schedlab export-mlx MODEL DIR
--dtype float32`` (dequantized: both servers run the same float32 weights); both servers load that
directory:

- ``mlx_lm.server --model DIR --port N`` with mlx-lm's defaults (decode concurrency 32, prompt
  concurrency 8, prefill step 2048: mlx-default's options; its prompt cache on, as shipped),
  started through a short wrapper that imports ``schedlab.engine`` first: that loads OpenBLAS
  into the process before mlx (``engine.blas``; MLX's wheel otherwise keeps its reference BLAS,
  10-20x slower), and prints the BLAS in use (recorded per run). ``OPENBLAS_THREAD_TIMEOUT`` and
  ``OPENBLAS_NUM_THREADS`` are the same for both servers (``engine.blas`` sets the first when the
  user has not).
- ``schedlab serve --policy P --model DIR --served-model-name DIR --port 0 -q`` for every policy
  (``--policies``; default all bundled), planning with ``--profile`` (default: the bundled
  SmolLM2 profile; serve's own default for a checkpoint directory would be the tiny model's),
  prefix caching off (serve's default).

Both servers get the same CPUs: ``--server-cpus`` (``taskset -c``; default none: all cores), and
the client ``--client-cpus`` (default none). Per round every server is started fresh, warmed with
``--warmup`` requests, measured on the loads below, then stopped (SIGTERM to its process group,
SIGKILL after 60 s); the servers' order alternates (mlx_lm.server first on even rounds, last on
odd ones); medians over ``--rounds``.

The loads. Text prompts from vLLM's sonnet dataset (``traces.sonnet_dataset``, with the
checkpoint's tokenizer and chat template: one user message, exactly ``input_len`` tokens), sent
to ``/v1/chat/completions``, streamed; every request's prompt is used once per server (no
repeat that mlx_lm.server's prompt cache could serve whole). All prompts share a 37-token head
(SmolLM2's default system prompt and the sonnet instruction): mlx_lm.server's prompt cache, on by
default, reuses it for every request (seen in the smoke run: 37 cached tokens per request;
recorded per run as ``prompt_cache_read_tokens``), where serve, prefix caching off by default,
computes it. ``--serve-args=--prefix-caching`` gives serve its block-level prefix cache too
(whole 16-token blocks):

(a) ``uniform``: at each concurrency of ``--concurrency`` (closed loop: a new request when one
    finishes, as ``vllm bench serve --max-concurrency``), ``max(--min-requests,
    --requests-per-client x C)`` prompts of ``--uniform``'s lengths.
(b) ``mixed``: ``--mixed-short`` short chats with ``--mixed-long`` long prompts among them
    (evenly spaced in arrival order), Poisson arrivals (vLLM's: ``traces.request_times``,
    burstiness 1) at ``--mixed-rate`` requests/s, the same times for every server (replayed with
    aiperf's ``--fixed-schedule``). Without ``--mixed-rate``: ``--load`` x the capacity measured
    once, in round 0 on mlx_lm.server, as its request throughput on a separate mixed set of the
    same shape at closed-loop concurrency ``--probe-concurrency``.

(c) ``curve``: the mixed load's shape at each rate of ``--curve-rates`` (req/s), light to past
    capacity, a fresh set of prompts per rate (each server sees every prompt once), the rates in
    ascending order within a server's run. Per rate: throughput, p50/p99 TTFT and ITL of every
    server, with their spread over rounds (``(max - min) / median``). The goal checked: at the
    lowest rate where mlx_lm.server's p99 TTFT exceeds ``--curve-ttft-ms`` (5 s), the best policy's
    p99 TTFT or ITL at least 1.5x lower at at least 0.95x its output throughput. ``--plot JSON``
    draws the curve (``docs/figures/serve_load_curve.png``) from a results file.

The client: NVIDIA AIPerf (``aiperf profile``, PyPI ``aiperf``; ``--aiperf`` or ``$AIPERF`` or
``aiperf`` on PATH), one run per load and concurrency, with ``--use-server-token-count`` (output
tokens from the servers' usage), ``--workers-max 1 --record-processors 1``, no server-metrics
scraping, and the checkpoint directory as its tokenizer. It reports vLLM's metrics: TTFT
(``time_to_first_token``), ITL (``inter_chunk_latency``: every gap between streamed chunks),
TPOT (``inter_token_latency``: per request (E2EL - TTFT) / (output tokens - 1)), E2EL
(``request_latency``), output throughput (output tokens / benchmark duration). Why AIPerf (tried
in a scratch venv, 2026-11-26, Python 3.11, x86_64, no GPU, no hub access):

- ``vllm bench serve``: ``pip install --dry-run vllm`` (0.33.0) resolves torch 2.14.0 with
  cuda-toolkit 13.0.3, nvidia-cudnn-cu13, nvidia-nccl-cu13, flashinfer-python, triton, ... (a
  CUDA build of several GB; no CPU wheel on PyPI): abandoned.
- GuideLLM 0.8.1: requires ``torch`` unconditionally (its requires_dist); ``pip install
  --dry-run guidellm`` resolves torch 2.14.1 + cuda-toolkit 13.0.3 (several GB): abandoned.
- AIPerf 0.13.0: no torch; ~1.2 GB venv (pandas, scipy, ...), ~90 s to install. Custom datasets
  (``single_turn`` JSONL: text, output_length, timestamp), closed-loop concurrency, fixed
  schedules, percentiles in ``profile_export_aiperf.json``. It loads a local tokenizer directory
  when given its path, but not with ``HF_HUB_OFFLINE=1``: aiperf 0.13 then looks every tokenizer
  up with ``snapshot_download`` and fails ("HFValidationError: Repo id must be in the form
  'repo_name' or 'namespace/repo_name': '/tmp/smol-mlx'"); this script unsets HF_HUB_OFFLINE and
  TRANSFORMERS_OFFLINE for it (nothing is fetched: the tokenizer is a local path).

  Install it beside the project, not in it: ``python -m venv ~/aiperf-venv &&
  ~/aiperf-venv/bin/pip install aiperf`` then ``--aiperf ~/aiperf-venv/bin/aiperf``.

AIPerf is several processes (controller, dataset, timing, worker, record processor, records
manager). What the client takes from a 2-core machine is recorded per run: the client's and the
server's CPU seconds over the whole run (``client_cpu_s``, ``server_cpu_s``) and the cores each
used within aiperf's benchmark window (``client_cores_in_benchmark``,
``server_cores_in_benchmark``: CPU time sampled every 0.5 s from /proc, per process session);
``--client-cpus`` pins the client. Each aiperf run also spends ~10-30 s starting and writing its
files, outside the benchmark window.

Closed loops are ``--concurrency C --request-rate 200 --arrival-pattern constant`` (``--poll-rate``),
not ``--concurrency C`` alone: in aiperf 0.13 the latter busy-waits while every slot is taken
(``RequestRateStrategy`` in its zero-interval burst mode loops on ``yield_to_event_loop()``). Seen
here: its timing_manager took 13 s of CPU in 24 s (~0.5 of the 2 cores) and the same 6 requests
took 31.7 s against 21.9 s with the rate set, where it took none (back to back, on a machine
others were using). With the rate, at most C requests are in flight and a freed slot is refilled
at the clock's next tick (5 ms apart at 200/s; 8-22 ms gaps seen at 50/s), a small delay against
requests of seconds.

End of sequence: by default each request ends at EOS or max_tokens, as the server decides
(identical request bodies for both; greedy decoding of the same weights: the same tokens, up to
float rounding). ``--ignore-eos`` asks every request to run to max_tokens with the same body for
both: OpenAI's ``logit_bias``, -100 (its floor) on the EOS ids (mlx_lm.server has no
``ignore_eos``; both servers then run a logits processor per row, a small cost). Each run records
its output tokens, so different lengths show.

Goals checked in the summary (medians over rounds): (a) serve ``mlx-default`` at least 1.0x
mlx_lm.server's output throughput at every concurrency, its TTFT p50 no worse; (b) on the mixed
load, the best policy at least 1.5x lower p99 TTFT or p99 ITL than mlx_lm.server at at least
0.95x its output throughput (also reported against serve mlx-default).

    python bench/serve_vs_mlxlm.py --aiperf ~/aiperf-venv/bin/aiperf [--rounds 3]
        [--policies mlx-default,vllm,chunked-prefill] [--concurrency 1,4,8,16] [--loads uniform,mixed]
        [--mixed-rate R | --load 0.85] [--server-cpus 0-1] [--client-cpus ...] [--ignore-eos]
    python bench/serve_vs_mlxlm.py --aiperf ... --quick      # a smoke run: minutes, figures meaningless
    python bench/serve_vs_mlxlm.py --aiperf ... --loads ready --rounds 5 --policies mlx-default \
        --serve-baseline DIR --out bench/results/serve_ready.json   # start-up only, beside another checkout

Start-up (``--loads ready``): each server's seconds from process start to its first answer (the
model's load, the warm-up, listening), no load; with ``--serve-baseline DIR`` (another checkout,
``git worktree add DIR REV``) that checkout's ``serve`` runs too, as ``serve@REV:POLICY``, in the
same alternating rounds. ``summary/ready_s`` and ``summary/ready_s_spread``; every mode also times
the ``--warmup`` requests sent after the first answer (sonnet prompts of the uniform load's
lengths), ``summary/first_requests_s``: the k-th one's latency, median over rounds.

Results: ``bench/results/serve_vs_mlxlm.json`` (``--quick``: ``WORK/serve_vs_mlxlm-quick.json``
unless ``--out``), rewritten after every round; aiperf's own files stay under ``--work``
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import common

BIN = Path(sys.executable).parent
MLX_LM = "mlx_lm.server"
SERVE = "serve:"  # + policy
SAMPLE_S = 0.5  # how often the client's and the server's CPU time are read during a run

# mlx_lm.server with OpenBLAS loaded first (schedlab.engine), the BLAS printed for the record
MLX_LM_WRAPPER = (
    "import json, sys\n"
    "from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)\n"
    "from schedlab.engine import blas\n"
    "print('blas: ' + json.dumps(blas.info()), file=sys.stderr, flush=True)\n"
    "sys.argv = ['mlx_lm.server', *sys.argv[1:]]\n"
    "from mlx_lm.server import main\n"
    "main()\n"
)

DEFAULTS = {
    "rounds": 3,
    "concurrency": "1,4,8,16",
    "uniform": "input_len=128,output_len=32,prefix_len=0",
    "requests_per_client": 2,
    "min_requests": 6,
    "mixed_short": "32,96,32",
    "mixed_long": "3,1024,16",
    "warmup": 2,
    "probe_concurrency": 8,
    "curve_rates": "0.15,0.3,0.6,1.2",
}
QUICK = {
    "rounds": 1,
    "concurrency": "1,2",
    "uniform": "input_len=48,output_len=4,prefix_len=0",
    "requests_per_client": 1,
    "min_requests": 3,
    "mixed_short": "3,48,4",
    "mixed_long": "1,256,4",
    "warmup": 1,
    "probe_concurrency": 2,
    "curve_rates": "0.5,2",
    "policies": "mlx-default",
}

# aiperf's metric -> ours (vLLM's names), with the statistics kept
METRICS = {
    "ttft_ms": ("time_to_first_token", ("avg", "p50", "p90", "p99")),
    "itl_ms": ("inter_chunk_latency", ("avg", "p50", "p90", "p99")),
    "tpot_ms": ("inter_token_latency", ("avg", "p50", "p90", "p99")),
    "e2el_ms": ("request_latency", ("avg", "p50", "p90", "p99")),
}
TOTALS = {
    "output_throughput_tok_s": "output_token_throughput",
    "request_throughput_rps": "request_throughput",
    "total_output_tokens": "total_output_tokens",
    "completed_requests": "completed_request_count",
    "request_error_rate_pct": "request_error_rate",
    "duration_s": "benchmark_duration",
    "prompt_cache_read_tokens": "total_usage_prompt_cache_read_tokens",  # from usage; absent: None
}


# ------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_cpu_s(sid: int) -> float:
    """User + system CPU seconds of the processes of session ``sid`` (a process started with
    ``start_new_session`` and its descendants), children they reaped included."""
    total, ticks = 0, os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            f = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(f[3]) == sid:
            total += sum(int(f[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return total / ticks


def cpu_between(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """CPU seconds spent from t0 to t1, from (wall time, cumulative CPU s) samples, interpolated."""

    def at(t):
        for (ta, ca), (tb, cb) in zip(samples, samples[1:]):
            if ta <= t <= tb:
                return ca + (cb - ca) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
        return None

    a, b = at(t0), at(t1)
    return None if a is None or b is None else b - a


class Server:
    """One server process in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, url: str | None = None):
        self.name, self.cmd, self.log, self.url = name, cmd, log, url
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> None:
        self._fh = open(self.log, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        t0 = time.monotonic()
        while self.url is None:  # serve: its listening line
            m = re.search(r"listening on (http://[\d.]+:\d+)", self.log.read_text())
            if m:
                self.url = m.group(1)
                break
            self._check_alive()
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{self.name}: no listening line after {timeout:.0f} s")
            time.sleep(0.2)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {tail}")

    def cpu_s(self) -> float | None:
        return session_cpu_s(self.proc.pid) if self.proc is not None else None

    def blas(self) -> dict | None:
        m = re.search(r"^blas: (\{.*\})$", self.log.read_text(), re.M)
        return json.loads(m.group(1)) if m else None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._fh.close()
        return self.proc.returncode


def launch(name: str, cmds: dict[str, tuple[list[str], bool]], log: Path) -> Server:
    """Server ``name`` of ``cmds`` (its command, and whether it takes --port), on a free port when
    it does, logging to ``log``; not started."""
    cmd, own_port = cmds[name]
    url = None
    if own_port:
        port = free_port()
        cmd = [*cmd, "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
    return Server(name, cmd, log, url)


def chat(url: str, model: str, text: str, max_tokens: int, timeout: float = 600.0) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(server: Server, model: str, timeout: float = 600.0) -> float:
    """Seconds until the server answers a one-token chat request (mlx_lm.server loads its model in
    a thread after it listens)."""
    t0 = time.monotonic()
    while True:
        server._check_alive()
        try:
            chat(server.url, model, "Hello", 1, timeout=timeout)
            return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            if isinstance(exc, urllib.error.HTTPError) and exc.code < 500 and exc.code != 404:
                raise RuntimeError(f"{server.name}: readiness request failed: {exc} {exc.read()[:500]!r}") from None
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{server.name}: not ready after {timeout:.0f} s ({exc})") from None
            time.sleep(0.5)


def export_checkpoint(model: str, ckpt: Path) -> dict:
    """``schedlab export-mlx MODEL CKPT --dtype float32`` unless CKPT already holds a checkpoint;
    its config.json."""
    if not (ckpt / "config.json").is_file():
        t = time.perf_counter()
        cmd = [str(BIN / "schedlab"), "export-mlx", model, str(ckpt), "--dtype", "float32", "-q"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"export-mlx failed: {p.stderr.strip()[-2000:]}")
        print(f"exported {model} to {ckpt} in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return json.loads((ckpt / "config.json").read_text())


def tokenizer_and_eos(ckpt: Path, config: dict):
    """The checkpoint's tokenizer and its EOS ids (config.json's and the tokenizer's)."""
    from schedlab.engine.tokenizer import TextTokenizer

    eos = config.get("eos_token_id")
    eos_ids = sorted({int(t) for t in ([eos] if isinstance(eos, int) else eos or [])})
    tok = TextTokenizer.from_dir(ckpt, eos_token_ids=eos_ids or None)
    return tok, sorted(set(eos_ids) | set(getattr(tok, "eos_token_ids", None) or []))


def serve_profile(profile: str | None, model: str) -> str | None:
    """serve's --profile: the one given; for smollm2-135m by default the bundled SmolLM2 profile
    (serve's own default for a checkpoint directory would be the tiny model's); 'none': serve's
    own choice."""
    if profile is None and model == "smollm2-135m":
        from schedlab.sim.profiles import PROFILE_DIR

        return str(PROFILE_DIR / "smollm2-135m-cpu.json")
    return None if profile == "none" else profile


def server_cmds(args, ckpt: Path, model_name: str) -> dict[str, tuple[list[str], bool]]:
    """name -> (command, listens on a port chosen here)."""
    pin = ["taskset", "-c", args.server_cpus] if args.server_cpus else []
    out = {
        MLX_LM: (
            [*pin, sys.executable, "-c", MLX_LM_WRAPPER, "--model", str(ckpt), "--host", "127.0.0.1",
             *shlex.split(args.mlx_lm_args)],
            True,
        )
    }  # fmt: skip
    for pol in args.policy_list:
        name, *options = pol.split(":")  # a policy, or one with options: vllm:max_batch=8:...
        cmd = [*pin, str(BIN / "schedlab"), "serve", "--policy", name, "--model", str(ckpt),
               "--served-model-name", model_name, "--port", "0", "-q"]  # fmt: skip
        for option in options:
            cmd += ["-o", option]
        if args.profile:
            cmd += ["--profile", args.profile]
        out[SERVE + pol] = (cmd + shlex.split(args.serve_args), False)
    if args.serve_baseline is not None:  # the same serve from another checkout, imported from there
        tree = args.serve_baseline.resolve()
        rev = common.git_rev(tree) or tree.name
        for pol in args.policy_list:
            cmd, _ = out[SERVE + pol]
            i = cmd.index(str(BIN / "schedlab"))
            run = [sys.executable, "-c", common.script_code(tree, "schedlab")]
            out[f"serve@{rev}:{pol}"] = (
                [*cmd[:i], "env", "-C", str(tree), f"PYTHONPATH={tree}", *run, *cmd[i + 1 :]],
                False,
            )
    return out


# ------------------------------------------------------------------------------- loads


def parse_triple(spec: str, what: str) -> tuple[int, int, int]:
    try:
        n, i, o = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"{what}: give N,INPUT_LEN,OUTPUT_LEN, got {spec!r}") from None
    return n, i, o


def parse_kv(spec: str) -> dict[str, int]:
    out = {}
    for part in spec.split(","):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v)
    return out


def sonnet(tok, n: int, input_len: int, output_len: int, prefix_len: int, seed: int) -> list[tuple[str, int]]:
    from schedlab.traces import sonnet_dataset

    if n <= 0:
        return []
    tr = sonnet_dataset(tok, n=n, input_len=input_len, output_len=output_len, prefix_len=prefix_len, seed=seed)
    return [(r.messages[-1][1], r.output_tokens) for r in tr.requests]


def write_jsonl(path: Path, rows: list[tuple[str, int]], times_s: list[float] | None = None) -> Path:
    with open(path, "w") as f:
        for i, (text, out) in enumerate(rows):
            row = {"text": text, "output_length": out}
            if times_s is not None:
                row["timestamp"] = round(times_s[i] * 1e3, 3)
            f.write(json.dumps(row) + "\n")
    return path


def mixed_rows(tok, short: tuple[int, int, int], long: tuple[int, int, int], seed: int) -> list[tuple[str, int]]:
    """The short chats with the long prompts evenly spaced among them (arrival order)."""
    s = sonnet(tok, short[0], short[1], short[2], 0, seed)
    lg = sonnet(tok, long[0], long[1], long[2], 0, seed + 1)
    total = len(s) + len(lg)
    at = {int((k + 0.5) * total / len(lg)) for k in range(len(lg))} if lg else set()
    rows, si, li = [], iter(s), iter(lg)
    for i in range(total):
        rows.append(next(li) if i in at else next(si))
    return rows


def requests_for(c: int, args) -> int:
    return max(args.min_requests, args.requests_per_client * c)


# ------------------------------------------------------------------------------- client


class Client:
    def __init__(self, args, ckpt: Path, model_name: str, eos_ids: list[int]):
        self.exe = args.aiperf
        self.ckpt, self.model, self.eos_ids = ckpt, model_name, eos_ids
        self.pin = ["taskset", "-c", args.client_cpus] if args.client_cpus else []
        self.ignore_eos = args.ignore_eos
        self.timeout = args.client_timeout
        self.seed = args.seed
        self.version: str | None = None
        self.poll_rate = args.poll_rate
        self.env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        self.env["HF_HUB_DISABLE_TELEMETRY"] = "1"

    def closed_loop(self, c: int) -> list[str]:
        """At most ``c`` requests in flight, a freed slot refilled at the next tick of a
        ``--poll-rate`` clock (aiperf's concurrency alone busy-waits: see the docstring)."""
        return ["--concurrency", str(c), "--request-rate", str(self.poll_rate), "--arrival-pattern", "constant",
                "--dataset-sampling-strategy", "sequential"]  # fmt: skip

    def extra(self, server: str) -> list[str]:
        """--ignore-eos: OpenAI's logit_bias at its floor on the EOS ids, the same body for both."""
        if not self.ignore_eos:
            return []
        return ["--extra-inputs", json.dumps({"logit_bias": {str(t): -100 for t in self.eos_ids}})]

    def command(self, server: str, url: str, dataset: Path, out: Path, load: list[str]) -> list[str]:
        return [*self.pin, self.exe, "profile", "--model", self.model, "--url", url, "--endpoint-type", "chat",
                "--streaming", "--tokenizer", str(self.ckpt), "--input-file", str(dataset),
                "--custom-dataset-type", "single_turn", "--use-server-token-count", "--ui", "none",
                "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1",
                "--request-timeout-seconds", str(self.timeout), "--random-seed", str(self.seed),
                "--artifact-dir", str(out), *load, *self.extra(server)]  # fmt: skip

    def run(self, server: Server, dataset: Path, out: Path, load: list[str]) -> dict:
        """One aiperf run; its metrics, and the CPU the client and the server used, over the whole
        run and within aiperf's benchmark window (sampled every ``SAMPLE_S``)."""
        cmd = self.command(server.name, server.url, dataset, out, load)
        log_path = out.parent / (out.name + ".log")
        client, srv, t0 = [], [], time.time()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log_path, "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
            try:
                while True:
                    now = time.time()
                    client.append((now, session_cpu_s(p.pid)))
                    srv.append((now, server.cpu_s() or 0.0))
                    if p.poll() is not None:
                        break
                    if now - t0 > self.timeout + 600:
                        raise RuntimeError(f"aiperf ran past {self.timeout + 600} s (log {log_path})")
                    time.sleep(SAMPLE_S)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        wall = time.time() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        server._check_alive()
        res = out / "profile_export_aiperf.json"
        if p.returncode != 0 or not res.is_file():
            raise RuntimeError(f"aiperf exited {p.returncode} against {server.name}: {log_path.read_text()[-3000:]}")
        d = json.loads(res.read_text())
        m = metrics(d)
        self.version = self.version or m["aiperf_version"]
        # the whole run (the client's start-up and exports too): the client's tree, reaped
        m["client_cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
        m["server_cpu_s"] = round(srv[-1][1] - srv[0][1], 2)
        try:  # aiperf's benchmark window (local times)
            b0 = datetime.fromisoformat(d["start_time"]).timestamp()
            b1 = datetime.fromisoformat(d["end_time"]).timestamp()
        except (KeyError, TypeError, ValueError):
            b0 = b1 = None
        if b0 is not None and b1 and b1 > b0:
            c, s = cpu_between(client, b0, b1), cpu_between(srv, b0, b1)
            m["client_cores_in_benchmark"] = round(c / (b1 - b0), 3) if c is not None else None
            m["server_cores_in_benchmark"] = round(s / (b1 - b0), 3) if s is not None else None
        m["client_wall_s"] = round(wall, 1)
        m["artifacts"] = str(out)
        return m


def metrics(d: dict) -> dict:
    out: dict = {"aiperf_version": d.get("aiperf_version")}
    for ours, key in TOTALS.items():
        v = d.get(key)
        out[ours] = v.get("avg") if isinstance(v, dict) else None
    for ours, (key, stats) in METRICS.items():
        v = d.get(key) or {}
        out[ours] = {s.replace("avg", "mean"): v.get(s) for s in stats}
    errs = d.get("error_summary")
    out["errors"] = errs if errs else None
    return out


def line(m: dict) -> str:
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    return (
        f"{f(m['output_throughput_tok_s'], '.1f')} tok/s, TTFT p50/p99 {f(m['ttft_ms']['p50'], '.0f')}/"
        f"{f(m['ttft_ms']['p99'], '.0f')} ms, ITL p50/p99 {f(m['itl_ms']['p50'], '.1f')}/{f(m['itl_ms']['p99'], '.1f')} ms, "
        f"{f(m['total_output_tokens'], '.0f')} tokens; cores used in the benchmark: client "
        f"{f(m.get('client_cores_in_benchmark'), '.2f')}, server {f(m.get('server_cores_in_benchmark'), '.2f')}"
    )


# ------------------------------------------------------------------------------- summary


def med(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


KEYS = (
    ("output_throughput_tok_s",),
    ("request_throughput_rps",),
    ("total_output_tokens",),
    ("prompt_cache_read_tokens",),
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("itl_ms", "p50"),
    ("itl_ms", "p99"),
    ("tpot_ms", "p50"),
    ("e2el_ms", "p50"),
    ("e2el_ms", "p99"),
    ("client_cpu_s",),
    ("server_cpu_s",),
    ("client_cores_in_benchmark",),
    ("server_cores_in_benchmark",),
)


def flat(path) -> str:
    return ".".join(path)


def medians(runs: list[dict]) -> dict:
    return {flat(p): med(common.value(r, p) for r in runs) for p in KEYS}


def summarize(rounds: list[dict], servers: list[str], concurrency: list[int]) -> dict:
    def runs(server, load, c=None):
        out = []
        for rd in rounds:
            r = rd["runs"].get(server, {}).get(load)
            if r is not None and c is not None:
                r = r.get(str(c))
            if isinstance(r, dict) and "error" not in r:
                out.append(r)
        return out

    uniform = {s: {str(c): medians(runs(s, "uniform", c)) for c in concurrency} for s in servers}
    for s in servers:  # the round-to-round spread of each point
        for c in concurrency:
            uniform[s][str(c)]["spread"] = spreads(runs(s, "uniform", c))
    mixed = {s: medians(runs(s, "mixed")) for s in servers}
    base = uniform.get(MLX_LM, {})
    vs = {}
    for s in servers:
        if s == MLX_LM:
            continue
        vs[s] = {
            str(c): {
                "throughput": ratio(
                    uniform[s][str(c)]["output_throughput_tok_s"], base[str(c)]["output_throughput_tok_s"]
                ),
                "ttft_p50": ratio(uniform[s][str(c)]["ttft_ms.p50"], base[str(c)]["ttft_ms.p50"]),
                "itl_p50": ratio(uniform[s][str(c)]["itl_ms.p50"], base[str(c)]["itl_ms.p50"]),
                "output_tokens": ratio(uniform[s][str(c)]["total_output_tokens"], base[str(c)]["total_output_tokens"]),
            }
            for c in concurrency
        }
    goal_a = None
    md = SERVE + "mlx-default"
    if vs.get(md):
        per_c = vs[md]
        ok = [
            r["throughput"] is not None
            and r["ttft_p50"] is not None
            and r["throughput"] >= 1.0
            and r["ttft_p50"] <= 1.0
            for r in per_c.values()
        ]
        goal_a = {
            "what": "serve mlx-default >= 1.0x mlx_lm.server's output throughput at every concurrency, TTFT p50 no worse",
            "per_concurrency": per_c,
            "met": bool(ok) and all(ok),
        }
    goal_b = {}
    for ref in (MLX_LM, md):
        if ref not in mixed or mixed[ref]["output_throughput_tok_s"] is None:
            continue
        # the policies (mlx_lm.server is only ever the reference) against ref
        vs_ref = _against({s: mixed[s] for s in servers if s == ref or s != MLX_LM}, ref)
        goal_b["vs " + ref] = {
            "what": f"best policy on the mixed load: >= 1.5x lower p99 TTFT or p99 ITL than {ref} "
            "at >= 0.95x its output throughput",
            **vs_ref,
            "met": bool(vs_ref["best"]) and vs_ref["best_gain_x"] >= 1.5,
        }
    curve = summarize_curve(rounds, servers)
    ready, ready_spread = {}, {}  # process start to its first answer (the model's load, warm-up, listening)
    for s in servers:
        got = [r["runs"][s]["ready_s"] for r in rounds if (r["runs"].get(s) or {}).get("ready_s") is not None]
        ready[s] = statistics.median(got) if got else None
        ready_spread[s] = spread(got)
    # the latency of the k-th request after the first answer (the warm-up requests, same for all)
    first = {
        s: [
            statistics.median(w)
            for w in zip(*[r["runs"][s]["warm_s"] for r in rounds if (r["runs"].get(s) or {}).get("warm_s")])
        ]
        for s in servers
    }
    return {
        "ready_s": ready,
        "ready_s_spread": ready_spread,
        "first_requests_s": first,
        "uniform": uniform,
        "mixed": mixed,
        "uniform_over_mlx_lm": vs,
        "goal_uniform": goal_a,
        "goal_mixed": goal_b,
        **curve,
    }


CURVE_KEYS = ("output_throughput_tok_s", "ttft_ms.p50", "ttft_ms.p99", "itl_ms.p50", "itl_ms.p99")


def spread(values) -> float | None:
    """(max - min) / median of the rounds' values: the round-to-round spread."""
    vals = [v for v in values if isinstance(v, (int, float))]
    m = statistics.median(vals) if vals else None
    return round((max(vals) - min(vals)) / m, 3) if m else None


def spreads(runs: list[dict]) -> dict:
    """The round-to-round spread of each of ``CURVE_KEYS`` over one point's runs."""
    return {k: spread(common.value(r, tuple(k.split("."))) for r in runs) for k in CURVE_KEYS}


def curve_runs(rounds: list[dict], server: str, rate: str) -> list[dict]:
    """The runs of ``server`` at the curve's ``rate`` (its key) that did not fail, one per round."""
    out = []
    for rd in rounds:
        r = ((rd["runs"].get(server) or {}).get("curve") or {}).get(rate)
        if isinstance(r, dict) and "error" not in r:
            out.append(r)
    return out


def summarize_curve(rounds: list[dict], servers: list[str]) -> dict:
    """The curve load: per rate, every server's medians over rounds and their spreads; the goal
    at the lowest rate where mlx_lm.server's p99 TTFT exceeds the threshold."""
    rates = sorted({float(r) for rd in rounds for runs in rd["runs"].values() for r in (runs.get("curve") or {})})
    if not rates:
        return {}
    threshold = rounds[0].get("curve_ttft_ms", 5000.0)
    curve = {}
    for rate in rates:
        per = {}
        for s in servers:
            runs = curve_runs(rounds, s, f"{rate:g}")
            m = medians(runs)
            m["spread"] = spreads(runs)
            m["rounds"] = len(runs)
            per[s] = m
        curve[f"{rate:g}"] = per
    vs = {rate: _against(per, MLX_LM) for rate, per in curve.items() if MLX_LM in per}
    at = next((r for r in curve if (curve[r].get(MLX_LM, {}).get("ttft_ms.p99") or 0) > threshold), None)
    goal = {
        "what": f"at the lowest rate where mlx_lm.server's p99 TTFT exceeds {threshold:g} ms, the best policy "
        ">= 1.5x lower p99 TTFT or p99 ITL at >= 0.95x its output throughput",
        "rate_rps": float(at) if at is not None else None,
        "met": False,
    }
    if at is not None:
        goal.update(vs[at])
        goal["met"] = bool(goal["best"]) and goal["best_gain_x"] >= 1.5
    return {"curve": curve, "curve_over_mlx_lm": vs, "goal_curve": goal}


def _against(per: dict, ref: str) -> dict:
    """Every other server at one point against ``ref``: output throughput (x), how many times lower
    its p99 TTFT and p99 ITL are; the best of those with at least 0.95x the throughput."""
    R, cands = per[ref], {}
    for s, M in per.items():
        if s == ref:
            continue
        cands[s] = {
            "throughput": ratio(M["output_throughput_tok_s"], R["output_throughput_tok_s"]),
            "ttft_p99_lower_x": ratio(R["ttft_ms.p99"], M["ttft_ms.p99"]),
            "itl_p99_lower_x": ratio(R["itl_ms.p99"], M["itl_ms.p99"]),
            "output_tokens": ratio(M["total_output_tokens"], R["total_output_tokens"]),
        }
    ok = {
        s: max(v["ttft_p99_lower_x"] or 0, v["itl_p99_lower_x"] or 0)
        for s, v in cands.items()
        if v["throughput"] is not None and v["throughput"] >= 0.95
    }
    best = max(ok, key=ok.get) if ok else None
    return {"per_policy": cands, "best": best, "best_gain_x": ok.get(best) if best else None}


def plot_curve(result: dict, path: Path) -> None:
    """The load curve: per server, output throughput, p99 TTFT and p99 ITL against the offered
    rate (medians over rounds, bars from the rounds' min to max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["summary"]["curve"]
    rates = sorted(curve, key=float)
    servers = list(curve[rates[0]])
    panels = (
        ("output_throughput_tok_s", "output throughput (tok/s)"),
        ("ttft_ms.p99", "p99 TTFT (s)"),
        ("itl_ms.p99", "p99 ITL (s)"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, label) in zip(axes, panels):
        scale = 1e-3 if key.endswith(("p99", "p50")) else 1.0
        for s in servers:
            xs, ys, lo, hi = [], [], [], []
            for r in rates:
                vals = [common.value(x, tuple(key.split("."))) for x in curve_runs(result["rounds"], s, r)]
                vals = [v * scale for v in vals if isinstance(v, (int, float))]
                if vals:
                    xs.append(float(r))
                    ys.append(statistics.median(vals))
                    lo.append(ys[-1] - min(vals))
                    hi.append(max(vals) - ys[-1])
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=s)
        ax.set_xscale("log")
        ax.set_xticks([float(r) for r in rates], rates)
        ax.minorticks_off()
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    goal = result["summary"].get("goal_curve") or {}
    if goal.get("rate_rps"):
        for ax in axes[1:]:
            ax.axvline(float(goal["rate_rps"]), color="grey", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    mixed = result["loads"]["curve"]
    fig.suptitle(
        f"{result['model']}: {mixed['short']['n']} chats + {mixed['long']['n']} x {mixed['long']['input_len']}-token "
        f"prompts per rate, {len(result['rounds'])} rounds (median, min-max)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m", help="what export-mlx exports (a preset or .gguf file)")
    ap.add_argument("--checkpoint", type=Path, help="the exported mlx-lm directory (exported there when missing; "
                    "default: WORK/checkpoint)")  # fmt: skip
    ap.add_argument(
        "--policies",
        default=None,
        help="comma-separated (default: every bundled policy); POLICY:key=value[:key=value] runs it with those "
        "options (-o), as a server of its own (mlx-default,mlx-default:time_budget=0.5: both, in the same rounds)",
    )
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument("--loads", default="uniform,mixed", help="uniform, mixed and/or curve; ready: only each "
                    "server's start-up, process start to its first answer (alternating, --rounds)")  # fmt: skip
    ap.add_argument("--concurrency", default=None, help=f"uniform load's levels (default {DEFAULTS['concurrency']})")
    ap.add_argument("--uniform", default=None, help=f"sonnet lengths (default {DEFAULTS['uniform']})")
    ap.add_argument("--requests-per-client", type=int, default=None, help="uniform: requests = max(MIN, this x C)")
    ap.add_argument("--min-requests", type=int, default=None)
    ap.add_argument("--mixed-short", default=None, help=f"N,INPUT,OUTPUT (default {DEFAULTS['mixed_short']})")
    ap.add_argument("--mixed-long", default=None, help=f"N,INPUT,OUTPUT (default {DEFAULTS['mixed_long']})")
    ap.add_argument("--mixed-rate", type=float, default=None, help="req/s (default: --load x measured capacity)")
    ap.add_argument("--load", type=float, default=0.85, help="mixed rate as a share of the measured capacity")
    ap.add_argument("--probe-concurrency", type=int, default=None, help="capacity probe's closed-loop concurrency")
    ap.add_argument("--warmup", type=int, default=None, help="untimed requests to each server after start")
    ap.add_argument("--ignore-eos", action="store_true", help="every request to max_tokens (see the docstring)")
    ap.add_argument("--profile", default=None, help="serve's --profile (default: bundled smollm2-135m-cpu for "
                    "smollm2-135m; 'none': serve's own choice)")  # fmt: skip
    ap.add_argument("--serve-args", default="", help="extra arguments for every serve (e.g. --prefix-caching)")
    ap.add_argument("--mlx-lm-args", default="", help="extra arguments for mlx_lm.server")
    ap.add_argument("--serve-baseline", type=Path, default=None, help="another checkout (git worktree add DIR REV): "
                    "its serve runs too, as serve@REV:POLICY, in the same rounds")  # fmt: skip
    ap.add_argument("--server-cpus", default=None, help="taskset -c list for both servers (default: none)")
    ap.add_argument("--client-cpus", default=None, help="taskset -c list for aiperf (default: none)")
    ap.add_argument("--aiperf", default=None, help="aiperf executable (default $AIPERF, else aiperf on PATH)")
    ap.add_argument("--poll-rate", type=float, default=200.0, help="closed loops: aiperf's --request-rate "
                    "(req/s, constant) under the concurrency cap; a freed slot waits at most 1/this s")  # fmt: skip
    ap.add_argument("--client-timeout", type=int, default=3600, help="aiperf's per-request timeout, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="aiperf artifacts and logs (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--curve-rates", default=None, help=f"curve load's rates, req/s (default {DEFAULTS['curve_rates']})"
    )
    ap.add_argument(
        "--curve-ttft-ms", type=float, default=5000.0, help="curve goal: mlx_lm.server's p99 TTFT threshold"
    )
    ap.add_argument("--summarize", type=Path, default=None, help="only compute a results file's summary again "
                    "from its rounds, in place")  # fmt: skip
    ap.add_argument("--plot", type=Path, default=None, help="only draw the load curve of this results file "
                    "(to docs/figures/serve_load_curve.png, or --out)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, C=1,2, 3 requests, 4 tokens, mlx-default")
    args = ap.parse_args()
    if args.summarize is not None:  # the summary again from a results file's rounds (its code changed)
        result = json.loads(args.summarize.read_text())
        conc = (result["loads"].get("uniform") or {}).get("concurrency", [])
        result["summary"] = summarize(result["rounds"], list(result["servers"]), conc)
        common.write_json(result, args.summarize, indent=1)
        report(result, args.summarize)
        return
    if args.plot is not None:
        out = args.out or Path(__file__).resolve().parent.parent / "docs" / "figures" / "serve_load_curve.png"
        plot_curve(json.loads(args.plot.read_text()), out)
        print(f"wrote {out}")
        return

    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick and k in QUICK else v)
    if args.quick and args.policies is None:
        args.policies = QUICK["policies"]
    from schedlab.policies import POLICIES

    args.policy_list = [p.strip() for p in (args.policies or ",".join(POLICIES)).split(",") if p.strip()]
    loads = {x.strip() for x in args.loads.split(",") if x.strip()}
    if not loads <= {"uniform", "mixed", "curve", "ready"} or ("ready" in loads and len(loads) > 1):
        raise SystemExit(f"--loads: uniform, mixed and/or curve, or ready alone, got {args.loads!r}")
    try:
        curve_rates = sorted({float(r) for r in args.curve_rates.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"--curve-rates: comma-separated req/s, got {args.curve_rates!r}") from None
    if "curve" in loads and (not curve_rates or min(curve_rates) <= 0):
        raise SystemExit(f"--curve-rates: at least one rate > 0 req/s, got {args.curve_rates!r}")
    conc = [int(c) for c in args.concurrency.split(",")]
    args.aiperf = args.aiperf or os.environ.get("AIPERF") or shutil.which("aiperf")
    if not args.aiperf or not Path(args.aiperf).exists() and not shutil.which(args.aiperf):
        raise SystemExit(
            "aiperf not found: python -m venv ~/aiperf-venv && ~/aiperf-venv/bin/pip install aiperf, "
            "then --aiperf ~/aiperf-venv/bin/aiperf"
        )
    args.profile = serve_profile(args.profile, args.model)

    work = args.work or Path(tempfile.mkdtemp(prefix="serve-vs-mlxlm-"))
    work.mkdir(parents=True, exist_ok=True)
    out_path = args.out or (work / "serve_vs_mlxlm-quick.json" if args.quick else common.result_path("serve_vs_mlxlm"))
    print(f"work: {work}", file=sys.stderr, flush=True)
    t_all = time.perf_counter()

    # the checkpoint, exported once
    ckpt = (args.checkpoint or work / "checkpoint").resolve()
    config = export_checkpoint(args.model, ckpt)
    model_name = str(ckpt)  # what both servers answer to (mlx_lm.server: the path it loaded)

    from schedlab.engine import blas
    from schedlab.traces import request_times

    tok, eos_ids = tokenizer_and_eos(ckpt, config)

    # the requests: disjoint prompt sets (uniform levels, mixed, probe, warm-up)
    u = parse_kv(args.uniform)
    data = work / "datasets"
    data.mkdir(exist_ok=True)
    n_uniform = sum(requests_for(c, args) for c in conc)
    upool = sonnet(tok, n_uniform, u["input_len"], u["output_len"], u.get("prefix_len", 0), args.seed)
    uniform_sets, at = {}, 0
    for c in conc:
        n = requests_for(c, args)
        uniform_sets[c] = write_jsonl(data / f"uniform-c{c}.jsonl", upool[at : at + n])
        at += n
    short, long = parse_triple(args.mixed_short, "--mixed-short"), parse_triple(args.mixed_long, "--mixed-long")
    mixed = mixed_rows(tok, short, long, args.seed + 10)
    probe = mixed_rows(tok, short, long, args.seed + 20)
    probe_set = write_jsonl(data / "probe.jsonl", probe)
    warm = sonnet(tok, max(args.warmup, 1), u["input_len"], u["output_len"], 0, args.seed + 30)
    mixed_rate = args.mixed_rate
    mixed_set = None

    def make_mixed_set(rate: float) -> Path:
        times = request_times(len(mixed), rate, 1.0, args.seed)
        return write_jsonl(data / "mixed.jsonl", mixed, times)

    if mixed_rate is not None:
        mixed_set = make_mixed_set(mixed_rate)
    curve_sets = {}  # per rate, its own prompts (each server sees a prompt once), the mixed shape
    for i, rate in enumerate(curve_rates if "curve" in loads else ()):
        rows = mixed_rows(tok, short, long, args.seed + 40 + 2 * i)
        curve_sets[rate] = write_jsonl(
            data / f"curve-{rate:g}.jsonl", rows, request_times(len(rows), rate, 1.0, args.seed)
        )

    cmds = server_cmds(args, ckpt, model_name)
    names = list(cmds)
    client = Client(args, ckpt, model_name, eos_ids)
    probe_result = None
    rounds: list[dict] = []

    def record(complete: bool) -> None:
        result = {
            "bench": "serve_vs_mlxlm",
            "what": "schedlab serve (each policy) vs mlx_lm.server: same float32 checkpoint, OpenBLAS in both, "
            "the same aiperf client and requests; servers alternating per round; medians over rounds",
            "complete": complete,
            "quick": args.quick,
            "model": args.model,
            "checkpoint": {"dir": str(ckpt), "dtype": "float32", "config": config},
            "client": {
                "name": "aiperf",
                "version": client.version,
                "command": shlex.join(client.command("SERVER", "URL", Path("DATASET.jsonl"), Path("OUT"), ["LOAD..."])),
                "metrics": {k: v[0] for k, v in METRICS.items()},
                "why": "vllm and guidellm pull a CUDA torch build (several GB); see the script's docstring",
                "cpus": args.client_cpus,
            },
            "servers": {n: shlex.join(c) for n, (c, _) in cmds.items()},
            "server_cpus": args.server_cpus,
            "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "schedlab")},
            "blas_bench_process": blas.info(),
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "SCHEDLAB_BLAS")},
            "ignore_eos": args.ignore_eos,
            "eos_ids": eos_ids,
            "loads": {
                "uniform": {
                    "sonnet": u,
                    "concurrency": conc,
                    "requests": {str(c): requests_for(c, args) for c in conc},
                }
                if "uniform" in loads
                else None,
                "mixed": {
                    "short": dict(zip(("n", "input_len", "output_len"), short)),
                    "long": dict(zip(("n", "input_len", "output_len"), long)),
                    "rate_rps": mixed_rate,
                    "rate_from": "--mixed-rate"
                    if args.mixed_rate is not None
                    else f"--load {args.load} x capacity probe",
                    "capacity_probe": probe_result,
                }
                if "mixed" in loads
                else None,
                "curve": {
                    "short": dict(zip(("n", "input_len", "output_len"), short)),
                    "long": dict(zip(("n", "input_len", "output_len"), long)),
                    "rates_rps": curve_rates,
                    "ttft_threshold_ms": args.curve_ttft_ms,
                }
                if "curve" in loads
                else None,
            },
            "rounds_asked": args.rounds,
            "rounds": rounds,
            "summary": summarize(rounds, names, conc if "uniform" in loads else []),
            "machine": common.machine(),
            "rev": common.git_rev(),
            "work": str(work),
            "wall_s": round(time.perf_counter() - t_all, 1),
        }
        common.write_json(result, out_path, indent=1)

    current: list[Server] = []

    def on_term(signum, frame):  # stop the servers on SIGTERM as on Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        for k in range(args.rounds):
            order = names if k % 2 == 0 else names[::-1]
            rd = {"round": k, "order": order, "runs": {}, "curve_ttft_ms": args.curve_ttft_ms}
            rounds.append(rd)
            for name in order:
                tag = f"r{k}-{name.replace(':', '-').replace('.', '_')}"
                srv = launch(name, cmds, work / f"{tag}.server.log")
                current.append(srv)
                runs: dict = {}
                rd["runs"][name] = runs
                try:
                    t = time.monotonic()
                    srv.start()
                    runs["ready_s"] = round(time.monotonic() - t + wait_ready(srv, model_name), 1)
                    runs["warm_s"] = []  # (each untimed request's latency: what the first requests pay)
                    for text, n_out in warm[: args.warmup]:
                        t = time.monotonic()
                        chat(srv.url, model_name, text, n_out)
                        runs["warm_s"].append(round(time.monotonic() - t, 3))
                    if srv.blas() is not None:
                        runs["blas"] = srv.blas()
                    if "uniform" in loads:
                        runs["uniform"] = {}
                        for c in conc:
                            load = [*client.closed_loop(c), "--request-count", str(requests_for(c, args))]
                            m = client.run(srv, uniform_sets[c], work / f"{tag}-c{c}", load)
                            runs["uniform"][str(c)] = m
                            print(f"round {k} {name:24s} C={c:<3d} {line(m)}", file=sys.stderr, flush=True)
                    if "mixed" in loads:
                        if mixed_set is None:  # the capacity probe, on the first server of round 0
                            pc = args.probe_concurrency
                            load = [*client.closed_loop(pc), "--request-count", str(len(probe))]
                            m = client.run(srv, probe_set, work / f"{tag}-probe", load)
                            cap = m["request_throughput_rps"]
                            if not cap:
                                raise RuntimeError(f"capacity probe measured no throughput: {m}")
                            mixed_rate = args.load * cap
                            probe_result = {"server": name, "concurrency": pc, "capacity_rps": cap,
                                            "load": args.load, "run": m}  # fmt: skip
                            mixed_set = make_mixed_set(mixed_rate)
                            print(
                                f"capacity probe on {name}: {cap:.3f} req/s at C={pc}; mixed rate "
                                f"{mixed_rate:.3f} req/s",
                                file=sys.stderr,
                                flush=True,
                            )
                        m = client.run(srv, mixed_set, work / f"{tag}-mixed", ["--fixed-schedule"])
                        runs["mixed"] = m
                        print(f"round {k} {name:24s} mixed {line(m)}", file=sys.stderr, flush=True)
                    if curve_sets:
                        runs["curve"] = {}
                        for rate, dataset in curve_sets.items():
                            m = client.run(srv, dataset, work / f"{tag}-curve-{rate:g}", ["--fixed-schedule"])
                            runs["curve"][f"{rate:g}"] = m
                            print(f"round {k} {name:24s} curve {rate:g} req/s {line(m)}", file=sys.stderr, flush=True)
                except RuntimeError as exc:  # one server's failure is recorded; the others go on
                    runs["error"] = str(exc)[-3000:]
                    print(f"round {k} {name}: FAILED: {str(exc)[-1000:]}", file=sys.stderr, flush=True)
                finally:
                    runs["exit_code"] = srv.stop()
                    current.remove(srv)
            record(complete=False)
    finally:
        for srv in current:
            srv.stop()
    record(complete=True)
    result = json.loads(Path(out_path).read_text())
    report(result, out_path)
    if result["summary"].get("curve") and not args.quick:
        plot_curve(result, Path(__file__).resolve().parent.parent / "docs" / "figures" / "serve_load_curve.png")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def report(result: dict, path) -> None:
    s = result["summary"]
    print(f"wrote {path}")
    for name, per_c in s["uniform"].items():
        for c, m in per_c.items():
            if m["output_throughput_tok_s"] is None:
                continue
            print(
                f"uniform C={c:<3s} {name:24s} {m['output_throughput_tok_s'] or 0:8.2f} tok/s  TTFT p50 "
                f"{m['ttft_ms.p50'] or 0:8.0f} ms  ITL p50 {m['itl_ms.p50'] or 0:7.1f} ms"
            )
    for name, m in s["mixed"].items():
        if m["output_throughput_tok_s"] is None:
            continue
        print(
            f"mixed   {name:24s} {m['output_throughput_tok_s'] or 0:8.2f} tok/s  TTFT p99 {m['ttft_ms.p99'] or 0:8.0f} ms"
            f"  ITL p99 {m['itl_ms.p99'] or 0:7.1f} ms"
        )
    if s["goal_uniform"]:
        print(f"goal (a) serve mlx-default vs mlx_lm.server on the uniform load: met={s['goal_uniform']['met']}")
    for ref, g in s["goal_mixed"].items():
        print(f"goal (b) mixed, {ref}: best {g['best']} ({g['best_gain_x']}x), met={g['met']}")
    for rate, per in (s.get("curve") or {}).items():
        for name, m in per.items():
            if m["output_throughput_tok_s"] is None:
                continue
            print(
                f"curve {rate:>5s} req/s {name:24s} {m['output_throughput_tok_s']:8.2f} tok/s  TTFT p99 "
                f"{m['ttft_ms.p99'] or 0:8.0f} ms  ITL p99 {m['itl_ms.p99'] or 0:7.1f} ms"
            )
    if s.get("goal_curve"):
        g = s["goal_curve"]
        print(
            f"goal (c) curve at {g['rate_rps']} req/s: best {g.get('best')} ({g.get('best_gain_x')}x), met={g['met']}"
        )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: the servers and the client were stopped; the results file has the rounds done")
