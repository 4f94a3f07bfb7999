"""Text in traces: the tokenizer protocol, and counting prompt tokens with it.

A request may carry its prompt as text (``prompt``) or as a chat (``messages``); the
simulator needs its length in tokens. :func:`tokenize` fills ``prompt_tokens`` with a
tokenizer, any object that follows :class:`Tokenizer`:

- ``encode(text) -> list[int]`` (required). A ``tokenizers.Tokenizer``, whose ``encode``
  returns an ``Encoding``, is accepted as it is (its ``.ids`` are used).
- ``apply_chat_template(messages) -> list[int] | str`` (optional; needed only for requests
  with ``messages``): the prompt the model sees for the chat, the assistant's generation
  prompt included. A string is encoded with ``encode``; a list is taken as token ids. When
  the method takes an ``add_generation_prompt`` argument (transformers' and mlx-lm's
  tokenizers do, defaulting it to False) it is called with ``add_generation_prompt=True``.

:func:`prompt_ids` is the one definition of "the tokens of this request's prompt": the
counts here are ``len(prompt_ids(request, tokenizer))``, so an engine that feeds the model
``prompt_ids(request, tokenizer)`` prefills exactly the counted tokens.

Nothing here imports a tokenizer library (or mlx): the tokenizer is whatever the caller has.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol, Sequence, runtime_checkable

from .schema import Request, Trace, TraceError

#: What to tell a user whose trace has text without token counts.
# the commands that count a trace's text with a model's tokenizer (simulate, sweep and capacity have none)
COUNTING = "run-real, validate and calibrate: --model M; in Python: traces.load(spec, tokenizer=...)"
HOW_TO_COUNT = (
    f"count them with the model's tokenizer ({COUNTING} or traces.tokenize(trace, tokenizer)), "
    "or write prompt_tokens into the trace"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What traces needs of a tokenizer: ``encode``; for chats, also ``apply_chat_template``
    (checked with ``hasattr``: it is optional, so not part of the runtime check)."""

    def encode(self, text: str) -> Sequence[int]:  # pragma: no cover - protocol
        ...


def _ids(value: Any, what: str) -> list[int]:
    """Token ids from what a tokenizer returned: a sequence of ints, a ``tokenizers``
    Encoding (``.ids``), or a mapping with ``input_ids`` (transformers' BatchEncoding)."""
    if hasattr(value, "ids") and not isinstance(value, (list, tuple)):
        value = value.ids
    elif isinstance(value, Mapping) and "input_ids" in value:
        value = value["input_ids"]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TraceError(f"{what} returned {type(value).__name__}, not a list of token ids")
    if value and isinstance(value[0], (list, tuple)):  # a batch of one
        if len(value) != 1:
            raise TraceError(f"{what} returned a batch of {len(value)} sequences, not one")
        value = value[0]
    return list(value)


def _takes_generation_prompt(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "add_generation_prompt" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def encode(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)`` as a list of ids; a tokenizer error is a TraceError."""
    fn = getattr(tokenizer, "encode", None)
    if not callable(fn):
        raise TraceError(f"not a tokenizer: {type(tokenizer).__name__} has no encode(text) method")
    try:
        out = fn(text)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a tokenizer's own error, reported in one line
        raise TraceError(f"tokenizer encode failed: {type(exc).__name__}: {exc}") from None
    return _ids(out, "tokenizer encode")


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of a chat as the model sees it (template, generation prompt included)."""
    fn = getattr(tokenizer, "apply_chat_template", None)
    if not callable(fn):
        raise TraceError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template "
            f"(apply_chat_template): cannot count a request given as 'messages'"
        )
    try:
        out = fn(messages, add_generation_prompt=True) if _takes_generation_prompt(fn) else fn(messages)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise TraceError(f"tokenizer apply_chat_template failed: {type(exc).__name__}: {exc}") from None
    if isinstance(out, str):
        return encode(tokenizer, out)
    return _ids(out, "tokenizer apply_chat_template")


def prompt_ids(request: Request, tokenizer: Any) -> list[int]:
    """The token ids of ``request``'s text: ``encode(prompt)``, or the chat template of its
    messages. A request without text is an error (its ids are the engine's to make)."""
    if request.messages is not None:
        return chat_ids(tokenizer, request.chat() or [])
    if request.prompt is not None:
        return encode(tokenizer, request.prompt)
    raise TraceError(f"request {request.id}: has no text to tokenize")


def tokenize(trace: Trace, tokenizer: Any, recount: bool = False) -> Trace:
    """A copy of ``trace`` with ``prompt_tokens`` counted by ``tokenizer``.

    Requests with text and no count get ``len(prompt_ids(request, tokenizer))``; with
    ``recount`` every request with text is recounted (the count written in the trace may
    come from another model's tokenizer). Requests without text are kept as they are.
    """
    reqs = []
    for r in trace.requests:
        if r.has_text and (recount or r.prompt_tokens is None):
            try:
                n = len(prompt_ids(r, tokenizer))
            except TraceError as exc:
                raise TraceError(f"{trace.name}: request {r.id}: {exc}") from None
            if n < 1:
                raise TraceError(f"{trace.name}: request {r.id}: empty prompt: the tokenizer gives its text 0 tokens")
            r = replace(r, prompt_tokens=n)
        reqs.append(r)
    return Trace(trace.name, trace.description, reqs, trace.speculative_acceptance)


def require_counts(trace: Trace) -> Trace:
    """``trace`` itself when every request has ``prompt_tokens``; else a one-line TraceError
    saying how many requests need counting and how to count them."""
    missing = trace.uncounted
    if missing:
        raise TraceError(
            f"{trace.name}: {len(missing)} of {len(trace)} request(s) have text but "
            f"no prompt_tokens (first: {missing[0].id}); the simulation needs token "
            f"counts: {HOW_TO_COUNT}"
        )
    return trace


__all__ = ["Tokenizer", "HOW_TO_COUNT", "encode", "chat_ids", "prompt_ids", "tokenize", "require_counts"]
