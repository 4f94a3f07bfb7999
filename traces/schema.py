"""The trace schema: requests with arrival times and token counts.

JSON form::

    {"name": "...", "description": "...",
     "requests": [{"id": "r0", "arrival_s": 0.0, "prompt_tokens": 128,
                   "output_tokens": 64, "prefix_ids": [1, 2]}, ...]}

``id`` may be a string or an integer (kept as its string); ``prefix_ids`` is optional
(Mooncake's 512-token prefix block hashes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable


class TraceError(ValueError):
    """A trace that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Request:
    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_ids: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        if self.prefix_ids is not None:
            row["prefix_ids"] = list(self.prefix_ids)
        return row


@dataclass
class Trace:
    name: str
    description: str = ""
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        validate_requests(self.requests, where=self.name)
        # stable: equal arrival times keep file order
        self.requests = sorted(self.requests, key=lambda r: r.arrival_s)

    def __len__(self) -> int:
        return len(self.requests)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "requests": [r.to_json() for r in self.requests],
        }


def _int_field(row: dict, key: str, where: str) -> int:
    value = row.get(key)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise TraceError(f"{where}: '{key}' must be an integer, got {value!r}")
    return int(value)


def request_from_json(row: Any, index: int, where: str) -> Request:
    """One request from its JSON object; every problem is a one-line TraceError."""
    at = f"{where}: request #{index}"
    if not isinstance(row, dict):
        raise TraceError(f"{at}: expected an object, got {type(row).__name__}")
    missing = [k for k in ("id", "arrival_s", "prompt_tokens", "output_tokens") if k not in row]
    if missing:
        raise TraceError(f"{at}: missing field(s) {', '.join(missing)}")
    rid = row["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid) == "":
        raise TraceError(f"{at}: 'id' must be a non-empty string or integer, got {rid!r}")
    at = f"{where}: request {rid}"
    arrival = row["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
        raise TraceError(f"{at}: 'arrival_s' must be a finite number, got {arrival!r}")
    prefix = row.get("prefix_ids")
    if prefix is not None:
        if not isinstance(prefix, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in prefix
        ):
            raise TraceError(f"{at}: 'prefix_ids' must be a list of integers")
        prefix = tuple(prefix)
    return Request(
        id=str(rid),
        arrival_s=float(arrival),
        prompt_tokens=_int_field(row, "prompt_tokens", at),
        output_tokens=_int_field(row, "output_tokens", at),
        prefix_ids=prefix,
    )


def validate_requests(requests: Iterable[Request], where: str = "trace") -> None:
    """Reject what can never be served: empty prompts, zero outputs, negative times, dup ids."""
    seen: set[str] = set()
    for r in requests:
        at = f"{where}: request {r.id}"
        if r.id in seen:
            raise TraceError(f"{at}: duplicate id")
        seen.add(r.id)
        if r.prompt_tokens < 1:
            raise TraceError(f"{at}: empty prompt (prompt_tokens={r.prompt_tokens})")
        if r.output_tokens < 1:
            raise TraceError(f"{at}: output_tokens must be >= 1, got {r.output_tokens}")
        if not (r.arrival_s >= 0 and math.isfinite(r.arrival_s)):
            raise TraceError(f"{at}: arrival_s must be >= 0, got {r.arrival_s}")
