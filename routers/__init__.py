"""Routers: which replica of a cluster serves each arriving request, one file each, over the
API in ``routers.base``.

``make_router("least-requests")`` builds a bundled router; ``make_router("power-of-two",
{"seed": "3"})`` with options (strings from the command line are converted);
``make_router("my_routers.py:Sticky", {})`` loads a user's class from a file, and
``make_router("pkg.module:Sticky", {})`` from an importable module.
"""

from __future__ import annotations

from typing import Any, Mapping

from schedlab.policies import load_class

from .base import (
    ClusterView,
    ReplicaSignals,
    RouteError,
    Router,
    RouterBase,
    RouterNotFound,
    RouterOptionError,
    SeededRouter,
    least,
    least_requests,
    least_tokens,
)
from .least_kv import LeastKV
from .least_requests import LeastRequests
from .least_tokens import LeastTokens
from .power_of_two import PowerOfTwo
from .prefix_affinity import PrefixAffinity
from .random_choice import Random
from .round_robin import RoundRobin
from .weighted import Weighted

ROUTERS: dict[str, type[RouterBase]] = {
    cls.name: cls
    for cls in (RoundRobin, Random, LeastRequests, LeastTokens, LeastKV, PowerOfTwo, PrefixAffinity, Weighted)
}


def make_router(spec: str, options: Mapping[str, Any] | None = None) -> Router:
    """A router object from a bundled name or ``file.py:Class`` / ``module:Class``."""
    if not isinstance(spec, str) or not spec.strip():
        raise RouterNotFound(f"a router is a bundled name ({', '.join(ROUTERS)}) or file.py:Class, got {spec!r}")
    if spec in ROUTERS:
        return ROUTERS[spec].from_options(options)
    if ":" not in spec:
        raise RouterNotFound(f"unknown router '{spec}' (bundled: {', '.join(ROUTERS)}; or give file.py:Class)")
    cls = load_class(spec, "router", "route", RouterNotFound)
    if hasattr(cls, "from_options"):
        return cls.from_options(options)
    try:
        router = cls(**dict(options or {}))
    except TypeError as exc:
        raise RouterOptionError(f"router '{spec}': {exc}") from None
    if not hasattr(router, "name"):
        router.name = spec
    return router


__all__ = [
    "ROUTERS",
    "make_router",
    "ClusterView",
    "ReplicaSignals",
    "RouteError",
    "Router",
    "RouterBase",
    "RouterNotFound",
    "RouterOptionError",
    "SeededRouter",
    "least",
    "least_requests",
    "least_tokens",
]
