"""What every module of the API shares: the one-line error boundary, checks of plain arguments
(seeds, SLOs, figure formats, a model spec) and the default ``log``. Imports nothing heavy."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from ..errors import SchedlabError, SchedlabWarning, opt, user_error_types

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from schedlab.traces.schema import Request, Trace

PolicyLike = Union[str, type, Any]
TraceLike = Union[str, Path, "Trace", Sequence["Request"], "pd.DataFrame"]
#: ``log(kind, message)``: kind is "progress", "note" or "warning"
Log = Callable[[str, str], None]


def _error_types() -> tuple[type[BaseException], ...]:
    from schedlab.analysis.plots import RunDirError

    return user_error_types() + (RunDirError,)


def public(fn):
    """A public function's boundary: bad input, from anywhere below, leaves as one
    ``SchedlabError`` line without the frames it came through."""

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


def fail(message: str, code: int = 1):
    raise SchedlabError(message, code)


def logger(log: Log | None) -> Log:
    """``log``, or the default: warnings as ``SchedlabWarning``, the rest dropped."""
    if log is not None:
        return log

    def default(kind: str, message: str) -> None:
        if kind == "warning":
            warnings.warn(message, SchedlabWarning, stacklevel=4)

    return default


def executor_name(executor: Any, ray_address: Any) -> str:
    """``sweep``'s and ``capacity``'s ``executor`` ("local" or "ray") and ``ray_address``, checked."""
    from schedlab.analysis.executors import EXECUTORS

    if executor not in EXECUTORS:
        fail(f"unknown executor {executor!r}: choose {' or '.join(EXECUTORS)}", 2)
    if ray_address is not None:
        if executor != "ray":
            fail(f"{opt('ray_address')} goes with the ray executor: give {opt('executor')} ray too", 2)
        if not isinstance(ray_address, str) or not ray_address.strip():
            fail(
                f"{opt('ray_address')} must be a non-empty string (host:port or ray://host:port), got {ray_address!r}",
                2,
            )
    return executor


@contextlib.contextmanager
def executor_errors():
    """A worker that died, or an executor that cannot start: one line, no traceback."""
    from schedlab.analysis.executors import ExecutorUnavailable, WorkerLost

    try:
        yield
    except WorkerLost as exc:
        fail(f"a worker process died (killed, or out of memory; {exc}); try fewer {opt('workers')}")
    except ExecutorUnavailable as exc:
        fail(str(exc))


def as_path(value: Any, what: str = "out") -> Path:
    """A path argument (a str or ``os.PathLike``); one line for anything else, and for ``""``
    (``Path("")`` is the current directory, which the caller did not name), as the commands
    refuse an empty ``--out``."""
    raw = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(raw, str):
        fail(f"{opt(what)} must be a str or pathlib.Path, got {type(value).__name__} {value!r}", 2)
    if raw == "":
        fail(f"{opt(what)} must not be empty", 2)
    return Path(raw)


def out_dir(out: Any, what: str = "out") -> Path | None:
    """An output directory argument: None, or a path (``as_path``) that is not a file."""
    if out is None:
        return None
    path = as_path(out, what)
    if path.exists() and not path.is_dir():
        fail(f"{opt(what)} {path} exists and is not a directory")
    return path


def check_bool(value: Any, what: str) -> bool:
    """A flag: True or False only (``"no"`` is not False)."""
    if not isinstance(value, bool):
        fail(f"{opt(what)} must be True or False, got {value!r}", 2)
    return value


def check_callable(fn: Any, what: str) -> None:
    """A callback: None or something callable, checked before any work starts."""
    if fn is not None and not callable(fn):
        fail(f"{what} must be a function (or None), got {type(fn).__name__} {fn!r}", 2)


def option_map(options: Any, word: str = "policy") -> dict[str, Any]:
    """A plugin's ``options`` (None or a mapping) as a dict, checked now by the plugins' own rule
    (``policies.plugins.option_keys``: before any worker starts); one line for anything else."""
    from schedlab.policies.plugins import option_keys

    option_keys(word, options, lambda message: SchedlabError(message, 2))
    return dict(options or {})


def check_seed(seed: Any, what: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        fail(f"{opt(what)} must be an integer, got {seed!r}", 2)
    return seed


def check_model_seed(seed: Any) -> int:
    """A preset's weight seed: an integer in [0, 2**64) (what MLX's random key takes)."""
    check_seed(seed, "model_seed")
    if not 0 <= seed < 2**64:
        fail(f"{opt('model_seed')} must be in [0, 2**64), got {seed}", 2)
    return seed


def check_kv_tokens(kv_tokens: int | None) -> None:
    if kv_tokens is None:
        return
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int):
        fail(f"{opt('kv_tokens')} must be an integer, got {kv_tokens!r}", 2)
    if kv_tokens < 1:
        fail(f"{opt('kv_tokens')} must be >= 1, got {kv_tokens}", 2)


def check_model(model: str, dtype: str) -> None:
    """A model spec and dtype, checked without importing mlx."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine.models import check_spec

    if not isinstance(model, (str, Path)):
        fail(f"model is a preset name, a .gguf file or a checkpoint directory, got {type(model).__name__}", 2)
    check_spec(str(model), dtype)


