"""``serve`` (the ``serve`` command): a policy on the real engine behind an OpenAI-compatible
HTTP server, one replica or several behind a router, over the serving runtime
(``schedlab.serving``); several replicas are started as ``replicas`` starts them, for
``run_real(..., replicas=N)`` too.

Several replicas are processes, each a ``schedlab serve`` that loads the model, the policy and
its cost model itself: the policy is then a bundled name or ``"file.py:Class"`` with its options
(an object does not cross to another process); the router, which the front runs in this
process, is anything ``ClusterOptions`` takes. This process owns them: SIGINT and SIGTERM (when
called from the main thread) end every replica at once, calibrating or not, and raise
``KeyboardInterrupt``; its death ends them too. Nothing here imports mlx or the HTTP stack until
called."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from schedlab.serving.result import ClusterRun

from ._base import Log, PolicyLike, check_bool, check_seed, fail, logger, opt, public
from .deployments import parse_speculative, speculative_policy, speculative_text
from .inputs import as_policy
from .options import EngineOptions, ReplicaOptions
from .profiles import ProfileLike
from .replicas import check_out, cluster_of, executor_of, replica_args, replica_urls

if TYPE_CHECKING:  # pragma: no cover
    from .runs import Run

__all__ = ["serve", "ClusterRun"]


@public
def serve(
    policy: PolicyLike = None,
    *,
    model: str = "smollm2-135m",
    dtype: str = "float32",
    options: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    max_tokens: int | None = None,
    profile: ProfileLike = None,
    calibrate: bool = False,
    kv_tokens: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    sampling: str = "greedy",
    seed: int = 0,
    model_seed: int = 0,
    noise: str | None = None,
    out: str | Path | None = None,
    max_waiting: int | None = None,
    replicas: int = 1,
    router: Any = None,
    router_options: Mapping[str, Any] | None = None,
    prefill: int = 0,
    decode: int = 0,
    log: Log | None = None,
    kv_dir: str | Path | None = None,
    replica_urls: Sequence[str] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    speculative: str | Mapping[str, Any] | None = None,
) -> "Run | ClusterRun":
    """Serve ``policy`` on ``model`` over HTTP (the ``serve`` command) until SIGINT or SIGTERM:
    OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, ``/v1/models``, ``/health``,
    ``/metrics``. Requests in flight then finish; the result is the ``Run`` of what was served
    (``out``: its run directory and ``trace.json`` written there).

    ``replicas`` N > 1 (or ``prefill`` P and ``decode`` D, prefill and decode apart): N
    processes, each a one-replica ``serve`` on its share of the cores, behind a front on
    ``host``/``port`` that routes each request with ``router`` (as ``ClusterOptions``; default
    round-robin); the result is a ``ClusterRun`` (``out``: each replica's run directory,
    ``trace.json`` and ``cluster.json``). ``executor="ray"`` starts them as Ray actors instead, on
    a local Ray started here or on the Ray cluster at ``ray_address``, each reached by URL; ending
    the front ends them. ``replica_urls`` (no ``policy``): the front routes to the ``schedlab
    serve`` replicas already listening there (on other machines, say), each with its own policy,
    model and settings; it never starts or ends them (they go on serving after it), and one that
    does not answer at the start is a ``SchedlabError``. ``calibrate``: without a profile measured on this
    model and machine, calibrate one first (else plan with the nearest); ``max_tokens``: what a
    request that gives none gets; ``max_waiting``: a request arriving while that many wait to be
    admitted gets a 429. The listening line (and its address) goes to stderr; ``log(kind,
    message)`` hears progress, notes and warnings. ``speculative``: speculative decoding on every
    replica (``"ngram:k=4"`` or ``"draft:model=M,k=3"``, as ``run_real`` takes it; /metrics counts
    it as vLLM does)."""
    from schedlab.serving.http import DEFAULT_MAX_TOKENS
    from schedlab.serving.single import check_address

    urls = _urls(replica_urls, policy, locals())
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    _check_serve(port, max_tokens, max_waiting, calibrate, profile, kv_dir)
    out = check_out(out)
    if urls is not None:
        return _front_over(urls, router, router_options, host, port, out, logger(log))
    engine = EngineOptions(model=model, dtype=dtype, sampling=sampling, noise=noise, model_seed=model_seed)
    replica = ReplicaOptions(kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching)
    seed = check_seed(seed)
    pol = as_policy(policy, options)  # a bad policy fails before the model loads
    spec = parse_speculative(speculative)
    pol = speculative_policy(pol, spec)
    cluster, split = cluster_of(replicas, router, router_options, prefill, decode, prefix_caching)  # and a router
    executor = executor_of(executor, ray_address, cluster.replicas, split)
    check_address(host, port)  # and so does an address in use (loading a model takes seconds)
    log = logger(log)
    if cluster.replicas > 1:
        from schedlab.serving.cluster import serve_cluster

        args = replica_args(
            policy,
            options,
            engine,
            replica,
            profile=profile,
            calibrate=calibrate,
            seed=seed,
            max_tokens=max_tokens,
            served_name=served_model_name,
            max_waiting=max_waiting,
            speculative=speculative_text(spec),
        )
        return serve_cluster(
            cluster.replicas,
            cluster.make_router(),
            dict(cluster.router_options or {}),
            args,
            host=host,
            port=port,
            out=out,
            policy_name=getattr(pol, "name", type(pol).__name__),
            served_name=served_model_name,
            sequential=profile is None and calibrate,  # the first calibrates, the rest find its profile
            log=log,
            pools=split,
            decode_router=cluster.make_router() if split else None,
            executor=executor,
            ray_address=ray_address,
        )
    return _serve_one(pol, engine, replica, profile, calibrate, seed, host, port, served_model_name, max_tokens,
                      out, log, max_waiting, kv_dir)  # fmt: skip


def _urls(urls, policy, given: dict) -> list[str] | None:
    """``replica_urls`` checked, and the settings that do not go with them (``replica_urls``)."""
    if urls is not None and given["replicas"] != 1:
        fail(
            f"{opt('replicas')} does not go with the replicas at URLs: the front routes to those, or starts its own", 2
        )
    given = {**given, "option": bool(given["options"])}  # (-o k=v; an empty mapping is none)
    defaults = dict(option=False, prefill=0, decode=0, executor="local", ray_address=None, profile=None,
                    calibrate=False, kv_tokens=None, prefix_caching=False, noise=None, max_waiting=None,
                    kv_dir=None, served_model_name=None)  # fmt: skip
    return replica_urls(urls, policy, {k: given[k] != v for k, v in defaults.items()})


def _front_over(urls, router, router_options, host, port, out, log) -> ClusterRun:
    """A front over the replicas at ``urls`` (``serve --replica-url``), until SIGINT/SIGTERM."""
    from schedlab.serving.cluster import serve_cluster
    from schedlab.serving.single import check_address

    cluster, _ = cluster_of(len(urls), router, router_options, 0, 0, False, urls=urls)
    check_address(host, port)
    return serve_cluster(
        len(urls),
        cluster.make_router(),
        dict(cluster.router_options or {}),
        [],
        host=host,
        port=port,
        out=out,
        policy_name=None,
        served_name=None,
        sequential=False,
        log=log,
        urls=urls,
    )


def _check_serve(port, max_tokens, max_waiting, calibrate, profile, kv_dir) -> None:
    """What ``serve``'s settings alone tell: one-line errors before anything loads."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        fail(f"{opt('port')} must be 0..65535, got {port}", 2)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        fail(f"{opt('max_tokens')} must be >= 1, got {max_tokens}", 2)
    if max_waiting is not None and (
        isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
    ):
        fail(f"{opt('max_waiting')} must be >= 1 (leave it out for no limit), got {max_waiting}", 2)
    if check_bool(calibrate, "calibrate") and profile is not None:
        fail(f"{opt('calibrate')} does not go with {opt('profile')}", 2)
    if kv_dir is not None and not Path(kv_dir).is_dir():
        fail(f"{opt('kv_dir')} {kv_dir}: no such directory")


def _serve_one(pol, engine, replica, profile, calibrate, seed, host, port, name, max_tokens, out, log, max_waiting,
               kv_dir) -> "Run":  # fmt: skip
    """One replica served in this process: the engine's loop in the main thread."""
    from schedlab.errors import SchedlabError
    from schedlab.serving.single import exit_with_front, serve_replica

    from .real import load_engine

    exit_with_front()
    eng = load_engine(
        engine,
        replica=replica,
        profile=profile,
        no_calibrate=not calibrate,  # serving needs no calibration; predictions do (calibrate)
        seed=seed,
        require_tokenizer=True,
        log=log,
    )
    kv = None if kv_dir is None else Path(kv_dir)
    run, error = serve_replica(
        eng, pol, host, port, name or eng.info.name, max_tokens, out, log, max_waiting=max_waiting, kv_dir=kv
    )
    if run is None:  # (it never served: its address was taken meanwhile)
        raise SchedlabError(error)
    return run  # (run.error: why it stopped early, if it did)
