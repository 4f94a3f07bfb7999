"""round-robin: each arrival to the next replica in turn (Vidur, BLIS, LLMServingSim and
SplitwiseSim have it); a replica that is down is skipped."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import ClusterView, RouterBase


@dataclass
class RoundRobin(RouterBase):
    name = "round-robin"
    _next: int = field(default=0, init=False, repr=False)

    def route(self, view: ClusterView) -> int:
        n = len(view.replicas)
        for k in range(n):
            j = (self._next + k) % n
            if view.replicas[j].up:
                self._next = j + 1
                return j
        return self._next % n  # none is up: the cluster reports it
