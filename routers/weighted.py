"""weighted: llm-d's scheduler in small: every replica up is scored by three scorers, each in
[0, 1], and the highest weighted sum wins (the lowest index on a tie):

- queue: ``1 - (waiting - least) / (most - least)`` over the replicas up (1 for all when their
  queues are equal): llm-d's queue scorer on ``num_requests_waiting``;
- kv: ``1 - KV utilisation`` (capped to [0, 1]): its KV-cache-utilisation scorer;
- prefix: the fraction of the prompt already in the replica's prefix cache: its prefix-cache
  scorer (0 without ``--prefix-caching``).

``queue_weight``, ``kv_weight``, ``prefix_weight`` weigh them (>= 0; defaults 1, 1, 1)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, RouterBase, RouterOptionError, require_non_negative


@dataclass
class Weighted(RouterBase):
    name = "weighted"
    queue_weight: float = 1.0
    kv_weight: float = 1.0
    prefix_weight: float = 1.0

    def __post_init__(self) -> None:
        require_non_negative(
            self.name, queue_weight=self.queue_weight, kv_weight=self.kv_weight, prefix_weight=self.prefix_weight
        )
        if self.queue_weight + self.kv_weight + self.prefix_weight <= 0:
            raise RouterOptionError(f"router '{self.name}': at least one weight must be > 0")

    def scores(self, view: ClusterView) -> dict[int, float]:
        """Each replica up: its weighted score (what ``route`` maximises)."""
        up = view.up()
        if not up:
            return {}
        lo = min(r.waiting for r in up)
        hi = max(r.waiting for r in up)
        prompt = view.request.prompt_tokens or 0
        out = {}
        for r in up:
            queue = 1.0 if hi == lo else 1.0 - (r.waiting - lo) / (hi - lo)
            kv = min(max(1.0 - r.kv_utilisation, 0.0), 1.0)
            prefix = min(r.prefix_hit / prompt, 1.0) if prompt > 0 else 0.0
            out[r.index] = self.queue_weight * queue + self.kv_weight * kv + self.prefix_weight * prefix
        return out

    def route(self, view: ClusterView) -> int:
        scores = self.scores(view)
        if not scores:
            return 0
        return min(scores, key=lambda i: (-scores[i], i))
