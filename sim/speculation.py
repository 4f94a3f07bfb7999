"""Speculative decoding in the simulator: how many drafts a verify row accepts.

A pass's decode rows may verify draft tokens (``Pass.draft``: k per row; the policy chooses k,
``policies.speculative``). On the real engine the target model decides which drafts it
accepts; in a simulation an **acceptance profile** does: ``accept[i]`` is the probability that
draft i + 1 is accepted given that the first i were (per position, not one geometric rate: the
first drafts of an n-gram match are accepted more often than the later ones, and a geometric
mean under-predicts the accepted length). A row that verifies k drafts accepts the leading run
of positions whose draw falls under their probability, at most k; positions past the profile's
length are never accepted.

Draws are per request, from its own generator seeded by (``seed``, request id), and every
verify row draws as many numbers as the profile is long whatever its k: the same request meets
the same luck under every policy and every k, so two runs differ by their schedules, not by
their dice.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from schedlab.policies.speculative import expected_tokens


class SpeculationError(ValueError):
    """A bad acceptance profile: one line."""


@dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance probabilities (``accept[i]``: of draft i + 1, given the first i
    were accepted), and the seed of the per-request draws."""

    accept: tuple[float, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        acc = tuple(self.accept) if isinstance(self.accept, (list, tuple)) else None
        if not acc:
            raise SpeculationError(f"an acceptance profile is one probability per draft position, got {self.accept!r}")
        for p in acc:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and 0 <= p <= 1):
                raise SpeculationError(f"an acceptance probability is a number in [0, 1], got {p!r}")
        object.__setattr__(self, "accept", tuple(float(p) for p in acc))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpeculationError(f"the acceptance draws' seed is an integer, got {self.seed!r}")

    def accepted(self, rid: str, k: int, rngs: dict) -> int:
        """How many of request ``rid``'s ``k`` drafts this verify accepts: its next draws from
        its generator in ``rngs`` (one run's: a run starts with an empty dict)."""
        rng = rngs.get(rid)
        if rng is None:
            rng = rngs[rid] = random.Random(zlib.crc32(f"{self.seed}/{rid}".encode()))
        draws = [rng.random() for _ in self.accept]
        a = 0
        for u, p in zip(draws, self.accept[:k]):
            if u >= p:
                break
            a += 1
        return a

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify row of ``k`` drafts yields on average: 1 + the expected accepted
        (``policies.speculative.expected_tokens``, what the adaptive k weighs)."""
        return expected_tokens(self.accept, k)

    def describe(self) -> dict[str, Any]:
        return {"accept": list(self.accept), "seed": self.seed}

    @classmethod
    def parse(cls, value: str | Sequence[float], seed: int = 0) -> "Acceptance":
        """``"0.8/0.6/0.4"`` (or a sequence of numbers) as a profile."""
        if isinstance(value, str):
            try:
                value = [float(x) for x in value.replace(",", "/").split("/") if x.strip()]
            except ValueError:
                raise SpeculationError(
                    f"an acceptance profile is probabilities per position such as 0.8/0.6/0.4, got {value!r}"
                ) from None
        return cls(tuple(value), seed)
