"""Seeded generators for the bundled synthetic traces.

Every generator is deterministic: the same arguments give the same trace, byte for byte
once written with :func:`traces.loaders.dumps_json`. Randomness comes only from
``random.Random(seed).random()``, the one stream Python promises to reproduce across
versions (integers, choices and exponential gaps are derived from it here, not with
``randint``/``sample``), and arrival times are rounded to the microsecond.

Ids: ``c###`` chat-sized requests, ``L###`` long-context requests, ``s###`` sonnet-shaped
ones; the number is the request's position in arrival order.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Sequence

from .schema import Request, Trace, TraceError


class _Rng:
    """The few draws the generators need, all built on ``random.Random.random``."""

    def __init__(self, seed: int):
        self._r = random.Random(seed)

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self._r.random()

    def integer(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi] (both ends included)."""
        return min(hi, lo + math.floor(self._r.random() * (hi - lo + 1)))

    def exponential(self, rate: float) -> float:
        return -math.log(1.0 - self._r.random()) / rate

    def gamma(self, shape: float, scale: float) -> float:
        """Gamma(shape, scale); shape 1 is the exponential above, drawn the same way.
        (``random.gammavariate`` is built on ``random()`` too; its algorithm has been the
        same in CPython for decades, but unlike ``random()`` it is not promised.)"""
        if shape == 1.0:
            return self.exponential(1.0 / scale)
        return self._r.gammavariate(shape, scale)

    def pick(self, items: Sequence):
        return items[self.integer(0, len(items) - 1)]

    def sample_indices(self, population: Sequence[int], k: int) -> list[int]:
        """k distinct members of ``population`` (partial Fisher-Yates), sorted."""
        pool = list(population)
        for i in range(k):
            j = self.integer(i, len(pool) - 1)
            pool[i], pool[j] = pool[j], pool[i]
        return sorted(pool[:k])


