"""What runs, described once: a **deployment** — everything a run needs besides its arrivals.

A deployment is replica groups (each ``count`` replicas alike: their policy objects, one per
replica, their cost model, KV capacity and, in a disaggregated deployment, their pool), the
router in front of them (with its options, as the router object holds them) and the delay of
its signals, the replicas that fail and when, the KV transfer between a prefill pool and a
decode pool, and the KV cache's block size and prefix caching. It is checked when it is made
(``DeploymentError``: one line), and ``describe()`` is what meta.json records of it.

``sim.run(deployment, arrivals)`` runs it. The commands and the Python API build deployments
from their flags, a cluster file (TOML) or Python objects (``schedlab.api``); this module only
holds and checks the objects, so a deployment is as easy to build by hand::

    Deployment.one(policy, cost_model, kv_capacity=65536)              # one replica
    Deployment((Group(tuple(policies), cost_model, 65536),), router=LeastTokens(), router_delay=0.05)

Policies and routers keep state between steps and decisions: a deployment's objects are the
ones a run uses (a group's replicas each their own object), so build a deployment per run.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

POOLS = ("prefill", "decode")


class DeploymentError(ValueError):
    """A deployment that cannot run: one line naming what is wrong."""


def check_router_delay(value: Any, name: str = "router_delay") -> float:
    """``value`` as seconds by which a router's signals lag: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeploymentError(f"{name} must be a number, got {value!r}")
    if not (value >= 0 and math.isfinite(value)):
        raise DeploymentError(f"{name} must be a finite number of seconds >= 0, got {value:g}")
    return float(value)


def check_faults(
    fail: Sequence[Any], n: int, name: str = "fail", shown: Sequence[Any] | None = None
) -> tuple[tuple[int, float], ...]:
    """``fail`` as ``((replica, seconds), ...)`` for a deployment of ``n`` replicas: each replica
    of 0 to n - 1 at most once, at a finite time >= 0 (``shown``: the items as the user wrote
    them, for the messages)."""
    out: list[tuple[int, float]] = []
    for item, as_given in zip(fail, shown if shown is not None else fail):
        try:
            i, at = item
        except (TypeError, ValueError):
            raise DeploymentError(f"{name}: a failure is (replica, seconds), got {as_given!r}") from None
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise DeploymentError(f"{name} {as_given!r}: the cluster has replicas 0 to {n - 1}")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not (math.isfinite(at) and at >= 0):
            raise DeploymentError(f"{name} {as_given!r}: the time must be a finite number of seconds >= 0")
        if any(j == i for j, _ in out):
            raise DeploymentError(f"{name}: replica {i} fails twice; a replica fails once")
        out.append((i, float(at)))
    return tuple(out)


