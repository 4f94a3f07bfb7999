"""schedlab's Python API: what the commands do, as functions for notebooks and scripts.

    import schedlab

    run = schedlab.simulate("chunked-prefill", "mixed", options={"budget": 512})
    run.summary["ttft_ms"]["p99"]          # the numbers of summary.json
    run.requests, run.tokens, run.steps, run.passes   # DataFrames: the --out files' columns
    run.plot()                             # the plot command's figures
    run.save("out/")                       # the files simulate --out writes

Keyword arguments are the commands' options (``--kv-tokens`` is ``kv_tokens``, ``-o k=v`` is
``options={"k": v}``); the replica's, the clients' and the engine's settings may also be given
as one object each (``replica=ReplicaOptions(...)``, ``clients=ClientOptions(...)``,
``cluster=ClusterOptions(...)``, ``engine=EngineOptions(...)``), as the commands give them. A policy is a bundled name,
``"file.py:Class"``, a class or an object with ``plan(view)``; a trace is a bundled name or a
path, a dataset spec (``"random:n=50"``), a ``traces.Trace``, a list of ``traces.Request`` or a
DataFrame with the trace columns (id, arrival_s, prompt_tokens, output_tokens). Bad input raises
:class:`SchedlabError` (a ``ValueError``) with a one-line message.

One module per command: ``inputs`` (policies, traces), ``profiles`` (cost models),
``simulation``, ``real`` (the engine: ``run_real``, ``load_engine``), ``serving`` (``serve``, ``run_real``'s
several replicas: ``schedlab.serving``), ``calibration``,
``validation``, ``sweeps``, ``capacities``, ``figures`` (``plot``), ``runs`` (``Run``, ``load_run``) and
``options``. Nothing here imports mlx until a real-engine function is called, nor the command
layer (``schedlab.commands``, typer) ever.
"""

from __future__ import annotations

from ..errors import SchedlabError, SchedlabWarning
from .calibration import calibrate
from .capacities import capacity
from .cluster_validation import validate_served
from .figures import Figures, plot
from .inputs import bundled_policies, load_trace, policy, trace_stats
from .options import ClientOptions, ClusterOptions, EngineOptions, ReplicaGroup, ReplicaOptions
from .profiles import Profile, ReplicaCostModel, cost_model, load_profile, profile_mismatch
from .real import Engine, load_engine, model_info, run_real
from .runs import Run, load_run
from .serving import ClusterRun, serve
from .simulation import simulate
from .sweeps import plot_sweep, sweep
from .validation import Validation, compare, validate

__all__ = [
    "SchedlabError",
    "SchedlabWarning",
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
]
