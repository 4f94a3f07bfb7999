"""random: a replica drawn uniformly among those up, from a generator seeded with ``seed``
(Vidur's, LLMServingSim's and SplitwiseSim's random router): the same seed, the same choices."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, SeededRouter


@dataclass
class Random(SeededRouter):
    name = "random"

    def route(self, view: ClusterView) -> int:
        up = view.up()
        if not up:
            return 0
        return up[self._rng.randrange(len(up))].index
