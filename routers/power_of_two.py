"""power-of-two: two distinct replicas drawn at random among those up (a generator seeded with
``seed``), the one with fewer unfinished requests taken (the first drawn on a tie): most of
least-requests' balance for two looks instead of N."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .base import ClusterView, RouterBase


@dataclass
class PowerOfTwo(RouterBase):
    name = "power-of-two"
    seed: int = 0
    _rng: random.Random = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def route(self, view: ClusterView) -> int:
        up = view.up()
        if len(up) < 2:
            return up[0].index if up else 0
        a, b = self._rng.sample(up, 2)
        return b.index if b.requests < a.requests else a.index
