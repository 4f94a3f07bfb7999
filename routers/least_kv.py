"""least-kv: the replica whose KV cache is least used, as a fraction of its capacity
(SplitwiseSim's join-shortest-queue by KV, llm-d's KV-utilisation scorer alone); then the fewest
unfinished requests, then the lowest index."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, RouterBase, least


@dataclass
class LeastKV(RouterBase):
    name = "least-kv"

    def route(self, view: ClusterView) -> int:
        up = view.up()
        return least(up, lambda r: (r.kv_utilisation, r.requests)) if up else 0
