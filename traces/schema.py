"""The trace schema: requests with arrival times, token counts and, optionally, text.

JSON form::

    {"name": "...", "description": "...",
     "requests": [{"id": "r0", "arrival_s": 0.0, "prompt_tokens": 128,
                   "output_tokens": 64, "prefix_ids": [1, 2]},
                  {"id": "r1", "arrival_s": 0.5, "prompt": "Once upon a time",
                   "output_tokens": 32},
                  {"id": "r2", "arrival_s": 0.7, "output_tokens": 64, "prompt_tokens": 41,
                   "messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Why is the sky blue?"}]}, ...]}

``id`` may be a string or an integer (kept as its string); ``prefix_ids`` is optional
(Mooncake's 512-token prefix block hashes). ``output_tokens`` is the request's max_tokens.
``cancel_after_s`` (optional): its client went away that many seconds after it arrived; the
replica ends it at its next step (``serve`` records it for every request a client abandoned).

A request's prompt is a token count (``prompt_tokens``), text (``prompt``: one string, or
``messages``: a chat, a list of ``{"role", "content"}`` objects), or both. A request with
text and no ``prompt_tokens`` is *uncounted*: the simulator needs the count, so such a trace
must be tokenized (:func:`traces.text.tokenize`, or ``traces.load(..., tokenizer=...)``)
before it is run. ``prompt`` and ``messages`` exclude each other.

``speculative_acceptance`` (optional, top level): the acceptance of speculative decoding's
drafts measured on this workload, which ``simulate --speculative ngram:k=4`` draws from when it
is given no ``accept=``::

    "speculative_acceptance": {"accept": [0.82, 0.71, 0.64, 0.55],
                               "method": "ngram", "k": 4, "model": "smollm2-135m", ...}

``accept`` (required): per draft position, the probability that it is accepted given the ones
before it were (``sim.speculation``); ``propose`` (optional, default 1): the share of the rows given
room to draft whose drafter proposed anything (an n-gram lookup finds no match in the others);
every other key says what it was measured on and is kept as it is. ``calibrate --speculative ngram:k=4 --trace T`` writes such an entry (its
``acceptance``), which can be copied here as it is.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

#: Chat roles a message may have (OpenAI's chat roles; chat templates know these).
ROLES = ("system", "developer", "user", "assistant", "tool")


class TraceError(ValueError):
    """A trace that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Request:
    """One request. ``prompt_tokens`` is None only for a request that carries text
    (``prompt`` or ``messages``) not yet counted with a tokenizer. ``messages`` is a tuple
    of ``(role, content)`` pairs (hashable, like the rest); :meth:`chat` gives the list of
    ``{"role", "content"}`` dicts that chat templates take."""

    id: str
    arrival_s: float
    prompt_tokens: int | None
    output_tokens: int
    prefix_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    cancel_after_s: float | None = None

    @property
    def has_text(self) -> bool:
        return self.prompt is not None or self.messages is not None

    def chat(self) -> list[dict[str, str]] | None:
        """The messages as ``[{"role": ..., "content": ...}, ...]``, or None."""
        if self.messages is None:
            return None
        return [{"role": role, "content": content} for role, content in self.messages]

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"id": self.id, "arrival_s": self.arrival_s}
        if self.prompt_tokens is not None:
            row["prompt_tokens"] = self.prompt_tokens
        row["output_tokens"] = self.output_tokens
        if self.prefix_ids is not None:
            row["prefix_ids"] = list(self.prefix_ids)
        if self.prompt is not None:
            row["prompt"] = self.prompt
        if self.messages is not None:
            row["messages"] = self.chat()
        if self.cancel_after_s is not None:
            row["cancel_after_s"] = self.cancel_after_s
        return row


