"""Summary statistics of a trace (for READMEs, reports and sanity checks)."""

from __future__ import annotations

import math
from typing import Sequence

from .schema import Trace


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics
    (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def trace_stats(trace: Trace) -> dict[str, float]:
    """Requests, duration (first to last arrival), mean rate ((n-1)/duration), token
    percentiles and totals."""
    from .text import require_counts

    reqs = require_counts(trace).requests
    n = len(reqs)
    duration = reqs[-1].arrival_s - reqs[0].arrival_s if n else 0.0
    prompts = [r.prompt_tokens for r in reqs]
    outputs = [r.output_tokens for r in reqs]
    return {
        "requests": n,
        "duration_s": duration,
        "mean_rate_rps": (n - 1) / duration if n > 1 and duration > 0 else 0.0,
        "prompt_p50": percentile(prompts, 50),
        "prompt_p99": percentile(prompts, 99),
        "prompt_max": max(prompts),
        "output_p50": percentile(outputs, 50),
        "output_p99": percentile(outputs, 99),
        "output_max": max(outputs),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outputs),
        "with_prefix_ids": sum(r.prefix_ids is not None for r in reqs),
        "with_text": sum(r.has_text for r in reqs),
    }
