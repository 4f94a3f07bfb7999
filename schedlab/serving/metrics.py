"""``GET /metrics``: Prometheus text with vLLM's names, a replica's (``Metrics``: read from its
bridge at each scrape, updated as each request finishes) and the front's (``FrontMetrics``: per
replica)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from .replicas import Replica

BIAS_STEPS = 100  # GET /metrics's schedlab:cost_model_bias: over the replica's latest steps

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
    admission, arrival to first token, arrival to finish, and between consecutive tokens (one per
    step's output: the tokens one speculative verify hands out together add no zero gaps). None
    for what never happened (a request cancelled before it was admitted, or before its first token)."""
    a = r.arrival_s
    times = r.token_times
    return (
        None if r.admitted_s is None else r.admitted_s - a,
        None if r.first_token_s is None else r.first_token_s - a,
        None if r.finish_s is None else r.finish_s - a,
        [y - x for x, y in zip(times, times[1:]) if y != x],
    )


class Metrics:
    """GET /metrics: Prometheus text (``prometheus_client``, a registry of its own), with vLLM's
    names and meanings. Gauges read the replica when scraped (``Bridge.signals``, what GET /state
    says, and the cost model's bias over the latest steps); counters and histograms are updated as
    each request finishes (``finished``, on the replica's thread; prometheus_client's metrics are
    thread-safe) and as the server refuses one (``rejected``, on the server's)."""

    def __init__(self, model_name: str, bridge):  # (a bridge.Bridge)
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
        yield from _spec_decode(m.model_name, getattr(m.bridge, "state", None))


def _spec_decode(model_name: str, st) -> Iterator:
    """vLLM's speculative-decoding counters (``vllm/v1/spec_decode/metrics.py``), read from the
    replica's state: verify rows that had drafts, draft tokens, accepted ones, and per position
    the rows whose accepted drafts reached it. Zero while the policy drafts nothing."""
    from prometheus_client.core import CounterMetricFamily

    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", getattr(st, "spec_drafts", 0)),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", getattr(st, "spec_draft_tokens", 0)),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            getattr(st, "spec_accepted_tokens", 0),
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model_name], value)
        yield c
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=["model_name", "position"],
    )
    for i, value in enumerate(getattr(st, "spec_accepted_per_pos", ()) or ()):
        per_pos.add_metric([model_name, str(i)], value)
    yield per_pos


class FrontMetrics:
    """/metrics: Prometheus text (``prometheus_client``), per replica, with vLLM's names where
    vLLM has one."""

    def __init__(self, model_name: str, n: int):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge

        prometheus_client.disable_created_metrics()  # (the front's process only: no *_created series)
        self.registry = reg = CollectorRegistry()
        labels = ["model_name", "replica"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests running on the replica", labels, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting on the replica", labels, registry=reg)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", labels, registry=reg)
        self.up = Gauge("schedlab:replica_up", "1 when the replica takes requests", labels, registry=reg)
        self.routed_c = Counter(
            "schedlab:requests_routed", "Routing decisions naming the replica", labels, registry=reg
        )
        self.retries = Counter("schedlab:request_retries", "Requests started again on another replica", registry=reg)
        self.failures = Counter("schedlab:request_failures", "Requests ended with an error", registry=reg)
        for i in range(n):
            self.routed_c.labels(model_name, str(i))
        # (said from /state: not relayed from the replicas)
        self._mine = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
        self._own = _Relayed()
        reg.register(self._own)

    def routed(self, i: int) -> None:
        self.routed_c.labels(self.model_name, str(i)).inc()

    def retried(self) -> None:
        self.retries.inc()

    def failed(self) -> None:
        self.failures.inc()

    def render(self, replicas: list[Replica], own: dict[int, str] | None = None) -> tuple[bytes, str]:
        """The front's metrics, and each replica's own (``own``: replica index -> its /metrics text:
        vLLM's counters and histograms, tokens, latencies, finishes) with a ``replica`` label, so
        that a dashboard made for vLLM reads the cluster (summed over ``replica``)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._own.families = _relabelled(own or {}, self._mine)
        for r in replicas:
            labels = (self.model_name, str(r.index))
            st = r.last_state if r.up else None
            self.up.labels(*labels).set(1 if r.up else 0)
            self.running.labels(*labels).set(st["running"] if st else 0)
            self.waiting.labels(*labels).set(st["waiting"] if st else 0)
            cap = st["kv_capacity"] if st else 0
            self.kv.labels(*labels).set(st.get("kv_usage", st["kv_used"] / cap if cap else 0) if st else 0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Relayed:
    """A collector of metric families set before each render (the replicas' own, relabelled)."""

    def __init__(self) -> None:
        self.families: list = []

    def collect(self):
        return iter(self.families)


def _relabelled(texts: dict[int, str], skip: set[str]) -> list:
    """The metric families in each replica's Prometheus text (``texts``: index -> text), one family
    per name with every replica's samples, each labelled ``replica``; the families named in
    ``skip`` (or unparseable text) left out."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    out: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for fam in families:
            if fam.name in skip:
                continue
            merged = out.get(fam.name)
            if merged is None:
                merged = out[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                labels = {**smp.labels, "replica": str(index)}
                merged.samples.append(Sample(smp.name, labels, smp.value, smp.timestamp, smp.exemplar))
    return list(out.values())
