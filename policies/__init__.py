"""Scheduling policies, one file each, over the API in ``policies.base``.

``make_policy("prefer-prefill", {"completion_batch_size": "16"})`` builds a bundled policy;
``make_policy("my_policies.py:Fair", {})`` loads a user's class from a file, and
``make_policy("pkg.module:Fair", {})`` from an importable module. Policies and routers are
built by one loader, ``policies.plugins``, which reads their options by one rule.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import (
    CostModel,
    OptionError,
    Pass,
    PassShape,
    Phase,
    Plan,
    Policy,
    PolicyBase,
    RequestView,
    SchedulerView,
    admit_fifo,
    as_cost_model,
    count_finishing,
    fifo_chunks,
    finishes_this_pass,
)
from .chunked_prefill import ChunkedPrefill
from .mlx_default import MlxDefault
from .plugins import PluginKind, build
from .prefer_prefill import PreferPrefill
from .slots import Slots
from .static import Static
from .unified import Unified
from .vllm import Vllm

POLICIES: dict[str, type[PolicyBase]] = {
    cls.name: cls for cls in (MlxDefault, PreferPrefill, Static, Slots, ChunkedPrefill, Unified, Vllm)
}


class PolicyNotFound(ValueError):
    """An unknown policy name, a ``file.py:Class`` that does not load, or no policy. Exit status 2."""

    code = 2


#: policies as the plugin loader (``policies.plugins``) knows them
POLICY = PluginKind("policy", "plan", POLICIES, PolicyNotFound, OptionError)


def make_policy(spec: Any, options: Mapping[str, Any] | None = None) -> Policy:
    """A policy object from a bundled name or ``file.py:Class`` / ``module:Class`` (or a class,
    built with ``options``, or a policy object, returned as it is): ``policies.plugins.build``."""
    return build(POLICY, spec, options)


__all__ = [
    "POLICIES",
    "make_policy",
    "PolicyNotFound",
    "OptionError",
    "CostModel",
    "as_cost_model",
    "Pass",
    "PassShape",
    "Phase",
    "Plan",
    "Policy",
    "PolicyBase",
    "RequestView",
    "SchedulerView",
    "admit_fifo",
    "count_finishing",
    "fifo_chunks",
    "finishes_this_pass",
]
