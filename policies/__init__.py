"""Scheduling policies, one file each, over the API in ``policies.base``.

``make_policy("prefer-prefill", {"completion_batch_size": "16"})`` builds a bundled policy;
``make_policy("my_policies.py:Fair", {})`` loads a user's class from a file, and
``make_policy("pkg.module:Fair", {})`` from an importable module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
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
from .prefer_prefill import PreferPrefill
from .slots import Slots
from .static import Static
from .unified import Unified
from .vllm import Vllm

POLICIES: dict[str, type[PolicyBase]] = {
    cls.name: cls for cls in (MlxDefault, PreferPrefill, Static, Slots, ChunkedPrefill, Unified, Vllm)
}


class PolicyNotFound(ValueError):
    pass


def make_policy(spec: str, options: Mapping[str, Any] | None = None) -> Policy:
    """A policy object from a bundled name or ``file.py:Class`` / ``module:Class``."""
    if spec in POLICIES:
        return POLICIES[spec].from_options(options)
    if ":" not in spec:
        known = ", ".join(POLICIES)
        raise PolicyNotFound(f"unknown policy '{spec}' (bundled: {known}; or give file.py:Class)")
    cls = load_class(spec)
    if hasattr(cls, "from_options"):
        return cls.from_options(options)
    if options:
        try:
            policy = cls(**options)
        except TypeError as exc:
            raise OptionError(f"policy '{spec}': {exc}") from None
    else:
        policy = cls()
    if not hasattr(policy, "name"):
        policy.name = spec
    return policy


def load_class(spec: str, kind: str = "policy", method: str = "plan", error: type[Exception] = PolicyNotFound) -> type:
    """The class ``spec`` names (``file.py:Class`` or ``module:Class``), which must have ``method``;
    anything wrong is ``error`` naming the ``kind`` (policies and routers share it)."""
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise error(f"{kind} file not found: {where}")
            tag = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
            name = f"_user_{kind}_{path.stem}_{tag}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(mod_spec)
            # registered before it runs, as an import would: @dataclass (with postponed
            # annotations), pickle and typing look the module up by name while it executes
            sys.modules[name] = module
            try:
                mod_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            module = importlib.import_module(where)
    except error:
        raise
    except Exception as exc:  # a user's file: report, don't crash
        raise error(f"cannot load {kind} '{spec}': {type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None or not inspect.isclass(cls) or not callable(getattr(cls, method, None)):
        raise error(f"'{spec}' is not a class with a {method}(view) method")
    return cls


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
