"""Step jitter: the spread of real step times around the cost model's prediction.

A real engine's step of a given shape does not take the same time twice: on a shared CPU the
step times are skewed to the slow side (a real run's p99 step is 1.65-2.05x its median:
bench/results/noise_blas_threads.json). A cost model fitted to the mean predicts every step at
that mean, so a deterministic simulation puts the typical step (ITL p50) above the real one,
while totals (makespan, throughput) come out right.

``StepJitter`` is that spread as a distribution of multipliers with mean 1 — the quantiles of a
calibration's measured / predicted step times, rescaled so their mean is exactly 1 — and
``SimBackend(jitter=...)`` multiplies each simulated step by a seeded draw from it: the
simulation's totals stay the model's, its percentiles take the spread. The policy still plans
with the cost model's own (deterministic) estimates, as it does on a real engine.

Stored in a profile as ``step_jitter`` (``to_dict``/``from_dict``); a profile fitted from real
runs (the default calibration's replay) carries one, a grid-only profile does not.

Not used by ``simulate`` or ``validate``: against kept real runs (``bench/jitter.py``,
bench/results/jitter_rescore.json) independent draws bring ITL p50 closer in 5 of 6 recordings
but put the TTFT tails further off in 6 of 6 — the real engine's slow steps are not independent
of what it is doing. The deterministic mean stays the default; this is kept for the comparison.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

POINTS = 101  # quantiles kept: every percent


class JitterError(ValueError):
    """A step-jitter distribution that cannot be used (too few ratios, not positive)."""


@dataclass(frozen=True)
class StepJitter:
    """Multipliers of predicted step seconds: ``quantiles`` at evenly spaced probabilities
    0..1 (non-decreasing, positive), their piecewise-linear distribution's mean exactly 1."""

    quantiles: tuple[float, ...]
    steps: int = 0  # how many measured steps it was made from

    def __post_init__(self) -> None:
        q = self.quantiles
        if len(q) < 2:
            raise JitterError("a step-jitter distribution needs at least two quantiles")
        if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in q):
            raise JitterError("step-jitter quantiles must be positive finite numbers")
        if any(b < a for a, b in zip(q, q[1:])):
            raise JitterError("step-jitter quantiles must be non-decreasing")
        if abs(self.mean() - 1.0) > 1e-6:
            raise JitterError(f"step-jitter quantiles must have mean 1, got {self.mean():.6f}")

    def mean(self) -> float:
        """The mean of the piecewise-linear distribution the quantiles describe."""
        q = self.quantiles
        return sum((a + b) / 2.0 for a, b in zip(q, q[1:])) / (len(q) - 1)

    def quantile(self, u: float) -> float:
        """The multiplier at probability ``u`` (0..1), interpolated linearly."""
        q = self.quantiles
        x = min(max(u, 0.0), 1.0) * (len(q) - 1)
        i = min(int(x), len(q) - 2)
        return q[i] + (x - i) * (q[i + 1] - q[i])

    def sampler(self, seed: int = 0):
        """A function of no arguments returning the next seeded multiplier."""
        draw, at = random.Random(seed).random, self.quantile
        return lambda: at(draw())

    @classmethod
    def from_ratios(cls, ratios: Iterable[float], points: int = POINTS, min_steps: int = 50) -> "StepJitter":
        """From measured / predicted step times (non-finite or non-positive ones dropped):
        their ``points`` quantiles, rescaled to mean 1."""
        r = sorted(float(v) for v in ratios if isinstance(v, (int, float)) and math.isfinite(v) and v > 0)
        if len(r) < min_steps:
            raise JitterError(f"a step-jitter distribution needs at least {min_steps} measured steps, got {len(r)}")
        n = len(r)
        q = []
        for j in range(points):
            x = j / (points - 1) * (n - 1)
            i = min(int(x), n - 2)
            q.append(r[i] + (x - i) * (r[i + 1] - r[i]))
        mean = sum((a + b) / 2.0 for a, b in zip(q, q[1:])) / (points - 1)
        return cls(tuple(v / mean for v in q), steps=n)

    def to_dict(self) -> dict[str, Any]:
        return {"quantiles": [round(v, 6) for v in self.quantiles], "steps": self.steps}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepJitter":
        if not isinstance(data, Mapping) or not isinstance(data.get("quantiles"), list):
            raise JitterError("step_jitter must be an object with a 'quantiles' list")
        q = data["quantiles"]
        if len(q) < 2 or any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in q):
            raise JitterError("step_jitter quantiles must be a list of at least two numbers")
        mean = sum((a + b) / 2.0 for a, b in zip(q, q[1:])) / (len(q) - 1)
        if not (math.isfinite(mean) and mean > 0):
            raise JitterError("step_jitter quantiles must be positive finite numbers")
        # stored rounded to 6 digits: rescale the small rounding error away
        return cls(tuple(float(v) / mean for v in q), steps=int(data.get("steps", 0) or 0))

    def summary(self) -> dict[str, float]:
        """p10 / p50 / p90 / p99 of the multipliers (for reports)."""
        return {f"p{int(p * 100)}": round(self.quantile(p), 3) for p in (0.1, 0.5, 0.9, 0.99)}
