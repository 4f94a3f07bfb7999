"""Use OpenBLAS for MLX's CPU matmuls when one is installed.

The ``mlx[cpu]`` wheel for Linux bundles the reference (netlib) BLAS: one thread and a few
GFLOP/s. MLX looks ``cblas_sgemm`` & co. up by symbol, so a BLAS loaded into the process's
global symbol scope *before* MLX's own library is loaded takes precedence: OpenBLAS then
does the work (65-200 GFLOP/s here against 2-7). That is what :func:`ensure_loaded` does,
with ``ctypes.CDLL(path, RTLD_GLOBAL)`` (no LD_PRELOAD). It must run before the first
``import mlx`` in the process; ``engine/__init__.py`` calls it first thing.

Where it looks, in order:

1. ``SCHEDLAB_BLAS=/path/to/libopenblas.so.0`` (or ``SCHEDLAB_BLAS=none`` to keep MLX's own),
2. Debian/Ubuntu/Fedora system paths (``apt install libopenblas0-pthread``),
3. PyPI's ``cmeel-openblas`` in any site-packages (it needs the system's libgfortran.so.5),
4. ``ctypes.util.find_library("openblas")``.

On macOS nothing is done: MLX uses Accelerate (and Metal).

Threads: OpenBLAS reads ``OPENBLAS_NUM_THREADS`` (default: one per core). The count in
use is read back with ``openblas_get_num_threads`` and recorded in every run's metadata,
because a cost profile measured under one BLAS/thread count is wrong under another.

Spinning: after a GEMM, OpenBLAS's worker threads busy-wait (sched_yield) for up to ~2^28
cycles before they sleep. On 2 cores that steals the CPU from MLX's own worker thread, which
runs everything that is not a matmul (softmax, copies): measured here, a 8-row decode step's
p90 was 15x its median and prefill 40% slower. Unless the user sets it, we set
``OPENBLAS_THREAD_TIMEOUT=4`` (sleep after 2^4 cycles) before loading: p90 went from 310 ms
to 37 ms for that step, prefill medians improved ~30%.

This module imports nothing from mlx.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

ENV = "SCHEDLAB_BLAS"
THREAD_TIMEOUT = "4"  # see "Spinning" above
HINT = (
    "schedlab: MLX is using its bundled reference BLAS (slow: ~10-20x slower prefill). "
    "For fast CPU matmuls: `apt install libopenblas0-pthread`, or "
    "`pip install cmeel-openblas` plus libgfortran5; or point SCHEDLAB_BLAS at a libopenblas.so"
)

SYSTEM_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

_state: dict[str, Any] | None = None
_hinted = False


def _candidates() -> list[tuple[str, str]]:
    """(path, source) pairs to try, in order, without the env override."""
    out: list[tuple[str, str]] = [(p, "system") for p in SYSTEM_PATHS]
    seen: set[str] = set()
    for entry in sys.path:
        if not entry:
            continue
        sp = Path(entry)
        for cand in (
            sp / "cmeel.prefix" / "lib" / "libopenblas.so.0",
            sp.parent / "cmeel.prefix" / "lib" / "libopenblas.so.0",
        ):
            key = str(cand)
            if key not in seen:
                seen.add(key)
                out.append((key, "cmeel-openblas"))
    found = ctypes.util.find_library("openblas")
    if found:
        out.append((found, "find_library"))
    return out


def _describe(lib: ctypes.CDLL) -> tuple[str, str | None, int | None]:
    """(name, config string, threads) of a loaded OpenBLAS."""
    config = None
    threads = None
    try:
        fn = lib.openblas_get_config
        fn.restype = ctypes.c_char_p
        raw = fn()
        config = raw.decode(errors="replace").strip() if raw else None
    except AttributeError:
        pass
    try:
        fn = lib.openblas_get_num_threads
        fn.restype = ctypes.c_int
        threads = int(fn())
    except AttributeError:
        pass
    name = "openblas" if (config or threads is not None) else "blas"
    return name, config, threads


def _resolves_to(lib: ctypes.CDLL, symbol: str = "cblas_sgemm") -> bool:
    """Whether the process's global scope resolves ``symbol`` to ``lib``'s definition."""
    try:
        mine = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        glob = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return False
    return mine is not None and mine == glob


def ensure_loaded() -> dict[str, Any]:
    """Load OpenBLAS globally (once per process); return what is in use."""
    global _state
    if _state is not None:
        return _state
    mlx_first = "mlx.core" in sys.modules
    info: dict[str, Any] = {
        "name": "reference (bundled with mlx)",
        "path": None,
        "source": "mlx-wheel",
        "config": None,
        "threads": 1,
        "active": False,
        "loaded_before_mlx": not mlx_first,
        "env": os.environ.get(ENV),
        "openblas_num_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
        "notes": [],
    }
    if sys.platform == "darwin":
        info.update(name="accelerate", source="macos", threads=None)
        _state = info
        return info
    override = os.environ.get(ENV, "").strip()
    if override.lower() in ("none", "off", "0", "false", "reference"):
        info["source"] = f"{ENV}=none"
        _state = info
        return info
    tries = [(override, ENV)] if override else _candidates()
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # read when the library loads
    info["thread_timeout"] = os.environ["OPENBLAS_THREAD_TIMEOUT"]
    for path, source in tries:
        if source != "find_library" and not os.path.isfile(path):
            if source == ENV:
                info["notes"].append(f"{ENV}={path}: no such file")
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            info["notes"].append(f"{path}: {exc}")
            continue
        name, config, threads = _describe(lib)
        info.update(
            name=name,
            path=os.path.realpath(path) if os.path.exists(path) else path,
            source=source,
            config=config,
            threads=threads,
            active=_resolves_to(lib) and not mlx_first,
        )
        if mlx_first:
            info["notes"].append(
                "mlx was imported before engine: MLX keeps its bundled BLAS; from schedlab import engine first"
            )
        info["_lib"] = lib  # keep the handle alive
        break
    _state = info
    return info


def info() -> dict[str, Any]:
    """JSON-ready description of the BLAS in use (name, path, threads, ...)."""
    state = ensure_loaded()
    out = {k: v for k, v in state.items() if not k.startswith("_")}
    out["notes"] = list(state.get("notes", []))
    lib = state.get("_lib")
    if lib is not None:  # threads can change after load (openblas_set_num_threads)
        out["threads"] = _describe(lib)[2]
    out["machine"] = platform.machine()
    return out


def fast() -> bool:
    """OpenBLAS (or Accelerate on macOS) does the matmuls."""
    state = ensure_loaded()
    return bool(state.get("active")) or state.get("name") == "accelerate"


def notify_if_missing(stream=None) -> bool:
    """Tell the user once, in one line on stderr, how to get a fast BLAS. True if told."""
    global _hinted
    if _hinted or fast():
        return False
    _hinted = True
    print(HINT, file=stream or sys.stderr)
    return True