def check_block_size(value: Any, name: str = "block_size") -> int:
    """``value`` as the KV cache's block size: an integer >= 1 (tokens)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeploymentError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise DeploymentError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Group:
    """``len(policies)`` replicas alike: replica k of the group runs ``policies[k]`` (each its own
    object), on ``cost_model``, with ``kv_capacity`` tokens of KV; ``pool``: ``"prefill"`` or
    ``"decode"`` in a disaggregated deployment, else None; ``meta``: how its cost model was given
    (a profile's path, a hardware preset and model config), as meta.json records it."""

    policies: tuple
    cost_model: Any
    kv_capacity: int
    pool: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", tuple(self.policies))
        if not self.policies:
            raise DeploymentError("a group has at least one replica (one policy object per replica)")
        for p in self.policies:
            if not callable(getattr(p, "plan", None)):
                raise DeploymentError(f"a group's policies are objects with plan(view), got {p!r}")
        k = self.kv_capacity
        try:
            if isinstance(k, bool) or operator.index(k) < 1:
                raise TypeError
        except TypeError:
            raise DeploymentError(f"kv_capacity must be an integer >= 1 (tokens), got {k!r}") from None
        if self.pool is not None and self.pool not in POOLS:
            raise DeploymentError(f"pool must be 'prefill', 'decode' or None, got {self.pool!r}")

    @property
    def count(self) -> int:
        return len(self.policies)


@dataclass(frozen=True)
class Deployment:
    """Replica ``groups`` (numbered group by group: replica 0 is the first group's first) behind
    ``router`` (an object with ``name`` and ``route(view) -> int``; None: one replica and no
    router, the plain single-replica run) whose view of each replica lags ``router_delay``
    seconds; ``fail``: ``(replica, seconds)`` pairs, that replica dies then; ``transfer``: the
    ``KVTransfer`` between the prefill and the decode pool (None: a free move); every replica's
    KV in blocks of ``block_size`` tokens, with ``prefix_caching`` (vLLM's automatic prefix
    caching); ``file``: the cluster file it was read from, if any; ``acceptance``: speculative
    decoding's acceptance profile (``sim.speculation.Acceptance``), which a deployment whose
    policies draft needs."""

    groups: tuple[Group, ...]
    router: Any = None
    router_delay: float = 0.0
    fail: tuple = ()
    transfer: Any = None
    block_size: int = 1
    prefix_caching: bool = False
    file: str | None = None
    acceptance: Any = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "groups", tuple(self.groups))
        if not self.groups or not all(isinstance(g, Group) for g in self.groups):
            raise DeploymentError(f"a deployment has one or more Group, got {self.groups!r}")
        n = self.replicas
        set_(self, "router_delay", check_router_delay(self.router_delay))
        set_(self, "fail", check_faults(self.fail, n))
        check_block_size(self.block_size)
        set_(self, "prefix_caching", bool(self.prefix_caching))
        if self.router is None and (n > 1 or self.fail or self.router_delay):
            raise DeploymentError(f"a deployment of {n} replica(s) with failures or a delay needs a router")
        if self.router is not None and not callable(getattr(self.router, "route", None)):
            raise DeploymentError(f"a router is an object with route(view), got {self.router!r}")
        self._check_pools()
        drafting = [p for p in self.policies if getattr(p, "drafts", False)]
        if drafting and self.acceptance is None:
            raise DeploymentError(
                f"policy '{drafting[0].name}' drafts tokens (speculative decoding): a simulation needs an acceptance "
                "profile: give accept=P1/P2/... (the probability of each draft position) or accept=FILE (a run's "
                "summary.json, a calibrate --speculative profile), or a trace that carries one (speculative_acceptance)"
            )
        if self.acceptance is not None and not hasattr(self.acceptance, "accepted"):
            raise DeploymentError(
                f"acceptance is an acceptance profile (sim.speculation.Acceptance), got {self.acceptance!r}"
            )
        if drafting and self.prefix_caching:
            raise DeploymentError("speculative decoding with a prefix cache is not supported yet: drop prefix caching")

    def _check_pools(self) -> None:
        pools = [g.pool for g in self.groups]
        if all(p is None for p in pools):
            if self.transfer is not None:
                raise DeploymentError("transfer goes with prefill and decode pools (a group's pool)")
            return
        if None in pools:
            k = pools.index(None) + 1
            raise DeploymentError(
                f"group {k}: no pool: in a cluster of prefill and decode pools every group names its pool"
            )
        if "prefill" not in pools or "decode" not in pools:
            missing = "decode" if "decode" not in pools else "prefill"
            raise DeploymentError(f"no {missing} group: a disaggregated cluster has a prefill pool and a decode pool")
        if pools != sorted(pools, key=lambda x: x == "decode"):
            raise DeploymentError(
                "the prefill groups come before the decode groups (replicas are numbered pool by pool)"
            )
        if self.fail:
            raise DeploymentError("failures (fail) are not supported in a disaggregated cluster yet")
        if self.prefix_caching:
            raise DeploymentError("a disaggregated cluster has no prefix cache yet: drop prefix caching")
        if self.router is None:
            raise DeploymentError("a disaggregated cluster needs a router (each pool gets its own copy)")

    @classmethod
    def one(
        cls,
        policy: Any,
        cost_model: Any,
        *,
        kv_capacity: int,
        block_size: int = 1,
        prefix_caching: bool = False,
        meta: Mapping[str, Any] | None = None,
        acceptance: Any = None,
    ) -> "Deployment":
        """One replica running ``policy`` on ``cost_model``, no router."""
        group = Group((policy,), cost_model, kv_capacity, meta=dict(meta or {}))
        return cls((group,), block_size=block_size, prefix_caching=prefix_caching, acceptance=acceptance)

    @property
    def replicas(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on different replicas (the groups' ``pool``)."""
        return self.groups[0].pool is not None

    @property
    def policies(self) -> list[Any]:
        """Each replica's policy object, in replica order."""
        return [p for g in self.groups for p in g.policies]

    @property
    def cost_models(self) -> list[Any]:
        return [g.cost_model for g in self.groups for _ in g.policies]

    @property
    def kv_capacities(self) -> list[int]:
        return [g.kv_capacity for g in self.groups for _ in g.policies]

    @property
    def group_of(self) -> list[int]:
        """Each replica's group, counted from 1."""
        return [k for k, g in enumerate(self.groups, 1) for _ in g.policies]

    def router_options(self) -> dict[str, Any]:
        """The router's options as the router object holds them (``options()``), else none."""
        get = getattr(self.router, "options", None)
        return dict(get()) if callable(get) else {}

    def pool(self, name: str, router: Any) -> "Deployment":
        """The deployment of one pool of a disaggregated deployment (its groups, no pools), behind
        ``router`` (each pool its own object: routers keep state)."""
        groups = tuple(
            Group(g.policies, g.cost_model, g.kv_capacity, None, g.meta) for g in self.groups if g.pool == name
        )
        if not groups:
            raise DeploymentError(f"the {name} pool has no replica")
        return Deployment(
            groups, router, self.router_delay, (), None, self.block_size, False, self.file, self.acceptance
        )

    def describe(self) -> dict[str, Any]:
        """The deployment as meta.json records it: each group (its replicas, policy and options,
        cost model, KV capacity, pool), the router and its options, the delay, the failures and
        the KV cache's settings."""
        groups = []
        first = 0
        for k, g in enumerate(self.groups, 1):
            p = g.policies[0]
            get = getattr(p, "options", None)
            groups.append(
                {
                    "group": k,
                    "replicas": [first, first + g.count - 1],
                    "count": g.count,
                    "policy": str(getattr(p, "name", type(p).__name__)),
                    "policy_options": dict(get()) if callable(get) else {},
                    **dict(g.meta),
                    "kv_tokens": g.kv_capacity,
                    **({"pool": g.pool} if g.pool is not None else {}),
                }
            )
            first += g.count
        out: dict[str, Any] = {
            "replicas": self.replicas,
            "groups": groups,
            "router": None if self.router is None else getattr(self.router, "name", type(self.router).__name__),
            "router_options": self.router_options(),
            "router_delay": self.router_delay,
            "block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
        }
        if self.fail:
            out["fail"] = [list(f) for f in self.fail]
        if self.transfer is not None:
            t = self.transfer
            out["transfer"] = {
                "mode": t.mode,
                "link": t.link.name,
                "bandwidth_gbs": t.link.bandwidth_gbs,
                "latency_s": t.link.latency_s,
                "bytes_per_token": t.bytes_per_token,
            }
        if self.file:
            out["file"] = self.file
        if self.acceptance is not None:
            out["acceptance"] = self.acceptance.describe()
        return out
