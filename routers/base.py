"""The router API: what a router reads (a cluster view) and what it returns (a replica index).

A router is any object with ``name`` and ``route(view) -> int``. At each arrival to the
cluster the simulator hands it a frozen ``ClusterView``: the arriving request and, per replica,
a ``ReplicaSignals`` (its queues, outstanding tokens, KV, the request's cached prefix there,
whether it is up), as the replica was ``router_delay`` seconds before (stale signals, as a
router that reads the replicas' metrics sees them). It returns the index of the replica that
serves the request; anything else (not an int, out of range, a replica that is down) stops the
run with one line naming the router and the request.

Routers may keep state between calls (round-robin's position, a seeded generator): the
simulator makes one router object per run and calls it once per arrival, in arrival order.

This module imports nothing from ``sim`` or ``engine``.
"""

from __future__ import annotations

import dataclasses
import operator
import random
from operator import add, itemgetter
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

from schedlab.policies.plugins import construct, option_names
from schedlab.traces.schema import Request


class ReplicaSignals(NamedTuple):
    """One replica as a router sees it (a snapshot; immutable).

    ``waiting``: requests arrived and not admitted (preempted ones included); ``running``:
    admitted and unfinished; ``prompt_tokens``: prompt tokens of its unfinished requests not yet
    in its KV cache (a preempted request's recompute included); ``output_tokens``: output tokens
    its unfinished requests have still to produce; ``kv_used``: KV tokens its requests hold (a
    shared cached block counts for each holder); ``kv_capacity``: its KV capacity in tokens;
    ``prefix_hit``: tokens of the arriving request's prompt already in its prefix cache (0
    without prefix caching; read at the decision, not delayed); ``up``: it takes requests."""

    index: int
    waiting: int = 0
    running: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    kv_used: int = 0
    kv_capacity: int = 1
    prefix_hit: int = 0
    up: bool = True

    @property
    def requests(self) -> int:
        """Unfinished requests: waiting + running."""
        return self.waiting + self.running

    @property
    def tokens(self) -> int:
        """Outstanding tokens: prompt tokens to compute + output tokens to produce."""
        return self.prompt_tokens + self.output_tokens

    @property
    def kv_utilisation(self) -> float:
        """KV in use as a fraction of the capacity (may exceed 1 when cached blocks are shared)."""
        return self.kv_used / self.kv_capacity if self.kv_capacity > 0 else 1.0


class ClusterView(NamedTuple):
    """What ``router.route(view)`` reads: the time of the decision, the arriving request, its
    position among the arrivals (0, 1, ...), and every replica's signals, in replica order."""

    now: float
    request: Request
    arrival: int
    replicas: tuple[ReplicaSignals, ...]

    def up(self) -> list[ReplicaSignals]:
        """The replicas that take requests, in replica order."""
        return [r for r in self.replicas if r.up]


class Router(Protocol):
    name: str

    def route(self, view: ClusterView) -> int: ...


class RouterNotFound(ValueError):
    """An unknown router name or a ``file.py:Class`` that does not load. Exit status 2."""

    code = 2


class RouterOptionError(ValueError):
    """A bad router option (unknown, or the wrong type). Exit status 2."""

    code = 2


class RouteError(RuntimeError):
    """A router returned something it may not (not an int, no such replica, one that is down)
    or raised. One line naming the router and the request."""


def route_checked(router: Any, view: ClusterView, where: str = "") -> int:
    """``router.route(view)``, checked: the index of a replica of ``view`` that is up, or a
    ``RouteError`` whose one line names the router, ``where`` (such as "in the prefill pool ")
    and the request. The one check of a router's answer, in the simulator and the serving front."""
    name = getattr(router, "name", type(router).__name__)
    n = len(view.replicas)

    def illegal(what: str) -> RouteError:
        return RouteError(f"router '{name}' {where}request {view.request.id}: {what}")

    try:
        j = router.route(view)
    except Exception as exc:  # the user's router code
        raise illegal(f"route() raised {type(exc).__name__}: {exc}") from exc
    if isinstance(j, bool):
        raise illegal(f"returned {j!r}, not a replica index (0 to {n - 1})")
    try:
        j = operator.index(j)
    except TypeError:
        raise illegal(f"returned {j!r}, not a replica index (0 to {n - 1})") from None
    if not 0 <= j < n:
        raise illegal(f"returned replica {j}, but the cluster has replicas 0 to {n - 1}")
    if not view.replicas[j].up:
        raise illegal(f"returned replica {j}, which is down")
    return j


def least(replicas: Sequence[ReplicaSignals], key) -> int:
    """The index of the replica with the smallest ``key`` among ``replicas`` (given in replica
    order, as ``view.up()`` gives them: the first, the lowest index, on a tie); the replicas
    given should be up."""
    return min(replicas, key=key).index


_WAITING, _RUNNING, _PROMPT, _OUTPUT = (itemgetter(k) for k in (1, 2, 3, 4))


def least_requests(replicas: Sequence[ReplicaSignals]) -> int:
    """``least(replicas, lambda r: r.requests)`` without a Python call per replica (a router
    that reads every replica does so at every arrival: on 64 replicas this is most of a
    decision's cost)."""
    loads = list(map(add, map(_WAITING, replicas), map(_RUNNING, replicas)))
    return replicas[loads.index(min(loads))].index


def least_tokens(replicas: Sequence[ReplicaSignals]) -> int:
    """``least(replicas, lambda r: r.tokens)``, as ``least_requests``."""
    loads = list(map(add, map(_PROMPT, replicas), map(_OUTPUT, replicas)))
    return replicas[loads.index(min(loads))].index


@dataclass
class RouterBase:
    """Base for the bundled routers: options are dataclass fields, settable by name (read by
    the plugins' one rule, ``policies.plugins``: strings from the command line are converted to
    the field's type)."""

    name = "router"

    @classmethod
    def option_names(cls) -> list[str]:
        return option_names(cls)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> "RouterBase":
        return construct(cls, options, "router", RouterOptionError)

    def options(self) -> dict[str, Any]:
        """The router's options (its state, such as a generator, left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def route(self, view: ClusterView) -> int:
        raise NotImplementedError


@dataclass
class SeededRouter(RouterBase):
    """A router that draws at random: ``seed`` (an option) seeds its own generator, ``_rng``;
    the same seed, the same choices."""

    seed: int = 0
    _rng: random.Random = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)


def require_non_negative(router: str, **values: float) -> None:
    for key, value in values.items():
        if value < 0:
            raise RouterOptionError(f"router '{router}': option {key} must be >= 0, got {value}")
