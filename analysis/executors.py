"""Where ``sweep`` and ``capacity`` run their jobs: here, in local worker processes, or on Ray.

A job is ``fn(job, shared)``: ``fn`` a module-level function (sent by reference), ``job`` small
(a policy name and a rate, a configuration), ``shared`` the large part every job reads (the
trace, the cost model), sent once:

- ``local`` (the default): ``workers`` spawned processes (``concurrent.futures``), ``shared``
  passed to each at its start; one worker runs here, in this process.
- ``ray``: each job a Ray task (one CPU), ``shared`` put into Ray's object store once and read
  by each worker process once (kept there for its later tasks). Without ``address`` a local
  Ray is started in this process on first use (``workers`` CPUs, default: this machine's) and
  kept for later calls until the process ends; with one (``ray://host:10001`` or
  ``host:6379``) the jobs run on that cluster, whose nodes must have the same schedlab
  installed. At most ``workers`` jobs are in flight (default: all of them, Ray schedules them
  on the cluster's CPUs). Ray is an optional dependency: ``pip install 'schedlab[ray]'``.

Results come back in job order; ``on_done(row)`` is called as each one arrives, and Ctrl-C
(or an error) stops the jobs still running before it is re-raised. A worker that dies (killed,
out of memory) raises ``WorkerLost``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Sequence

EXECUTORS = ("local", "ray")


class WorkerLost(RuntimeError):
    """A worker process died before its job finished (killed, or out of memory)."""


class ExecutorUnavailable(RuntimeError):
    """The executor cannot run here: Ray is not installed, or its cluster cannot be reached."""


def run_jobs(
    fn: Callable[[Any, Any], dict[str, Any]],
    jobs: Sequence[Any],
    shared: Any,
    workers: int | None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """``fn(job, shared)`` for every job on ``executor``; the results in job order.
    ``on_start(jobs, workers)`` once the jobs are queued and the workers exist."""
    if executor == "ray":
        return _on_ray(fn, jobs, shared, workers, on_done, on_start, ray_address)
    n = max(1, min(workers or 1, len(jobs)))
    if n == 1:
        if on_start:
            on_start(len(jobs), 1)
        out = []
        for job in jobs:
            row = fn(job, shared)
            out.append(row)
            if on_done:
                on_done(row)
        return out
    return _in_processes(fn, jobs, shared, n, on_done, on_start)


def default_workers(n_jobs: int) -> int:
    return max(1, min(os.cpu_count() or 1, n_jobs))


# ------------------------------------------------------------------------ local processes


_SHARED: tuple = ()  # in a worker process: (fn, shared)


def _init_worker(fn, shared) -> None:
    """Each worker gets ``shared`` once (jobs stay tiny); Ctrl-C is left to the parent."""
    global _SHARED
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _SHARED = (fn, shared)


def _call(job):
    fn, shared = _SHARED
    return fn(job, shared)


@contextmanager
def _main_not_reimported():
    """Spawned workers import nothing of the parent's ``__main__``. They need nothing from it
    (jobs name their policies; the trace and cost model are library objects), and a spawned
    process otherwise runs the parent's script again: a script that calls a sweep at its top
    level (no ``if __name__ == "__main__":`` guard, as in a quick script using the API) would
    start a sweep in every worker, which fails there and leaves the pool waiting forever."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing.spawn reads both to re-run the main module
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _in_processes(fn, jobs, shared, n, on_done, on_start):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # spawn (as on macOS): no fork of a process that has threads. A terminal's Ctrl-C goes
    # to the whole process group, workers included. SIGINT is ignored while the workers are
    # created: they inherit "ignore" through exec (a blocked mask would not survive it), so a
    # Ctrl-C during their start-up prints no traceback there; the parent's handler is back
    # (a Ctrl-C in those few milliseconds is lost) before any result is awaited, and the
    # parent then stops them.
    main_thread = threading.current_thread() is threading.main_thread()  # signals: main thread only
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    restored = not main_thread
    pool = None
    results: dict[int, dict[str, Any]] = {}
    try:
        with _main_not_reimported():  # the workers start during the submits
            pool = ProcessPoolExecutor(
                max_workers=n,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(fn, shared),
            )
            futures = {pool.submit(_call, job): k for k, job in enumerate(jobs)}
        if not restored:
            signal.signal(signal.SIGINT, previous)
            restored = True
        if on_start:
            on_start(len(jobs), n)
        for fut in as_completed(futures):
            row = fut.result()
            results[futures[fut]] = row
            if on_done:
                on_done(row)
    except BaseException as exc:
        if not restored:
            signal.signal(signal.SIGINT, previous)
        if pool is not None:
            # Stop the running jobs now, not when they finish, then let the pool's own thread
            # fail or cancel the rest and wind down: futures are not cancelled from here (that
            # races with it), and it is joined before we return (so nothing of it is left to
            # race with interpreter exit). Jobs are small, so its queue never blocks.
            for p in list((getattr(pool, "_processes", None) or {}).values()):  # private: the only handle
                if p.is_alive():
                    p.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(exc, BrokenProcessPool):
            raise WorkerLost(str(exc)) from None
        raise
    pool.shutdown(wait=True)
    return [results[k] for k in range(len(jobs))]


