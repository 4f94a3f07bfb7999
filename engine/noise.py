"""Settings that may lower the run-to-run spread of real timings, to compare, not to assume.

On a small shared VM three identical real runs differ by 5-19 % (median over the metrics).
Things that could lower it, each a switch so that a measurement can compare them:

- ``gc-off``: Python's cyclic garbage collector disabled while the engine runs (collected
  once before): a collection in the middle of a step adds milliseconds to it;
- ``pin=CPUS``: every thread of the process (MLX's CPU worker, OpenBLAS's threads, Python)
  pinned to these CPUs (``0-1``, ``1``, ``0,2``), so the scheduler does not move them;
- ``warmup=N``: the engine's warm-up passes run N times instead of once (allocations, first
  calls, caches) before the clock starts;
- ``malloc-keep``: glibc's malloc keeps freed memory in the process (no trimming of the heap,
  blocks up to 32 MiB from the heap, not from fresh mmaps) for the rest of the process. A join
  or leave allocates a new batch cache and frees the old one; by default the freed pages go
  back to the system and the next allocation faults them in again, which on a VM costs more
  than the copy itself. Linux (glibc) only.
- ``mlx-cache=SIZE``: MLX's buffer cache may hold up to SIZE (``2g``, ``512m``, bytes) of freed
  buffers for reuse. MLX's CPU backend keeps 32 MiB by default (on Apple silicon, Metal's cache
  may grow to the memory limit): a batch cache larger than that is handed back when it is
  replaced, and the next join of that size faults its pages in again.

What each setting did to the spread and to joins on the project's VM is in docs/benchmarks.md
(*Investigations*); none is the default.

The BLAS thread count is the environment's ``OPENBLAS_NUM_THREADS`` (read when the library
loads; the profile records it, so a profile measured with another count is not used).

Given as ``--noise gc-off,pin=0-1,warmup=3`` (run-real, validate, bench/fidelity.py) or the
environment's ``SCHEDLAB_NOISE`` (the same spec; the option sets it, so calibrations made in
the same process use the same settings). Recorded in every run's meta.json.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import EngineError

ENV = "SCHEDLAB_NOISE"


@dataclass(frozen=True)
class Noise:
    gc_off: bool = False
    pin: tuple[int, ...] | None = None
    warmup: int = 1
    malloc_keep: bool = False
    mlx_cache: int | None = None  # bytes; None: MLX's default

    @classmethod
    def parse(cls, spec: str | None) -> "Noise":
        gc_off, pin, warmup, keep, cache = False, None, 1, False, None
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key in ("gc-off", "gc_off", "nogc") and not value:
                gc_off = True
            elif key == "pin" and value:
                pin = _cpus(value)
            elif key in ("malloc-keep", "malloc_keep") and not value:
                _mallopt()  # fails here, with one line, where glibc's malloc is not the allocator
                keep = True
            elif key in ("mlx-cache", "mlx_cache") and value:
                cache = _size(value)
            elif key == "warmup" and value:
                try:
                    warmup = int(value)
                except ValueError:
                    raise EngineError(f"noise setting warmup={value!r}: give a whole number") from None
                if warmup < 0:
                    raise EngineError(f"noise setting warmup={warmup}: must be >= 0")
            else:
                raise EngineError(
                    f"unknown noise setting {part!r} (gc-off, pin=CPUS, warmup=N, malloc-keep, mlx-cache=SIZE)"
                )
        return cls(gc_off, pin, warmup, keep, cache)

    @classmethod
    def from_env(cls) -> "Noise":
        return cls.parse(os.environ.get(ENV))

    def spec(self) -> str:
        parts = (["gc-off"] if self.gc_off else []) + ([f"pin={','.join(map(str, self.pin))}"] if self.pin else [])
        if self.warmup != 1:
            parts.append(f"warmup={self.warmup}")
        if self.malloc_keep:
            parts.append("malloc-keep")
        if self.mlx_cache is not None:
            parts.append(f"mlx-cache={self.mlx_cache}")
        return ",".join(parts)

    def allocator(self) -> dict[str, Any]:
        """The settings that change what a pass costs, not only how much it varies: how freed
        memory is kept for reuse. A profile records them (``engine.calibrate``), and is used only
        under the same ones (``profile_mismatch``)."""
        return allocator_settings(self.describe())

    def describe(self) -> dict[str, Any]:
        return {
            "gc_off": self.gc_off,
            "pin": list(self.pin) if self.pin else None,
            "warmup": self.warmup,
            "malloc_keep": self.malloc_keep,
            "mlx_cache": self.mlx_cache,
            "openblas_num_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
        }

    def enter(self) -> Any:
        """Apply (pin every thread, collect then disable the collector); returns what ``leave``
        restores."""
        saved = (gc.isenabled(), None, None)
        if self.mlx_cache is not None:
            import mlx.core as mx

            saved = (saved[0], None, mx.set_cache_limit(self.mlx_cache))
        if self.malloc_keep:  # for the rest of the process: glibc cannot hand the kept pages back later
            keep_freed_memory()
        if self.pin:
            saved = (saved[0], _affinity(), saved[2])
            _pin_all(self.pin)
        if self.gc_off:
            gc.collect()
            gc.disable()
        return saved

    def leave(self, saved: Any) -> None:
        enabled, affinity, cache = saved
        if self.gc_off and enabled:
            gc.enable()
        if affinity:
            _pin_all(affinity)
        if cache is not None:
            import mlx.core as mx

            mx.set_cache_limit(cache)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = self.enter()
        try:
            yield
        finally:
            self.leave(saved)


def allocator_settings(described: dict[str, Any] | None) -> dict[str, Any]:
    """``Noise.allocator`` from a ``describe()`` dict as a run's meta.json keeps it (None, or a
    profile from before these were recorded: the defaults)."""
    d = described or {}
    return {"malloc_keep": bool(d.get("malloc_keep", False)), "mlx_cache": d.get("mlx_cache")}


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
KEEP = ((M_TRIM_THRESHOLD, 1 << 30), (M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 64 << 20))


def _mallopt():
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        raise EngineError("noise setting malloc-keep: needs glibc's malloc (Linux)")
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        raise EngineError("noise setting malloc-keep: glibc's mallopt could not be loaded") from None


def keep_freed_memory() -> None:
    """glibc malloc: keep freed memory in the process (``malloc-keep``)."""
    mallopt = _mallopt()
    for param, value in KEEP:
        if mallopt(param, value) != 1:
            raise EngineError(f"noise setting malloc-keep: mallopt({param}, {value}) was refused")


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _size(value: str) -> int:
    """``2g``, ``512m``, ``64k``, ``2GiB``, ``1024`` (bytes) -> bytes."""
    v = value.strip().lower()
    v = v[:-2] if v.endswith("ib") else v[:-1] if v.endswith("b") else v
    num, unit = (v[:-1], _UNITS[v[-1]]) if v and v[-1] in _UNITS else (v, 1)
    try:
        n = float(num) * unit
    except ValueError:
        raise EngineError(f"noise setting mlx-cache={value!r}: give a size such as 2g, 512m or 0") from None
    if not (n >= 0 and n == n and n < 1 << 50):
        raise EngineError(f"noise setting mlx-cache={value!r}: must be a size >= 0")
    return int(n)


def _cpus(value: str) -> tuple[int, ...]:
    out: list[int] = []
    try:
        for piece in value.replace(";", ",").replace(" ", "").split(","):
            if "-" in piece:
                a, b = piece.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif piece:
                out.append(int(piece))
    except ValueError:
        raise EngineError(f"noise setting pin={value!r}: give CPUs as 0-1 or 0,2") from None
    have = _affinity()
    if not out or (have and not set(out) <= set(have)):
        raise EngineError(f"noise setting pin={value!r}: this process may run on CPUs {sorted(have or [])}")
    return tuple(sorted(set(out)))


def _affinity() -> tuple[int, ...] | None:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return None


def _pin_all(cpus) -> None:
    """Every thread of this process (those that exist now; new ones inherit the caller's)."""
    if not hasattr(os, "sched_setaffinity"):
        raise EngineError("noise setting pin: this system cannot pin threads")
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, set(cpus))
        except OSError:
            pass  # a thread that ended meanwhile
