"""power-of-two: two distinct replicas drawn at random among those up (a generator seeded with
``seed``), the one with fewer unfinished requests taken (the first drawn on a tie): most of
least-requests' balance for two looks instead of N."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, SeededRouter


@dataclass
class PowerOfTwo(SeededRouter):
    name = "power-of-two"

    def route(self, view: ClusterView) -> int:
        up = view.up()
        if len(up) < 2:
            return up[0].index if up else 0
        a, b = self._rng.sample(up, 2)
        return b.index if b.requests < a.requests else a.index
