"""Token ids and sampling for the engine (no mlx here: the CLI parses these up front)."""

from __future__ import annotations

import hashlib
import json
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

PENALTY_CONTEXT = 20  # tokens a penalty looks back over (prompt + output): mlx-lm's default
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's limit)
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)

# what each sampling parameter may be (OpenAI's ranges; vLLM's for its extensions): a check
# that returns the value as stored, or None when it is out of range (the message says why)
_RANGES: dict[str, tuple[str, Any]] = {
    # (below GREEDY_BELOW: greedy, as vLLM; dividing logits by less overflows float32 into garbage)
    "temperature": (
        "a number from 0 to 2",
        lambda v: (float(v) if v >= GREEDY_BELOW else 0.0) if 0 <= v <= 2 else None,
    ),
    "top_p": ("a number in (0, 1]", lambda v: float(v) if 0 < v <= 1 else None),
    "top_k": ("an integer: -1 or 0 (off), or >= 1", lambda v: max(int(v), 0) if v == int(v) and v >= -1 else None),
    "min_p": ("a number from 0 to 1", lambda v: float(v) if 0 <= v <= 1 else None),
    "presence_penalty": ("a number from -2 to 2", lambda v: float(v) if -2 <= v <= 2 else None),
    "frequency_penalty": ("a number from -2 to 2", lambda v: float(v) if -2 <= v <= 2 else None),
    "repetition_penalty": ("a number > 0", lambda v: float(v) if v > 0 else None),
}
SAMPLING_KEYS = tuple(_RANGES) + ("seed",)


def check_sampling_value(key: str, value: Any) -> tuple[Any, str | None]:
    """``(value as stored, None)``, or ``(None, why not)`` for one of ``SAMPLING_KEYS``.

    ``seed`` is any integer; the rest are finite numbers in ``_RANGES`` (``top_k``: an integer,
    -1 and 0 both meaning off, stored as 0)."""
    shown = json.dumps(value, default=str)
    if key == "seed":
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            return None, f"seed must be an integer, got {shown}"
        return int(value), None
    what, check = _RANGES[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None, f"{key} must be {what}, got {shown}"
    ok = check(value) if np.isfinite(value) else None
    if ok is None:
        return None, f"{key} must be {what}, got {shown}"
    return ok, None


@dataclass(frozen=True)
class Sampling:
    """How a request's tokens are chosen: greedy (``temperature == 0``) or sampled, as mlx-lm
    samples (``mlx_lm.sample_utils``).

    The logits first go through mlx-lm's logits processors: ``logit_bias`` (token id, bias)
    pairs, then ``repetition_penalty`` (vLLM's; 1 = off), ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's; 0 = off), over the request's last ``PENALTY_CONTEXT``
    tokens (prompt and output, as mlx-lm counts them). Greedy takes their argmax. Sampled: their
    log-softmax is filtered by ``top_p`` (1 = off), ``min_p`` (0 = off) and ``top_k`` (0 = off),
    in mlx-lm's order, then one token is drawn at ``temperature``.

    The draw is batch-invariant (Gumbel-max with its own noise): a request with its own seed
    (``request_seed``, OpenAI's ``seed``) draws its ``i``-th token from ``(request_seed, i)``, the
    same whichever requests share its passes and whatever its id; one without draws from
    ``(seed, its id, i)``, ``seed`` being the run's. ``logprobs``: None, or how many of the most
    likely alternatives to report with each token's own log-probability (0: none but its own).
    """

    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    request_seed: int | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether logits processors (penalties, bias) change the logits."""
        return bool(
            self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def filtered(self) -> bool:
        """Whether top-p, min-p or top-k filter what is sampled (never for greedy)."""
        return not self.greedy and (self.top_p < 1.0 or self.min_p > 0.0 or self.top_k > 0)

    @property
    def plain(self) -> bool:
        """Greedy on the model's own logits, no log-probabilities: a plain argmax."""
        return self.greedy and not self.processed and self.logprobs is None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = (
            {"kind": "greedy"}
            if self.greedy
            else {"kind": "temperature", "temperature": self.temperature, "seed": self.seed}
        )
        neutral = Sampling()
        for key in ("top_p", "top_k", "min_p") if not self.greedy else ():
            if getattr(self, key) != getattr(neutral, key):
                out[key] = getattr(self, key)
        for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "request_seed", "logprobs"):
            if getattr(self, key) != getattr(neutral, key):
                out[key] = getattr(self, key)
        if self.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias}
        return out


def parse_sampling(spec: Any) -> Sampling:
    """``greedy``, ``temperature=0.7,seed=1`` (and ``top_p``, ``top_k``, ``min_p``,
    ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``), a dict, or a Sampling."""
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
    if "temp" in items and "temperature" not in items:
        items["temperature"] = items.pop("temp")
    unknown = set(items) - set(SAMPLING_KEYS)
    if unknown:
        raise EngineError(f"unknown sampling key(s): {', '.join(sorted(unknown))} (use {', '.join(SAMPLING_KEYS)})")
    values: dict[str, Any] = {}
    for key, raw in items.items():
        try:
            v = int(raw) if key in ("seed", "top_k") and not isinstance(raw, float) else float(raw)
        except (TypeError, ValueError):
            what = "an integer" if key in ("seed", "top_k") else "a number"
            raise EngineError(f"sampling {key} must be {what}, got {raw!r}") from None
        values[key], why = check_sampling_value(key, v)
        if why is not None:
            if key == "temperature" and np.isfinite(v) and v > 2:
                values[key] = float(v)  # (an offline run may sample hotter than OpenAI allows)
                continue
            raise EngineError(f"sampling {why}")
    return Sampling(**values)
