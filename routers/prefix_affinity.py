"""prefix-affinity: the replica that holds the longest cached prefix of the arriving request,
unless it has more than ``max_requests`` unfinished requests; else (no replica holds any of it,
or the one that does is loaded beyond the bound) the least loaded one by unfinished requests.
Among replicas with the same cached prefix, the least loaded one, then the lowest index.

What it reads is the replicas' prefix caches (``--prefix-caching``; without it every hit is 0
and this is least-requests). ``min_hit``: tokens a hit must have to count (a shared system
prompt of a few tokens is not worth a queue)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClusterView, RouterBase, RouterOptionError, least_requests


@dataclass
class PrefixAffinity(RouterBase):
    name = "prefix-affinity"
    max_requests: int = 32
    min_hit: int = 1

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise RouterOptionError(f"router '{self.name}': option max_requests must be >= 1, got {self.max_requests}")
        if self.min_hit < 1:
            raise RouterOptionError(f"router '{self.name}': option min_hit must be >= 1, got {self.min_hit}")

    def route(self, view: ClusterView) -> int:
        up = view.up()
        if not up:
            return 0
        best = max(r.prefix_hit for r in up)
        if best >= self.min_hit:
            holders = [r for r in up if r.prefix_hit == best and r.requests <= self.max_requests]
            if holders:
                return least_requests(holders)
        return least_requests(up)