#: ``vllm bench serve --goodput``'s SLO names (values in ms) and schedlab's for them
SLO_ALIASES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}


def _slo_key(key: Any) -> str:
    """An SLO's key as schedlab names it (``ttft`` -> ``ttft_ms``, ...); one line if unknown."""
    from schedlab.sim.metrics import SLO_KEYS

    k = SLO_ALIASES.get(key, key) if isinstance(key, str) else key
    if k not in SLO_KEYS:
        fail(
            f"unknown SLO key {key!r} (use {', '.join(SLO_KEYS)}, or vllm bench serve --goodput's "
            f"{', '.join(SLO_ALIASES)})",
            2,
        )
    return k


def parse_slo(slo: str | Mapping[str, float] | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` or ``{"ttft_ms": 500}``: the same checks either way. The
    names ``vllm bench serve --goodput`` gives them (``ttft``, ``tpot``, ``e2el``; values in ms)
    are accepted too and become schedlab's (``ttft_ms``, ``tpot_ms``, ``e2e_ms``)."""
    if slo is None or slo == "" or slo == {}:
        return {}
    if isinstance(slo, Mapping):
        out = {}
        for k, v in slo.items():
            k = _slo_key(k)
            if k in out:
                fail(f"SLO {k} is given twice", 2)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                if isinstance(v, str):
                    out.update(parse_slo(f"{k}={v}"))
                    continue
                fail(f"SLO {k}={v!r} is not a number", 2)
            if not math.isfinite(v) or v <= 0:
                fail(f"SLO {k}={v!r} must be a finite number > 0", 2)
            out[k] = float(v)
        return out
    if not isinstance(slo, str):
        fail(
            f"slo is a mapping such as {{'ttft_ms': 2000}} or a string 'ttft_ms=2000,...', got {type(slo).__name__}", 2
        )
    out: dict[str, float] = {}
    from schedlab.sim.metrics import SLO_KEYS

    for item in slo.split(","):
        item = item.strip()
        if "=" not in item:
            fail(f"SLO '{item}' is not key=value (keys: {', '.join(SLO_KEYS)})", 2)
        k, v = (x.strip() for x in item.split("=", 1))
        k = _slo_key(k)
        if k in out:
            fail(f"SLO {k} is given twice", 2)
        try:
            limit = float(v)
        except ValueError:
            fail(f"SLO {k}={v!r} is not a number", 2)
        if not math.isfinite(limit) or limit <= 0:
            fail(f"SLO {k}={v!r} must be a finite number > 0", 2)
        out[k] = limit
    return out


def parse_formats(formats: str | Sequence[str]) -> list[str]:
    """Figure formats: png, svg or both (``"png,svg"`` or a list)."""
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    fmts = [str(f).strip().lower().lstrip(".") for f in items if str(f).strip()]
    bad = [f for f in fmts if f not in ("png", "svg")]
    if bad or not fmts:
        text = formats if isinstance(formats, str) else ",".join(map(str, items))
        fail(
            f"{opt('format') if opt('format') != 'format' else 'formats'} must be png, svg or png,svg; got {text!r}", 2
        )
    return list(dict.fromkeys(fmts))


def is_frame(obj: Any) -> bool:
    import sys

    pd = sys.modules.get("pandas")
    return pd is not None and isinstance(obj, pd.DataFrame)


def policy_options(pol) -> dict:
    """A policy's options as meta.json records them."""
    get = getattr(pol, "options", None)
    return get() if callable(get) else {}


def worker_count(in_process: bool, workers: Any, executor: str, n_jobs: int) -> int | None:
    """How many worker processes run ``n_jobs`` jobs (``sweep``, ``capacity``): ``workers``
    (>= 1) or, not given, one per job up to the CPUs (Ray: None, as many as it gives); 1 when a
    job holds a class or a policy object, which runs in this process (one line if ``workers`` or
    the executor says otherwise)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        fail(f"{opt('workers')} must be an integer, got {workers!r}", 2)
    if workers is not None and workers < 1:
        fail(f"{opt('workers')} must be >= 1, got {workers}", 2)
    if in_process and (workers not in (None, 1) or executor != "local"):
        fail(
            "classes and policy objects run in this process: give workers=1 and the local executor "
            "(or a 'file.py:Class' spec)",
            2,
        )
    if in_process:
        return 1
    from schedlab.analysis.executors import default_workers

    return workers or (None if executor == "ray" else default_workers(n_jobs))
