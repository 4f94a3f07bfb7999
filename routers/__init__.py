"""Routers: which replica of a cluster serves each arriving request, one file each, over the
API in ``routers.base``.

``make_router("least-requests")`` builds a bundled router; ``make_router("power-of-two",
{"seed": "3"})`` with options (strings from the command line are converted);
``make_router("my_routers.py:Sticky", {})`` loads a user's class from a file, and
``make_router("pkg.module:Sticky", {})`` from an importable module.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Mapping

from .base import (
    ClusterView,
    ReplicaSignals,
    RouteError,
    Router,
    RouterBase,
    RouterNotFound,
    RouterOptionError,
    least,
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
    cls = _load_class(spec)
    if hasattr(cls, "from_options"):
        return cls.from_options(options)
    try:
        router = cls(**dict(options or {}))
    except TypeError as exc:
        raise RouterOptionError(f"router '{spec}': {exc}") from None
    if not hasattr(router, "name"):
        router.name = spec
    return router


def _load_class(spec: str) -> type:
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise RouterNotFound(f"router file not found: {where}")
            mod_spec = importlib.util.spec_from_file_location(f"_user_router_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RouterNotFound:
        raise
    except Exception as exc:  # a user's file: report, don't crash
        raise RouterNotFound(f"cannot load router '{spec}': {type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None or not inspect.isclass(cls) or not callable(getattr(cls, "route", None)):
        raise RouterNotFound(f"'{spec}' is not a class with a route(view) method")
    return cls


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
    "least",
]
