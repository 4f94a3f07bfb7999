"""Token ids and sampling for the engine (no mlx here: the CLI parses these up front)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import EngineError

BLOCK = 512  # Mooncake hash block size in tokens


def h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def prompt_ids(seed: int, rid: str, n: int, vocab: int, prefix_ids: Sequence[int] | None = None) -> list[int]:
    """Deterministic prompt token ids for request ``rid``, in ``[0, vocab)``.

    Requests that share a Mooncake hash block (``prefix_ids[i]``, 512 tokens) get identical
    ids for it; positions past the hashed blocks depend on ``(seed, rid)``.
    """
    mask = (1 << 64) - 1
    ids: list[int] = []
    for h in prefix_ids or ():
        if len(ids) >= n:
            break
        rng = np.random.default_rng([seed & mask, 1, int(h) & mask])
        ids.extend(rng.integers(0, vocab, BLOCK).tolist())
    if len(ids) < n:
        rng = np.random.default_rng([seed & mask, 2, h64(str(rid))])
        ids.extend(rng.integers(0, vocab, n - len(ids)).tolist())
    return ids[:n]


# ------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sampling:
    """Greedy (``temperature == 0``) or temperature sampling with a seed.

    Sampling is batch-invariant: the noise for request ``rid``'s ``i``-th token depends only
    on ``(seed, rid, i)`` (Gumbel-max), so the same request draws the same token whichever
    rows share its pass.
    """

    temperature: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> dict[str, Any]:
        return (
            {"kind": "greedy"}
            if self.greedy
            else {"kind": "temperature", "temperature": self.temperature, "seed": self.seed}
        )


def parse_sampling(spec: Any) -> Sampling:
    """``greedy``, ``temperature=0.7,seed=1``, a dict, or a Sampling."""
    if spec is None or isinstance(spec, Sampling):
        return spec or Sampling()
    if isinstance(spec, dict):
        items = dict(spec)
    else:
        text = str(spec).strip()
        if text in ("", "greedy"):
            return Sampling()
        items = {}
        for part in text.split(","):
            if "=" not in part:
                raise EngineError(f"sampling '{text}' is not 'greedy' or key=value pairs (temperature=0.7,seed=1)")
            k, v = part.split("=", 1)
            items[k.strip()] = v.strip()
    unknown = set(items) - {"temperature", "temp", "seed"}
    if unknown:
        raise EngineError(f"unknown sampling key(s): {', '.join(sorted(unknown))} (use temperature=..,seed=..)")
    try:
        temp = float(items.get("temperature", items.get("temp", 0.0)))
        seed = int(items.get("seed", 0))
    except (TypeError, ValueError):
        raise EngineError(f"sampling values must be numbers: {items}") from None
    if not np.isfinite(temp) or temp < 0:
        raise EngineError(f"sampling temperature must be >= 0, got {temp}")
    return Sampling(temperature=temp, seed=seed)
