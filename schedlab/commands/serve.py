"""``serve``: a scheduling policy behind an OpenAI-compatible HTTP server, on the real MLX engine.

The same replica loop as ``run-real`` (policy, state machine, ``MLXBackend``, wall clock); only
the arrival source differs: requests come from HTTP clients (``sim.sources.LiveSource``) instead
of a trace. The loop runs in the main thread; uvicorn serves FastAPI in a second one, started
once the engine has warmed up and the clock runs. Between the two:

- a handler turns a request into a ``traces.Request`` (text, counted with the model's
  tokenizer, ``max_tokens``), opens a stream for it and submits it to the source, which stamps
  its arrival time;
- the backend hands each token to its request's stream as the pass that made it ends
  (``MLXBackend.on_token``); a request that finishes (or that the replica refuses: larger than
  its KV capacity) closes its stream with a finish reason (or an error) from ``on_finish``;
- SIGINT/SIGTERM close the source: requests in flight finish and are answered, new ones get
  503, then the run ends and ``--out`` gets the run directory ``run-real`` writes plus
  ``trace.json``, the requests as they arrived (text, token counts, arrival times): the traffic
  the server saw, for ``simulate``/``validate`` to replay under any policy.

``--replicas N`` (N > 1) runs N such servers as processes behind a front that routes each
request with the simulator's routers (``schedlab.serving.cluster``); each replica answers
``GET /state`` (what a router reads) and ``POST /prepare/...`` (a request checked and counted).
``--executor ray`` starts them as Ray actors instead (a local Ray, or ``--ray-address``'s);
``--replica-url URL`` (repeatable, no ``--policy``) puts the front over servers already
listening there, which it never starts or stops.

Endpoints: ``GET /v1/models``, ``GET /health``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream`` with server-sent events, ``stream_options.include_usage``),
``GET /metrics`` (Prometheus text with vLLM's names: requests running and waiting, KV cache usage,
token, request, preemption and prefix-cache counters, TTFT, inter-token, end-to-end and queue-time
histograms; schedlab's ``schedlab:cost_model_bias`` and ``schedlab:requests_rejected_total``).
Bad input is an OpenAI-style error (``{"error": {"message", "type", "param", "code"}}``) with
status 400 (404 for an unknown model, 503 while shutting down); no other request is affected.
``--max-waiting N`` is admission control: a request arriving while N requests wait to be admitted
gets a 429 (type ``rate_limit_exceeded``, code ``queue_full``) with a ``Retry-After`` header;
nothing admitted is touched.
Each request samples as it asks, as mlx-lm's server does (``engine.sampling.Sampling``):
``temperature``, ``top_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
vLLM's ``top_k``, ``min_p``, ``repetition_penalty``; what it does not give is ``--sampling``'s
(greedy by default). Requests with different samplers share the same batched passes; greedy ones
stay the model alone's answers, a seeded one gives the same text whichever requests share its
passes. ``logprobs`` (completions: 0-20; chat: ``logprobs: true`` and ``top_logprobs`` 0-20) come
in OpenAI's formats, whole or per streamed chunk. A value out of OpenAI's range, or what the
server does not do (``n``/``best_of`` > 1, ``echo``, ``min_tokens``, tools, ``response_format``)
is a 400 naming the parameter; vLLM's ``ignore_eos`` is honoured. ``stop`` strings end a request at the
token that completes one (the text stops before it, finish reason ``stop``); a client that goes
away (a stream closed, or a whole answer's connection) has its request cancelled at the replica's
next step, waiting, prefilling or decoding (``/health`` counts them as ``cancelled``; ``trace.json``
records when it left, ``cancel_after_s``, for ``simulate`` to replay).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import SchedlabError
from ..serving.http import DEFAULT_MAX_TOKENS
from ._app import (
    BLOCK_SIZE_HELP,
    DECODE_HELP,
    NOISE_HELP,
    PREFILL_HELP,
    PREFIX_HELP,
    RAY_ADDRESS_HELP,
    log_to_stderr,
    make_app,
    out_path,
    parse_options,
    replicas_stopped,
    run_app,
)

# ---------------------------------------------------------------------------- the command

PROFILE_HELP = (
    "cost-model profile JSON the policy plans with (default: one measured on this model and machine, "
    "else the bundled one; the listening line names it)"
)
CALIBRATE_HELP = (
    "without a profile measured on this model and machine, calibrate one first (minutes; cached for "
    "the next start) instead of planning with the bundled one"
)
SAMPLING_HELP = (
    "greedy, or temperature=0.7,seed=1 (also top_p, top_k, min_p, penalties): what a request gets for "
    "the sampling parameters it does not set"
)
MAX_WAITING_HELP = (
    "admission control: a request arriving while this many wait to be admitted gets a 429 with "
    "Retry-After (default: no limit; with --replicas, each replica's)"
)
REPLICAS_HELP = "replica processes behind a front that routes each request, each a serve on its share of the cores"
ROUTER_HELP = "with --replicas: which replica serves each request, as simulate --router (default round-robin)"
REPLICA_URL_HELP = (
    "a replica already listening (a `schedlab serve` on another machine, say), repeatable: the front routes "
    "to these instead of starting replicas, and leaves them running when it stops (no --policy: each has its own)"
)
EXECUTOR_HELP = (
    "with --replicas: where the replicas run: local (processes here) or ray (Ray actors, one CPU each, "
    "reached by URL; pip install 'schedlab[ray]')"
)

serve_app = make_app(
    "Serve a scheduling policy on a real MLX model behind an OpenAI-compatible HTTP API "
    "(/v1/completions, /v1/chat/completions, /v1/models); on SIGINT/SIGTERM finish the requests in "
    "flight, print the `vllm bench serve` summary of what was served and write it with --out."
)


SPECULATIVE_HELP = (
    "speculative decoding: ngram:k=4 (every decode row verifies up to k draft tokens found by n-gram prompt "
    "lookup) or draft:model=M,k=3 (drafted by model M, a smaller one of the same vocabulary: a preset, a .gguf "
    "file or a checkpoint directory); greedy rows only; adaptive=true,accept=P1/P2/...: k chosen per step from "
    "that acceptance prior"
)


@serve_app.command()
def serve(
    policy: Optional[str] = typer.Option(
        None, "--policy", "-p", help="bundled policy name or file.py:Class (required but with --replica-url)"
    ),
    model: str = typer.Option(
        "smollm2-135m",
        "--model",
        "-m",
        help="a model with a tokenizer: smollm2-135m, gemma3-270m, a llama or gemma3 .gguf file or a local mlx-lm checkpoint directory",
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16, bfloat16, quantized or auto"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    port: int = typer.Option(8000, "--port", help="port to listen on (0: any free port; the chosen one is printed)"),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name", help="the model name clients give (default: the model's)"
    ),
    max_tokens: int = typer.Option(
        DEFAULT_MAX_TOKENS, "--max-tokens", help="max_tokens of a request that gives none (capped by the context)"
    ),
    profile: Optional[str] = typer.Option(None, "--profile", help=PROFILE_HELP),
    calibrate: bool = typer.Option(False, "--calibrate", help=CALIBRATE_HELP),
    no_calibrate: bool = typer.Option(
        False, "--no-calibrate", help="the default: never calibrate before serving (kept for scripts)"
    ),
    kv_tokens: Optional[int] = typer.Option(
        None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's)"
    ),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help=PREFIX_HELP),
    sampling: str = typer.Option("greedy", "--sampling", help=SAMPLING_HELP),
    seed: int = typer.Option(0, "--seed", help="seed of the engine's prompt ids and sampling"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        parser=out_path,
        help="at shutdown write the run directory (as run-real --out) and trace.json, the requests as served",
    ),
    noise: Optional[str] = typer.Option(None, "--noise", help=NOISE_HELP),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="print nothing but the listening line, errors and warnings"
    ),
    replicas: int = typer.Option(1, "--replicas", help=REPLICAS_HELP),
    router: Optional[str] = typer.Option(None, "--router", help=ROUTER_HELP),
    router_option: Optional[List[str]] = typer.Option(
        None, "--router-option", help="router option key=value (repeatable)"
    ),
    max_waiting: Optional[int] = typer.Option(None, "--max-waiting", help=MAX_WAITING_HELP),
    prefill: int = typer.Option(0, "--prefill", help=PREFILL_HELP),
    decode: int = typer.Option(0, "--decode", help=DECODE_HELP),
    kv_dir: Optional[Path] = typer.Option(
        None, "--kv-dir", hidden=True, help="a prefill replica's folder for the KV it hands on (set by the front)"
    ),
    replica_url: Optional[List[str]] = typer.Option(None, "--replica-url", help=REPLICA_URL_HELP),
    executor: str = typer.Option("local", "--executor", help=EXECUTOR_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    speculative: Optional[str] = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
) -> None:
    """Serve POLICY on MODEL over HTTP until SIGINT/SIGTERM."""
    import schedlab

    if calibrate and no_calibrate:
        raise SchedlabError("--calibrate does not go with --no-calibrate", 2)
    cluster = replicas > 1 or bool(prefill or decode)  # (replicas started here, to be stopped)
    with replicas_stopped(cluster):
        run = schedlab.serve(
            policy,
            model=model,
            dtype=dtype,
            options=parse_options(option),
            host=host,
            port=port,
            served_model_name=served_model_name,
            max_tokens=max_tokens,
            profile=profile,
            calibrate=calibrate,
            kv_tokens=kv_tokens,
            block_size=block_size,
            prefix_caching=prefix_caching,
            sampling=sampling,
            seed=seed,
            model_seed=model_seed,
            noise=noise,
            out=out,
            max_waiting=max_waiting,
            replicas=replicas,
            router=router,
            router_options=parse_options(router_option),
            prefill=prefill,
            decode=decode,
            log=log_to_stderr("serve", quiet),
            kv_dir=kv_dir,
            replica_urls=replica_url or None,
            executor=executor,
            ray_address=ray_address,
            speculative=speculative,
        )
    if not quiet:
        print(run.report())
    if not cluster and not replica_url and run.error:
        raise SchedlabError(run.error)


def main() -> None:
    run_app(serve_app, "serve")
