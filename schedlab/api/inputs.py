"""Inputs: a policy (``policy``, ``bundled_policies``) and a trace (``load_trace``,
``trace_stats``) from what a caller gives: a bundled name, a file, a class, an object, a list of
requests or a DataFrame."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..errors import opt
from ._base import PolicyLike, TraceLike, fail, is_frame, public

if TYPE_CHECKING:  # pragma: no cover
    from schedlab.policies.base import Policy
    from schedlab.traces.schema import Trace


def as_policy(spec: PolicyLike, options: Mapping[str, Any] | None = None):
    """A policy object from a name, file spec, class or object (``policy``, without the error
    boundary): ``schedlab.policies.make_policy``, the plugins' one loader."""
    from schedlab.policies import make_policy

    return make_policy(spec, options)


@public
def policy(spec: PolicyLike, /, **options: Any) -> "Policy":
    """A policy object: ``spec`` is a bundled name (``"unified"``), ``"file.py:Class"`` or
    ``"module:Class"``, a class (built with its options) or an object with ``plan(view)``
    (returned as it is). ``options``: the policy's options (``-o key=value``), e.g.
    ``policy("chunked-prefill", budget=512)``."""
    return as_policy(spec, options)


def bundled_policies() -> dict[str, dict[str, Any]]:
    """The bundled policies and their default options."""
    from schedlab.policies import POLICIES

    return {name: cls().options() for name, cls in POLICIES.items()}


def _plain(v: Any) -> Any:
    """A DataFrame cell as the JSON loader sees it: numpy scalars and arrays as Python values."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()
    return v


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def as_trace(
    trace: TraceLike, seed: int = 0, tokenizer: Any = None, name: str | None = None, recount: bool = False
) -> "Trace":
    """A ``traces.Trace`` with token counts from anything ``load_trace`` takes; ``tokenizer``
    counts prompts given as text (``recount``: also those given with counts)."""
    from schedlab import traces
    from schedlab.traces.schema import Trace, TraceError, request_from_json

    if isinstance(trace, Trace):
        tr = trace
    elif isinstance(trace, (str, Path)):
        return traces.load(trace, seed=seed, tokenizer=tokenizer, recount=recount)
    elif is_frame(trace):
        where = name or "DataFrame"
        missing = [c for c in ("id", "arrival_s", "output_tokens") if c not in trace.columns]
        if missing:
            raise TraceError(
                f"{where}: missing column(s) {', '.join(missing)} (a trace has id, arrival_s, "
                f"prompt_tokens, output_tokens)"
            )
        rows = [{k: _plain(v) for k, v in row.items() if not _missing(_plain(v))} for row in trace.to_dict("records")]
        tr = Trace(name or "dataframe", "", [request_from_json(row, i, where) for i, row in enumerate(rows)])
    elif isinstance(trace, Iterable) and not isinstance(trace, (bytes, Mapping)):
        reqs = list(trace)  # (each checked as a traces.Request by the Trace: validate_requests)
        if not reqs:
            raise TraceError("the trace has no requests")
        tr = Trace(name or "requests", "", reqs)
    else:
        raise TraceError(
            f"a trace is a name or path, a dataset spec (random:n=50), a traces.Trace, a list of "
            f"traces.Request or a DataFrame; got {type(trace).__name__}"
        )
    if tokenizer is not None:
        tr = traces.tokenize(tr, tokenizer, recount=recount)
    return traces.require_counts(tr)


@public
def load_trace(
    trace: TraceLike,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    rate: float | None = None,
    head: int | None = None,
    name: str | None = None,
) -> "Trace":
    """A trace (``traces.Trace``: ``name``, ``requests``) from a bundled name or path (JSON,
    Azure CSV, Mooncake JSONL), a dataset spec (``"random:n=200,input_len=512,rate=2"``), a
    list of ``traces.Request`` or a DataFrame with the columns id, arrival_s, prompt_tokens,
    output_tokens. ``seed``: the loader's randomness (tick jitter, datasets); ``tokenizer``:
    counts prompts given as text; ``head``: keep the first N requests; ``rate``: rescale the
    arrivals to this mean rate (req/s); ``name``: the trace's name (lists and DataFrames)."""
    from schedlab import traces

    tr = as_trace(trace, seed=seed, tokenizer=tokenizer, name=name)
    if head is not None:
        tr = traces.head(tr, head)
    if rate is not None:
        tr = traces.to_rate(tr, rate)
    return tr


@public
def trace_stats(trace: TraceLike, *, seed: int = 0) -> dict[str, float]:
    """Requests, duration, mean rate, prompt and output token percentiles of a trace."""
    from schedlab import traces

    return traces.trace_stats(as_trace(trace, seed=seed))


def policy_list(policy, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Policies by name: one (a name, class or object), several (a list, or "a,b"), or "all";
    ``options`` go to every one given by name or class."""
    from schedlab.policies import POLICIES

    if isinstance(policy, str):
        items = list(POLICIES) if policy == "all" else [p.strip() for p in policy.split(",") if p.strip()]
    elif isinstance(policy, (list, tuple)):
        items = list(policy)
    else:
        items = [policy]
    if not items:
        fail(f"{opt('policy')} is empty", 2)
    out: dict[str, Any] = {}
    for item in items:
        pol = as_policy(item, options if isinstance(item, (str, Path, type)) else None)
        name = getattr(pol, "name", type(pol).__name__)
        if name in out:
            fail(f"policy {name!r} given twice", 2)
        out[name] = pol
    return out