# ------------------------------------------------------------------------ Ray


_RAY_CACHE: dict[str, Any] = {}  # in a Ray worker process: the shared object of the latest call


def _ray_call(fn, job, shared_box):
    """A Ray task: ``shared_box`` is ``[ObjectRef]`` (boxed, so Ray does not fetch it for every
    task); this worker fetches and unpickles it once."""
    import ray

    (ref,) = shared_box
    key = ref.hex()
    if key not in _RAY_CACHE:
        _RAY_CACHE.clear()
        _RAY_CACHE[key] = ray.get(ref)
    return fn(job, _RAY_CACHE[key])


def _start_ray(workers: int | None, address: str | None):
    if address not in (None, "auto", "local"):
        token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
        if token or os.path.exists(os.path.expanduser("~/.ray/auth_token")):
            # A cluster started by `ray start` (token authentication is Ray's default) wants its
            # token; Ray's client sends it only in token mode, read when ray is imported, and
            # otherwise retries unauthenticated for ~20 s before it gives up.
            os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        import ray
    except ImportError:
        raise ExecutorUnavailable(
            "the ray executor needs Ray, which is not installed: pip install 'schedlab[ray]'"
        ) from None
    if ray.is_initialized():  # started earlier in this process (by us or by the caller): use it
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = dict(
        include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, configure_logging=True
    )
    if address not in (None, "auto", "local"):
        _reachable(address)  # Ray itself retries an unreachable address for minutes
    try:
        if address is None:
            ray.init(num_cpus=workers or os.cpu_count() or 1, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except Exception as exc:  # ConnectionError, a bad address, a cluster of another version
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise ExecutorUnavailable(f"cannot start {where}: {' '.join(str(exc).split())}") from None
    return ray


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """``ExecutorUnavailable`` unless something listens at ``[ray://]host:port``."""
    import socket

    where = address.split("://", 1)[-1]
    host, sep, port = where.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ExecutorUnavailable(f"the Ray address {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ExecutorUnavailable(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} "
            f"(start one with `ray start --head`, or leave out the address for a local Ray)"
        ) from None


def _on_ray(fn, jobs, shared, workers, on_done, on_start, address):
    ray = _start_ray(workers, address)
    from ray.exceptions import RayTaskError

    task = ray.remote(num_cpus=1, max_retries=0)(_ray_call)
    box = [ray.put(shared)]
    cap = len(jobs) if workers is None else max(1, workers)
    pending: dict[Any, int] = {}
    results: dict[int, dict[str, Any]] = {}
    queue = list(enumerate(jobs))
    queue.reverse()

    def submit():
        while queue and len(pending) < cap:
            k, job = queue.pop()
            pending[task.remote(fn, job, box)] = k

    try:
        submit()
        if on_start:
            cpus = int(ray.cluster_resources().get("CPU", 0)) or cap
            on_start(len(jobs), min(cap, cpus, len(jobs)))
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(ready[0])
            try:
                row = ray.get(ready[0])
            except RayTaskError as exc:  # fn itself raised: that error, as if it ran here
                raise exc.as_instanceof_cause() from None
            except ray.exceptions.RayError as exc:  # the worker died, or its node
                raise WorkerLost(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
            results[k] = row
            submit()
            if on_done:
                on_done(row)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return [results[k] for k in range(len(jobs))]
