"""Several real replicas, as ``serve(..., replicas=N)`` and ``run_real(..., replicas=N)`` start
them (``schedlab.serving``): the replicas and router checked before anything starts
(``cluster_of``), the ``schedlab serve`` options each replica process starts with
(``replica_args``: the policy a name each can load), and ``run_real``'s cluster
(``run_real_cluster``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from schedlab.serving.result import ClusterRun

from ._base import Log, PolicyLike, TraceLike, fail, opt, out_dir
from .inputs import as_policy, as_trace
from .options import ClusterOptions, EngineOptions, ReplicaOptions
from .profiles import ProfileLike, profile_path


def pools(prefill: int, decode: int, replicas: int, prefix_caching: bool) -> tuple[int, int] | None:
    """Prefill and decode apart (``prefill`` P and ``decode`` D replicas): (P, D), or None when
    neither is given; one-line errors."""
    if not (prefill or decode):
        return None
    if prefill < 1 or decode < 1:
        fail(
            f"{opt('prefill')} and {opt('decode')} go together, each >= 1 (got {opt('prefill')} {prefill} "
            f"{opt('decode')} {decode})",
            2,
        )
    if replicas != 1:
        fail(f"{opt('replicas')} does not go with {opt('prefill')}/{opt('decode')} (the replicas are their sum)", 2)
    if prefix_caching:
        fail(f"{opt('prefix_caching')} does not go with {opt('prefill')}/{opt('decode')} yet", 2)
    return prefill, decode


def cluster_of(
    replicas: int, router: Any, router_options: Any, prefill: int, decode: int, prefix_caching: bool, urls=None
):
    """(``ClusterOptions``, (P, D) or None): the replicas behind a router, checked before anything
    starts (a bad router, a bad count, a router for one replica that this process runs alone:
    nothing would route; a front over ``urls`` routes even to one)."""
    split = pools(prefill, decode, replicas, prefix_caching)
    n = sum(split) if split is not None else replicas
    if n == 1 and router is not None and not urls:
        fail(
            f"{opt('router')} goes with {opt('replicas')} N > 1 (or {opt('prefill')}/{opt('decode')}): "
            "one replica is not routed",
            2,
        )
    cluster = ClusterOptions(replicas=n, router=router, router_options=router_options)
    cluster.make_router()  # (a bad router fails now)
    return cluster, split


def executor_of(executor: Any, ray_address: Any, n: int, split: tuple[int, int] | None) -> str:
    """Where the replicas run: "local" (processes here) or "ray" (Ray actors; ``ray_address``: an
    existing Ray cluster); one-line errors."""
    from ._base import executor_name

    executor = executor_name(executor, ray_address)
    if executor == "ray" and split is not None:
        fail(f"{opt('executor')} ray does not go with {opt('prefill')}/{opt('decode')} yet (the KV moves through a "
             f"folder of this machine)", 2)  # fmt: skip
    if executor == "ray" and n < 2:
        fail(
            f"{opt('executor')} ray starts the replicas of {opt('replicas')} N > 1 as Ray actors: give {opt('replicas')}",
            2,
        )
    return executor


def _urls_opt() -> str:
    o = opt("replica_url")
    return o if o.startswith("--") else "replica_urls"


def replica_urls(urls: Any, policy: Any, given: Mapping[str, Any]) -> list[str] | None:
    """``serve``'s ``replica_urls`` (``--replica-url``, repeatable): servers already listening that
    the front routes to; None without. Each runs its own policy, model and settings, so ``policy``
    and ``given`` (the other settings the caller gave: name -> whether given) are refused beside
    them, one line; so is a policy missing without them."""
    if urls is None or (not isinstance(urls, str) and len(urls) == 0):
        if policy is None:
            fail(f"{opt('policy')} is needed: a bundled policy name or 'file.py:Class' (or {_urls_opt()})", 2)
        return None
    from schedlab.serving.replicas import check_urls

    where = _urls_opt()
    if isinstance(urls, str):
        urls = [urls]
    if policy is not None:
        fail(f"the replicas at {where} run their own policies: leave out {opt('policy')}", 2)
    for name, yes in given.items():
        if yes:
            fail(f"{opt(name)} does not go with {where} (the replicas there have their own; each is started apart)", 2)
    return check_urls(urls)


def replica_args(
    policy: PolicyLike,
    options: Mapping[str, Any] | None,
    engine: EngineOptions,
    replica: ReplicaOptions,
    *,
    profile: ProfileLike,
    calibrate: bool,
    seed: int,
    **serve_only: Any,
) -> list[str]:
    """The ``schedlab serve`` options each replica process starts with (``serving.replicas.serve_args``):
    the policy as a name each can load, checked here first."""
    from schedlab.serving.replicas import serve_args

    if not isinstance(policy, (str, Path)):
        fail(
            f"with several replicas the policy is a bundled name or 'file.py:Class' (each replica process loads "
            f"it), got {type(policy).__name__}",
            2,
        )
    as_policy(str(policy), options)  # a bad policy or option fails before any replica starts
    return serve_args(
        str(policy),
        dict(options or {}),
        model=engine.model,
        dtype=engine.dtype,
        sampling=engine.sampling,
        seed=seed,
        model_seed=engine.model_seed,
        block_size=replica.block_size,
        prefix_caching=replica.prefix_caching,
        profile=None if profile is None else str(profile_path(profile)),
        kv_tokens=replica.kv_tokens,
        noise=engine.noise,
        calibrate=calibrate,
        **serve_only,
    )


def check_out(out: str | Path | None) -> Path | None:
    return out_dir(out)


class _Uncounted:
    """A stand-in tokenizer for a trace sent to a cluster as text: the replicas count its prompts
    with the model's tokenizer; the counts it gives (one per byte) are never used."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode()) or [0]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return [b for m in messages for b in (m["role"] + m["content"]).encode()] or [0]


def run_real_cluster(
    policy: PolicyLike,
    trace: TraceLike,
    *,
    options: Mapping[str, Any] | None,
    engine: EngineOptions,
    replica: ReplicaOptions,
    cluster: ClusterOptions,
    split: tuple[int, int] | None,
    profile: ProfileLike,
    no_calibrate: bool,
    seed: int,
    out: str | Path | None,
    log: Log,
    executor: str = "local",
    ray_address: str | None = None,
    speculative: str | None = None,
) -> ClusterRun:
    """``run_real(..., replicas=N)``: the trace's requests sent at their arrival times to a front
    over N replica processes (``serving.cluster.run_real_cluster``); a ``ClusterRun``."""
    from schedlab.serving.cluster import run_real_cluster as run

    out = check_out(out)
    # calibrated first where no profile matches, as with one replica (the first replica calibrates,
    # the others find its profile)
    calibrate = profile is None and not no_calibrate
    args = replica_args(
        policy, options, engine, replica, profile=profile, calibrate=calibrate, seed=seed, speculative=speculative
    )
    tr = as_trace(trace, seed=seed, tokenizer=_Uncounted())  # (the replicas count)
    pol = as_policy(str(policy), options)
    return run(
        tr,
        cluster.replicas,
        cluster.make_router(),
        dict(cluster.router_options or {}),
        args,
        out=out,
        policy_name=getattr(pol, "name", type(pol).__name__),
        ignore_eos=engine.ignore_eos,
        sequential=calibrate,
        log=log,
        pools=split,
        decode_router=cluster.make_router() if split else None,
        executor=executor,
        ray_address=ray_address,
    )