@dataclass
class Trace:
    name: str
    description: str = ""
    requests: list[Request] = field(default_factory=list)
    speculative_acceptance: dict[str, Any] | None = None  # (see the module's docstring)

    def __post_init__(self) -> None:
        validate_requests(self.requests, where=self.name)
        self.requests = [_plain_numbers(r) for r in self.requests]
        if self.speculative_acceptance is not None:
            self.speculative_acceptance = acceptance_from_json(self.speculative_acceptance, self.name)
        # stable: equal arrival times keep file order
        self.requests = sorted(self.requests, key=lambda r: r.arrival_s)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def uncounted(self) -> list[Request]:
        """Requests with text but no ``prompt_tokens`` (they need a tokenizer)."""
        return [r for r in self.requests if r.prompt_tokens is None]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.speculative_acceptance is not None:
            out["speculative_acceptance"] = dict(self.speculative_acceptance)
        out["requests"] = [r.to_json() for r in self.requests]
        return out


def acceptance_from_json(value: Any, where: str) -> dict[str, Any]:
    """A trace's ``speculative_acceptance``: an object whose ``accept`` is a non-empty list of
    probabilities in [0, 1] (one per draft position); a one-line TraceError for anything else."""
    at = f"{where}: 'speculative_acceptance'"
    if not isinstance(value, dict):
        raise TraceError(
            f"{at} must be an object with 'accept' (a probability per draft position), got {_short(value)}"
        )
    accept = value.get("accept")
    if not isinstance(accept, list) or not accept:
        raise TraceError(
            f"{at}: 'accept' must be a non-empty list of probabilities per draft position, got {_short(accept)}"
        )
    for p in accept:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and 0 <= p <= 1):
            raise TraceError(f"{at}: 'accept' holds probabilities in [0, 1], got {_short(p)}")
    q = value.get("propose", 1.0)
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not (math.isfinite(q) and 0 < q <= 1):
        raise TraceError(f"{at}: 'propose' (the share of rows whose drafter proposes) is in (0, 1], got {_short(q)}")
    return dict(value, accept=[float(p) for p in accept])


def _int_field(row: dict, key: str, where: str) -> int:
    value = row.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))
    ):
        raise TraceError(f"{where}: '{key}' must be an integer, got {value!r}")
    return int(value)


def messages_from_json(value: Any, at: str) -> tuple[tuple[str, str], ...]:
    """``[{"role": ..., "content": ...}, ...]`` -> ``((role, content), ...)``; a one-line
    TraceError for anything else (not a non-empty list, an item not an object, a missing,
    extra or non-string field, an unknown role)."""
    if not isinstance(value, list) or not value:
        raise TraceError(
            f'{at}: \'messages\' must be a non-empty list of {{"role", "content"}} objects, got {_short(value)}'
        )
    out = []
    for i, m in enumerate(value):
        where = f"{at}: messages[{i}]"
        if not isinstance(m, dict):
            raise TraceError(f'{where}: expected a {{"role", "content"}} object, got {_short(m)}')
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise TraceError(
                f'{where}: unsupported field(s) {", ".join(map(repr, extra))} (a message is {{"role", "content"}})'
            )
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise TraceError(f"{where}: 'role' must be one of {', '.join(ROLES)}, got {_short(role)}")
        if not isinstance(content, str):
            raise TraceError(f"{where}: 'content' must be a string, got {_short(content)}")
        out.append((role, content))
    if not any(content for _, content in out):
        raise TraceError(f"{at}: empty prompt (every message's content is empty)")
    return tuple(out)