def _check_rate(rate: float, what: str = "rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise TraceError(f"{what} must be a finite number of requests/s > 0, got {rate!r}")
    return float(rate)


def _t(x: float) -> float:
    return round(x, 6)


def poisson_arrivals(n: int, rate: float, rng: _Rng, exact_rate: bool = True) -> list[float]:
    """n arrival times of a Poisson process of ``rate`` req/s, the first at 0.0.

    With ``exact_rate`` the exponential gaps are scaled so the last arrival is at exactly
    (n - 1) / rate: the realised mean rate is ``rate`` (a 100-request sample would otherwise
    miss it by ~10 %, which matters when a trace is meant to load a server to a given level).
    Given the time of the last arrival, the earlier ones of a Poisson process are uniform
    order statistics, so the scaled times are still a Poisson sample (conditioned on its span).
    """
    rate = _check_rate(rate)
    gaps = [rng.exponential(rate) for _ in range(n - 1)]
    if exact_rate and gaps:
        scale = (n - 1) / rate / sum(gaps)
        gaps = [g * scale for g in gaps]
    times, t = [0.0], 0.0
    for g in gaps:
        t += g
        times.append(_t(t))
    return times[:n]


def length_pairs(source: Trace, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """(prompt, output) pairs of ``source``'s requests that fit both limits, in trace order."""
    pairs = [
        (r.prompt_tokens, r.output_tokens)
        for r in source.requests
        if r.prompt_tokens <= max_prompt and r.output_tokens <= max_output
    ]
    if not pairs:
        raise TraceError(f"{source.name}: no request fits prompt <= {max_prompt}, output <= {max_output}")
    return pairs


def mixed(
    source: Trace,
    rate: float,
    seed: int = 0,
    n: int = 300,
    long_fraction: float = 0.1,
    max_prompt: int = 1024,
    max_output: int = 256,
    long_prompt: tuple[int, int] = (3000, 8000),
    long_output: tuple[int, int] = (32, 256),
    long_after: int = 10,
) -> Trace:
    """Chat traffic with some long-context prompts, Poisson arrivals at ``rate`` req/s.

    Chat requests take (prompt, output) pairs drawn uniformly, with replacement, from the
    pairs of ``source`` (the Azure 2023 conversation hour) that fit ``max_prompt`` and
    ``max_output`` (pairs are drawn among those that fit, not clipped, so no spike forms at
    the limits). ``round(n * long_fraction)`` arrival slots, drawn among slots
    ``long_after``.. (so other requests are already decoding), hold long prompts with
    uniform lengths in ``long_prompt`` and outputs in ``long_output``.
    """
    rate = _check_rate(rate, "mixed rate")
    rng = _Rng(seed)
    pairs = length_pairs(source, max_prompt, max_output)
    times = poisson_arrivals(n, rate, rng)
    n_long = round(n * long_fraction)
    longs = set(rng.sample_indices(range(long_after, n), n_long))
    reqs = []
    for i, t in enumerate(times):
        if i in longs:
            reqs.append(Request(f"L{i:03d}", t, rng.integer(*long_prompt), rng.integer(*long_output)))
        else:
            p, o = rng.pick(pairs)
            reqs.append(Request(f"c{i:03d}", t, p, o))
    desc = (
        f"{n} requests, Poisson arrivals at {rate:g} req/s (seed {seed}): {n - n_long} chat "
        f"requests with (prompt, output) pairs drawn from the Azure 2023 conversation hour "
        f"among those with prompt <= {max_prompt} and output <= {max_output}, and {n_long} "
        f"long-context requests (prompt {long_prompt[0]}-{long_prompt[1]}, output "
        f"{long_output[0]}-{long_output[1]}, ids L###) arriving among the others"
    )
    return Trace(name="mixed", description=desc, requests=reqs)


def long_context(seed: int = 0, n_long: int = 4, n_short: int = 8) -> Trace:
    """A few concurrent long prompts (8k-16k tokens, outputs 128-512) arriving within the
    first second, and short chat requests (prompt 64-512, output 32-128) arriving over the
    first 10 s, while the long ones are being prefilled and decoded."""
    rng = _Rng(seed)
    arrivals = [("L", 0.0)] + [("L", _t(rng.uniform(0.05, 1.0))) for _ in range(n_long - 1)]
    arrivals += [("c", _t(rng.uniform(0.1, 10.0))) for _ in range(n_short)]
    arrivals.sort(key=lambda a: a[1])
    reqs = []
    for i, (kind, t) in enumerate(arrivals):
        if kind == "L":
            reqs.append(Request(f"L{i:03d}", t, rng.integer(8000, 16000), rng.integer(128, 512)))
        else:
            reqs.append(Request(f"c{i:03d}", t, rng.integer(64, 512), rng.integer(32, 128)))
    desc = (
        f"{n_long} long prompts (8k-16k tokens, outputs 128-512) arriving within 1 s, and "
        f"{n_short} short chat requests (prompts 64-512, outputs 32-128) arriving over "
        f"0.1-10 s while the long ones run (seed {seed})"
    )
    return Trace(name="long-context", description=desc, requests=reqs)


def sonnet(rate: float, seed: int = 0, n: int = 100, prompt: int = 1024, output: int = 128) -> Trace:
    """vLLM's sonnet benchmark shape: fixed 1024-token prompts and 128-token outputs,
    Poisson arrivals at ``rate`` req/s."""
    rate = _check_rate(rate, "sonnet rate")
    rng = _Rng(seed)
    reqs = [Request(f"s{i:03d}", t, prompt, output) for i, t in enumerate(poisson_arrivals(n, rate, rng))]
    desc = (
        f"{n} requests of {prompt} prompt / {output} output tokens (vLLM's sonnet benchmark "
        f"shape), Poisson arrivals at {rate:g} req/s (seed {seed})"
    )
    return Trace(name="sonnet", description=desc, requests=reqs)


def real_smoke(seed: int = 0, n: int = 10, span_s: float = 3.0) -> Trace:
    """A small trace for real MLX runs with a tiny model: prompts 16-256, outputs 8-48;
    two requests at 0 s, the rest arriving uniformly over ``span_s`` (mid-stream)."""
    rng = _Rng(seed)
    times = sorted([0.0, 0.0] + [_t(rng.uniform(0.2, span_s)) for _ in range(n - 2)])
    reqs = [Request(f"c{i:03d}", t, rng.integer(16, 256), rng.integer(8, 48)) for i, t in enumerate(times)]
    desc = (
        f"{n} small requests for real runs (prompts 16-256, outputs 8-48): two at 0 s, the "
        f"rest arriving over 0.2-{span_s:g} s while others decode (seed {seed})"
    )
    return Trace(name="real-smoke", description=desc, requests=reqs)


def real_mixed(seed: int = 0, n: int = 28, n_long: int = 5, rate: float = 1.5) -> Trace:
    """Real-run mix: short prompts (32-256 tokens, outputs 16-64) and ``n_long`` long prompts
    (1000-2000 tokens, outputs 16-48) in slots 1.. of a Poisson stream at ``rate`` req/s,
    so long prefills overlap short decodes."""
    rate = _check_rate(rate, "real-mixed rate")
    rng = _Rng(seed)
    times = poisson_arrivals(n, rate, rng)
    longs = set(rng.sample_indices(range(1, n), n_long))
    reqs = []
    for i, t in enumerate(times):
        if i in longs:
            reqs.append(Request(f"L{i:03d}", t, rng.integer(1000, 2000), rng.integer(16, 48)))
        else:
            reqs.append(Request(f"c{i:03d}", t, rng.integer(32, 256), rng.integer(16, 64)))
    desc = (
        f"{n} requests for real runs, Poisson arrivals at {rate:g} req/s (seed {seed}): "
        f"{n - n_long} short (prompts 32-256, outputs 16-64) and {n_long} long (prompts "
        f"1000-2000, outputs 16-48, ids L###) overlapping them"
    )
    return Trace(name="real-mixed", description=desc, requests=reqs)


def azure_slice(conv: Trace, n: int, start_s: float, prompt: float, output: float, rate: float, name: str) -> Trace:
    """``n`` consecutive requests of a real trace (the Azure 2023 conversation hour) from
    ``start_s``: their order, burstiness and prompt/output mix as served, lengths scaled by
    ``prompt`` and ``output`` (rounded half up, never below 1) and arrival times rescaled to
    a mean ``rate`` req/s, so that a small model on a laptop-class CPU serves them in under
    a minute. Ids are the source's."""
    from .transforms import head, scale_lengths, to_rate, window

    tr = to_rate(scale_lengths(head(window(conv, start_s, math.inf), n), prompt, output), rate)
    desc = (
        f"{n} consecutive requests of the Azure 2023 conversation hour from {start_s:g} s, "
        f"prompts x{prompt:g}, outputs x{output:g}, arrivals rescaled to {rate:g} req/s"
    )
    return Trace(
        name=name, description=desc, requests=[replace(r, arrival_s=round(r.arrival_s, 6)) for r in tr.requests]
    )


__all__ = [
    "poisson_arrivals",
    "length_pairs",
    "mixed",
    "long_context",
    "sonnet",
    "real_smoke",
    "real_mixed",
    "azure_slice",
]
