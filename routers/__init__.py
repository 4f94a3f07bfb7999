"""Routers: which replica of a cluster serves each arriving request, one file each, over the
API in ``routers.base``.

``make_router("least-requests")`` builds a bundled router; ``make_router("power-of-two",
{"seed": "3"})`` with options (strings from the command line are converted);
``make_router("my_routers.py:Sticky", {})`` loads a user's class from a file, and
``make_router("pkg.module:Sticky", {})`` from an importable module: the loader and the rule
for options are the policies' own (``policies.plugins``).
"""

from __future__ import annotations

from typing import Any, Mapping

from schedlab.policies.plugins import PluginKind, build

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
    route_checked,
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


#: routers as the plugin loader (``policies.plugins``) knows them
ROUTER = PluginKind("router", "route", ROUTERS, RouterNotFound, RouterOptionError)


def make_router(spec: Any, options: Mapping[str, Any] | None = None) -> Router:
    """A router object from a bundled name or ``file.py:Class`` / ``module:Class`` (or a class,
    built with ``options``, or a router object, returned as it is): ``policies.plugins.build``."""
    return build(ROUTER, spec, options)


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
    "route_checked",
]