def _short(value: Any) -> str:
    """A value for an error message: its repr, cut to 40 characters, on one line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


def request_from_json(row: Any, index: int, where: str) -> Request:
    """One request from its JSON object; every problem is a one-line TraceError."""
    at = f"{where}: request #{index}"
    if not isinstance(row, dict):
        raise TraceError(f"{at}: expected an object, got {type(row).__name__}")
    missing = [k for k in ("id", "arrival_s", "output_tokens") if k not in row]
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
        if not isinstance(prefix, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in prefix):
            raise TraceError(f"{at}: 'prefix_ids' must be a list of integers")
        prefix = tuple(prefix)
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        raise TraceError(f"{at}: give either 'prompt' or 'messages', not both")
    if "prompt_tokens" not in row and prompt is None and messages is None:
        raise TraceError(f"{at}: no prompt: give 'prompt_tokens' (a count), 'prompt' (text) or 'messages' (a chat)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TraceError(f"{at}: 'prompt' must be a string, got {_short(prompt)}")
        if not prompt:
            raise TraceError(f"{at}: empty prompt ('prompt' is \"\")")
    if messages is not None:
        messages = messages_from_json(messages, at)
    counted = row.get("prompt_tokens") is not None or (prompt is None and messages is None)
    cancel = row.get("cancel_after_s")
    if cancel is not None and (
        isinstance(cancel, bool) or not isinstance(cancel, (int, float)) or not (math.isfinite(cancel) and cancel >= 0)
    ):
        raise TraceError(f"{at}: 'cancel_after_s' must be a finite number >= 0, got {_short(cancel)}")
    return Request(
        id=str(rid),
        arrival_s=float(arrival),
        prompt_tokens=_int_field(row, "prompt_tokens", at) if counted else None,
        output_tokens=_int_field(row, "output_tokens", at),
        prefix_ids=prefix,
        prompt=prompt,
        messages=messages,
        cancel_after_s=None if cancel is None else float(cancel),
    )


def _plain_numbers(r: Request) -> Request:
    """``r`` with Python numbers (numpy's, from a DataFrame or an array, as int and float): the
    state machine checks a pass's token counts as ``int``."""
    p, o, a = r.prompt_tokens, r.output_tokens, r.arrival_s
    if type(o) is int and (p is None or type(p) is int) and type(a) in (int, float):
        return r
    return replace(r, prompt_tokens=None if p is None else int(p), output_tokens=int(o), arrival_s=float(a))


def validate_requests(requests: Iterable[Request], where: str = "trace") -> None:
    """Reject what can never be served: empty prompts, zero outputs, negative times, dup ids,
    a request with neither a count nor text, one with both ``prompt`` and ``messages``."""
    seen: set[str] = set()
    for r in requests:
        if not isinstance(r, Request):
            raise TraceError(f"{where}: the requests are traces.Request objects, got {type(r).__name__}")
        if not isinstance(r.id, str) or not r.id:
            raise TraceError(f"{where}: a request id is a non-empty string, got {r.id!r}")
        if r.id in seen:
            raise TraceError(f"{where}: request {r.id}: duplicate id")
        seen.add(r.id)
        for key in ("prompt_tokens", "output_tokens"):
            v = getattr(r, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise TraceError(f"{where}: request {r.id}: {key} must be an integer, got {v!r}")
        for key in ("arrival_s", "cancel_after_s"):
            v = getattr(r, key)
            if (v is not None or key == "arrival_s") and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
                raise TraceError(f"{where}: request {r.id}: {key} must be a number, got {v!r}")
        if r.cancel_after_s is not None and not (r.cancel_after_s >= 0 and math.isfinite(r.cancel_after_s)):
            raise TraceError(
                f"{where}: request {r.id}: cancel_after_s must be a finite number >= 0, got {r.cancel_after_s}"
            )
        if r.prompt is not None and r.messages is not None:
            raise TraceError(f"{where}: request {r.id}: give either 'prompt' or 'messages', not both")
        if r.prompt_tokens is None:
            if not r.has_text:
                raise TraceError(f"{where}: request {r.id}: no prompt: neither prompt_tokens nor text")
        elif r.prompt_tokens < 1:
            raise TraceError(
                f"{where}: request {r.id}: empty prompt: prompt_tokens must be >= 1, got {r.prompt_tokens}"
            )
        if r.output_tokens < 1:
            raise TraceError(f"{where}: request {r.id}: output_tokens must be >= 1, got {r.output_tokens}")
        if not (r.arrival_s >= 0 and math.isfinite(r.arrival_s)):
            raise TraceError(f"{where}: request {r.id}: arrival_s must be >= 0, got {r.arrival_s}")
