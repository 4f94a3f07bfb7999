"""least-tokens: the replica with the fewest outstanding tokens, prompt tokens still to compute
plus output tokens still to produce (SplitwiseSim's join-shortest-queue by tokens); a long
prompt weighs what it costs, not one request."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, RouterBase, least_tokens


@dataclass
class LeastTokens(RouterBase):
    name = "least-tokens"

    def route(self, view: ClusterView) -> int:
        up = view.up()
        return least_tokens(up) if up else 0
