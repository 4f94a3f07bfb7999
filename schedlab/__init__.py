"""schedlab: design LLM batching schedulers; simulate them, run them on a real MLX engine.

The Python API (the package ``schedlab.api``, imported on first use: ``import schedlab`` stays
fast and never imports mlx or the command layer; the real-engine functions import mlx when
called)::

    import schedlab

    run = schedlab.simulate("unified", "mixed")           # a Run
    run.summary, run.requests, run.tokens, run.steps, run.passes, run.plot(), run.save("out")
    schedlab.run_real("unified", "real-smoke", model="tiny")
    schedlab.run_real("vllm", "sonnet", model="smollm2-135m", replicas=2, out="runs/two")   # a ClusterRun
    schedlab.serve("vllm", model="smollm2-135m", port=8000)   # until SIGINT/SIGTERM: the Run served
    schedlab.calibrate(model="tiny", quick=True)           # a Profile
    schedlab.validate("unified", "real-smoke")             # a Validation
    schedlab.sweep(["unified", "static"], "mixed", rates=[0.2, 0.4])   # a DataFrame
    schedlab.capacity("unified,vllm", "azure-conv-150", slo="ttft=500,tpot=50", replicas=[1, 2],
                      hardware="h100-sxm", model_config="llama-3.1-8b")   # a DataFrame

The commands (``schedlab COMMAND``: ``simulate``, ``run-real``, ``serve``, ``calibrate``,
``validate``, ``plot``, ``sweep``, ``capacity``, ``export-mlx``) are thin wrappers over it (and over the
serving runtime, ``schedlab.serving``), one module each in
``schedlab.commands`` (with ``schedlab.cli``, the command layer: everything else in this package
is the API, which never imports it). Bad input raises ``SchedlabError`` (a ``ValueError``) with
a one-line message.
"""

from __future__ import annotations

from pathlib import Path

from .errors import SchedlabError, SchedlabWarning

# Installed, schedlab.sim, .policies, .engine, .analysis and .traces are subpackages (pyproject's
# package-dir maps them from the repository's top-level folders). Imported from a checkout
# without installing (its root on sys.path), they are found beside this folder instead.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "sim" / "loop.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821  (the package's own __path__)
del _checkout

__version__ = "0.1.0"

_API = (
    "Run",
    "Profile",
    "Validation",
    "ReplicaCostModel",
    "Figures",
    "Engine",
    "ReplicaOptions",
    "ClientOptions",
    "ClusterOptions",
    "ReplicaGroup",
    "EngineOptions",
    "policy",
    "bundled_policies",
    "load_trace",
    "trace_stats",
    "cost_model",
    "load_profile",
    "model_info",
    "profile_mismatch",
    "simulate",
    "load_engine",
    "run_real",
    "serve",
    "ClusterRun",
    "calibrate",
    "validate",
    "validate_served",
    "compare",
    "sweep",
    "plot_sweep",
    "capacity",
    "plot",
    "load_run",
)
__all__ = ["SchedlabError", "SchedlabWarning", *_API]


def __getattr__(name: str):
    if name in _API:
        from . import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'schedlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
