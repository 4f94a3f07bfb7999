"""Trace transforms: pure functions ``Trace -> Trace`` that reshape load without new data.

Every transform returns a new Trace (the input is not changed), keeps request ids, and
returns requests sorted by arrival with the first one at 0.0. Random transforms take a
``seed``: the same seed gives the same trace. A bad argument, or a result with no
requests, is a one-line TraceError.

==================  ===============================================================
scale_rate(t, k)    arrival times / k: k x the request rate, same shape (k > 1 = more load)
to_rate(t, rps)     scale_rate to a target mean rate (requests-1 over the arrival span)
scale_lengths(t,..) prompt and/or output lengths x factor, rounded half up, never below 1
window(t, a, b)     requests arriving in [a, b) seconds, re-based so the first is at 0
head(t, n)          the first n requests by arrival
thin(t, p, seed)    keep each request with probability p (independent draws, seeded)
==================  ===============================================================
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from .schema import Request, Trace, TraceError


def _positive(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TraceError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def _derive(trace: Trace, reqs: list[Request], note: str) -> Trace:
    if not reqs:
        raise TraceError(f"{trace.name}: {note} leaves no requests")
    t0 = min(r.arrival_s for r in reqs)
    if t0 != 0.0:
        reqs = [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]
    desc = f"{trace.description}; {note}" if trace.description else note
    return Trace(name=trace.name, description=desc, requests=reqs, speculative_acceptance=trace.speculative_acceptance)


def mean_rate(trace: Trace) -> float:
    """Requests per second: (n - 1) / (last arrival - first arrival); 0.0 when undefined."""
    if len(trace.requests) < 2:
        return 0.0
    span = trace.requests[-1].arrival_s - trace.requests[0].arrival_s
    return (len(trace.requests) - 1) / span if span > 0 else 0.0


def scale_rate(trace: Trace, k: float) -> Trace:
    """Divide every arrival time by ``k``: the request rate is multiplied by ``k``.

    The arrival pattern's shape (burstiness, order, lengths) is unchanged.
    """
    k = _positive(k, "rate scale k")
    return _derive(trace, [replace(r, arrival_s=r.arrival_s / k) for r in trace.requests], f"rate x{k:g}")


def to_rate(trace: Trace, rps: float) -> Trace:
    """Rescale arrival times so the mean rate (see :func:`mean_rate`) is ``rps``."""
    rps = _positive(rps, "target rate (requests/s)")
    current = mean_rate(trace)
    if current <= 0:
        raise TraceError(f"{trace.name}: cannot set a rate: it needs at least two requests arriving at different times")
    out = scale_rate(trace, rps / current)
    out.description = (
        f"{trace.description}; rate set to {rps:g} req/s" if trace.description else f"rate set to {rps:g} req/s"
    )
    return out


def _scaled(n: int, f: float) -> int:
    return max(1, math.floor(n * f + 0.5))


def scale_lengths(trace: Trace, prompt: float = 1.0, output: float = 1.0) -> Trace:
    """Multiply prompt and/or output token counts, rounding half up, never below 1.

    When the prompt is scaled, ``prefix_ids`` (hashes of the original prompt's 512-token
    blocks) and the prompt's text no longer describe it and are dropped. A request with
    text but no count must be counted first (:func:`traces.text.tokenize`).
    """
    fp = _positive(prompt, "prompt length factor")
    fo = _positive(output, "output length factor")
    if fp != 1.0 and trace.uncounted:
        raise TraceError(
            f"{trace.name}: request {trace.uncounted[0].id} has text but no prompt_tokens: "
            f"count the trace's tokens before scaling its prompts"
        )
    reqs = [
        r
        if fp == 1.0 and fo == 1.0
        else replace(r, output_tokens=_scaled(r.output_tokens, fo))
        if fp == 1.0
        else replace(
            r,
            prompt_tokens=_scaled(r.prompt_tokens, fp),
            output_tokens=_scaled(r.output_tokens, fo),
            prefix_ids=None,
            prompt=None,
            messages=None,
        )
        for r in trace.requests
    ]
    return _derive(trace, reqs, f"lengths x{fp:g} prompt, x{fo:g} output")


def window(trace: Trace, start_s: float, end_s: float) -> Trace:
    """Requests arriving in [start_s, end_s), re-based so the first kept one is at 0.0."""
    for v, what in ((start_s, "window start"), (end_s, "window end")):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise TraceError(f"{what} must be a number of seconds, got {v!r}")
    if not end_s > start_s:
        raise TraceError(f"window end ({end_s:g} s) must be after its start ({start_s:g} s)")
    reqs = [r for r in trace.requests if start_s <= r.arrival_s < end_s]
    return _derive(trace, reqs, f"window [{start_s:g}, {end_s:g}) s")


def head(trace: Trace, n: int) -> Trace:
    """The first ``n`` requests by arrival (all of them when there are fewer)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TraceError(f"max requests must be an integer >= 1, got {n!r}")
    return _derive(trace, list(trace.requests[:n]), f"first {n} requests")


def thin(trace: Trace, p: float, seed: int = 0) -> Trace:
    """Keep each request independently with probability ``p`` in (0, 1] (seeded)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
        raise TraceError(f"keep probability p must be in (0, 1], got {p!r}")
    rng = random.Random(seed)
    reqs = [r for r in trace.requests if rng.random() < p]
    return _derive(trace, reqs, f"thinned to p={p:g} (seed {seed})")


__all__ = ["mean_rate", "scale_rate", "to_rate", "scale_lengths", "window", "head", "thin"]
