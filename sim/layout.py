"""What a request's cache holds besides the KV that grows with its context.

A replica's KV capacity and a request's KV are counted in tokens of the layers whose KV grows
with the context: full-attention layers. A model with other layers holds more per request:

- a sliding-window layer keeps the keys and values of at most its window's last tokens (Gemma 3's
  local layers, GPT-OSS's banded ones);
- a linear-attention (recurrent) or convolution layer keeps a state of fixed size, whatever the
  request's length (Qwen3.5/3.6 and Qwen3-Next's Gated DeltaNet layers, LFM2's convolutions).

``CacheLayout`` turns that into whole KV blocks a request holds from its admission to its end
(finish, preemption, cancellation): its recurrent state, and each sliding layer's window filled
to ``min(window, prompt + output - 1)`` tokens (reserved whole at admission rather than grown
token by token: what the window reaches at the request's end, so that a request admitted never
runs out of it). The bytes are converted into tokens of the full-attention layers (rounded up),
so admission, preemption and capacity count one memory. A model without full-attention layers
counts its capacity in tokens of its sliding layers, or, with neither, in request states (its
requests' KV tokens, counted as well, then over-count its memory: a bound, not the figure).

A layout is a measured profile's ``cache_layout`` (``calibrate`` records what the model's own
caches hold), what the analytic model reads from a config.json, or the engine's own model
(a real run counts the memory of the model it runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


class LayoutError(ValueError):
    """A cache layout that cannot be used. One line."""


def _number(d: Mapping[str, Any], key: str) -> float:
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise LayoutError(f"cache_layout.{key} must be a non-negative number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class CacheLayout:
    """One request's cache: ``kv_bytes_per_token`` of the full-attention layers (all of them
    together: the unit a capacity in tokens counts), ``sliding`` ``((window, bytes per token),
    ...)`` of the sliding-window layers grouped by window, ``state_bytes`` of the fixed-size
    recurrent and convolution states."""

    kv_bytes_per_token: float
    sliding: tuple[tuple[int, float], ...] = ()
    state_bytes: float = 0.0

    @property
    def unit_bytes(self) -> float:
        """Bytes of one token of capacity."""
        return self.kv_bytes_per_token or sum(b for _, b in self.sliding) or self.state_bytes or 1.0

    def fixed_tokens(self, footprint: int) -> int:
        """Tokens of capacity a request whose KV reaches ``footprint`` tokens holds besides that
        KV: its sliding windows (each filled to at most its window) and its recurrent state."""
        held = self.state_bytes + sum(min(footprint, w) * b for w, b in self.sliding)
        return math.ceil(held / self.unit_bytes - 1e-9) if held > 0 else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "sliding": [[w, b] for w, b in self.sliding],
            "state_bytes": self.state_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "CacheLayout | None":
        """A profile's ``cache_layout`` (``engine.models.cache_layout``'s keys: ``kv_bytes_per_token``,
        ``sliding`` ``[[window, layers], ...]`` with ``sliding_kv_bytes_per_token`` of all of them,
        ``state_bytes``), or ``as_dict``'s (``sliding`` ``[[window, bytes per token], ...]``).
        None for none, or for a layout of full attention only (nothing to add)."""
        if d is None:
            return None
        if isinstance(d, CacheLayout):
            return d if d.sliding or d.state_bytes else None
        if not isinstance(d, Mapping):
            raise LayoutError(f"cache_layout must be an object, got {type(d).__name__}")
        kv = _number(d, "kv_bytes_per_token")
        state = _number(d, "state_bytes")
        groups = d.get("sliding") or []
        if not isinstance(groups, list) or not all(
            isinstance(g, (list, tuple))
            and len(g) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in g)
            and int(g[0]) == g[0]
            and g[0] >= 1
            for g in groups
        ):
            raise LayoutError(f"cache_layout.sliding must be [[window, n], ...] with windows >= 1, got {groups!r:.80}")
        if "sliding_kv_bytes_per_token" in d:  # [[window, layers]] and the bytes of all the layers
            total = _number(d, "sliding_kv_bytes_per_token")
            layers = sum(n for _, n in groups)
            sliding = tuple((int(w), total * n / layers) for w, n in groups if n) if layers else ()
        else:
            sliding = tuple((int(w), float(b)) for w, b in groups if b)
        if not sliding and not state:
            return None
        return cls(kv, tuple(sorted(sliding)), state)
