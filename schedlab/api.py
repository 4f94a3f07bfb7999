"""schedlab's Python API: what the commands do, as functions for notebooks and scripts.

    import schedlab

    run = schedlab.simulate("chunked-prefill", "mixed", options={"budget": 512})
    run.summary["ttft_ms"]["p99"]          # the numbers of summary.json
    run.requests, run.tokens, run.steps, run.passes   # DataFrames: the --out files' columns
    run.plot()                             # the plot command's figures
    run.save("out/")                       # the files simulate --out writes

Keyword arguments are the commands' options (``--kv-tokens`` is ``kv_tokens``, ``-o k=v`` is
``options={"k": v}``). A policy is a bundled name, ``"file.py:Class"``, a class or an object
with ``plan(view)``; a trace is a bundled name or a path, a dataset spec (``"random:n=50"``), a
``traces.Trace``, a list of ``traces.Request`` or a DataFrame with the trace columns (id,
arrival_s, prompt_tokens, output_tokens). Bad input raises :class:`SchedlabError` (a
``ValueError``) with a one-line message.

Nothing here imports mlx until a real-engine function (``run_real``, ``calibrate``,
``validate``) is called; ``engine`` is imported first there, so OpenBLAS is loaded before MLX.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, Union

from .errors import SchedlabError, SchedlabWarning, opt, user_error_types
from .results import CostModel, Figures, Profile, Run, Validation, real_dir_name

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure
    from schedlab.policies.base import Policy
    from schedlab.traces.schema import Request, Trace

PolicyLike = Union[str, type, Any]
TraceLike = Union[str, Path, "Trace", Sequence["Request"], "pd.DataFrame"]
ProfileLike = Union[str, Path, Profile, None]
#: ``log(kind, message)``: kind is "progress", "note" or "warning"
Log = Callable[[str, str], None]

__all__ = [
    "SchedlabError", "SchedlabWarning", "Run", "Profile", "Validation", "CostModel", "Figures",
    "policy", "policies", "load_trace", "trace_stats", "cost_model", "load_profile", "model_info",
    "profile_mismatch", "simulate", "run_real", "calibrate", "validate", "compare", "sweep", "plot_sweep", "plot",
    "load_run",
]


# ---------------------------------------------------------------------------- errors


def _error_types() -> tuple[type[BaseException], ...]:
    from schedlab.analysis.plots import RunDirError

    return user_error_types() + (RunDirError,)


def _api(fn):
    """Bad input, from anywhere below, leaves as one ``SchedlabError`` line without the frames
    it came through."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SchedlabError as exc:
            raise exc.with_traceback(None) from None
        except Exception as exc:
            if isinstance(exc, _error_types()):
                raise SchedlabError(str(exc), getattr(exc, "code", 1)) from None
            raise

    return wrapper


def _fail(message: str, code: int = 1):
    raise SchedlabError(message, code)


def _logger(log: Log | None) -> Log:
    if log is not None:
        return log

    def default(kind: str, message: str) -> None:
        if kind == "warning":
            warnings.warn(message, SchedlabWarning, stacklevel=4)

    return default


# ---------------------------------------------------------------------------- policies


def _policy(spec: PolicyLike, options: Mapping[str, Any] | None = None):
    from schedlab.policies import POLICIES, make_policy
    from schedlab.policies.base import OptionError

    options = dict(options or {})
    for key in list(options):
        if not isinstance(key, str) or not key:
            _fail(f"policy option names are strings, got {key!r}", 2)
        norm = key.replace("-", "_")
        if norm != key:
            options[norm] = options.pop(key)
    if isinstance(spec, (str, Path)):
        spec = str(spec)
        if not spec.strip():
            _fail("policy is empty", 2)
        if spec in POLICIES:
            _check_option_types(POLICIES[spec], options)
        pol = make_policy(spec, options)
    elif isinstance(spec, type):
        if not callable(getattr(spec, "plan", None)):
            _fail(f"policy class {spec.__name__} has no plan(view) method")
        if hasattr(spec, "from_options"):
            _check_option_types(spec, options)
            pol = spec.from_options(options)
        else:
            try:
                pol = spec(**options)
            except TypeError as exc:
                raise OptionError(f"policy '{spec.__name__}': {exc}") from None
            if not hasattr(pol, "name"):
                try:
                    pol.name = spec.__name__
                except AttributeError:
                    pass
    elif callable(getattr(spec, "plan", None)):
        if options:
            _fail(f"options go with a policy's name or class, not with a policy object "
                  f"({getattr(spec, 'name', type(spec).__name__)!r} is built already)", 2)
        pol = spec
    else:
        _fail(f"a policy is a bundled name ({', '.join(POLICIES)}), 'file.py:Class', a class or an "
              f"object with a plan(view) method; got {type(spec).__name__}", 2)
    return pol


def _check_option_types(cls: type, options: Mapping[str, Any]) -> None:
    """Python values for a bundled policy's options must have the option's type (strings are
    parsed as ``-o key=value``)."""
    import dataclasses

    from schedlab.policies.base import OptionError

    if not dataclasses.is_dataclass(cls):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in options.items():
        f = fields.get(key)
        if f is None or isinstance(value, str) or f.default is dataclasses.MISSING:
            continue
        kind = type(f.default)
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, int) and not isinstance(value, bool) if kind is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              if kind is float else True)
        if not ok:
            raise OptionError(f"policy '{getattr(cls, 'name', cls.__name__)}': option {key}={value!r} "
                              f"is not a valid {kind.__name__}")


@_api
def policy(spec: PolicyLike, /, **options: Any) -> "Policy":
    """A policy object: ``spec`` is a bundled name (``"unified"``), ``"file.py:Class"`` or
    ``"module:Class"``, a class (built with its options) or an object with ``plan(view)``
    (returned as it is). ``options``: the policy's options (``-o key=value``), e.g.
    ``policy("chunked-prefill", budget=512)``."""
    return _policy(spec, options)


def bundled_policies() -> dict[str, dict[str, Any]]:
    """The bundled policies and their default options."""
    from schedlab.policies import POLICIES

    return {name: cls().options() for name, cls in POLICIES.items()}


def _policy_options(pol) -> dict:
    get = getattr(pol, "options", None)
    return get() if callable(get) else {}


# ---------------------------------------------------------------------------- traces


def _is_frame(obj: Any) -> bool:
    pd = sys.modules.get("pandas")
    return pd is not None and isinstance(obj, pd.DataFrame)


def _plain(v: Any) -> Any:
    """A DataFrame cell as the JSON loader sees it: numpy scalars and arrays as Python values."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()
    return v


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _trace(trace: TraceLike, seed: int = 0, tokenizer: Any = None, name: str | None = None,
           recount: bool = False):
    from schedlab import traces
    from schedlab.traces.schema import Request, Trace, TraceError, request_from_json

    if isinstance(trace, Trace):
        tr = trace
    elif isinstance(trace, (str, Path)):
        return traces.load(trace, seed=seed, tokenizer=tokenizer, recount=recount)
    elif _is_frame(trace):
        where = name or "DataFrame"
        missing = [c for c in ("id", "arrival_s", "output_tokens") if c not in trace.columns]
        if missing:
            raise TraceError(f"{where}: missing column(s) {', '.join(missing)} (a trace has id, arrival_s, "
                             f"prompt_tokens, output_tokens)")
        rows = [{k: _plain(v) for k, v in row.items() if not _missing(_plain(v))}
                for row in trace.to_dict("records")]
        tr = Trace(name or "dataframe", "", [request_from_json(row, i, where) for i, row in enumerate(rows)])
    elif isinstance(trace, Iterable) and not isinstance(trace, (bytes, Mapping)):
        reqs = list(trace)
        bad = next((r for r in reqs if not isinstance(r, Request)), None)
        if bad is not None:
            raise TraceError(f"a list of requests holds traces.Request objects, got {type(bad).__name__}")
        if not reqs:
            raise TraceError("the trace has no requests")
        tr = Trace(name or "requests", "", reqs)
    else:
        raise TraceError(f"a trace is a name or path, a dataset spec (random:n=50), a traces.Trace, a list of "
                         f"traces.Request or a DataFrame; got {type(trace).__name__}")
    if tokenizer is not None:
        tr = traces.tokenize(tr, tokenizer, recount=recount)
    return traces.require_counts(tr)


@_api
def load_trace(trace: TraceLike, *, seed: int = 0, tokenizer: Any = None, rate: float | None = None,
               head: int | None = None, name: str | None = None) -> "Trace":
    """A trace (``traces.Trace``: ``name``, ``requests``) from a bundled name or path (JSON,
    Azure CSV, Mooncake JSONL), a dataset spec (``"random:n=200,input_len=512,rate=2"``), a
    list of ``traces.Request`` or a DataFrame with the columns id, arrival_s, prompt_tokens,
    output_tokens. ``seed``: the loader's randomness (tick jitter, datasets); ``tokenizer``:
    counts prompts given as text; ``head``: keep the first N requests; ``rate``: rescale the
    arrivals to this mean rate (req/s); ``name``: the trace's name (lists and DataFrames)."""
    from schedlab import traces

    tr = _trace(trace, seed=seed, tokenizer=tokenizer, name=name)
    if head is not None:
        tr = traces.head(tr, head)
    if rate is not None:
        tr = traces.to_rate(tr, rate)
    return tr


