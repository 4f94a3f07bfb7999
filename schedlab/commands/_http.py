"""``serve``'s HTTP side: an OpenAI-compatible FastAPI app (``Server``) whose handlers turn
requests into ``traces.Request`` objects and submit them to the replica's live arrival source,
and the ``Bridge`` that hands each request's tokens from the replica's thread back to its
handler (``TextDelta``: their text as it grows, cut at stop strings). The command itself, which
runs the replica loop, is ``schedlab.commands.serve``."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from typing import Any

from fastapi import Request as HTTPRequest  # (module level: FastAPI resolves handler annotations here)

DEFAULT_MAX_TOKENS = 256  # a request that gives no max_tokens: at most this many (and what the context allows)
BIAS_STEPS = 100  # GET /metrics's schedlab:cost_model_bias: over the replica's latest steps


# How long an idle HTTP connection stays open on our servers (uvicorn's default is 5 s): longer
# than an HTTP client keeps an idle pooled connection (httpx, under the openai SDK and the cluster
# front, drops it after 5 s), so the client closes it first. With both at 5 s, a request sent on a
# connection the server is closing that instant is lost ("Server disconnected without sending a
# response"; seen in a cluster test, and a client that does not retry gets an error).
KEEP_ALIVE_S = 65


def server_config(app, host: str, port: int):
    """The uvicorn configuration of a replica's server and of the cluster's front."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def openai_app(title: str):
    """A FastAPI app whose unknown paths and methods answer as OpenAI errors, and ``error``: an
    ``APIError`` as its JSON response (the single replica's server and the cluster's front)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: "APIError") -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return error(APIError(exc.status_code, str(exc.detail), kind="invalid_request_error"))

    return app, error


def models_body(name: str) -> dict[str, Any]:
    """``GET /v1/models``: the one model served, as OpenAI lists models."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "schedlab"}]}


def listening(http_server) -> tuple[str, int] | None:
    """Where a started uvicorn server listens: (host, port), or None."""
    for s in getattr(http_server, "servers", None) or []:
        for sock in getattr(s, "sockets", None) or []:
            host, port = sock.getsockname()[:2]
            return host, port
    return None


