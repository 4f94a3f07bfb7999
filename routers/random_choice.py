"""random: a replica drawn uniformly among those up, from a generator seeded with ``seed``
(Vidur's, LLMServingSim's and SplitwiseSim's random router): the same seed, the same choices."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .base import ClusterView, RouterBase


@dataclass
class Random(RouterBase):
    name = "random"
    seed: int = 0
    _rng: random.Random = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def route(self, view: ClusterView) -> int:
        up = view.up()
        if not up:
            return 0
        return up[self._rng.randrange(len(up))].index
