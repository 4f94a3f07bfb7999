"""Moving a request's KV cache between replicas: what it costs in time.

Disaggregated serving (prefill on one replica, decode on another: DistServe, Splitwise,
Mooncake, vLLM's KV connectors) moves each request's KV from the replica that prefilled it to the
one that decodes it. Its bytes are the model's KV per token (``layers x (K + V) values per layer
x bytes per value``: ``analysis.analytic.ModelSpec.kv_bytes_per_token``) times the request's
tokens; its time is a link's latency plus bytes / bandwidth. Two ways to send it (``mode``):

- ``whole``: after the prefill ends, in one transfer: the whole time is exposed;
- ``layerwise``: each layer's KV leaves as soon as that layer is computed, while the prefill
  computes the next ones (vLLM's and Mooncake's connectors): with ``c`` seconds of prefill per
  layer and ``x`` seconds of transfer per layer over one link (layers sent one after another),
  the last layer's KV lands ``max(x, L*x - (L-1)*c)`` after the prefill ends (plus the latency):
  one layer's transfer where the link keeps up with the compute, else what the link could not
  hide.

``exposed_seconds`` is what the decode side waits after the prefill's end; the prefill replica's
compute is not slowed (the copy engines and NICs do the moving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("whole", "layerwise")


class TransferError(ValueError):
    """A link or transfer that cannot be: its message is one line for a user."""


def _positive(name: str, v, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
        raise TransferError(f"{name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise TransferError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Link:
    """One direction of an interconnect: ``bandwidth_gbs`` GB/s (10^9 bytes per second) and a
    fixed ``latency_s`` per transfer."""

    bandwidth_gbs: float
    latency_s: float = 0.0
    name: str = "link"

    def __post_init__(self) -> None:
        _positive(f"link {self.name}: bandwidth (GB/s)", self.bandwidth_gbs)
        _positive(f"link {self.name}: latency (s)", self.latency_s, allow_zero=True)

    def seconds(self, nbytes: float) -> float:
        """Latency plus ``nbytes`` at the link's bandwidth."""
        return self.latency_s + nbytes / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class KVTransfer:
    """A request's KV over ``link``: ``bytes_per_token`` for all ``layers`` together."""

    bytes_per_token: float
    layers: int
    link: Link
    mode: str = "layerwise"

    def __post_init__(self) -> None:
        _positive("KV bytes per token", self.bytes_per_token)
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise TransferError(f"layers must be a positive integer, got {self.layers!r}")
        if self.mode not in MODES:
            raise TransferError(f"transfer mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def bytes(self, tokens: int) -> float:
        """The KV bytes of ``tokens`` tokens, every layer."""
        return self.bytes_per_token * tokens

    def seconds(self, tokens: int) -> float:
        """The whole transfer on its own: latency + bytes / bandwidth."""
        return self.link.seconds(self.bytes(tokens))

    def exposed_seconds(self, tokens: int, prefill_s: float) -> float:
        """From the end of a ``prefill_s``-second prefill of ``tokens`` tokens to the KV's arrival
        (see the module's docstring for ``layerwise``)."""
        if self.mode == "whole":
            return self.seconds(tokens)
        n = self.layers
        x = self.bytes(tokens) / n / (self.link.bandwidth_gbs * 1e9)
        c = max(prefill_s, 0.0) / n
        return self.link.latency_s + max(x, n * x - (n - 1) * c)
