"""least-requests: the replica with the fewest unfinished requests, waiting + running (Vidur's
least-outstanding-requests, SplitwiseSim's join-shortest-queue); the lowest index on a tie."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, RouterBase, least_requests


@dataclass
class LeastRequests(RouterBase):
    name = "least-requests"

    def route(self, view: ClusterView) -> int:
        up = view.up()
        return least_requests(up) if up else 0