@_api
def trace_stats(trace: TraceLike, *, seed: int = 0) -> dict[str, float]:
    """Requests, duration, mean rate, prompt and output token percentiles of a trace."""
    from schedlab import traces

    return traces.trace_stats(_trace(trace, seed=seed))


# ---------------------------------------------------------------------------- options


def _slo(slo: str | Mapping[str, float] | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` or ``{"ttft_ms": 500}``: the same checks either way."""
    from schedlab.sim.metrics import SLO_KEYS

    if slo is None or slo == "" or slo == {}:
        return {}
    if isinstance(slo, Mapping):
        out = {}
        for k, v in slo.items():
            if k not in SLO_KEYS:
                _fail(f"unknown SLO key {k!r} (use {', '.join(SLO_KEYS)})", 2)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                if isinstance(v, str):
                    out.update(_slo(f"{k}={v}"))
                    continue
                _fail(f"SLO {k}={v!r} is not a number", 2)
            if not math.isfinite(v) or v <= 0:
                _fail(f"SLO {k}={v!r} must be a finite number > 0", 2)
            out[k] = float(v)
        return out
    if not isinstance(slo, str):
        _fail(f"slo is a mapping such as {{'ttft_ms': 2000}} or a string 'ttft_ms=2000,...', got {type(slo).__name__}", 2)
    out: dict[str, float] = {}
    for item in slo.split(","):
        item = item.strip()
        if "=" not in item:
            _fail(f"SLO '{item}' is not key=value (keys: {', '.join(SLO_KEYS)})", 2)
        k, v = (x.strip() for x in item.split("=", 1))
        if k not in SLO_KEYS:
            _fail(f"unknown SLO key {k!r} (use {', '.join(SLO_KEYS)})", 2)
        try:
            limit = float(v)
        except ValueError:
            _fail(f"SLO {k}={v!r} is not a number", 2)
        if not math.isfinite(limit) or limit <= 0:
            _fail(f"SLO {k}={v!r} must be a finite number > 0", 2)
        out[k] = limit
    return out


def _check_kv_tokens(kv_tokens: int | None) -> None:
    if kv_tokens is None:
        return
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int):
        _fail(f"{opt('kv_tokens')} must be an integer, got {kv_tokens!r}", 2)
    if kv_tokens < 1:
        _fail(f"{opt('kv_tokens')} must be >= 1, got {kv_tokens}", 2)


def _seed(seed: Any, what: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        _fail(f"{opt(what)} must be an integer, got {seed!r}", 2)
    return seed


# ---------------------------------------------------------------------------- cost models


def _profile_path(profile: ProfileLike) -> Path:
    """A profile file: ``profile`` (a path, a bundled name, a ``Profile``), else the default."""
    from schedlab.sim.profiles import resolve_profile

    if isinstance(profile, Profile):
        return profile._file()
    return resolve_profile(None if profile is None else str(profile))


def _linear(profile: ProfileLike, kv_tokens: int | None):
    """(linear cost model, KV capacity, profile path)."""
    from schedlab.sim.cost import DEFAULT_KV_TOKENS, LinearCostModel

    _check_kv_tokens(kv_tokens)
    path = _profile_path(profile)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens if kv_tokens is not None else int(cost.meta.get("kv_tokens", DEFAULT_KV_TOKENS))
    return cost, capacity, path


def _pick_cost(profile: ProfileLike, kv_tokens, hardware, model_config, quant, cost=None):
    """(cost model, KV capacity, what meta.json records): ``cost`` (a model object) as it is, a
    measured profile (the default), or the analytic model of ``hardware`` + ``model_config``."""
    if cost is not None:
        if any(x is not None for x in (profile, hardware, model_config, quant)):
            _fail(f"give either cost or {opt('profile')} / {opt('hardware')}, not both", 2)
        _check_kv_tokens(kv_tokens)
        if isinstance(cost, Profile):
            return _pick_cost(cost, kv_tokens, None, None, None)
        if isinstance(cost, CostModel):
            return cost.model, (kv_tokens if kv_tokens is not None else cost.kv_tokens), dict(cost.source)
        if not (callable(getattr(cost, "pass_seconds", None)) and callable(getattr(cost, "step_overhead_seconds", None))):
            _fail(f"a cost model has pass_seconds(shape) and step_overhead_seconds(passes, rows); "
                  f"got {type(cost).__name__}", 2)
        from schedlab.sim.cost import DEFAULT_KV_TOKENS

        meta = getattr(cost, "meta", None)
        meta = meta if isinstance(meta, Mapping) else {}
        capacity = kv_tokens if kv_tokens is not None else int(meta.get("kv_tokens", DEFAULT_KV_TOKENS))
        return cost, capacity, {"cost_model": type(cost).__name__}
    if hardware is None and model_config is None:
        if quant is not None:
            _fail(f"{opt('quant')} goes with {opt('hardware')} and {opt('model_config')}", 2)
        model, capacity, path = _linear(profile, kv_tokens)
        return model, capacity, {"profile": str(path)}
    if not (hardware and model_config):
        _fail(f"{opt('hardware')} and {opt('model_config')} go together", 2)
    if profile is not None:
        _fail(f"give either {opt('profile')} or {opt('hardware')}/{opt('model_config')}, not both", 2)
    _check_kv_tokens(kv_tokens)
    from schedlab.analysis.analytic import make_analytic_cost_model

    model, capacity, meta = make_analytic_cost_model(hardware, model_config, quant)
    return model, (kv_tokens if kv_tokens is not None else capacity), {"analytic": meta}


@_api
def cost_model(profile: ProfileLike = None, *, kv_tokens: int | None = None, hardware: str | None = None,
               model_config: str | Path | None = None, quant: int | None = None) -> CostModel:
    """The cost model ``simulate`` would use, with its KV capacity: a measured profile's
    linear model (``profile``: a path, a bundled name or a ``Profile``; default: the bundled
    one), or the analytic roofline of ``hardware`` (a preset: ``m4-max``, ``h100-sxm``, ...)
    running ``model_config`` (``qwen3-8b``, a config.json) at ``quant`` bits."""
    model, capacity, meta = _pick_cost(profile, kv_tokens, hardware, model_config, quant)
    return CostModel(model, capacity, meta)


@_api
def load_profile(profile: str | Path | None = None) -> Profile:
    """A cost profile from a file or a bundled name (default: the bundled measured profile)."""
    from schedlab.sim.cost import read_profile

    path = _profile_path(profile)
    return Profile(read_profile(path), path)


# ---------------------------------------------------------------------------- simulate


@_api
def simulate(policy: PolicyLike, trace: TraceLike, *, options: Mapping[str, Any] | None = None,
             profile: ProfileLike = None, kv_tokens: int | None = None, hardware: str | None = None,
             model_config: str | Path | None = None, quant: int | None = None, cost: Any = None,
             seed: int = 0, slo: str | Mapping[str, float] | None = None, block_size: int = 16,
             prefix_caching: bool = False, max_concurrency: int | None = None,
             request_rate: float | str | None = None, burstiness: float | None = None,
             think_time: float | None = None, passes: bool = True) -> Run:
    """Simulate ``policy`` on ``trace`` (the ``simulate`` command).

    ``options``: the policy's options (``-o``); ``profile``: a cost profile (default: the
    bundled measured one); ``kv_tokens``: KV capacity (default: the profile's, or what the
    hardware's memory holds); ``hardware`` + ``model_config`` [+ ``quant``]: the analytic
    roofline model instead of a profile; ``cost``: any cost model object (``pass_seconds``,
    ``step_overhead_seconds``) or a ``CostModel``; ``seed``: the trace's randomness;
    ``slo``: goodput SLOs (``{"ttft_ms": 2000, "tpot_ms": 100}``); ``block_size``: KV block size in
    tokens; ``prefix_caching``: block-level prefix caching; ``max_concurrency`` / ``request_rate`` /
    ``burstiness`` / ``think_time``: clients as ``vllm bench serve`` has them; ``passes=False``:
    keep no pass log (no ``run.passes``, no passes.parquet; less memory and time on long
    traces, what ``simulate`` does without ``--passes``)."""
    from schedlab.sim import run as run_loop
    from schedlab.sim.gcpause import gc_paused
    from schedlab.sim.metrics import summarize

    seed = _seed(seed)
    pol = _policy(policy, options)
    slos = _slo(slo)
    tr = _trace(trace, seed=seed)
    arrivals = _arrivals(tr, block_size, max_concurrency, request_rate, burstiness, think_time, seed)
    model, capacity, cost_meta = _pick_cost(profile, kv_tokens, hardware, model_config, quant, cost)
    result = run_loop(arrivals, pol, model, kv_capacity=capacity, trace_name=tr.name, block_size=block_size,
                      prefix_caching=bool(prefix_caching), record_passes=bool(passes))
    @gc_paused()
    def summary():  # when first needed (saving writes the large tables meanwhile)
        return summarize(result, slo=slos or None)

    return Run(result, summary, {**cost_meta, "kv_tokens": result.kv_capacity, "block_size": block_size,
                                 "prefix_caching": bool(prefix_caching), "seed": seed,
                                 "policy_options": _policy_options(pol)})


def _arrivals(tr, block_size, max_concurrency, request_rate, burstiness, think_time, seed):
    """The trace's requests, or closed-loop clients over them; bad settings are one line."""
    from .common import check_kv_layout, make_arrivals, parse_rate

    check_kv_layout(block_size)
    rate = parse_rate(None if request_rate is None else str(request_rate))
    return make_arrivals(tr.requests, max_concurrency, rate, burstiness, think_time, seed)


# ---------------------------------------------------------------------------- the real engine


def _check_model(model: str, dtype: str) -> None:
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine.models import check_spec

    if not isinstance(model, (str, Path)):
        _fail(f"model is a preset name, a .gguf file or a checkpoint directory, got {type(model).__name__}", 2)
    check_spec(str(model), dtype)


@contextlib.contextmanager
def _noise(spec: str | None):
    """The engine's noise settings (``engine.noise``: gc-off, pin=CPUS, warmup=N, malloc-keep,
    mlx-cache=SIZE), checked; in the environment while the call runs, so that every backend and
    calibration it makes uses them (as the commands' ``--noise`` does). Yields the settings."""
    import os

    from schedlab.engine.noise import ENV, Noise

    if spec is not None and not isinstance(spec, str):
        _fail(f"noise is a string such as 'gc-off,pin=0-1,warmup=3', got {type(spec).__name__}", 2)
    noise = Noise.parse(spec if spec is not None else os.environ.get(ENV))
    saved = os.environ.get(ENV)
    if spec is not None:
        os.environ[ENV] = spec
    try:
        yield noise
    finally:
        if spec is not None:
            if saved is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved


@_api
def model_info(model: str = "tiny", *, dtype: str = "float32", model_seed: int = 0) -> dict[str, Any]:
    """What the engine records about ``model`` (as in a real run's meta.json): architecture,
    parameters, dtype, tokenizer, mlx and mlx-lm versions, device, BLAS and machine. Loads it."""
    from schedlab.engine.models import load_model

    _check_model(model, dtype)
    return load_model(str(model), dtype=dtype, seed=_seed(model_seed, "model_seed")).metadata()


@_api
def profile_mismatch(profile: ProfileLike, *, model: str = "tiny", dtype: str = "float32",
                     model_seed: int = 0) -> str | None:
    """Why ``profile`` was not measured on ``model`` on this machine, or None when it was."""
    from schedlab.engine.calibrate import profile_mismatch as mismatch
    from schedlab.engine.models import load_model
    from schedlab.sim.cost import read_profile

    _check_model(model, dtype)
    data = profile._data if isinstance(profile, Profile) else read_profile(_profile_path(profile))
    return mismatch(data, load_model(str(model), dtype=dtype, seed=_seed(model_seed, "model_seed")))


def _blas_mismatch(profile_blas, engine_blas) -> str | None:
    """A one-line warning when the profile was measured under another BLAS or thread count."""
    if not isinstance(profile_blas, dict):
        return None
    want = (profile_blas.get("name"), profile_blas.get("threads"))
    have = (engine_blas.get("name"), engine_blas.get("threads"))
    if want[0] is None:
        return None
    if want[0] != have[0] or (want[1] is not None and want[1] != have[1]):
        return (f"the profile was measured with BLAS {want[0]} ({want[1]} threads) but the engine "
                f"uses {have[0]} ({have[1]} threads): predicted_s will be off")
    return None


def _real_cost(profile: ProfileLike, kv_tokens: int | None, no_calibrate: bool, info, log: Log,
               notes: list[str]):
    """(cost model, KV capacity, profile path) the policy sees and steps are predicted with.

    ``profile``: that file (a warning when it was measured elsewhere). Otherwise one measured on
    this model and machine (bundled, or calibrate's cache), else a quick calibration now (cached
    for the next run), as ``validate`` does; with ``no_calibrate`` the bundled default profile,
    which ``simulate`` uses, with a warning that its predictions are for another setup.
    """
    from schedlab.engine.calibrate import candidate_profiles, find_or_calibrate, profile_mismatch
    from schedlab.sim.cost import read_profile
    from schedlab.sim.profiles import resolve_profile

    def note(kind: str, text: str) -> None:
        notes.append(text)
        log(kind, text)

    if profile is None and no_calibrate:
        matching = []
        for p in candidate_profiles(info):
            try:
                if profile_mismatch(read_profile(p), info) is None:
                    matching.append(p)
            except Exception:  # a broken cache file is no match
                continue
        path = matching[0] if matching else resolve_profile(None)
        if not matching:
            note("warning", f"no cost profile for model {info.name} on this machine: the policy plans and "
                            f"steps.parquet's predicted_s come from the bundled {path.name} (measured elsewhere)")
    else:
        given = None if profile is None else str(_profile_path(profile))
        path, why = find_or_calibrate(given, info, None, lambda msg: log("progress", msg))
        if why:
            note("note" if profile is None else "warning", why)
    return _linear(path, kv_tokens)


@_api
def run_real(policy: PolicyLike, trace: TraceLike, *, model: str = "tiny", dtype: str = "float32",
             options: Mapping[str, Any] | None = None, profile: ProfileLike = None, no_calibrate: bool = False,
             kv_tokens: int | None = None, seed: int = 0, ignore_eos: bool = False, model_seed: int = 0,
             sampling: str = "greedy", slo: str | Mapping[str, float] | None = None, noise: str | None = None,
             log: Log | None = None, on_step: Callable[[int, int], None] | None = None, block_size: int = 16,
             prefix_caching: bool = False, max_concurrency: int | None = None,
             request_rate: float | str | None = None, burstiness: float | None = None,
             think_time: float | None = None) -> Run:
    """Run ``policy`` on ``trace`` with a real MLX model (the ``run-real`` command): the same
    loop as ``simulate``, every pass a real forward, the clock wall time.

    ``model``: a preset (``micro``, ``tiny``, ``small``, ``smollm2-135m``), a llama ``.gguf``
    file or an mlx-lm checkpoint directory; ``dtype``; ``profile``: the cost model the policy
    sees and each step is predicted with (default: one measured on this model and machine, else
    a quick calibration first; ``no_calibrate``: the bundled profile instead); ``seed``: the
    trace's and the prompt ids' seed; ``ignore_eos``: generate every request's output_tokens,
    past the model's EOS; ``model_seed``: a preset's random weights; ``sampling``:
    ``"greedy"`` or ``"temperature=0.7,seed=1"``; ``noise``: settings that may lower the run's
    timing noise (``"gc-off,pin=0-1,warmup=3"``, see engine/noise.py; default ``$SCHEDLAB_NOISE``).
    Prompts given as text are counted with the model's tokenizer; ``run.texts`` holds what the
    model generated, ``run.features`` and ``run.residuals()`` the steps' measured/predicted.
    ``log(kind, message)`` hears progress, notes and warnings (default: warnings as
    ``SchedlabWarning``); ``on_step(finished, requests)`` is called after every step."""
    log = _logger(log)
    seed, model_seed = _seed(seed), _seed(model_seed, "model_seed")
    pol, sampler = _real_checks(policy, options, model, dtype, sampling, kv_tokens, block_size)
    slos = _slo(slo)
    from .common import check_client_options, parse_rate

    check_client_options(max_concurrency, parse_rate(None if request_rate is None else str(request_rate)),
                         burstiness, think_time)  # bad client options fail before the model loads
    clients = (block_size, bool(prefix_caching), max_concurrency, request_rate, burstiness, think_time)
    with _noise(noise) as settings:
        return _run_real(pol, trace, slos, model, dtype, sampler, profile, no_calibrate, kv_tokens, seed,
                         ignore_eos, model_seed, settings, log, on_step, clients)


def _real_checks(policy, options, model, dtype, sampling, kv_tokens, block_size):
    """(policy, sampler): what run-real and serve check before a model loads (policy and its
    options, model spec, sampling, KV capacity and block size)."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine.sampling import parse_sampling

    from .common import check_kv_layout

    pol = _policy(policy, options)
    _check_model(model, dtype)
    sampler = parse_sampling(sampling)
    _check_kv_tokens(kv_tokens)
    check_kv_layout(block_size)
    return pol, sampler


def _real_cost_checked(profile, kv_tokens, no_calibrate, info, log: Log, notes: list[str]):
    """``_real_cost``, with a warning when the profile was measured under another BLAS setup."""
    from schedlab.engine import blas

    cost, capacity, profile_path = _real_cost(profile, kv_tokens, no_calibrate, info, log, notes)
    mismatch = _blas_mismatch(cost.meta.get("blas"), blas.info())
    if mismatch:
        notes.append(mismatch)
        log("warning", mismatch)
    return cost, capacity, profile_path


def _run_real(pol, trace, slos, model, dtype, sampler, profile, no_calibrate, kv_tokens, seed, ignore_eos,
              model_seed, noise, log, on_step, clients=(16, False, None, None, None, None)) -> Run:
    from schedlab.engine.models import load_model

    if profile is not None:
        _profile_path(profile)  # a bad profile fails before the model loads
    notes: list[str] = []
    info = load_model(str(model), dtype=dtype, seed=model_seed)
    tok = info.tokenizer  # the trace is read with the model's tokenizer: text prompts counted by it
    tr = _trace(trace, seed=seed, tokenizer=tok, recount=tok is not None)
    info.check_trace(tr.requests)
    cost, capacity, profile_path = _real_cost_checked(profile, kv_tokens, no_calibrate, info, log, notes)

    from schedlab.engine.backend import MLXBackend

    hook = None if on_step is None else (lambda state: on_step(state.finished, state.n_accepted))

    block_size, prefix_caching, max_concurrency, request_rate, burstiness, think_time = clients
    arrivals = _arrivals(tr, block_size, max_concurrency, request_rate, burstiness, think_time, seed)
    backend = MLXBackend(info, sampling=sampler, seed=seed, ignore_eos=ignore_eos)
    return _real_run(pol, arrivals, tr.name, backend, cost, capacity, profile_path, slos, notes, noise,
                     seed=seed, model_seed=model_seed, on_step=hook, block_size=block_size,
                     prefix_caching=prefix_caching)


def _real_run(pol, arrivals, trace_name: str, backend, cost, capacity: int, profile_path, slos, notes: list[str],
              noise, *, seed: int, model_seed: int, on_step=None, block_size: int = 16, prefix_caching: bool = False,
              clock=None) -> Run:
    """The replica loop on the real engine (``backend``: an ``MLXBackend``) over ``arrivals`` (a
    trace's requests or a source: ``serve``'s live one), as a ``Run`` with what run-real records."""
    from schedlab.analysis.residuals import bias
    from schedlab.sim import run as run_loop
    from schedlab.sim.features import step_table
    from schedlab.sim.metrics import summarize

    result = run_loop(arrivals, pol, cost, kv_capacity=capacity, backend=backend, trace_name=trace_name,
                      on_step=on_step, block_size=block_size, prefix_caching=prefix_caching, clock=clock)
    summary = summarize(result, slo=slos or None)
    return Run(result, summary, {"profile": str(profile_path), "kv_tokens": result.kv_capacity, "seed": seed,
                                 "block_size": block_size, "prefix_caching": prefix_caching,
                                 "model_seed": model_seed, "policy_options": _policy_options(pol),
                                 "warnings": notes, "step_bias": bias(step_table(result)),
                                 "noise": noise.describe()},
               _write_texts=lambda path: backend.write_texts(path, result.requests))


def _grid(grid: str | Mapping[str, Any] | None, quick: bool, info=None):
    """The calibration grid: ``grid`` by name, or the model's grid (the compact one for large
    models, else quick or default; ``engine.calibrate.grid_for``) with ``grid``'s fields."""
    import dataclasses

    from schedlab.engine.calibrate import GRIDS, grid_for

    base = grid_for(info, quick=quick) if info is not None else GRIDS["quick" if quick else "default"]
    if grid is None:
        return base
    if isinstance(grid, str):
        if grid not in GRIDS:
            _fail(f"unknown grid {grid!r} (grids: {', '.join(GRIDS)}, or a mapping of grid fields)", 2)
        return GRIDS[grid]
    if not isinstance(grid, Mapping):
        _fail(f"grid is a name ({', '.join(GRIDS)}) or a mapping of grid fields, got {type(grid).__name__}", 2)
    fields = {f.name for f in dataclasses.fields(base)}
    bad = sorted(set(grid) - fields)
    if bad:
        _fail(f"grid: unknown field(s) {', '.join(map(str, bad))} (fields: {', '.join(sorted(fields))})", 2)
    return dataclasses.replace(base, **{"name": f"{base.name}+custom", **grid})


def _from_runs(runs: Sequence[Any], grid: Any, out: str | Path | None) -> Profile:
    """calibrate --from-runs: a profile fitted to real runs' features.parquet (no mlx needed)."""
    import json

    from schedlab.analysis.runfit import RunsError, load_runs, profile_from_runs

    if isinstance(runs, (str, Path)):
        runs = [runs]
    dirs = [r._dir if isinstance(r, Run) and r._dir is not None else r for r in runs]
    if any(isinstance(d, Run) for d in dirs):
        _fail("from_runs takes run directories: save() a Run first", 2)
    if not dirs:
        _fail(f"{opt('from_runs')} needs one or more run directories", 2)
    out = Path(out) if out is not None else None
    if out is not None:
        if out.exists() and out.is_dir():
            _fail(f"{opt('out')} {out} is a directory; give a file name")
        if not out.parent.exists():
            _fail(f"{opt('out')}: directory {out.parent} does not exist")
    grid_prof = None
    if isinstance(grid, Profile):
        grid_prof = grid.data
    elif grid is not None:
        if not isinstance(grid, (str, Path)):
            _fail(f"with from_runs, grid is a grid profile (a path or a Profile), got {type(grid).__name__}", 2)
        try:
            grid_prof = json.loads(Path(grid).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            _fail(f"{opt('grid')} {grid}: not a readable profile JSON ({exc})")
        if not isinstance(grid_prof, dict) or not isinstance(grid_prof.get("coefficients"), dict):
            _fail(f"{opt('grid')} {grid}: not a profile (no coefficients)")
    try:
        data = profile_from_runs(load_runs([Path(d) for d in dirs]), grid_prof,
                                 kind="grid+runs" if grid_prof else "runs")
    except RunsError as exc:
        _fail(str(exc))
    prof = Profile(data)
    if out is not None:
        prof.save(out)
    return prof


def _stored_profile(path: Path, info) -> dict:
    """A profile JSON with samples, measured on this model and machine."""
    import json

    from schedlab.engine.calibrate import profile_mismatch

    name = opt("from_profile")
    try:
        prof = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _fail(f"{name} {path}: not a readable profile JSON ({exc})")
    if not isinstance(prof, dict) or not isinstance(prof.get("samples"), list) or not prof["samples"]:
        _fail(f"{name} {path}: the profile stores no samples")
    missing = [k for k in ("fit_report", "calibration", "coefficients") if k not in prof]
    if missing:
        _fail(f"{name} {path}: not a calibrate profile (no {', '.join(missing)})")
    why = profile_mismatch(prof, info)
    if why:
        _fail(f"{name} {path} was not measured on this model and machine: {why}")
    return prof


@_api
def calibrate(*, model: str = "tiny", dtype: str = "float32", quick: bool = False,
              grid: str | Mapping[str, Any] | Path | Profile | None = None, seed: int = 0, model_seed: int = 0,
              analytic: bool = False, from_profile: str | Path | None = None, replay: bool = False,
              keep_runs: str | Path | None = None, from_runs: Sequence[str | Path] | None = None,
              out: str | Path | None = None, log: Log | None = None) -> Profile:
    """Time real passes over a grid and fit the cost model (the ``calibrate`` command).

    ``quick``: the smaller grid (models above 50M parameters use the compact one); ``grid``: a
    grid by name (``quick``, ``default``, ``compact``) or a mapping of ``engine.calibrate.Grid``
    fields replacing those of the chosen grid (e.g.
    ``{"decode_batches": (1, 2, 4), "rounds": 2}``); ``analytic``: also fit the cpu-local
    roofline's factors; ``from_profile``: with ``analytic``, time nothing and fit those factors
    to this profile's samples; ``replay``: the default calibration (what ``validate`` and
    ``run_real`` make when no profile matches: the quick grid, then a short real replay of a few
    policies, fitted together), ``keep_runs``: keep the replay's run directories there;
    ``from_runs``: time nothing, fit to these real runs' steps (``run_real``/``validate`` output
    directories, their features.parquet), whole runs held out, on top of ``grid``'s fit when
    ``grid`` is then a grid profile (a path or ``Profile``); ``out``: write the profile JSON (and
    its .md report) there. ``log`` hears progress lines."""
    if from_runs is not None:
        return _from_runs(from_runs, grid, out)
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine import blas

    log = _logger(log)
    seed, model_seed = _seed(seed), _seed(model_seed, "model_seed")
    _check_model(model, dtype)
    out = Path(out) if out is not None else None
    if out is not None:
        if out.exists() and out.is_dir():
            _fail(f"{opt('out')} {out} is a directory; give a file name")
        if not out.parent.exists():
            _fail(f"{opt('out')}: directory {out.parent} does not exist")
    if from_profile is not None and not analytic:
        _fail(f"{opt('from_profile')} goes with {opt('analytic')}", 2)
    if from_profile is not None and not Path(from_profile).is_file():
        _fail(f"{opt('from_profile')} {from_profile}: no such file")
    if keep_runs is not None and not replay:
        _fail(f"{opt('keep_runs')} goes with {opt('replay')}", 2)
    _grid(grid, quick)  # a bad grid fails before the model loads
    from schedlab.engine.calibrate import calibrate as run_calibration
    from schedlab.engine.models import load_model

    info = load_model(str(model), dtype=dtype, seed=model_seed)
    blas.notify_if_missing()
    chosen = _grid(grid, quick, info)

    def say(msg: str) -> None:
        log("progress", msg)

    if from_profile is not None:
        data = _stored_profile(Path(from_profile), info)
    elif replay:
        from schedlab.engine.calibrate import calibrate_default

        data = calibrate_default(info, seed=seed, progress=say, keep=Path(keep_runs) if keep_runs is not None else None)
    else:
        data = run_calibration(info, chosen, seed=seed, progress=say)
    if analytic:
        from schedlab.engine.calibrate import fit_analytic

        say("analytic roofline: fitting cpu-local's factors to the samples")
        data["analytic_cpu_local"] = fit_analytic(data["samples"], info)
    prof = Profile(data)
    if out is not None:
        prof.save(out)
    return prof


# ---------------------------------------------------------------------------- validate


def validate_many(pols: Mapping[str, Any], tr, info, cost, capacity, dirs: Mapping[str, Path | None], repeat: int,
                  seed: int, cost_meta: dict, say, speed_check_runs: bool = True, speed_probe: str = "passes",
                  probe_each_round: bool = False) -> dict[str, tuple[dict, Run, list[Run]]]:
    """Policies side by side: each one's simulation, then the real runs round by round — run k
    of every policy before run k + 1 of any — and the machine's speed timed once before the
    first round and once after the last. This machine's speed drifts by tens of percent within
    minutes (``bench/drift.py``): one policy's runs after another's would compare the two
    policies at two speeds of the machine; interleaved, every policy meets the same spells.
    Then, per policy, the comparison (validation.json's content, written under its directory
    when given), its simulated run and its real runs.

    ``speed_probe``: how the machine's speed is timed before and after: ``"passes"`` (the
    profile's reference passes, isolated: ``engine.calibrate.speed_check``) or ``"replay"`` (a
    default calibration's own replay run again by one policy in the real loop:
    ``replay_speed_check``; the reference passes where the profile has no replay).
    ``probe_each_round``: the speed timed before every round as well (``repeat`` + 1 probes,
    ``machine_speed["probes"]``), and the drift-adjusted simulation made per real run at the
    speed interpolated in time between the probes around it (``probe_speeds``): a run sits a
    round's length from a probe, not the whole validation's — this machine's speed moves by
    several percent from one run to the next, so the two ends' mean misses the run's speed by
    5 % (median over 798 recorded runs) where the runs of the same round miss it by 3.6 %.
    Measured in two recordings (``bench/fidelity.py --probe-each-round``): no better than the
    two ends' mean — one probe is itself a noisy reading, missing a run's own speed by 4-8 %
    (median) — so it is not the default.

    The real runs plan and predict with the same cost model as the simulation: the policy
    sees the same estimates on both sides, and steps.parquet's predicted_s (the per-step error)
    is that model's, analytic with ``hardware``."""
    import json
    import time

    from schedlab.engine.backend import MLXBackend
    from schedlab.engine.calibrate import has_replay, replay_speed_check, speed_check
    from schedlab.sim import run as run_loop
    from schedlab.sim.features import step_table
    from schedlab.sim.metrics import summarize
    from schedlab.analysis.residuals import bias, concat, residual_table
    from schedlab.analysis.validation import compare as compare_runs

    sims: dict[str, Run] = {}
    metas = {}
    for name, pol in pols.items():
        metas[name] = {"cost_model": cost_meta, "kv_tokens": capacity, "seed": seed,
                       "policy_options": _policy_options(pol)}
        say(f"{pol.name}: simulating")
        sim_res = run_loop(tr.requests, pol, cost, kv_capacity=capacity, trace_name=tr.name)
        sims[name] = Run(sim_res, summarize(sim_res), metas[name])
        if dirs.get(name) is not None:
            sims[name].save(dirs[name] / "sim")
    if speed_probe not in ("passes", "replay"):
        raise ValueError(f"speed_probe: 'passes' or 'replay', not {speed_probe!r}")
    speed_ref = _speed_reference(cost_meta) if speed_check_runs else None
    speed = {}

    replay = speed_probe == "replay" and has_replay(speed_ref)

    def time_speed():
        got = replay_speed_check(info, speed_ref) if replay else None
        return got if got is not None else speed_check(info, speed_ref, seed=seed)

    t_start = time.perf_counter()
    probes: list[dict] = []
    run_at: dict[str, list[float]] = {name: [] for name in pols}

    def probe() -> dict | None:
        t = time.perf_counter()
        got = time_speed()
        if got is not None:  # when it ran, in seconds from the first probe's start (its midpoint)
            got = dict(got, at_s=round((t + time.perf_counter()) / 2 - t_start, 2))
            probes.append(got)
        return got

    if speed_ref is not None:
        say("running the profile's replay again (the machine's speed now)" if replay
            else "timing the profile's reference passes (the machine's speed now)")
        speed["before"] = probe()
    reals: dict[str, list[Run]] = {name: [] for name in pols}
    for k in range(repeat):
        if k and probe_each_round and speed_ref is not None:
            say(f"the machine's speed again, before round {k + 1}/{repeat}")
            probe()
        for name, pol in pols.items():
            say(f"{pol.name}: real run {k + 1}/{repeat}")
            t = time.perf_counter()
            res = run_loop(tr.requests, pol, cost, kv_capacity=capacity,
                           backend=MLXBackend(info, seed=seed, ignore_eos=True), trace_name=tr.name)
            run_at[name].append((t + time.perf_counter()) / 2 - t_start)
            real = Run(res, summarize(res), metas[name])
            if dirs.get(name) is not None:
                real.save(dirs[name] / real_dir_name(k))
            if res.error:
                _fail(f"{pol.name}: real run stopped: {res.error}")
            reals[name].append(real)
    if speed_ref is not None:
        speed["after"] = probe()
        if probe_each_round:
            speed["probes"] = probes
    out = {}
    for name, pol in pols.items():
        summaries = [r._summary for r in reals[name]]
        steps = [st for r in reals[name] for st in r._result.steps]
        v = compare_runs(sims[name]._summary, summaries, policy=pol.name, trace=tr.name, real_steps=steps)
        tables = [step_table(r._result) for r in reals[name]]
        feats = concat(tables)
        v["step_bias"] = bias(feats)
        v["residuals"] = residual_table(feats)
        if speed_ref is not None:
            v["machine_speed"] = speed
            at = probe_speeds(probes, run_at[name]) if probe_each_round else None
            adj = drift_adjusted(pol, tr, cost, capacity, speed, summaries, steps, run_speeds=at,
                                 run_steps=[r._result.steps for r in reals[name]])
            if adj is not None and at is not None:
                ends = ends_only(pol, tr, cost, capacity, speed, summaries, [r._result.steps for r in reals[name]])
                if ends is not None:
                    adj["ends_only"] = ends
            if adj is not None:
                v["drift_adjusted"] = adj
        matched = speed_matched(pol, tr, cost, capacity, summaries, [run_speed(t) for t in tables])
        if matched is not None:
            v["speed_matched"] = matched
        v["model"] = info.name
        v["cost_model"] = cost_meta
        v["sim_dir"] = "sim"
        v["real_dirs"] = [real_dir_name(k) for k in range(repeat)]
        if dirs.get(name) is not None:
            (dirs[name] / "validation.json").write_text(json.dumps(v, indent=2) + "\n")
        out[name] = (v, sims[name], reals[name])
    return out


def probe_speeds(probes: list[dict], at: list[float]) -> list[float] | None:
    """Each real run's speed as the speed probes around it tell it: linear in time between the
    last probe before the run's midpoint and the first after it (``at``: the runs' midpoints
    and the probes' ``at_s``, seconds on one clock); the nearest probe's outside them. None
    without two timed probes."""
    pts = sorted((p["at_s"], p["ratio"]) for p in probes if p and p.get("ratio") and p.get("at_s") is not None)
    if len(pts) < 2:
        return None
    out = []
    for t in at:
        if t <= pts[0][0]:
            out.append(pts[0][1])
        elif t >= pts[-1][0]:
            out.append(pts[-1][1])
        else:
            (t0, r0), (t1, r1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= t <= b[0])
            out.append(r0 + (r1 - r0) * (t - t0) / (t1 - t0) if t1 > t0 else (r0 + r1) / 2)
    return out


def ends_only(pol, tr, cost, capacity, speed: dict, reals: list, run_steps: list[list]) -> dict | None:
    """Beside a drift-adjusted comparison probed each round: the same made with every run at the
    mean of the first and last probes only (as ``drift_adjusted`` without the probes between the
    rounds, the policy planning with the cost model the same way): what the probes between the
    rounds added. Its speed factor and median / worst |error|."""
    ratios = [r["ratio"] for r in (speed.get("before"), speed.get("after")) if r and r.get("ratio")]
    if not ratios:
        return None
    factor = sum(ratios) / len(ratios)
    got = drift_adjusted(pol, tr, cost, capacity, speed, reals, [], run_speeds=[factor] * len(reals),
                         run_steps=run_steps)
    return None if got is None else {k: got[k] for k in ("speed_factor", "median_abs_error_pct", "max_abs_error_pct")}


def drift_adjusted(pol, tr, cost, capacity, speed: dict, reals: list, steps: list,
                   run_speeds: list[float] | None = None, run_steps: list[list] | None = None) -> dict | None:
    """The simulation again with every pass scaled by the machine's measured speed during the
    real runs (the mean of the before/after ratios), compared with the same real runs: how far
    the model is once the machine's drift is taken out. Reported beside the plain comparison,
    never instead of it.

    ``run_speeds`` (one per real run, from probes timed between the rounds: ``probe_speeds``)
    and ``run_steps`` (each real run's steps): the simulation made once per real run at its own
    probed speed, the policy planning with the cost model as in the real run (``time_scale``),
    the metrics' medians compared — as ``speed_matched``, with speeds the runs' own timings
    never set."""
    from schedlab.sim import run as run_loop
    from schedlab.sim.cost import ScaledCostModel
    from schedlab.sim.metrics import summarize
    from schedlab.analysis.validation import compare as compare_runs, step_errors

    if run_speeds is not None and run_steps is not None and len(run_speeds) == len(reals) == len(run_steps):
        got = speed_matched(pol, tr, cost, capacity, reals, run_speeds)
        if got is None:
            return None
        scaled = [s._replace(predicted_s=s.predicted_s * f) for f, st in zip(run_speeds, run_steps) for s in st]
        return {"kind": "probed each round", "speed_factor": sum(run_speeds) / len(run_speeds),
                "speeds": [float(f) for f in run_speeds], "median_abs_error_pct": got["median_abs_error_pct"],
                "max_abs_error_pct": got["max_abs_error_pct"], "step_error_pct": step_errors(scaled),
                "error_pct": got["error_pct"]}
    ratios = [r["ratio"] for r in (speed.get("before"), speed.get("after")) if r and r.get("ratio")]
    if not ratios:
        return None
    factor = sum(ratios) / len(ratios)
    res = run_loop(tr.requests, pol, ScaledCostModel(cost, factor), kv_capacity=capacity, trace_name=tr.name)
    scaled = [s._replace(predicted_s=s.predicted_s * factor) for s in steps]
    c = compare_runs(summarize(res), reals, policy=pol.name, trace=tr.name, real_steps=scaled)
    return {"speed_factor": factor, "median_abs_error_pct": c["median_abs_error_pct"],
            "max_abs_error_pct": c["max_abs_error_pct"], "step_error_pct": c["step_error_pct"],
            "error_pct": {k: r["error_pct"] for k, r in c["metrics"].items()}}


def run_speed(cols, coef: Mapping[str, float] | None = None) -> float | None:
    """A real run's own speed against its cost model: its steps' total measured seconds over
    their total predicted seconds, from its step table (``sim.features.step_table``, or a run
    directory's features.parquet as ``analysis.runfit.load_runs`` reads it); ``coef``: predicted
    by these coefficients instead of the run's own predictions. None without measured steps."""
    from schedlab.analysis.residuals import run_speed as speed

    return speed(cols, coef)


def speed_matched(pol, tr, cost, capacity, reals: list, speeds: list, jitter=None) -> dict | None:
    """The comparison again with the simulation made at each real run's own speed (``run_speed``:
    the one number a real run tells about the machine as a whole while it ran; the policy still
    plans with the cost model, as it did in the real run): per metric the median of those
    simulations against the median of the real runs, as the plain comparison takes it. On a
    shared machine that speed moves by tens of percent between identical runs minutes apart;
    this takes it out, so what remains is the model's — the order and shape of the steps, the
    queueing they cause — while the speeds are reported beside it. Reported beside the plain
    comparison, never instead of it. ``jitter`` (``sim.jitter.StepJitter``): each simulation
    with that step jitter (seed: the real run's index)."""
    from schedlab.sim import run as run_loop
    from schedlab.sim.backend import SimBackend
    from schedlab.sim.metrics import summarize
    from schedlab.analysis.validation import compare as compare_runs, median_summary

    if not reals or len(speeds) != len(reals) or any(f is None for f in speeds):
        return None
    sims = [summarize(run_loop(tr.requests, pol, cost, kv_capacity=capacity, trace_name=tr.name,
                               backend=SimBackend(cost, time_scale=f, jitter=jitter, seed=i)))
            for i, f in enumerate(speeds)]
    c = compare_runs(median_summary(sims), reals, policy=pol.name, trace=tr.name)
    return {"speeds": [round(f, 4) for f in speeds],
            "median_abs_error_pct": c["median_abs_error_pct"], "max_abs_error_pct": c["max_abs_error_pct"],
            "error_pct": {k: r["error_pct"] for k, r in c["metrics"].items()}}


def _speed_reference(cost_meta: dict) -> dict | None:
    """The measured profile the speed check times against (None for an analytic model)."""
    import json

    path = cost_meta.get("profile")  # analytic: only cpu-local factors fitted to a profile name one
    if not path:
        return None
    try:
        prof = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return prof if isinstance(prof, dict) and prof.get("samples") else None


def _validation_cost(profile: ProfileLike, hardware, kv_tokens, info, out: Path | None, log: Log):
    """(cost model, KV capacity, description) for both sides of the validation.

    Without ``hardware``: the linear model of a measured profile (``find_or_calibrate``).
    With it: the analytic roofline of the engine's model (its config; the dtype's width for
    weights and KV) on that hardware preset. On ``cpu-local`` its factors are the ones fitted
    to this model on this machine where a matching profile has them (``calibrate
    --analytic``), else fitted now to a matching profile's stored samples, else the priors;
    one note says which.
    """
    from schedlab.sim.cost import DEFAULT_KV_TOKENS

    if hardware:
        cost, meta = analytic_cost(hardware, info)
        log("note", meta["factors_note"])
        return cost, kv_tokens or DEFAULT_KV_TOKENS, meta
    from schedlab.sim.cost import LinearCostModel
    from schedlab.engine.calibrate import find_or_calibrate

    given = None if profile is None else str(_profile_path(profile))
    path, note = find_or_calibrate(given, info, out, lambda msg: log("progress", msg))
    if note:
        log("note", note)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens or int(cost.meta.get("kv_tokens", DEFAULT_KV_TOKENS))
    return cost, capacity, {"kind": "linear", "profile": str(path)}


def _matching_profiles(info):
    """Profiles measured on this model and machine: bundled ones, then calibrate's cache."""
    import json

    from schedlab.engine.calibrate import candidate_profiles, profile_mismatch

    for path in candidate_profiles(info):
        try:
            prof = json.loads(path.read_text())
            if isinstance(prof, dict) and profile_mismatch(prof, info) is None:
                yield path, prof
        except Exception:  # a broken file is no match
            continue


def analytic_cost(hardware: str, info):
    """(analytic cost model, description) of ``info``'s model on ``hardware``."""
    from schedlab.engine.calibrate import analytic_bits
    from schedlab.analysis.analytic import analytic_from_config, load_hardware
    from schedlab.analysis.analytic.local import BLOCK_KEY, block_mismatch, efficiency_from_block, fit_local

    bits, kv_bits = analytic_bits(info)
    hw = load_hardware(hardware)
    name = str(info.name)
    factors, source = "preset", f"{hw.name}'s preset factors ({hw.efficiency.basis}); not measured on this machine"
    fitted_from = None
    if hw.name == "cpu-local":
        factors, source = "prior", (f"no profile of {name} measured on this machine: cpu-local's prior factors "
                                    f"(fit them with calibrate --analytic)")
        for path, prof in _matching_profiles(info):
            block = prof.get(BLOCK_KEY)
            why = block_mismatch(block, name, bits, kv_bits) if block is not None else "none"
            if block is not None and why is None:
                hw, _ = efficiency_from_block(block, hw)
                factors, source = "fitted", f"cpu-local factors fitted for {name} on this machine, from {path}"
                fitted_from = path
                break
            if isinstance(prof.get("samples"), list) and prof["samples"]:
                try:
                    block = fit_local(prof["samples"], info.config, name=name, quant=bits, kv_bits=kv_bits, hardware=hw)
                except ValueError:
                    continue
                hw, _ = efficiency_from_block(block, hw)
                factors, source = "fitted-now", (f"cpu-local factors fitted now to the samples of {path} "
                                                 f"(store them with calibrate --analytic)")
                fitted_from = path
                break
    cost = analytic_from_config(hw, info.config, bits, name=name, kv_bits=kv_bits)
    meta = {"kind": "analytic", "hardware": hw.name, "factors": factors, "factors_note": source,
            "analytic": cost.meta()}
    if fitted_from is not None:  # the profile whose passes the factors were fitted to
        meta["profile"] = str(fitted_from)
    return cost, meta


def format_overview(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per policy; with several real runs also each run held out against the others'
    median (``analysis.validation.hold_one_out``): the simulation's median error there beside a
    real run's own, the machine's repeat error."""
    held = any(v.get("hold_one_out") for v in results.values())
    lines = [f"{'policy':<18}{'median |err| %':>16}{'max |err| %':>13}{'step p50 %':>12}{'step p90 %':>12}"
             + (f"{'held out: sim / a real run %':>31}" if held else "")]

    def f(x):
        return "-" if x is None else f"{x:.1f}"
    for n, v in results.items():
        se = v["step_error_pct"]
        h = v.get("hold_one_out")
        lines.append(f"{n:<18}{f(v['median_abs_error_pct']):>16}{f(v['max_abs_error_pct']):>13}"
                     f"{f(se.get('p50')):>12}{f(se.get('p90')):>12}"
                     + (f"{(f(h['sim_median_pct']) + ' / ' + f(h['real_median_pct'])) if h else '-':>31}" if held else ""))
    return "\n".join(lines)


def policy_list(policy, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Policies by name: one (a name, class or object), several (a list, or "a,b"), or "all";
    ``options`` go to every one given by name or class."""
    from schedlab.policies import POLICIES

    if isinstance(policy, str):
        items = list(POLICIES) if policy == "all" else [p.strip() for p in policy.split(",") if p.strip()]
    elif isinstance(policy, (list, tuple)):
        items = list(policy)
    else:
        items = [policy]
    if not items:
        _fail(f"{opt('policy')} is empty", 2)
    out: dict[str, Any] = {}
    for item in items:
        pol = _policy(item, options if isinstance(item, (str, Path, type)) else None)
        name = getattr(pol, "name", type(pol).__name__)
        if name in out:
            _fail(f"policy {name!r} given twice", 2)
        out[name] = pol
    return out


@_api
def validate(policy: PolicyLike | Sequence[PolicyLike], trace: TraceLike, *, model: str = "tiny",
             dtype: str = "float32", options: Mapping[str, Any] | None = None, profile: ProfileLike = None,
             hardware: str | None = None, kv_tokens: int | None = None, seed: int = 0, repeat: int = 1,
             out: str | Path | None = None, noise: str | None = None, log: Log | None = None,
             on_result: Callable[[str, dict], None] | None = None) -> Validation:
    """Run ``policy`` for real (MLX) and in simulation on the same trace and cost model, and
    compare (the ``validate`` command).

    ``policy``: one policy, several (a list, or ``"a,b"``), or ``"all"`` (the six bundled);
    ``options``: applied to every policy given by name; ``profile``: the cost profile (default:
    one measured on this model and machine, else a quick calibration first); ``hardware``: the
    analytic roofline of a preset instead (``cpu-local``: this machine); ``repeat``: real runs
    per policy (the measured value is their median); ``out``: write validation.json and the
    runs' directories there as they come; ``noise``: the real runs' noise settings (see
    ``run_real``). ``log`` hears progress and notes; ``on_result(policy, result)`` is called as
    each policy's comparison is done (``result``: what its validation.json holds)."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine import blas

    log = _logger(log)
    seed = _seed(seed)
    pols = policy_list(policy, options)  # bad names and options fail here, before any run
    tr = _trace(trace, seed=seed)
    _check_model(model, dtype)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        _fail(f"{opt('repeat')} must be >= 1, got {repeat}", 2)
    if hardware and profile:
        _fail(f"give either {opt('profile')} or {opt('hardware')}, not both", 2)
    if hardware:
        from schedlab.analysis.analytic import list_hardware

        if hardware.strip().lower() not in list_hardware():
            _fail(f"unknown hardware '{hardware}' (presets: {', '.join(list_hardware())}; "
                  "cpu-local is this machine)", 2)
    _check_kv_tokens(kv_tokens)
    with _noise(noise):
        return _validate(pols, tr, model, dtype, profile, hardware, kv_tokens, seed, repeat, out, log, on_result)


def _validate(pols, tr, model, dtype, profile, hardware, kv_tokens, seed, repeat, out, log, on_result):
    from schedlab.engine import blas
    from schedlab.engine.models import load_model

    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not out.is_dir():
        _fail(f"{opt('out')} {out} exists and is not a directory")

    info = load_model(str(model), dtype=dtype)
    info.check_trace(tr.requests)
    blas.notify_if_missing()

    def say(msg: str) -> None:
        log("progress", msg)

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    cost, capacity, cost_meta = _validation_cost(profile, hardware, kv_tokens, info, out, log)

    results, sims, reals = {}, {}, {}
    dirs = {name: None if out is None else (out if len(pols) == 1 else out / name) for name in pols}
    got = validate_many(pols, tr, info, cost, capacity, dirs, repeat, seed, cost_meta, say)
    for name, (v, sim_run, real_runs) in got.items():
        results[name], sims[name], reals[name] = v, sim_run, real_runs
        if on_result is not None:
            on_result(name, v)
    val = Validation(results, sims, reals, trace=tr.name, model=str(info.name), cost_model=cost_meta,
                     path=out)
    if out is not None and len(results) > 1:
        import json

        (out / "validation.json").write_text(json.dumps(val.overview(), indent=2) + "\n")
    return val


@_api
def compare(sim: Run, real: Run | Sequence[Run]) -> Validation:
    """Compare a simulated run with one or more real runs of the same policy and trace, as
    ``validate`` does (the measured value is the real runs' median; the per-step error is over
    the real runs' steps)."""
    from schedlab.analysis.validation import compare as compare_runs

    reals = [real] if isinstance(real, Run) else list(real)
    if not isinstance(sim, Run) or not reals or not all(isinstance(r, Run) for r in reals):
        _fail("compare takes a Run (the simulation) and a Run or a list of Runs (the real runs)", 2)
    if any(r.mode != "real" for r in reals):
        _fail("compare: the runs to compare with must be real runs (run_real)", 2)
    steps: list = []
    for r in reals:
        steps.extend(r._result.steps if r._result is not None else r.steps.itertuples(index=False))
    v = compare_runs(sim._summary, [r._summary for r in reals], policy=sim.policy, trace=sim.trace,
                     real_steps=steps)
    return Validation({sim.policy: v}, {sim.policy: sim}, {sim.policy: reals}, trace=sim.trace,
                      model=(reals[0].meta.get("model")), cost_model=sim.meta)


# ---------------------------------------------------------------------------- sweep


def parse_rates(rates: str | float | Sequence[float]) -> list[float]:
    if isinstance(rates, (int, float)) and not isinstance(rates, bool):
        rates = [rates]
    items = rates.split(",") if isinstance(rates, str) else list(rates)
    out = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            try:
                v = float(item)
            except ValueError:
                _fail(f"{opt('rates')}: {item!r} is not a number", 2)
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            _fail(f"{opt('rates')}: {item!r} is not a number", 2)
        else:
            v = float(item)
        if not (v > 0 and math.isfinite(v)):
            _fail(f"{opt('rates')}: every rate must be a finite number > 0 (requests/s), got {item}", 2)
        out.append(v)
    if not out:
        _fail(f"{opt('rates')} needs at least one rate, e.g. {'--rates 0.5,1,2' if opt('rates') != 'rates' else 'rates=[0.5, 1, 2]'}", 2)
    return sorted(set(out))


def _formats(formats: str | Sequence[str]) -> list[str]:
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    fmts = [str(f).strip().lower().lstrip(".") for f in items if str(f).strip()]
    bad = [f for f in fmts if f not in ("png", "svg")]
    if bad or not fmts:
        text = formats if isinstance(formats, str) else ",".join(map(str, items))
        _fail(f"{opt('format') if opt('format') != 'format' else 'formats'} must be png, svg or png,svg; got {text!r}", 2)
    return list(dict.fromkeys(fmts))


@_api
def sweep(policies: str | Sequence[PolicyLike], trace: TraceLike, rates: str | Sequence[float], *,
          options: Mapping[str, Any] | None = None, profile: ProfileLike = None, kv_tokens: int | None = None,
          slo: str | Mapping[str, float] | None = None, attainment: float = 0.9, seed: int = 0,
          workers: int | None = None, out: str | Path | None = None, formats: str | Sequence[str] = ("png", "svg"),
          on_start: Callable[[int, int], None] | None = None,
          on_done: Callable[[dict[str, Any]], None] | None = None) -> "pd.DataFrame":
    """Simulate every policy at every request rate (the trace's arrivals rescaled to it), in
    worker processes (the ``sweep`` command). Returns one row per (policy, rate) with the
    latency percentiles, throughput, goodput and SLO attainment (``sweep.csv``'s columns; a row
    whose simulation failed has ``error``). ``df.attrs["info"]`` holds what sweep.json holds
    besides the rows, ``max_sustained_rate`` among it when ``slo`` is given.

    ``policies``: names or ``"file.py:Class"`` specs (a list, or ``"a,b"``); classes and
    objects run in this process (``workers`` 1); ``options``: for every policy; ``slo`` and
    ``attainment``: the highest rate each policy sustains; ``out``: also write sweep.csv,
    sweep.json and the latency-vs-load figure there. ``on_start(jobs, workers)`` and
    ``on_done(row)`` report progress."""
    import pandas as pd

    from schedlab import traces
    from schedlab.analysis.sweep import ROW_FIELDS, default_workers, max_sustained_rate, rescale, write_results
    from schedlab.analysis.sweep import sweep as run_sweep

    if isinstance(policies, str):
        pols: list = list(dict.fromkeys(p.strip() for p in policies.split(",") if p.strip()))
    elif isinstance(policies, (list, tuple)):
        pols = list(policies)
    else:
        pols = [policies]
    if not pols:
        _fail(f"{opt('policy')} needs at least one policy", 2)
    rate_list = parse_rates(rates)
    fmts = _formats(formats)
    opts = dict(options or {})
    slos = _slo(slo)
    if isinstance(attainment, bool) or not isinstance(attainment, (int, float)) or not 0 < attainment <= 1:
        _fail(f"{opt('attainment')} must be in (0, 1], got {attainment:g}" if isinstance(attainment, (int, float))
              else f"{opt('attainment')} must be in (0, 1], got {attainment!r}", 2)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        _fail(f"{opt('workers')} must be >= 1, got {workers}", 2)
    seed = _seed(seed)
    in_process = any(not isinstance(p, str) for p in pols)
    if in_process and workers not in (None, 1):
        _fail("classes and policy objects run in this process: give workers=1 (or a 'file.py:Class' spec)", 2)
    labels = []
    for p in pols:  # bad names and options fail here, once, not in every worker
        pol = _policy(p, opts if isinstance(p, (str, type)) else None)
        labels.append(p if isinstance(p, str) else getattr(pol, "name", type(pol).__name__))
    if len(set(labels)) != len(labels):
        _fail(f"{opt('policy')}: a policy is given twice", 2)
    tr = _trace(trace, seed=seed)
    rescale(tr, rate_list[0])  # a trace whose rate cannot be set fails here
    cost, capacity, profile_path = _linear(profile, kv_tokens)
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not out.is_dir():
        _fail(f"{opt('out')} {out} exists and is not a directory")
    if in_process:
        jobs_pols = [p if isinstance(p, str) else _Built(p, opts, label) for p, label in zip(pols, labels)]
        n_workers = 1
    else:
        jobs_pols = pols
        n_workers = workers or default_workers(len(pols) * len(rate_list))
    from concurrent.futures.process import BrokenProcessPool

    try:
        rows = run_sweep(tr, jobs_pols, rate_list, cost, capacity, options=opts, slo=slos or None,
                         workers=n_workers, on_done=on_done, on_start=on_start)
    except BrokenProcessPool:
        _fail(f"a worker process died (killed, or out of memory); try fewer {opt('workers')}")
    sustained = max_sustained_rate(rows, attainment) if slos else None
    info: dict[str, Any] = {
        "trace": tr.name, "trace_requests": len(tr), "trace_rate_rps": traces.mean_rate(tr),
        "rate_definition": "(requests - 1) / (last arrival - first arrival); arrivals rescaled with traces.to_rate",
        "profile": str(profile_path), "kv_tokens": capacity, "seed": seed, "policies": labels,
        "rates_rps": rate_list, "options": {k: v if isinstance(v, (str, int, float, bool)) else str(v)
                                            for k, v in opts.items()},
        "slo": slos or None,
    }
    if slos:
        info["attainment"] = attainment
        info["max_sustained_rate"] = sustained
        info["max_sustained_rate_definition"] = (
            f"largest swept rate r such that at r and at every lower swept rate at least {attainment:g} "
            f"of all requests finished and met every SLO (vllm bench serve --goodput rule)")
    table = pd.DataFrame(rows, columns=list(ROW_FIELDS))
    for c in ("max_concurrency", "peak_concurrency", "preemptions", "recomputed_tokens", "prefix_hit_rate"):
        if c in table.columns:  # (absent values are NaN, as the CSV reads back)
            table[c] = pd.to_numeric(table[c], errors="coerce")
    table.attrs["info"] = info
    table.attrs["offered_tok_per_req"] = sum(r.output_tokens for r in tr.requests) / len(tr)
    files: list[Path] = []
    if out is not None:
        try:
            files = write_results(out, rows, info)
            files += _sweep_figure(table, out, fmts)[1]
        except OSError as exc:
            _fail(f"cannot write to {out}: {exc.strerror or exc}")
    table.attrs["files"] = files
    return table


class _Built:
    """A policy object or class in an in-process sweep: ``run_job`` calls it for the policy."""

    def __init__(self, spec, options, label):
        self.spec, self.options, self.label = spec, options, label

    def __call__(self):
        return _policy(self.spec, self.options if isinstance(self.spec, type) else None)

    def __str__(self) -> str:
        return self.label


def _sweep_figure(table, out: Path | None, formats: Sequence[str]):
    from schedlab.analysis.sweep import plot_sweep as draw

    info = table.attrs.get("info") or {}
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    profile = info.get("profile")
    title = (f"{info.get('trace')}: {info.get('trace_requests')} requests, KV {info.get('kv_tokens')} tokens, "
             f"profile {Path(profile).name if profile else '-'}") if info else ""
    fig = draw(rows, out, slo=info.get("slo"), attainment=info.get("attainment", 0.9),
               sustained=info.get("max_sustained_rate"), offered_tok_per_req=table.attrs.get("offered_tok_per_req"),
               title=title, formats=formats)
    return fig["figure"], fig["files"]


@_api
def plot_sweep(table: "pd.DataFrame", *, out: str | Path | None = None,
               formats: str | Sequence[str] = ("png", "svg")) -> "Figure":
    """The latency-vs-load figure of a ``sweep`` table (``out``: also write it there)."""
    if not _is_frame(table) or "rate_rps" not in table.columns:
        _fail("plot_sweep takes the DataFrame sweep() returns", 2)
    try:
        return _sweep_figure(table, Path(out) if out is not None else None, _formats(formats))[0]
    except OSError as exc:
        _fail(f"cannot write to {out}: {exc.strerror or exc}")


# ---------------------------------------------------------------------------- figures and run directories


@_api
def load_run(path: str | Path) -> Run:
    """A run directory (``simulate --out DIR``) read back: the same ``Run`` the API returns,
    its tables read from the files."""
    import json

    import pandas as pd
    from schedlab.analysis.plots import RunDirError, load_run as read_dir
    from schedlab.sim.output import read_requests_csv

    p = Path(path)
    data = read_dir(p)  # checks the directory: one RunDirError line for anything wrong
    frames = {"requests": read_requests_csv(p / "requests.csv"), "tokens": pd.read_parquet(p / "tokens.parquet"),
              "steps": pd.read_parquet(p / "steps.parquet")}
    if data.passes is not None:  # (simulate writes it with --passes; run.passes raises without)
        frames["passes"] = pd.read_parquet(p / "passes.parquet")
    meta = {}
    if (p / "meta.json").is_file():
        try:
            meta = json.loads((p / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
    return Run(None, data.summary, _dir=p, _frames=frames, _meta_file=meta)


def _plot_inputs(items: Sequence[Any]):
    from schedlab.analysis.plots import _unique_labels, is_validation_dir, load_run as read_dir, load_validation

    runs, vals = [], []
    for it in items:
        if isinstance(it, Run):
            runs.append(it._run_data())
        elif isinstance(it, Validation):
            for v in it._validation_data():
                vals.append(v)
                runs.extend((v.sim, v.real))
        elif isinstance(it, (str, Path)):
            if is_validation_dir(it):
                v = load_validation(it)
                vals.append(v)
                runs.extend((v.sim, v.real))
            else:
                runs.append(read_dir(it))
        else:
            _fail(f"plot takes runs, validations and run directories, got {type(it).__name__}", 2)
    _unique_labels(runs)
    return runs, vals


@_api
def plot(*items: Run | Validation | str | Path, out: str | Path | None = None,
         formats: str | Sequence[str] = ("png", "svg"), lanes: int = 60,
         window: tuple[float, float] | str | None = None, kinds: str | Sequence[str] | None = None) -> Figures:
    """The ``plot`` command's figures for runs, validations and run/validation directories:
    TTFT and ITL CDFs (one curve per run), per-request decode rates, a step timeline per run,
    and simulated-vs-measured overlays for validations. Returns the matplotlib figures by name
    (the file stems the command writes); ``out``: also write them there in ``formats``.
    ``lanes``: the most requests a timeline draws; ``window``: its time span ``(start, end)``
    in seconds (or ``"START:END"``); ``kinds``: only these figures, of ``ttft``, ``itl``,
    ``decode_rate``, ``timeline``, ``validation`` (default: all)."""
    from schedlab.analysis.plots import KINDS, parse_window, plot_runs

    if not items:
        _fail("plot needs at least one run, validation or run directory", 2)
    if kinds is None:
        kinds = KINDS
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        _fail(f"kinds are {', '.join(KINDS)}; got {', '.join(map(repr, bad)) or 'none'}", 2)
    fmts = _formats(formats)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        _fail(f"{opt('lanes')} must be >= 1, got {lanes}", 2)
    if isinstance(window, str) or window is None:
        win = parse_window(window)
    else:
        try:
            start, end = (float(x) for x in window)
        except (TypeError, ValueError):
            _fail(f"window is (start, end) in seconds, got {window!r}", 2)
        if not end > start:
            _fail(f"window end must be after its start, got {window!r}", 2)
        win = (start, end)
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not out.is_dir():
        _fail(f"{opt('out')} {out} exists and is not a directory")
    runs, vals = _plot_inputs(items)
    try:
        rep = plot_runs(runs, vals, out, formats=fmts, lanes=lanes, window=win, kinds=kinds)
    except OSError as exc:
        _fail(f"cannot write figures to {out}: {exc.strerror or exc}")
    return Figures(rep.figures, rep.files, rep.warnings)