class APIError(Exception):
    """An OpenAI-style error response: ``status``, one-line ``message``, ``param``, ``code``
    (and ``headers``, of the response)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers  # of its response (a 429's Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------- engine <-> HTTP


def _unlink(path: str) -> None:
    import os

    try:
        os.unlink(path)
    except OSError:
        pass


class _Stream:
    """One request's way back to its handler: events on an asyncio queue of the server's loop;
    with stop strings, its text as the engine makes it (to end the request at one)."""

    __slots__ = ("loop", "queue", "text", "cancelled", "hit_stop")

    def __init__(self, loop: asyncio.AbstractEventLoop, text: "TextDelta | None" = None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = text  # a TextDelta with the request's stop strings, or None
        self.cancelled = False  # its client went away: the replica ends it at its next step
        self.hit_stop = False

    def put(self, item: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Bridge:
    """Hands each request's tokens from the replica's thread to its handler.

    Events: ``("tokens", [ids])`` as each token is made (``MLXBackend.on_token``: at the end of
    the pass that made it, not of the step; ``("tokens", [ids], [logprobs])`` for a request that
    asked for logprobs), then ``("done", finish_reason)`` or ``("error",
    APIError)``. A token that completes one of the request's stop strings, or that comes after its
    client went away (``cancel``), is its last (``on_token`` says so to the engine, which ends it as
    at EOS). ``on_token`` and ``on_finish`` run on the replica's thread; ``open`` and ``cancel`` on
    the server's."""

    def __init__(self, backend, kv_capacity: int, tokenizer=None, eos: frozenset[int] = frozenset()):
        self.backend = backend
        self.kv_capacity = kv_capacity
        self.tokenizer = tokenizer
        self.eos = eos
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.cancelled = 0  # requests ended early because their client went away
        self.on_cancel = None  # where a cancellation goes: the live source's cancel (serve sets it)
        backend.on_token = self.on_token
        # what GET /state reads (a cluster's router): the replica's ReplicaState, known once the
        # run starts (the loop hands it to the backend's start), and what was sent to it
        self.state = None
        self.received = [0, 0, 0]  # requests, prompt tokens, output tokens submitted (cumulative)
        self._refused = [0, 0]  # prompt and output tokens of requests refused on arrival
        self._sizes: dict[str, tuple[int, int]] = {}
        # requests sent and not admitted yet (admission control counts them: ``unadmitted``)
        self._unadmitted: dict[str, None] = {}
        self.metrics: Metrics | None = None  # the server's /metrics, once it has one
        start = backend.start

        def start_and_keep(state, requests=None):
            self.state = state
            return start(state, requests)

        backend.start = start_and_keep

    def open(
        self,
        rid: str,
        loop: asyncio.AbstractEventLoop,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        sizes: tuple[int, int] | None = None,
        sampling=None,
        seen: tuple[int, ...] = (),
    ) -> _Stream:
        """A stream for request ``rid`` (``sizes``: its prompt and output tokens, counted as sent;
        ``sampling``: its own ``engine.sampling.Sampling``, else it samples as the server does;
        ``seen``: tokens its client already has from another replica, which a stop string may span)."""
        st = _Stream(loop, TextDelta(self.tokenizer, self.eos, stop) if stop else None)
        if st.text is not None and seen:
            st.text.feed(list(seen))
        with self._lock:
            self._streams[rid] = st
            if sampling is not None and sampling != self.backend.sampling:
                self.backend.request_sampling[rid] = sampling
            self._unadmitted[rid] = None
            if ignore_eos:
                self.backend.no_eos.add(rid)
            if sizes is not None:
                self._sizes[rid] = sizes
                self._count(sizes, 1)
        return st

    def _count(self, sizes: tuple[int, int], sign: int) -> None:
        self.received[0] += sign
        self.received[1] += sign * sizes[0]
        self.received[2] += sign * sizes[1]

    def drop(self, rid: str) -> None:
        """Forget ``rid``: it was never submitted."""
        with self._lock:
            self._streams.pop(rid, None)
            self._unadmitted.pop(rid, None)
            self.backend.no_eos.discard(rid)
            self.backend.request_sampling.pop(rid, None)
            sizes = self._sizes.pop(rid, None)
            if sizes is not None:
                self._count(sizes, -1)

    def cancel(self, rid: str) -> None:
        """The client of ``rid`` went away: the replica ends it at its next step, whatever its
        phase (``on_cancel``: the arrival source's ``cancel``); its tokens meanwhile go nowhere."""
        with self._lock:
            st = self._streams.get(rid)
            if st is None or st.cancelled:
                return
            st.cancelled = True
            self.cancelled += 1
        if self.on_cancel is not None:
            self.on_cancel(rid)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def on_token(self, rid: str, token: int, logprobs=None) -> bool:
        """``logprobs``: for a request that asked, (its token's log-probability, [(id,
        log-probability)] of the most likely alternatives): the stream's event carries them."""
        with self._lock:
            st = self._streams.get(rid)
        if st is None:
            return False
        if st.cancelled:  # (the replica ends it before its next step)
            return False
        st.put(("tokens", [token]) if logprobs is None else ("tokens", [token], [logprobs]))
        if st.text is not None:
            st.text.feed([token])
            st.hit_stop = st.text.stopped
        return st.hit_stop

    def on_finish(self, r, t: float) -> None:
        with self._lock:
            st = self._streams.pop(r.id, None)
            self._unadmitted.pop(r.id, None)
            self.backend.no_eos.discard(r.id)
            self.backend.request_sampling.pop(r.id, None)
            sizes = self._sizes.pop(r.id, None)
            if sizes is not None and r.finish_s is None:  # refused: its tokens are never done
                self._refused[0] += sizes[0]
                self._refused[1] += sizes[1]
        reason = "stop" if r.id in self.backend.stopped or (st is not None and st.hit_stop) else "length"
        if self.metrics is not None:
            gone = getattr(r, "cancelled_s", None) is not None or (st is not None and st.cancelled)
            self.metrics.finished(r, "abort" if gone else reason)
        exported = getattr(self.backend, "exported", None)  # (a prefill replica's requests: their KV written)
        kv = exported.pop(r.id, None) if exported else None
        if kv is not None and (st is None or reason != "length"):
            _unlink(kv["path"])  # it ended here (EOS, a stop string, its client gone): nobody reads it
            kv = None
        if st is None:
            return
        if kv is not None:
            st.put(("kv", kv))
        if r.finish_s is None:  # refused on arrival: the replica's own reason (it can never fit its KV cache)
            rejected = getattr(self.state, "rejected", None)
            why = rejected[-1][1] if rejected and rejected[-1][0] is r else None
            if why is None or "KV capacity" in why:
                why = (
                    f"this request needs {r.kv_footprint} KV tokens (prompt {r.prompt_tokens} + max_tokens "
                    f"{r.output_tokens} - 1"
                    + (f" + {r.fixed_tokens} for its sliding windows and recurrent state" if r.fixed_tokens else "")
                    + f") but the server's KV capacity is {self.kv_capacity} (serve --kv-tokens)"
                )
            st.put(("error", APIError(400, why, "max_tokens" if "KV" in why else "prompt")))
            return
        st.put(("done", reason))

    def signals(self) -> dict[str, Any]:
        """GET /state: the replica as a router reads it (``routers.ReplicaSignals``' fields): requests
        waiting (sent and not admitted: in the source's queue or the waiting queue) and running,
        prompt and output tokens outstanding (sent less what the steps did), KV used and capacity
        (tokens), ``kv_usage`` (the fraction of KV blocks held by requests, vLLM's
        ``kv_cache_usage_perc``); and ``received``, what was sent to it so far (requests, prompt
        tokens, output tokens). Read from the replica loop's state while it runs (plain counters: a
        snapshot, not a locked one). GET /metrics's gauges are these."""
        st = self.state
        with self._lock:
            in_flight = len(self._streams)
            n, p, o = self.received
            rp, ro = self._refused
        running = len(st.running) if st is not None else 0
        return {
            "waiting": max(in_flight - running, 0),
            "running": running,
            "prompt_tokens": max(p - rp - (st.prompt_done if st is not None else 0), 0),
            "output_tokens": max(o - ro - (st.output_done if st is not None else 0), 0),
            "kv_used": st.kv_used if st is not None else 0,
            "kv_capacity": st.kv_capacity if st is not None else self.kv_capacity,
            "kv_usage": st.blocks_used / st.kv_blocks if st is not None and st.kv_blocks else 0.0,
            "received": {"requests": n, "prompt_tokens": p, "output_tokens": o},
        }

    def unadmitted(self) -> int:
        """Requests sent and not admitted yet (in the source's queue or the waiting queue, never
        admitted: a preempted request is not counted again), exactly: what ``serve --max-waiting``
        bounds. On the server's thread."""
        st = self.state
        with self._lock:
            if st is not None:
                by_id = st.by_id
                admitted = [
                    rid for rid in self._unadmitted if (r := by_id.get(rid)) is not None and r.admitted_s is not None
                ]
                for rid in admitted:
                    del self._unadmitted[rid]
            return len(self._unadmitted)

    def cost_model_bias(self, last: int = BIAS_STEPS) -> float | None:
        """The replica's measured over predicted step time over its ``last`` steps (None before
        any): how much slower (> 1) or faster than its cost model the replica runs now."""
        steps = getattr(self.state, "steps", None)  # the loop's StepLog (sim.loop.ReplicaLoop)
        if steps is None:
            return None
        fields = steps.fields
        cols = steps.columns  # (a real run's: plain lists, appended to one step at a time)
        measured = cols[fields.index("measured_s")]
        n = len(measured)  # (appended after predicted_s)
        k = max(n - last, 0)
        return step_time_ratio(cols[fields.index("predicted_s")][k:n], measured[k:n])

    def fail_all(self, error: APIError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            self._unadmitted.clear()
        for st in streams:
            st.put(("error", error))


# ---------------------------------------------------------------------------- GET /metrics

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")  # vllm:request_success_total's finished_reason
REJECT_REASONS = ("queue_full", "kv_capacity")  # schedlab:requests_rejected_total's reason


def step_time_ratio(predicted, measured) -> float | None:
    """Total measured over total predicted seconds of the steps that have both (> 0; a step's
    measured seconds are None in a simulation), or None without any such step."""
    p = m = 0.0
    for a, b in zip(predicted, measured):
        if a is not None and b is not None and a > 0 and b > 0:
            p += a
            m += b
    return m / p if p > 0 else None


def request_latencies(r) -> tuple[float | None, float | None, float | None, list[float]]:
    """A finished request's (queue time, time to first token, end-to-end latency, inter-token
    latencies) in seconds on the replica's clock, as vLLM observes them: arrival to first
    admission, arrival to first token, arrival to finish, and between consecutive tokens. None
    for what never happened (a request cancelled before it was admitted, or before its first token)."""
    a = r.arrival_s
    times = r.token_times
    return (
        None if r.admitted_s is None else r.admitted_s - a,
        None if r.first_token_s is None else r.first_token_s - a,
        None if r.finish_s is None else r.finish_s - a,
        [y - x for x, y in zip(times, times[1:])],
    )


class Metrics:
    """GET /metrics: Prometheus text (``prometheus_client``, a registry of its own), with vLLM's
    names and meanings. Gauges read the replica when scraped (``Bridge.signals``, what GET /state
    says, and the cost model's bias over the latest steps); counters and histograms are updated as
    each request finishes (``finished``, on the replica's thread; prometheus_client's metrics are
    thread-safe) and as the server refuses one (``rejected``, on the server's)."""

    def __init__(self, model_name: str, bridge: Bridge):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Histogram

        prometheus_client.disable_created_metrics()  # (as vLLM: no *_created series)
        self.model_name = model_name
        self.bridge = bridge
        self.registry = reg = CollectorRegistry()
        lab = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, lab + list(extra), registry=reg)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.rejected_c = counter(
            "schedlab:requests_rejected",
            "Requests refused on arrival: queue_full (serve --max-waiting), kv_capacity (larger than the KV cache).",
            ("reason",),
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, lab, buckets=buckets, registry=reg)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS
        )
        for c in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.prefix_queries, self.prefix_hits):
            c.labels(model_name)  # (every series from the start, at 0)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.rejected_c.labels(model_name, reason)
        for h in (self.ttft, self.itl, self.e2e, self.queue):
            h.labels(model_name)
        self._queued = [0.0, 0]  # queue times observed: sum, count (Retry-After's estimate)
        reg.register(_LiveGauges(self))

    def finished(self, r, reason: str) -> None:
        """Request ``r`` finished with ``reason`` (stop, length, abort), or was refused on arrival
        (``r.finish_s`` None: larger than the KV cache)."""
        name = self.model_name
        if r.finish_s is None:
            self.rejected("kv_capacity")
            return
        self.success.labels(name, reason).inc()
        queue, ttft, e2e, itl = request_latencies(r)
        if ttft is not None:  # (its prompt was processed)
            self.prompt_tokens.labels(name).inc(r.prompt_tokens)
            self.ttft.labels(name).observe(ttft)
        self.generation_tokens.labels(name).inc(r.generated)
        if r.preemptions:
            self.preemptions.labels(name).inc(r.preemptions)
        if queue is not None:
            if getattr(self.bridge.state, "prefix", None) is not None:  # (as vLLM: tokens looked up, found)
                self.prefix_queries.labels(name).inc(r.prompt_tokens)
                self.prefix_hits.labels(name).inc(r.cached_tokens)
            self.queue.labels(name).observe(queue)
            self._queued[0] += queue
            self._queued[1] += 1
        self.e2e.labels(name).observe(e2e)
        h = self.itl.labels(name)
        for dt in itl:
            h.observe(dt)

    def rejected(self, reason: str) -> None:
        self.rejected_c.labels(self.model_name, reason).inc()

    def retry_after(self) -> int:
        """Seconds a refused client should wait (a 429's Retry-After): the mean time requests
        waited to be admitted so far, 1 to 60."""
        total, n = self._queued
        return min(max(math.ceil(total / n), 1), 60) if n else 1

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveGauges:
    """/metrics's gauges, read from the replica at each scrape."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        m = self.metrics
        s = m.bridge.signals()
        bias = m.bridge.cost_model_bias()
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s["running"]),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s["waiting"]),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s["kv_usage"]),
            (
                "schedlab:cost_model_bias",
                f"Measured over predicted step time of the replica's latest {BIAS_STEPS} steps "
                "(the cost model the policy plans with; 1 = exact).",
                bias,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            if value is not None:
                g.add_metric([m.model_name], value)
            yield g


class TextDelta:
    """Incremental text of a growing list of token ids: each ``feed`` returns the new text. Held
    back: an incomplete UTF-8 sequence at the end (the tokenizer's replacement character), and
    an end that may begin one of the ``stop`` strings; the text ends before the first stop string
    (``stopped`` then), which it never contains, as OpenAI's API returns it."""

    def __init__(self, tokenizer, eos: frozenset[int], stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.eos = eos
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def feed(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i not in self.eos]
        full = self.tok.decode(self.ids)
        cuts = [i for i in (full.find(x) for x in self.stop) if i >= 0]
        if cuts:
            full, final, self.stopped = full[: min(cuts)], True, True
        if not final:
            if full.endswith("\ufffd"):
                return ""
            hold = max((k for x in self.stop for k in range(1, len(x)) if full.endswith(x[:k])), default=0)
            full = full[: len(full) - hold]
        if not full.startswith(self.text):
            return ""  # (a decoding that rewrote earlier text: what was sent stands)
        delta, self.text = full[len(self.text) :], full
        return delta


class TokenLogprobs:
    """A request's tokens with their logprobs, as OpenAI returns them: each token's text (its
    share of the answer: a token that ends inside a character has "" and the character goes with
    the token that completes it; EOS is not part of the text and is left out), its offset in the
    answer, its log-probability and the most likely alternatives. ``take(upto)`` hands over the
    tokens whose text lies within the first ``upto`` characters of the answer (what was sent so
    far); ``final``: those that start before it, the last cut there (at a stop string)."""

    def __init__(self, tokenizer, eos: frozenset[int]):
        self.tok = tokenizer
        self.eos = eos
        self.pieces = TextDelta(tokenizer, eos)
        self.offset = 0
        self.pending: list[list] = []  # [offset, text, token id, (logprob, [(id, logprob)]) or None]

    def add(self, ids: list[int], logprobs: list | None) -> None:
        for t, lp in zip(ids, logprobs or [None] * len(ids)):
            if t in self.eos:
                continue
            piece = self.pieces.feed([t])
            self.pending.append([self.offset, piece, t, lp])
            self.offset += len(piece)

    def take(self, upto: int, final: bool = False) -> list[list]:
        if final:
            rest = self.pieces.feed([], final=True)  # (a character left incomplete at the end)
            if rest and self.pending:
                self.pending[-1][1] += rest
        out = []
        while self.pending:
            off, piece = self.pending[0][:2]
            whole = off + len(piece) <= upto and (piece or len(self.pending) > 1)  # ("": a character to come)
            if not (whole or (final and off < upto)):
                break
            entry = self.pending.pop(0)
            entry[1] = piece[: upto - off]
            out.append(entry)
        if final:
            self.pending = []
        return out

    def _alt(self, token: int) -> str:
        return self.tok.decode([token])

    def chat(self, entries: list[list]) -> dict[str, Any]:
        """``choices[i].logprobs`` of a chat completion (or chunk)."""
        content = []
        for _, piece, _, lp in entries:
            logprob, top = lp if lp is not None else (None, [])
            alts = [(self._alt(i), v) for i, v in top]
            content.append(
                {
                    "token": piece,
                    "logprob": logprob,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in alts],
                }
            )
        return {"content": content, "refusal": None}

    def legacy(self, entries: list[list]) -> dict[str, Any]:
        """``choices[i].logprobs`` of a completion (or chunk), OpenAI's legacy format: the top
        alternatives of each token and the token itself (up to N + 1, as OpenAI's)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for off, piece, t, lp in entries:
            logprob, top = lp if lp is not None else (None, [])
            alts = {self._alt(i): v for i, v in top}
            if logprob is not None:
                alts.setdefault(self._alt(t), logprob)
            out["tokens"].append(piece)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(off)
        return out


# ---------------------------------------------------------------------------- requests


def _number(body: dict, key: str, default=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(400, f"{key} must be a number, got {json.dumps(v)}", key)
    return v


def _int(body: dict, key: str):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise APIError(400, f"{key} must be an integer >= 1, got {json.dumps(v)}", key)
    return v


class Params:
    """What a completion request asks for, checked against what this server does."""

    def __init__(self, body: Any, server: "Server", chat: bool):
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise APIError(400, "model is required", "model")
        if model != server.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{server.model_name}`)",
                "model",
                "model_not_found",
            )
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise APIError(400, f"stream must be true or false, got {json.dumps(stream)}", "stream")
        self.stream = stream
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise APIError(400, "stream_options must be an object", "stream_options")
        self.include_usage = bool((opts or {}).get("include_usage", False))
        if opts is not None and not stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        self.sampling = request_sampling(body, server.sampling, chat, getattr(server.info, "vocab_size", None))
        self.logprobs = self.sampling.logprobs  # None, or the alternatives asked for per token
        keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_tokens = None
        for k in keys:
            v = _int(body, k)
            if v is not None:
                self.max_tokens, self.max_tokens_key = v, k
                break
        self.stop = _stop(body.get("stop"))
        self.ignore_eos = body.get("ignore_eos", False)  # vLLM's extension (vllm bench serve --ignore-eos)
        if not isinstance(self.ignore_eos, bool):
            raise APIError(400, f"ignore_eos must be true or false, got {json.dumps(self.ignore_eos)}", "ignore_eos")
        if chat:
            self.messages = _messages(body.get("messages"))
            self.prompt = None
        else:
            self.messages = None
            self.prompt = _prompt(body.get("prompt"))


def request_sampling(body: dict, default, chat: bool, vocab: int | None = None):
    """The ``engine.sampling.Sampling`` a completion request asks for: the server's ``default``
    (serve --sampling) with what the request sets instead (OpenAI's ``temperature``, ``top_p``,
    ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and logprobs; vLLM's
    ``top_k``, ``min_p``, ``repetition_penalty``), each checked against OpenAI's ranges; what this
    server does not do (``n`` or ``best_of`` > 1, ``echo``, ``min_tokens``, tools, ...) is a 400."""
    from dataclasses import replace

    from schedlab.engine.sampling import MAX_LOGPROBS, SAMPLING_KEYS, check_sampling_value

    values: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        v = body.get(key)
        if v is None:
            continue
        ok, why = check_sampling_value(key, v)
        if why is not None:
            raise APIError(400, why, key)
        values["request_seed" if key == "seed" else key] = ok
    bias = body.get("logit_bias")
    if bias is not None:
        values["logit_bias"] = _logit_bias(bias, vocab)
    values["logprobs"] = _logprobs_asked(body, chat, MAX_LOGPROBS)
    for key, neutral in (("n", 1), ("best_of", 1), ("min_tokens", 0)):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or v != neutral):
            what = "one choice per request" if key != "min_tokens" else "not supported by this server"
            raise APIError(400, f"{key} must be {neutral} ({what}), got {json.dumps(v)}", key)
    for key in ("echo", "suffix", "tools", "functions", "response_format"):
        if body.get(key) not in (None, False, [], {}, ""):
            raise APIError(400, f"{key} is not supported by this server", key)
    return replace(default, **values)


def _logit_bias(bias: Any, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {token id (a string): bias from -100 to 100}."""
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object of token ids to biases from -100 to 100", "logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            tid = -1
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise APIError(400, f"logit_bias: {json.dumps(k)} is not a token id of this model", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise APIError(400, f"logit_bias of token {tid} must be a number from -100 to 100, got {json.dumps(v)}",
                           "logit_bias")  # fmt: skip
        out[tid] = float(v)
    return tuple(sorted(out.items()))


def _logprobs_asked(body: dict, chat: bool, most: int) -> int | None:
    """How many alternatives per token a request wants with its tokens' logprobs (None: no
    logprobs): chat's ``logprobs: true`` and ``top_logprobs``, completions' ``logprobs``: N."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise APIError(400, "top_logprobs is for chat completions (completions take logprobs: 0 to 20)",
                           "top_logprobs")  # fmt: skip
        if lp is None:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= most:
            raise APIError(400, f"logprobs must be an integer from 0 to {most}, got {json.dumps(lp)}", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise APIError(400, f"logprobs must be true or false, got {json.dumps(lp)}", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= most:
            raise APIError(400, f"top_logprobs must be an integer from 0 to {most}, got {json.dumps(top)}",
                           "top_logprobs")  # fmt: skip
        if top and not lp:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None


def _stop(v: Any) -> tuple[str, ...]:
    """``stop``: a string or up to 4 strings, none empty (OpenAI's limits)."""
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(x, str) and x for x in stops):
        raise APIError(400, f"stop must be a non-empty string or a list of 1 to 4 of them, got {json.dumps(v)}", "stop")
    return tuple(stops)


def _prompt(p: Any) -> str:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise APIError(400, "prompt must be a string (one prompt per request)", "prompt")
    if not p:
        raise APIError(400, "prompt is empty", "prompt")
    return p


def _messages(ms: Any) -> tuple[tuple[str, str], ...]:
    from schedlab.traces.schema import ROLES

    if not isinstance(ms, list) or not ms:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise APIError(
                400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", "messages"
            )
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        out.append((role, content))
    return tuple(out)


# ---------------------------------------------------------------------------- the server


async def _json(http: HTTPRequest) -> Any:
    try:
        return await http.json()
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None


class Server:
    """The HTTP side: a FastAPI app whose handlers submit to ``source`` and read ``bridge``;
    ``max_waiting``: a request arriving while that many wait to be admitted gets a 429."""

    def __init__(
        self,
        info,
        source,
        bridge: Bridge,
        model_name: str,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_waiting: int | None = None,
        kv_dir=None,
    ):
        self.info = info
        self.kv_dir = kv_dir  # where this replica writes the KV it hands to a decode replica (serve --kv-dir)
        self._kv_files = itertools.count()
        self.tokenizer = info.tokenizer
        self.eos = frozenset(info.eos_token_ids or ())
        self.source = source
        self.bridge = bridge
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self._ids = itertools.count()
        self._used: set[str] = set()  # request ids given so far (the replica's state keeps them all)
        self.max_waiting = max_waiting
        self.metrics = bridge.metrics = Metrics(model_name, bridge)
        self.app = self._make_app()

    @property
    def sampling(self):
        """The server's sampling (serve --sampling: the backend's), what a request gets for any
        sampling parameter it does not give."""
        return self.bridge.backend.sampling

    def claim_id(self, chat: bool, given: str | None = None) -> str:
        """A fresh request id: ``given`` (a cluster's front names its requests, header
        ``X-Schedlab-Request-Id``) unless already used here, else the next of ours."""
        if given is not None:
            if not given or len(given) > 200 or given in self._used:
                raise APIError(400, f"request id {given[:200]!r} is empty, too long or already used on this replica")
            rid = given
        else:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
            while rid in self._used:
                rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        self._used.add(rid)
        return rid

    def request(self, params: Params, chat: bool, rid: str = "request"):
        """A ``traces.Request`` for ``params``, counted with the model's tokenizer (not stamped)."""
        from schedlab import traces
        from schedlab.engine.errors import EngineError
        from schedlab.traces.schema import Request, TraceError

        req = Request(rid, 0.0, None, 1, prompt=params.prompt, messages=params.messages)
        try:
            n = len(traces.prompt_ids(req, self.tokenizer))
        except TraceError as exc:
            raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        if n < 1:
            raise APIError(400, "the prompt is 0 tokens for this model's tokenizer", "messages" if chat else "prompt")
        ctx = self.info.max_context
        if params.max_tokens is None:
            room = self.default_max_tokens if ctx is None else min(self.default_max_tokens, ctx - n)
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt is {n} tokens and the model's context is {ctx}: no room for output",
                    "messages" if chat else "prompt",
                )
            max_tokens, key = room, "max_tokens"
        else:
            max_tokens, key = params.max_tokens, params.max_tokens_key
        req = Request(rid, 0.0, n, max_tokens, prompt=params.prompt, messages=params.messages)
        try:
            self.info.check_trace([req])
        except EngineError as exc:
            raise APIError(
                400, str(exc).replace(f"request {rid} needs", "this request needs").replace("+ output", f"+ {key}"), key
            ) from None
        return req

    def _make_app(self):
        from fastapi.responses import Response, StreamingResponse

        from schedlab.sim.sources import SourceClosed

        app, error = openai_app("schedlab serve")
        server = self

        @app.get("/health")
        async def health():
            return {"status": "ok", "in_flight": server.bridge.in_flight(), "cancelled": server.bridge.cancelled}

        @app.get("/state")
        async def state():  # what a cluster's router reads (routers.ReplicaSignals' fields)
            return server.bridge.signals()

        @app.get("/metrics")
        async def metrics():  # Prometheus text
            body, kind = server.metrics.render()
            return Response(body, media_type=kind)

        async def prepare(http: HTTPRequest, chat: bool):
            """A completion request checked and counted, not submitted (a cluster's front asks
            before it routes): its prompt and max_tokens, or the error it would get."""
            try:
                params = Params(await _json(http), server, chat)
                req = server.request(params, chat)
                server.check_fits(req)
            except APIError as e:
                return error(e)
            return {
                "prompt_tokens": req.prompt_tokens,
                "max_tokens": req.output_tokens,
                "stream": params.stream,
                "include_usage": params.include_usage,
                "prompt": req.prompt,
                "messages": req.chat(),
            }

        @app.post("/prepare/completions")
        async def prepare_completions(http: HTTPRequest):
            return await prepare(http, chat=False)

        @app.post("/prepare/chat/completions")
        async def prepare_chat_completions(http: HTTPRequest):
            return await prepare(http, chat=True)

        @app.get("/v1/models")
        async def models():
            return models_body(server.model_name)

        async def handle(http: HTTPRequest, chat: bool):
            try:
                params = Params(await _json(http), server, chat)
                rid = server.claim_id(chat, http.headers.get("x-schedlab-request-id"))
            except APIError as e:
                return error(e)
            seen: tuple[int, ...] = ()
            try:
                req = server.request(params, chat, rid)
                if http.headers.get("x-schedlab-kv-import"):  # a decode replica's: it comes with its KV
                    req, seen = await server.take_kv(req, http.headers["x-schedlab-kv-import"])
                server.check_queue(rid)
                if http.headers.get("x-schedlab-kv-export"):  # a prefill replica's: it leaves its KV
                    server.export_kv(rid)
            except APIError as e:
                server.forget(rid)
                return error(e)
            st = server.bridge.open(
                req.id,
                asyncio.get_running_loop(),
                params.stop,
                params.ignore_eos,
                (req.prompt_tokens, req.output_tokens),
                sampling=params.sampling,
                seen=seen,
            )
            try:
                server.source.submit(req)
            except SourceClosed as exc:
                server.bridge.drop(req.id)
                server.forget(req.id)
                return error(APIError(503, str(exc), kind="server_error"))
            created = int(time.time())
            if params.stream:  # (Starlette ends the stream's generator when its client goes away)
                return StreamingResponse(
                    server._events(req, st, params, chat, created, seen), media_type="text/event-stream"
                )
            return await server._whole_unless_gone(http, req, st, params, chat, created)

        @app.post("/v1/completions")
        async def completions(http: HTTPRequest):
            return await handle(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HTTPRequest):
            return await handle(http, chat=True)

        return app

    async def _whole_unless_gone(self, http: HTTPRequest, req, st: _Stream, params: "Params", chat: bool, created: int):
        """The whole answer, unless its client goes away first (the connection closes: ASGI's
        ``http.disconnect``, which nothing else awaits for a response not yet started): then the
        request is cancelled at once, wherever it is, as a stream's is."""
        from fastapi import Response

        async def gone() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass

        answer = asyncio.ensure_future(self._whole(req, st, params, chat, created))
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((answer, watch), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            answer.cancel()  # (which cancels the request)
            raise
        finally:
            watch.cancel()
        if answer.done():
            return answer.result()
        self.bridge.cancel(req.id)
        answer.cancel()
        return Response(status_code=499)  # (nobody reads it: nginx's "client closed request")

    async def take_kv(self, req, path: str):
        """A decode replica's request (header ``X-Schedlab-KV-Import``: a KV file a prefill replica
        wrote): the request as it arrives here, its prompt plus its first token with the prompt's KV
        given (``sim.disagg.TransferredRequest``), and that first token (its client has it)."""
        from schedlab.engine import kvfile
        from schedlab.engine.errors import EngineError
        from schedlab.sim.disagg import TransferredRequest

        try:
            head, kv = await asyncio.to_thread(kvfile.read, path)
            n = kvfile.prompt_tokens(head)
            if n != req.prompt_tokens:
                raise EngineError(f"the KV given holds {n} prompt tokens, but the prompt is {req.prompt_tokens}")
            moved = TransferredRequest(
                req.id, 0.0, n + 1, req.output_tokens, prompt=req.prompt, messages=req.messages, kv_transferred=n
            )
            self.info.check_trace([moved])
            self.bridge.backend.expect_kv(req.id, head, kv)
        except EngineError as exc:
            raise APIError(400, str(exc), code="kv_transfer") from None
        _unlink(path)  # (read: the KV is this replica's now)
        return moved, (int(head["ids"][-1]),)

    def export_kv(self, rid: str) -> None:
        """A prefill replica's request (header ``X-Schedlab-KV-Export``): when it ends at its one
        token its prompt's KV is written to a file in ``kv_dir`` (its stream says where)."""
        if self.kv_dir is None:
            raise APIError(400, "this replica hands no KV on: it was started without --kv-dir", code="kv_transfer")
        self.bridge.backend.export_kv[rid] = str(self.kv_dir / f"{next(self._kv_files)}.kv")

    def forget(self, rid: str) -> None:
        """A request refused before it was submitted: its id is free again, nothing kept for it."""
        self._used.discard(rid)
        drop = getattr(self.bridge.backend, "drop_kv", None)  # (the MLX engine's: any other hands no KV on)
        if drop is not None:
            drop(rid)

    def check_queue(self, rid: str) -> None:
        """The 429 of a request arriving while ``max_waiting`` requests wait to be admitted (its id
        is free again: the client may send it again)."""
        if self.max_waiting is None:
            return
        n = self.bridge.unadmitted()
        if n < self.max_waiting:
            return
        self._used.discard(rid)
        self.metrics.rejected("queue_full")
        raise APIError(
            429,
            f"the server's queue is full: {n} request(s) wait to be admitted (serve --max-waiting "
            f"{self.max_waiting}); retry later",
            code="queue_full",
            kind="rate_limit_exceeded",
            headers={"Retry-After": str(self.metrics.retry_after())},
        )

    def check_fits(self, req) -> None:
        """The 400 the replica gives on arrival a request larger than its KV capacity, said now."""
        st = self.bridge.state
        capacity = st.kv_capacity if st is not None else self.bridge.kv_capacity
        need = req.prompt_tokens + req.output_tokens - 1
        if need > capacity:
            raise APIError(
                400,
                f"this request needs {need} KV tokens (prompt {req.prompt_tokens} + max_tokens "
                f"{req.output_tokens} - 1) but the server's KV capacity is {self.bridge.kv_capacity} (serve --kv-tokens)",
                "max_tokens",
            )

    def _usage(self, req, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": req.prompt_tokens + completion,
        }

    async def _whole(self, req, st: _Stream, params: Params, chat: bool, created: int):
        from fastapi.responses import JSONResponse

        ids: list[int] = []
        lps = TokenLogprobs(self.tokenizer, self.eos) if params.logprobs is not None else None
        try:
            while True:
                item = await st.queue.get()
                kind, value = item[0], item[1]
                if kind == "tokens":
                    ids += value
                    if lps is not None:
                        lps.add(value, item[2] if len(item) > 2 else None)
                elif kind == "error":
                    return JSONResponse(value.body(), status_code=value.status)
                elif kind == "done":
                    break
        except asyncio.CancelledError:  # the client went away: the replica ends it at its next step
            self.bridge.cancel(req.id)
            raise
        text = TextDelta(self.tokenizer, self.eos, params.stop)
        text.feed(ids, final=True)
        text = text.text
        choice: dict[str, Any] = {"index": 0, "finish_reason": value, "logprobs": None}
        if lps is not None:
            taken = lps.take(len(text), final=True)
            choice["logprobs"] = lps.chat(taken) if chat else lps.legacy(taken)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse(
            {
                "id": req.id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(req, len(ids)),
            }
        )

    async def _events(self, req, st: _Stream, params: Params, chat: bool, created: int, seen: tuple[int, ...] = ()):
        obj = "chat.completion.chunk" if chat else "text_completion"

        lps = TokenLogprobs(self.tokenizer, self.eos) if params.logprobs is not None else None

        def chunk(delta: str | None = None, finish: str | None = None, role: bool = False, usage=None, lp=None) -> str:
            if lp:  # the logprobs of the tokens whose text this chunk completes
                lp = lps.chat(lp) if chat else lps.legacy(lp)
            if usage is not None:
                choices: list = []
            elif chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choices = [{"index": 0, "delta": d, "finish_reason": finish, "logprobs": lp or None}]
            else:
                choices = [{"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": lp or None}]
            out: dict[str, Any] = {
                "id": req.id,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

        text = TextDelta(self.tokenizer, self.eos, params.stop)
        text.feed(list(seen))  # (text its client has from the replica that made those tokens)
        if lps is not None and seen:  # (and their logprobs: this answer's offsets start after them)
            lps.offset = len(lps.pieces.feed(list(seen)))
        n = 0
        ended = False
        handed_on = False  # its KV went to a file: another replica goes on from its last token
        try:
            if chat:
                yield chunk("", role=True)
            while True:
                item = await st.queue.get()
                kind, value = item[0], item[1]
                if kind == "tokens":
                    n += len(value)
                    delta = text.feed(value)
                    if lps is not None:
                        lps.add(value, item[2] if len(item) > 2 else None)
                    if delta:
                        yield chunk(delta, lp=lps.take(len(text.text)) if lps is not None else None)
                elif kind == "kv":  # (for the cluster's front: not an OpenAI event)
                    handed_on = True
                    yield f"data: {json.dumps({'schedlab_kv': value})}\n\n"
                elif kind == "error":
                    ended = True
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:
                    ended = True
                    # (text held back, an unfinished character or a stop string's start, is the
                    # next replica's to send when the request goes on there)
                    rest = "" if handed_on else text.feed([], final=True)
                    last = lps.take(len(text.text), final=True) if lps is not None else None
                    if rest or last:
                        yield chunk(rest, lp=last)
                    yield chunk(None if chat else "", finish=value)
                    if params.include_usage:
                        yield chunk(usage=self._usage(req, n))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away: the replica ends the request at its next step
                self.bridge.cancel(req.id)
