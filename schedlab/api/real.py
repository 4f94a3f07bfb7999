"""The real MLX engine: ``run_real`` (the ``run-real`` command; several replicas:
``replicas.run_real_cluster``, over ``schedlab.serving``), and under it ``load_engine``, a model
loaded with the cost model its policy plans with (an ``Engine``), which runs a policy
over a trace or a live arrival source (``serve``'s). ``model_info`` describes a model.

Nothing here imports mlx until one of these is called; ``engine`` is imported first there, so
OpenBLAS is loaded before MLX."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ._base import (
    Log,
    PolicyLike,
    TraceLike,
    check_bool,
    check_callable,
    check_model,
    check_model_seed,
    check_seed,
    fail,
    logger,
    opt,
    out_dir,
    parse_slo,
    policy_options,
    public,
)
from .deployments import parse_speculative, speculative_policy, speculative_text
from .inputs import as_policy, as_trace
from .options import ClientOptions, EngineOptions, ReplicaOptions, merged
from .profiles import ProfileLike, ReplicaCostModel, linear_model, profile_path
from .runs import Run

if TYPE_CHECKING:  # pragma: no cover
    from schedlab.engine.backend import MLXBackend
    from schedlab.serving.result import ClusterRun
    from schedlab.engine.models import ModelInfo
    from schedlab.engine.noise import Noise


@contextlib.contextmanager
def noise_env(spec: str | None):
    """The engine's noise settings (``engine.noise``: gc-off, pin=CPUS, warmup=N, malloc-keep,
    mlx-cache=SIZE), checked; in the environment while the block runs, so that every backend and
    calibration made in it uses them (as the commands' ``--noise`` does). Yields the settings."""
    import os

    from schedlab.engine.noise import ENV, Noise

    if spec is not None and not isinstance(spec, str):
        fail(f"noise is a string such as 'gc-off,pin=0-1,warmup=3', got {type(spec).__name__}", 2)
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


def _blas_mismatch(profile_blas, engine_blas) -> str | None:
    """A one-line warning when the profile was measured under another BLAS or thread count."""
    if not isinstance(profile_blas, dict):
        return None
    want = (profile_blas.get("name"), profile_blas.get("threads"))
    have = (engine_blas.get("name"), engine_blas.get("threads"))
    if want[0] is None:
        return None
    if want[0] != have[0] or (want[1] is not None and want[1] != have[1]):
        return (
            f"the profile was measured with BLAS {want[0]} ({want[1]} threads) but the engine "
            f"uses {have[0]} ({have[1]} threads): predicted_s will be off"
        )
    return None


def nearest_profile(info, candidates) -> tuple[Path, str] | None:
    """Of profiles none of which was measured on this model and machine, the nearest: one of this
    model (its name, dtype and size), measured on this machine's CPU (under other BLAS settings)
    before one measured on another machine; with why it does not match. None when none is of
    this model (the caller falls back to the default profile: another model's)."""
    from schedlab.engine.calibrate import profile_mismatch
    from schedlab.sim.cost import read_profile

    here = info.metadata()
    best = None
    for p in candidates:
        try:
            meta = read_profile(p)
        except Exception:  # a broken cache file is no candidate
            continue
        if (meta.get("model"), meta.get("dtype"), meta.get("parameters")) != (
            here["model"],
            here["dtype"],
            here["parameters"],
        ):
            continue
        rank = 0 if (meta.get("machine") or {}).get("cpu_model") == here["machine"].get("cpu_model") else 1
        if best is None or rank < best[0]:
            best = (rank, Path(p), profile_mismatch(meta, info) or "measured elsewhere")
    return None if best is None else (best[1], best[2])


def _real_cost(profile: ProfileLike, kv_tokens: int | None, no_calibrate: bool, info, log: Log, notes: list[str]):
    """(cost model, KV capacity, profile path) the policy sees and steps are predicted with.

    ``profile``: that file (a warning when it was measured elsewhere). Otherwise one measured on
    this model and machine (bundled, or calibrate's cache), else a quick calibration now (cached
    for the next run), as ``validate`` does; with ``no_calibrate`` the bundled default profile,
    which ``simulate`` uses, with a warning that its predictions are for another setup. Then a
    warning when the profile was measured under another BLAS setup.
    """
    from schedlab.engine import blas
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
        if matching:
            path = matching[0]
        else:
            near = nearest_profile(info, candidate_profiles(info))
            path, why = near if near is not None else (resolve_profile(None), "another model's")
            note(
                "warning",
                f"no cost profile for model {info.name} on this machine: the policy plans and "
                f"steps.parquet's predicted_s come from {path.name}, measured elsewhere ({why})",
            )
    else:
        given = None if profile is None else str(profile_path(profile))
        path, why = find_or_calibrate(given, info, None, lambda msg: log("progress", msg))
        if why:
            note("note" if profile is None else "warning", why)
    cost, capacity, path = linear_model(path, kv_tokens)
    mismatch = _blas_mismatch(cost.meta.get("blas"), blas.info())
    if mismatch:
        note("warning", mismatch)
    return cost, capacity, path


class Engine:
    """A model loaded on the real MLX engine (``load_engine``), with the cost model a policy
    plans with and each step is predicted with, and the replica it runs.

    - ``info``: the model (``engine.models.ModelInfo``: ``name``, ``tokenizer``,
      ``eos_token_ids``, ``max_context``, ``check_trace(requests)``, ``metadata()``);
    - ``cost_model``: a ``ReplicaCostModel`` (its ``kv_tokens``: the replica's KV capacity);
    - ``options``, ``replica``: the ``EngineOptions`` and ``ReplicaOptions`` it was loaded with;
      ``seed``: the prompt ids' and the sampling's seed (and a trace's, in ``run``);
    - ``notes``: what loading noted or warned about (a run's meta.json keeps them);
    - ``run(policy, arrivals)``: a ``Run``; ``make_backend()``: a fresh engine backend for it.
    """

    def __init__(
        self,
        info: "ModelInfo",
        options: EngineOptions,
        replica: ReplicaOptions,
        seed: int,
        cost_model: ReplicaCostModel,
        noise: "Noise",
        sampler: Any,
        notes: list[str],
    ):
        self.info = info
        self.options = options
        self.replica = replica
        self.seed = seed
        self.cost_model = cost_model
        self.noise = noise
        self._sampler = sampler
        self.notes = list(notes)

    @property
    def kv_tokens(self) -> int:
        return self.cost_model.kv_tokens

    def make_backend(self, warmup: bool | str = True) -> "MLXBackend":
        """A fresh engine backend (``engine.backend.MLXBackend``) with this engine's sampling,
        seed, EOS handling and noise settings: what ``run`` runs on unless given one (``serve``
        hooks its ``on_token`` first, and warms it up "light")."""
        from schedlab.engine.backend import MLXBackend

        return MLXBackend(
            self.info,
            sampling=self._sampler,
            seed=self.seed,
            ignore_eos=self.options.ignore_eos,
            noise=self.noise,
            warmup=warmup,
        )

    @public
    def run(
        self,
        policy: PolicyLike,
        arrivals: Any,
        *,
        trace_name: str | None = None,
        clients: ClientOptions | None = None,
        slo: str | Mapping[str, float] | None = None,
        on_step: Callable[[int, int], None] | None = None,
        clock: Any = None,
        backend: "MLXBackend | None" = None,
    ) -> Run:
        """Run ``policy`` on this engine over ``arrivals``: a trace (anything ``load_trace``
        takes; prompts given as text are counted with the model's tokenizer; ``clients``: the
        clients in front of the replica) or an arrival source (``sim.sources``: e.g. a
        ``LiveSource`` whose requests come from other threads while the replica runs, as
        ``serve``'s HTTP handlers submit them; with ``clock``, the ``sim.WallClock`` it stamps
        arrivals with). ``trace_name``: the run's trace name (default: the trace's, ``"live"``
        for a source); ``slo``: goodput SLOs; ``on_step(finished, requests)`` is called after
        every step; ``backend``: the engine backend to run on (default: ``make_backend()``)."""
        check_callable(on_step, "on_step")
        pol = as_policy(policy)
        slos = parse_slo(slo)
        if hasattr(arrivals, "process"):  # an arrival source
            if clients is not None:
                fail("clients go with a trace, not with an arrival source", 2)
            return self._run(pol, arrivals, trace_name or "live", slos, on_step, clock, backend)
        tr = _model_trace(self.info, arrivals, self.seed)
        return self._run(
            pol,
            (clients or ClientOptions()).arrivals(tr.requests, self.seed),
            trace_name or tr.name,
            slos,
            on_step,
            clock,
            backend,
        )

    def _run(self, pol, arrivals, trace_name: str, slos: dict, on_step, clock, backend) -> Run:
        from schedlab.analysis.residuals import bias
        from schedlab.sim import run_replica as run_loop
        from schedlab.sim.features import step_table
        from schedlab.sim.metrics import summarize

        backend = backend if backend is not None else self.make_backend()
        hook = None if on_step is None else (lambda state: on_step(state.finished, state.n_accepted))
        rep = self.replica
        result = run_loop(
            arrivals,
            pol,
            self.cost_model.model,
            kv_capacity=self.kv_tokens,
            backend=backend,
            trace_name=trace_name,
            on_step=hook,
            block_size=rep.block_size,
            prefix_caching=rep.prefix_caching,
            clock=clock,
        )
        summary = summarize(result, slo=slos or None)
        return Run(
            result,
            summary,
            {
                "profile": self.cost_model.source["profile"],
                "kv_tokens": result.kv_capacity,
                "seed": self.seed,
                "block_size": rep.block_size,
                "prefix_caching": rep.prefix_caching,
                "model_seed": self.options.model_seed,
                "policy_options": policy_options(pol),
                "warnings": list(self.notes),
                "step_bias": bias(step_table(result)),
                "noise": self.noise.describe(),
            },
            _write_texts=lambda path: backend.write_texts(path, result.requests),
        )

    def __repr__(self) -> str:
        return (
            f"Engine(model={self.info.name!r}, dtype={self.info.dtype!r}, kv_tokens={self.kv_tokens}, "
            f"profile={self.cost_model.source.get('profile')!r})"
        )


def _engine_checks(options: EngineOptions):
    """The sampler: what is checked of the engine's options before a model loads."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine.sampling import parse_sampling

    check_model(options.model, options.dtype)
    return parse_sampling(options.sampling)


def _load(
    options: EngineOptions,
    replica: ReplicaOptions,
    profile: ProfileLike,
    no_calibrate: bool,
    seed: int,
    log: Log,
    sampler,
    noise,
    before_cost: Callable[["ModelInfo"], Any] | None = None,
) -> Engine:
    """The model loaded, then (after ``before_cost(info)``, which checks what needs the model)
    its cost model: calibrated first where no profile matches. Called with the noise settings in
    the environment (``noise_env``)."""
    from schedlab.engine.models import load_model

    if profile is not None:
        profile_path(profile)  # a bad profile fails before the model loads
    info = load_model(options.model, dtype=options.dtype, seed=options.model_seed)
    if before_cost is not None:
        before_cost(info)
    notes: list[str] = []
    cost, capacity, path = _real_cost(profile, replica.kv_tokens, no_calibrate, info, log, notes)
    return Engine(
        info, options, replica, seed, ReplicaCostModel(cost, capacity, {"profile": str(path)}), noise, sampler, notes
    )


@public
def load_engine(
    engine: EngineOptions | None = None,
    *,
    replica: ReplicaOptions | None = None,
    profile: ProfileLike = None,
    no_calibrate: bool = False,
    seed: int = 0,
    log: Log | None = None,
    model: str = "tiny",
    dtype: str = "float32",
    sampling: str = "greedy",
    noise: str | None = None,
    model_seed: int = 0,
    ignore_eos: bool = False,
    kv_tokens: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    require_tokenizer: bool = False,
) -> Engine:
    """Load a model on the real MLX engine with the cost model its policies plan with: an
    ``Engine``, whose ``run`` runs a policy over a trace or a live arrival source.

    ``engine`` (an ``EngineOptions``, or its fields ``model``, ``dtype``, ``sampling``,
    ``noise``, ``model_seed``, ``ignore_eos``) and ``replica`` (a ``ReplicaOptions``, or its
    fields ``kv_tokens``, ``block_size``, ``prefix_caching``): see those classes. ``profile``:
    the cost model the policy sees and each step is predicted with (default: one measured on this
    model and machine, else a quick calibration first, cached for the next time;
    ``no_calibrate``: the bundled profile instead); ``seed``: the prompt ids' and the
    sampling's; ``require_tokenizer``: fail (before any calibration) when the model has no
    tokenizer, i.e. takes no text; ``log(kind, message)`` hears progress, notes and warnings
    (default: warnings as ``SchedlabWarning``)."""
    check_callable(log, "log")
    check_bool(no_calibrate, "no_calibrate")
    check_bool(require_tokenizer, "require_tokenizer")
    opts = merged(
        EngineOptions,
        engine,
        "engine",
        model=model,
        dtype=dtype,
        sampling=sampling,
        noise=noise,
        model_seed=model_seed,
        ignore_eos=ignore_eos,
    )
    rep = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    seed = check_seed(seed)
    sampler = _engine_checks(opts)

    def has_tokenizer(info) -> None:
        if require_tokenizer and info.tokenizer is None:
            fail(
                f"model {info.name} has no tokenizer, so it takes no text (models with one: smollm2-135m, a .gguf "
                f"file or an mlx-lm checkpoint directory with tokenizer.json)"
            )

    with noise_env(opts.noise) as settings:
        return _load(opts, rep, profile, no_calibrate, seed, logger(log), sampler, settings, before_cost=has_tokenizer)


@public
def run_real(
    policy: PolicyLike,
    trace: TraceLike,
    *,
    model: str = "tiny",
    dtype: str = "float32",
    options: Mapping[str, Any] | None = None,
    profile: ProfileLike = None,
    no_calibrate: bool = False,
    kv_tokens: int | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    model_seed: int = 0,
    sampling: str = "greedy",
    slo: str | Mapping[str, float] | None = None,
    noise: str | None = None,
    log: Log | None = None,
    on_step: Callable[[int, int], None] | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    max_concurrency: int | None = None,
    request_rate: float | str | None = None,
    burstiness: float | None = None,
    think_time: float | None = None,
    engine: EngineOptions | None = None,
    replica: ReplicaOptions | None = None,
    clients: ClientOptions | None = None,
    replicas: int = 1,
    router: Any = None,
    router_options: Mapping[str, Any] | None = None,
    prefill: int = 0,
    decode: int = 0,
    out: str | Path | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    speculative: str | Mapping[str, Any] | None = None,
) -> "Run | ClusterRun":
    """Run ``policy`` on ``trace`` with a real MLX model (the ``run-real`` command): the same
    loop as ``simulate``, every pass a real forward, the clock wall time. ``out``: the run
    directory is written there too.

    ``replicas`` N > 1 (or ``prefill`` P and ``decode`` D: prefill and decode apart), as
    ``run-real --replicas``: N replica processes behind a front that routes each request with
    ``router`` (and its ``router_options``, as ``ClusterOptions``; default round-robin), the
    trace's requests sent to it over HTTP at their arrival times; ``policy`` is then a bundled
    name or ``"file.py:Class"`` (each replica loads it), and the result a ``ClusterRun`` (the
    front's summary, the requests that failed; ``out``: ``trace.json``, ``cluster.json`` and each
    replica's run directory). SIGINT and SIGTERM end every replica at once (``KeyboardInterrupt``;
    ``schedlab.serving``). ``executor="ray"``: the replicas are Ray actors (a local Ray started
    here, or the cluster at ``ray_address``), as ``serve`` starts them.

    ``engine`` (or ``model``, ``dtype``, ``sampling``, ``noise``, ``model_seed``,
    ``ignore_eos``), ``replica`` (or ``kv_tokens``, ``block_size``, ``prefix_caching``) and
    ``clients`` (or ``max_concurrency``, ``request_rate``, ``burstiness``, ``think_time``): see
    ``EngineOptions``, ``ReplicaOptions``, ``ClientOptions``. ``profile`` and ``no_calibrate``:
    see ``load_engine``; ``seed``: the trace's and the prompt ids' seed. Prompts given as text are
    counted with the model's tokenizer; ``run.texts`` holds what the model generated,
    ``run.features`` and ``run.residuals()`` the steps' measured/predicted. ``log(kind,
    message)`` hears progress, notes and warnings (default: warnings as ``SchedlabWarning``);
    ``on_step(finished, requests)`` is called after every step. ``speculative``: speculative
    decoding (``"ngram:k=4"`` or ``"draft:model=M,k=3"``, as ``simulate`` takes it): the policy's
    decode rows verify up to k draft tokens found by n-gram prompt lookup or proposed by draft
    model M (loaded beside the model, of its vocabulary), greedy rows only; the model decides
    what it accepts (``accept`` is only the adaptive k's prior)."""
    check_callable(log, "log")
    check_callable(on_step, "on_step")
    check_bool(no_calibrate, "no_calibrate")
    out = out_dir(out)
    log = logger(log)
    seed = check_seed(seed)
    opts = merged(
        EngineOptions,
        engine,
        "engine",
        model=model,
        dtype=dtype,
        sampling=sampling,
        noise=noise,
        model_seed=model_seed,
        ignore_eos=ignore_eos,
    )
    rep = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    cl = merged(
        ClientOptions,
        clients,
        "clients",
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        think_time=think_time,
    )
    if replicas != 1 or router is not None or router_options or prefill or decode or executor != "local" or ray_address:
        from .replicas import cluster_of, executor_of, run_real_cluster

        cluster, split = cluster_of(replicas, router, router_options, prefill, decode, rep.prefix_caching)
        where = executor_of(executor, ray_address, cluster.replicas, split)
        if cluster.replicas > 1:
            _one_replica_only(cl, slo, on_step)
            _engine_checks(opts)
            return run_real_cluster(policy, trace, options=options, engine=opts, replica=rep, cluster=cluster,
                                    split=split, profile=profile, no_calibrate=no_calibrate, seed=seed, out=out,
                                    log=log, executor=where, ray_address=ray_address,
                                    speculative=speculative_text(parse_speculative(speculative)))  # fmt: skip
    pol = speculative_policy(as_policy(policy, options), parse_speculative(speculative))
    sampler = _engine_checks(opts)
    slos = parse_slo(slo)
    got: dict[str, Any] = {}

    def read_trace(info) -> None:  # with the model's tokenizer, before any calibration
        got["trace"] = _model_trace(info, trace, seed)

    with noise_env(opts.noise) as settings:
        eng = _load(opts, rep, profile, no_calibrate, seed, log, sampler, settings, before_cost=read_trace)
    tr = got["trace"]
    run = eng._run(pol, cl.arrivals(tr.requests, seed), tr.name, slos, on_step, None, None)
    if out is not None:
        run.save(out)
    return run


def _one_replica_only(clients: ClientOptions, slo, on_step) -> None:
    """What goes with one replica only (yet): a cluster is sent the trace at its arrival times."""
    for key in ("max_concurrency", "request_rate", "burstiness", "think_time"):
        if getattr(clients, key) is not None:
            fail(f"{opt(key)} does not go with {opt('replicas')} (yet): the requests are sent at the trace's "
                 f"arrival times", 2)  # fmt: skip
    if slo is not None:
        fail(f"{opt('slo')} does not go with {opt('replicas')} (yet): the requests are sent at the trace's "
             f"arrival times", 2)  # fmt: skip
    if on_step is not None:
        fail(f"on_step goes with one replica (the replicas are other processes), not {opt('replicas')}", 2)


def _model_trace(info, trace: TraceLike, seed: int):
    """``trace`` read with ``info``'s tokenizer (text prompts counted by it), checked against
    the model's context."""
    tok = info.tokenizer
    tr = as_trace(trace, seed=seed, tokenizer=tok, recount=tok is not None)
    info.check_trace(tr.requests)
    return tr


@public
def model_info(model: str = "tiny", *, dtype: str = "float32", model_seed: int = 0) -> dict[str, Any]:
    """What the engine records about ``model`` (as in a real run's meta.json): architecture,
    parameters, dtype, tokenizer, mlx and mlx-lm versions, device, BLAS and machine. Loads it."""
    from schedlab.engine.models import load_model

    check_model(model, dtype)
    return load_model(str(model), dtype=dtype, seed=check_model_seed(model_seed)).metadata()
