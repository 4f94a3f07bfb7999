"""The options a run is made with, as small frozen objects: the replica's KV cache
(``ReplicaOptions``), the clients in front of it (``ClientOptions``), several replicas behind a
router (``ClusterOptions``) and the real engine (``EngineOptions``). The commands build them
from their flags and hand them to the API, which hands their fields to the loop and the engine;
the API's functions also take the same settings as keyword arguments (``kv_tokens=``,
``max_concurrency=``, ``replicas=``, ``model=``, ...).

Each checks its values when made: bad ones raise ``SchedlabError`` with one line naming the
option as the caller knows it (``block_size`` in Python, ``--block-size`` on the command line).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import opt
from ._base import check_kv_tokens, check_seed, fail


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{opt(name)} must be a number, got {value!r}", 2)
    return float(value)


@dataclass(frozen=True)
class ReplicaOptions:
    """One replica's KV cache. ``kv_tokens``: its capacity in tokens (None: the cost profile's,
    or what the hardware's memory holds); ``block_size``: KV is allocated in blocks of this many
    tokens (a request holds ceil(tokens / block)); ``prefix_caching``: block-level prefix caching
    (vLLM's automatic prefix caching): cached prefixes are not computed again."""

    kv_tokens: int | None = None
    block_size: int = 16
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        check_kv_tokens(self.kv_tokens)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            fail(f"{opt('block_size')} must be an integer, got {self.block_size!r}", 2)
        if self.block_size < 1:
            fail(f"{opt('block_size')} must be >= 1, got {self.block_size}", 2)
        object.__setattr__(self, "prefix_caching", bool(self.prefix_caching))


def parse_rate(value: float | str | None, name: str = "request_rate") -> float | None:
    """A request rate (req/s): a number > 0 or ``inf`` (a string from the command line); None
    when not given."""
    if value is None:
        return None
    if isinstance(value, bool):
        v = math.nan
    else:
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = math.nan
    if math.isnan(v) or v <= 0:
        fail(f"{opt(name)} must be a number > 0 or inf (requests/s), got {str(value)!r}", 2)
    return v


@dataclass(frozen=True)
class ClientOptions:
    """The clients in front of the replica, as ``vllm bench serve`` has them. None of them: the
    trace replayed at its own arrival times. ``max_concurrency``: closed-loop clients, at most
    this many requests in flight, the next one sent when one finishes; ``request_rate``: requests
    issued at this rate (req/s; ``inf`` or ``"inf"``: all at once) in trace order, replacing the
    trace's arrival times; ``burstiness``: with ``request_rate``, the gamma shape of the gaps
    (1: Poisson, the default); ``think_time``: with ``max_concurrency``, seconds a client waits
    after a response before its slot is free again."""

    max_concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float | None = None
    think_time: float | None = None

    def __post_init__(self) -> None:
        mc = self.max_concurrency
        if mc is not None:
            if isinstance(mc, bool) or not isinstance(mc, int):
                fail(f"{opt('max_concurrency')} must be an integer, got {mc!r}", 2)
            if mc < 1:
                fail(f"{opt('max_concurrency')} must be >= 1, got {mc}", 2)
        object.__setattr__(self, "request_rate", parse_rate(self.request_rate))
        if self.burstiness is not None:
            b = _number(self.burstiness, "burstiness")
            if self.request_rate is None:
                fail(
                    f"{opt('burstiness')} shapes the {opt('request_rate')} schedule: give {opt('request_rate')} too", 2
                )
            if math.isnan(b) or b <= 0:
                fail(f"{opt('burstiness')} must be > 0 (1: Poisson; inf: constant gaps), got {b:g}", 2)
            object.__setattr__(self, "burstiness", b)
        if self.think_time is not None:
            t = _number(self.think_time, "think_time")
            if mc is None:
                fail(f"{opt('think_time')} is the pause of a closed-loop client: give {opt('max_concurrency')} too", 2)
            if not (t >= 0 and math.isfinite(t)):
                fail(f"{opt('think_time')} must be a finite number of seconds >= 0, got {t:g}", 2)
            object.__setattr__(self, "think_time", t)

    def arrivals(self, requests: Sequence[Any], seed: int = 0):
        """What the loop is handed: ``requests`` themselves (no client option given: a trace
        replay), else the clients over them (``sim.sources.clients``)."""
        from schedlab.sim.sources import clients

        return clients(requests, self.max_concurrency, self.request_rate, self.burstiness, self.think_time or 0.0, seed)


@dataclass(frozen=True)
class ClusterOptions:
    """Several replicas behind a router. ``replicas``: how many (each its own copy of the policy,
    KV cache and backend); ``router``: which replica serves each arrival, a bundled router's name
    (``round-robin``, ``random``, ``least-requests``, ``least-tokens``, ``least-kv``,
    ``power-of-two``, ``prefix-affinity``, ``weighted``), ``"file.py:Class"``, a router class or
    object (``route(view) -> replica index``); None: round-robin; ``router_options``: the
    router's options (``--router-option k=v``); ``router_delay``: seconds by which the router's
    view of each replica lags (stale signals). The defaults are one replica and no router: the
    single-replica simulation; giving any of them runs the cluster (with one replica, the same
    result)."""

    replicas: int = 1
    router: Any = None
    router_options: Any = None
    router_delay: float = 0.0

    def __post_init__(self) -> None:
        n = self.replicas
        if isinstance(n, bool) or not isinstance(n, int):
            fail(f"{opt('replicas')} must be an integer, got {n!r}", 2)
        if n < 1:
            fail(f"{opt('replicas')} must be >= 1, got {n}", 2)
        d = _number(self.router_delay, "router_delay")
        if not (d >= 0 and math.isfinite(d)):
            fail(f"{opt('router_delay')} must be a finite number of seconds >= 0, got {d:g}", 2)
        object.__setattr__(self, "router_delay", d)
        ro = self.router_options
        if ro is not None:
            if not isinstance(ro, Mapping):
                fail(f"router_options is a mapping such as {{'seed': 1}}, got {type(ro).__name__}", 2)
            for key in ro:
                if not isinstance(key, str) or not key:
                    fail(f"router option names are strings, got {key!r}", 2)
            object.__setattr__(self, "router_options", {k.replace("-", "_"): v for k, v in ro.items()})
        if ro and self.router is None:
            fail(f"{opt('router_option')} goes with {opt('router')}: name the router too", 2)
        if self.router is not None and isinstance(self.router, (str, Path)) and not str(self.router).strip():
            fail(f"{opt('router')} is empty", 2)

    @property
    def used(self) -> bool:
        """Whether the run is a cluster's (any field other than its default)."""
        return self.replicas != 1 or self.router is not None or bool(self.router_options) or self.router_delay != 0

    def make_router(self):
        """A fresh router object (one per run: routers keep state, such as round-robin's turn)."""
        from schedlab.routers import ROUTERS, RouterNotFound, RouterOptionError, make_router

        spec, options = self.router, dict(self.router_options or {})
        if spec is None:
            return make_router("round-robin")
        if isinstance(spec, (str, Path)):
            return make_router(str(spec), options)
        if isinstance(spec, type):
            if not callable(getattr(spec, "route", None)):
                raise RouterNotFound(f"router class {spec.__name__} has no route(view) method")
            if hasattr(spec, "from_options"):
                return spec.from_options(options)
            try:
                router = spec(**options)
            except TypeError as exc:
                raise RouterOptionError(f"router '{spec.__name__}': {exc}") from None
            if not hasattr(router, "name"):
                router.name = spec.__name__
            return router
        if callable(getattr(spec, "route", None)):
            if options:
                fail("router options go with a router's name or class, not with a router object", 2)
            return spec
        raise RouterNotFound(
            f"a router is a bundled name ({', '.join(ROUTERS)}), 'file.py:Class', a class or an object with "
            f"a route(view) method; got {type(spec).__name__}"
        )


@dataclass(frozen=True)
class EngineOptions:
    """The real MLX engine. ``model``: a preset (``micro``, ``tiny``, ``small``,
    ``smollm2-135m``), a llama ``.gguf`` file or an mlx-lm checkpoint directory; ``dtype``:
    float32, float16, bfloat16, quantized or auto; ``sampling``: ``"greedy"`` or
    ``"temperature=0.7,seed=1"``; ``noise``: settings that may lower the timing noise
    (``"gc-off,pin=0-1,warmup=3"``, see engine/noise.py; None: ``$SCHEDLAB_NOISE``);
    ``model_seed``: a preset's random weights; ``ignore_eos``: generate every request's
    output_tokens, past the model's EOS. The model itself is checked when it is used."""

    model: str = "tiny"
    dtype: str = "float32"
    sampling: str = "greedy"
    noise: str | None = None
    model_seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)):
            fail(f"model is a preset name, a .gguf file or a checkpoint directory, got {type(self.model).__name__}", 2)
        object.__setattr__(self, "model", str(self.model))
        if not isinstance(self.dtype, str):
            fail(f"{opt('dtype')} is a string such as 'float32', got {self.dtype!r}", 2)
        if not isinstance(self.sampling, str):
            fail(
                f"{opt('sampling')} is 'greedy' or a string such as 'temperature=0.7,seed=1', "
                f"got {type(self.sampling).__name__}",
                2,
            )
        if self.noise is not None and not isinstance(self.noise, str):
            fail(f"noise is a string such as 'gc-off,pin=0-1,warmup=3', got {type(self.noise).__name__}", 2)
        check_seed(self.model_seed, "model_seed")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))


def merged(cls, given, what: str, **fields):
    """``given`` (an options object), or one made from ``fields`` (keyword arguments of an API
    function); giving both, with a field other than its default, is an error."""
    if given is None:
        return cls(**fields)
    if not isinstance(given, cls):
        fail(f"{what} is a {cls.__name__}, got {type(given).__name__}", 2)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    clash = [k for k, v in fields.items() if v is not defaults[k] and v != defaults[k]]
    if clash:
        fail(f"give either {what}= or {', '.join(clash)}, not both", 2)
    return given
