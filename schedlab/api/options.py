"""The options a run is made with, as small frozen objects: the replica's KV cache
(``ReplicaOptions``), the clients in front of it (``ClientOptions``), several replicas behind a
router (``ClusterOptions``; its kinds of replica in a heterogeneous cluster, ``ReplicaGroup``,
also read from a cluster file) and the real engine (``EngineOptions``). The commands build them
from their flags and hand them to the API, which hands their fields to the loop and the engine;
the API's functions also take the same settings as keyword arguments (``kv_tokens=``,
``max_concurrency=``, ``replicas=``, ``model=``, ...).

Each checks its values when made: bad ones raise ``SchedlabError`` with one line naming the
option as the caller knows it (``block_size`` in Python, ``--block-size`` on the command line).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import SchedlabError, opt
from ._base import check_bool, check_kv_tokens, check_model_seed, fail


def _checked_failures(value: Any, n: int) -> tuple[tuple[int, float], ...]:
    """``fail`` as ((replica, seconds), ...): each a pair or a string ``REPLICA@SECONDS``, read
    here and checked by the deployment's own rule (``sim.deployment.check_faults``); one line
    naming the bad one otherwise."""
    from schedlab.sim.deployment import DeploymentError, check_faults

    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        fail(f"{opt('fail')} is REPLICA@SECONDS (or a list of them), got {value!r}", 2)
    pairs: list[Any] = []
    for given in items:
        item = given
        if isinstance(item, str):
            head, at, tail = item.strip().partition("@")
            try:
                item = (int(head), float(tail))
            except ValueError:
                at = ""
            if not at:
                fail(f"{opt('fail')} is REPLICA@SECONDS such as 1@30, got {item!r}", 2)
        elif not (isinstance(item, (list, tuple)) and len(item) == 2):
            fail(f"{opt('fail')} is REPLICA@SECONDS such as 1@30, got {item!r}", 2)
        pairs.append(tuple(item))
    try:
        return check_faults(pairs, n, opt("fail"), items)
    except DeploymentError as exc:
        fail(str(exc), 2)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{opt(name)} must be a number, got {value!r}", 2)
    return float(value)


@dataclass(frozen=True)
class ReplicaOptions:
    """One replica's KV cache. ``kv_tokens``: its capacity in tokens (None: the cost profile's,
    or what the hardware's memory holds); ``block_size``: KV is allocated in blocks of this many
    tokens (a request holds ceil(tokens / block)); ``prefix_caching``: block-level prefix caching
    (vLLM's automatic prefix caching): cached prefixes are not computed again."""

    kv_tokens: int | None = None
    block_size: int = 16
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        check_kv_tokens(self.kv_tokens)
        from schedlab.sim.deployment import DeploymentError, check_block_size

        try:
            check_block_size(self.block_size, opt("block_size"))
        except DeploymentError as exc:
            fail(str(exc), 2)
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            fail(
                f"{opt('kv_tokens')} {self.kv_tokens} is less than one block ({opt('block_size')} {self.block_size})", 2
            )
        check_bool(self.prefix_caching, "prefix_caching")


def parse_rate(value: float | str | None, name: str = "request_rate") -> float | None:
    """A request rate (req/s): a number > 0 or ``inf`` (a string from the command line); None
    when not given."""
    if value is None:
        return None
    if isinstance(value, bool):
        v = math.nan
    else:
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = math.nan
    if math.isnan(v) or v <= 0:
        fail(f"{opt(name)} must be a number > 0 or inf (requests/s), got {str(value)!r}", 2)
    return v


@dataclass(frozen=True)
class ClientOptions:
    """The clients in front of the replica, as ``vllm bench serve`` has them. None of them: the
    trace replayed at its own arrival times. ``max_concurrency``: closed-loop clients, at most
    this many requests in flight, the next one sent when one finishes; ``request_rate``: requests
    issued at this rate (req/s; ``inf`` or ``"inf"``: all at once) in trace order, replacing the
    trace's arrival times; ``burstiness``: with ``request_rate``, the gamma shape of the gaps
    (1: Poisson, the default); ``think_time``: with ``max_concurrency``, seconds a client waits
    after a response before its slot is free again."""

    max_concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float | None = None
    think_time: float | None = None

    def __post_init__(self) -> None:
        mc = self.max_concurrency
        if mc is not None:
            if isinstance(mc, bool) or not isinstance(mc, int):
                fail(f"{opt('max_concurrency')} must be an integer, got {mc!r}", 2)
            if mc < 1:
                fail(f"{opt('max_concurrency')} must be >= 1, got {mc}", 2)
        object.__setattr__(self, "request_rate", parse_rate(self.request_rate))
        if self.burstiness is not None:
            b = _number(self.burstiness, "burstiness")
            if self.request_rate is None:
                fail(
                    f"{opt('burstiness')} shapes the {opt('request_rate')} schedule: give {opt('request_rate')} too", 2
                )
            if math.isnan(b) or b <= 0:
                fail(f"{opt('burstiness')} must be > 0 (1: Poisson; inf: constant gaps), got {b:g}", 2)
            object.__setattr__(self, "burstiness", b)
        if self.think_time is not None:
            t = _number(self.think_time, "think_time")
            if mc is None:
                fail(f"{opt('think_time')} is the pause of a closed-loop client: give {opt('max_concurrency')} too", 2)
            if not (t >= 0 and math.isfinite(t)):
                fail(f"{opt('think_time')} must be a finite number of seconds >= 0, got {t:g}", 2)
            object.__setattr__(self, "think_time", t)

    def arrivals(self, requests: Sequence[Any], seed: int = 0):
        """What the loop is handed: ``requests`` themselves (no client option given: a trace
        replay), else the clients over them (``sim.sources.clients``)."""
        from schedlab.sim.sources import clients

        return clients(requests, self.max_concurrency, self.request_rate, self.burstiness, self.think_time or 0.0, seed)


_GROUP_KEYS = ("count", "policy", "options", "profile", "hardware", "model_config", "quant", "kv_tokens", "pool")
POOLS = ("prefill", "decode")
_TRANSFER_KEYS = (
    "link",
    "bandwidth_gbs",
    "latency_s",
    "mode",
    "model_config",
    "kv_bits",
    "kv_bytes_per_token",
    "layers",
)


def _option_keys(word: str, options: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """A plugin's ``options`` with their names read as the plugin loader reads them
    (``policies.plugins.option_keys``: strings, ``-`` as ``_``); a bad name is one line."""
    from schedlab.policies.plugins import option_keys

    return option_keys(word, options, lambda message: SchedlabError(f"{where}{message}", 2))


def _checked_group(fields: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A replica group's fields (a ``[[group]]`` table, a mapping or a ``ReplicaGroup``'s),
    checked and normalised; a bad one is one line starting with ``where`` and naming the key."""

    def bad(message: str) -> None:
        fail(f"{where}{message}", 2)

    unknown = [k for k in fields if k not in _GROUP_KEYS + ("cost",)]
    if unknown:
        bad(f"unknown key {unknown[0]!r} (keys: {', '.join(_GROUP_KEYS)})")
    out = {k: fields.get(k) for k in _GROUP_KEYS + ("cost",)}
    n = fields.get("count", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        bad(f"count must be an integer >= 1, got {n!r}")
    out["count"] = n
    pol = out["policy"]
    if pol is None:
        bad("no policy: every group names its policy (a bundled name or 'file.py:Class')")
    if isinstance(pol, (str, Path)):
        if not str(pol).strip():
            bad("policy is empty")
    elif not (isinstance(pol, type) or callable(getattr(pol, "plan", None))):
        bad(f"policy must be a policy's name, 'file.py:Class', a class or an object with plan(view), got {pol!r}")
    o = out["options"]
    if o is not None:
        if not isinstance(o, Mapping):
            bad(f"options must be a table of the policy's options such as {{ budget = 256 }}, got {o!r}")
        out["options"] = _option_keys("policy", o, where)
    for key in ("hardware", "model_config"):
        v = out[key]
        if v is not None and not (isinstance(v, (str, Path)) and str(v).strip()):
            bad(f"{key} must be a non-empty string, got {v!r}")
    prof = out["profile"]
    if prof is not None and isinstance(prof, (str, Path, bool, int, float)):
        if isinstance(prof, (bool, int, float)) or not str(prof).strip():
            bad(f"profile must be a profile's path or bundled name, got {prof!r}")
    q = out["quant"]
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        bad(f"quant must be the weights' bits (4, 8, 16), got {q!r}")
    kv = out["kv_tokens"]
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
        bad(f"kv_tokens must be an integer >= 1, got {kv!r}")
    if out["pool"] is not None and out["pool"] not in POOLS:
        bad(f"pool must be 'prefill' or 'decode' (leave it out for replicas that do both), got {out['pool']!r}")
    hw, mc = out["hardware"] is not None, out["model_config"] is not None
    if out["cost"] is not None and (prof is not None or hw or mc or q is not None):
        bad("give one cost source: profile, hardware + model_config, or cost")
    if prof is not None and (hw or mc):
        bad("give either profile or hardware + model_config, not both")
    if hw != mc:
        bad("hardware and model_config go together")
    if q is not None and not hw:
        bad("quant goes with hardware and model_config")
    return out


@dataclass(frozen=True)
class ReplicaGroup:
    """``count`` replicas alike, one kind of replica of a heterogeneous cluster
    (``ClusterOptions.groups``; a ``[[group]]`` table of a cluster file). Each replica runs its
    own ``policy`` object (a bundled name, ``"file.py:Class"``, a class, or an object, copied per
    replica) made with ``options``; its cost model is a measured ``profile`` (a path or a
    bundled name; none given: the bundled measured one), or the analytic model of ``hardware``
    running ``model_config`` [at ``quant`` bits], or ``cost`` (any cost model object);
    ``kv_tokens``: each replica's KV capacity (default: the profile's, or what the hardware's
    memory holds). Names (policies, profiles, presets) are looked up when the run starts."""

    policy: Any
    count: int = 1
    options: Any = None
    profile: Any = None
    hardware: str | None = None
    model_config: Any = None
    quant: int | None = None
    kv_tokens: int | None = None
    cost: Any = None
    pool: str | None = None

    def __post_init__(self) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in _checked_group(fields, "ReplicaGroup: ").items():
            object.__setattr__(self, key, value)

    def describe(self) -> dict[str, Any]:
        """The group as meta.json records it (what was given, names as strings)."""
        out: dict[str, Any] = {"count": self.count}
        for key in ("policy", "profile", "cost"):
            v = getattr(self, key)
            if v is not None:
                out[key] = str(v) if isinstance(v, (str, Path)) else getattr(v, "name", None) or type(v).__name__
        for key in ("hardware", "model_config", "quant", "kv_tokens", "pool"):
            v = getattr(self, key)
            if v is not None:
                out[key] = str(v) if isinstance(v, Path) else v
        if self.options:
            out["options"] = dict(self.options)
        return out


def _cluster_dir() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("schedlab.routers").origin).parent / "clusters"


def bundled_clusters() -> list[str]:
    """Bare names of the cluster files shipped with schedlab (``routers/clusters``)."""
    d = _cluster_dir()
    return sorted(f.stem for f in d.glob("*.toml")) if d.is_dir() else []


def bundled_cluster(path: str | Path) -> Path:
    """``path``, or the bundled cluster file it names (``h100-a100``) when there is no such file."""
    p = Path(path)
    if p.exists() or p.parent != Path("."):
        return p
    for cand in (_cluster_dir() / p.name, _cluster_dir() / f"{p.name}.toml"):
        if cand.is_file():
            return cand
    return p


def _near(value: Any, base: Path, spec: bool = False) -> Any:
    """A path in a cluster file, relative to the file's folder when it names something there
    (``spec``: a ``file.py:Class``, whose file part is the path); else as written (a bundled
    name, a path from the working directory)."""
    if not isinstance(value, str) or not value:
        return value
    path, sep, cls = value.rpartition(":") if spec and ".py:" in value else (value, "", "")
    if Path(path).is_absolute() or not (base / path).exists():
        return value
    return f"{base / path}{sep}{cls}"


def _near_transfer(t: Any, base: Path) -> Any:
    """A cluster file's ``transfer`` table with its model_config relative to the file's folder."""
    if isinstance(t, dict) and "model_config" in t:
        return {**t, "model_config": _near(t["model_config"], base)}
    return t


@dataclass(frozen=True)
class ClusterOptions:
    """Several replicas behind a router. ``replicas``: how many (each its own copy of the policy,
    KV cache and backend); ``router``: which replica serves each arrival, a bundled router's name
    (``round-robin``, ``random``, ``least-requests``, ``least-tokens``, ``least-kv``,
    ``power-of-two``, ``prefix-affinity``, ``weighted``), ``"file.py:Class"``, a router class or
    object (``route(view) -> replica index``); None: round-robin; ``router_options``: the
    router's options (``--router-option k=v``); ``router_delay``: seconds by which the router's
    view of each replica lags (stale signals). The defaults are one replica and no router: the
    single-replica simulation; giving any of them runs the cluster (with one replica, the same
    result).

    ``groups``: a heterogeneous cluster, a sequence of ``ReplicaGroup`` (or mappings of its
    fields), replicas numbered group by group in order; each group names its own policy, cost
    model and KV capacity, so ``simulate`` is then given no policy, profile or KV capacity of
    its own. ``replicas`` is then the groups' count (leave it out). ``file``: the cluster file
    they were read from (``from_file``), named by messages and meta.json.

    ``fail``: replicas that die during the run, ``(replica, seconds)`` pairs or strings
    ``"REPLICA@SECONDS"`` (``--fail 1@30``): from then on the router sees the replica down, its
    requests with no token yet go to another replica (once), those with tokens are refused
    (``sim.cluster.Cluster``)."""

    replicas: int = 1
    router: Any = None
    router_options: Any = None
    router_delay: float = 0.0
    groups: Any = None
    file: str | None = None
    fail: Any = ()
    transfer: Any = None

    def __post_init__(self) -> None:
        if self.groups is not None:
            self._check_groups()
        self._check_pools()
        n = self.replicas
        if isinstance(n, bool) or not isinstance(n, int):
            fail(f"{opt('replicas')} must be an integer, got {n!r}", 2)
        if n < 1:
            fail(f"{opt('replicas')} must be >= 1, got {n}", 2)
        from schedlab.sim.deployment import DeploymentError, check_router_delay

        try:
            object.__setattr__(self, "router_delay", check_router_delay(self.router_delay, opt("router_delay")))
        except DeploymentError as exc:
            fail(str(exc), 2)
        ro = self.router_options
        if ro is not None:
            if not isinstance(ro, Mapping):
                fail(f"router_options is a mapping such as {{'seed': 1}}, got {type(ro).__name__}", 2)
            object.__setattr__(self, "router_options", _option_keys("router", ro))
        if ro and self.router is None:
            fail(f"{opt('router_option')} goes with {opt('router')}: name the router too", 2)
        if self.router is not None and isinstance(self.router, (str, Path)) and not str(self.router).strip():
            fail(f"{opt('router')} is empty", 2)
        object.__setattr__(self, "fail", _checked_failures(self.fail, self.replicas))

    def _check_groups(self) -> None:
        where = f"{self.file}: " if self.file else ""
        gs = self.groups
        if isinstance(gs, (str, bytes, Mapping, ReplicaGroup)) or not isinstance(gs, Sequence) or not gs:
            fail(f"{where}groups is a non-empty sequence of ReplicaGroup, got {gs!r}", 2)
        out = []
        for k, g in enumerate(gs, 1):
            if isinstance(g, Mapping):
                g = ReplicaGroup(**_checked_group(g, f"{where}group {k}: "))
            elif not isinstance(g, ReplicaGroup):
                fail(f"{where}group {k} is a ReplicaGroup or a mapping of its fields, got {type(g).__name__}", 2)
            out.append(g)
        total = sum(g.count for g in out)
        if self.replicas not in (1, total):
            fail(f"{where}give either replicas or groups: the groups' counts make {total} replicas", 2)
        object.__setattr__(self, "groups", tuple(out))
        object.__setattr__(self, "replicas", total)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on different replicas (the groups' ``pool``)."""
        return bool(self.groups) and any(g.pool is not None for g in self.groups)

    def _check_pools(self) -> None:
        where = f"{self.file}: " if self.file else ""
        t = self.transfer
        if not self.disaggregated:
            if t is not None:
                fail(f"{where}transfer goes with prefill and decode pools (a group's pool)", 2)
            return
        pools = [g.pool for g in self.groups]
        for k, pool in enumerate(pools, 1):
            if pool is None:
                fail(
                    f"{where}group {k}: no pool: in a cluster of prefill and decode pools every group names its pool", 2
                )
        if "prefill" not in pools or "decode" not in pools:
            missing = "decode" if "decode" not in pools else "prefill"
            fail(f"{where}no {missing} group: a disaggregated cluster has a prefill pool and a decode pool", 2)
        if pools != sorted(pools, key=lambda x: x == "decode"):
            fail(f"{where}the prefill groups come before the decode groups (replicas are numbered pool by pool)", 2)
        if self.fail:
            fail(f"{where}failures (fail) are not supported in a disaggregated cluster yet", 2)
        if t is None:
            return
        if not isinstance(t, Mapping):
            fail(f'{where}transfer must be a table such as {{ link = "nvlink4", mode = "layerwise" }}, got {t!r}', 2)
        unknown = [k for k in t if k not in _TRANSFER_KEYS]
        if unknown:
            fail(f"{where}transfer: unknown key {unknown[0]!r} (keys: {', '.join(_TRANSFER_KEYS)})", 2)
        from schedlab.sim.transfer import MODES

        if t.get("mode", "layerwise") not in MODES:
            fail(f"{where}transfer: mode must be one of {', '.join(MODES)}, got {t.get('mode')!r}", 2)
        if t.get("link") is not None and t.get("bandwidth_gbs") is not None:
            fail(f"{where}transfer: give either link (a preset) or bandwidth_gbs, not both", 2)
        for key in ("link", "model_config"):
            v = t.get(key)
            if v is not None and not (isinstance(v, str) and v.strip()):
                fail(f"{where}transfer: {key} must be a non-empty string, got {v!r}", 2)
        for key, zero in (("bandwidth_gbs", False), ("latency_s", True)):
            v = t.get(key)
            if v is not None and (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
                or (v == 0 and not zero)
            ):
                fail(f"{where}transfer: {key} must be a finite number {'>= 0' if zero else '> 0'}, got {v!r}", 2)
        kb = t.get("kv_bits", 16)
        if isinstance(kb, bool) or not isinstance(kb, int) or kb < 1:
            fail(f"{where}transfer: kv_bits must be the KV values' bits (16, 8), got {kb!r}", 2)
        for key in ("kv_bytes_per_token", "layers"):
            v = t.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                fail(f"{where}transfer: {key} must be an integer >= 1, got {v!r}", 2)
        if t.get("kv_bytes_per_token") is not None:
            if t.get("model_config") is not None:
                fail(f"{where}transfer: give either model_config or kv_bytes_per_token, not both", 2)
            if t.get("mode", "layerwise") == "layerwise" and t.get("layers") is None:
                fail(f"{where}transfer: a layerwise transfer of kv_bytes_per_token needs the model's layers", 2)
        object.__setattr__(self, "transfer", dict(t))

    @classmethod
    def from_file(cls, path: str | Path) -> "ClusterOptions":
        """A cluster file (TOML; ``simulate --cluster FILE``): ``router``, ``router_options`` (a
        table), ``router_delay`` and one ``[[group]]`` table per kind of replica, with the fields
        of ``ReplicaGroup`` (``count``, ``policy``, ``options``, ``profile`` or ``hardware`` +
        ``model_config`` [+ ``quant``], ``kv_tokens``). Paths in it (profiles, config.json,
        ``file.py:Class``) are relative to its folder. ``path`` may be a bundled file's bare name
        (``bundled_clusters()``: ``h100-a100``). Anything wrong is one line naming the file, the
        group (counted from 1) and the key."""
        try:
            import tomllib
        except ImportError:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                fail("reading a cluster file needs Python 3.11 or later (tomllib), or the tomli package", 2)
        from ..errors import _CLI

        where = str(path)
        p = bundled_cluster(path)
        try:
            text = p.read_bytes().decode("utf-8")
        except FileNotFoundError:
            names = ", ".join(bundled_clusters())
            fail(f"{where}: no such cluster file" + (f" (bundled: {names})" if names else ""), 2)
        except IsADirectoryError:
            fail(f"{where} is a directory, not a cluster file (TOML)", 2)
        except OSError as exc:
            fail(f"cannot read {where}: {exc.strerror or exc}", 2)
        except UnicodeDecodeError:
            fail(f"{where}: not a UTF-8 text file", 2)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            fail(f"{where}: invalid TOML: {exc}", 2)
        top = ("router", "router_options", "router_delay", "transfer", "group")
        unknown = [k for k in data if k not in top]
        if unknown:
            fail(
                f"{where}: unknown key {unknown[0]!r} (keys: router, router_options, router_delay, [transfer], [[group]])",
                2,
            )
        tables = data.get("group")
        if tables is None:
            fail(f"{where}: no [[group]] table: the file has one [[group]] per kind of replica", 2)
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            fail(f"{where}: group must be [[group]] tables, got {tables!r}", 2)
        base = p.parent
        groups = []
        for k, t in enumerate(tables, 1):
            t = dict(t)
            for key in ("profile", "model_config"):
                t[key] = _near(t.get(key), base)
            t["policy"] = _near(t.get("policy"), base, spec=True)
            t = {key: v for key, v in t.items() if v is not None}
            if "cost" in t:
                fail(f"{where}: group {k}: unknown key 'cost' (keys: {', '.join(_GROUP_KEYS)})", 2)
            groups.append(_checked_group(t, f"{where}: group {k}: "))
        router = data.get("router")
        if router is not None and not isinstance(router, str):
            fail(f"{where}: router must be a router's name or 'file.py:Class', got {router!r}", 2)
        ro = data.get("router_options")
        if ro is not None and not isinstance(ro, dict):
            fail(f"{where}: router_options must be a table such as {{ seed = 1 }}, got {ro!r}", 2)
        if ro and router is None:
            fail(f"{where}: router_options goes with router: name the router too", 2)
        delay = data.get("router_delay", 0.0)
        from schedlab.routers import RouterNotFound, RouterOptionError

        token = _CLI.set(False)  # the file's keys, not the command's flags
        try:
            made = cls(
                router=_near(router, base, spec=True),
                router_options=ro,
                router_delay=delay,
                groups=tuple(ReplicaGroup(**g) for g in groups),
                file=where,
                transfer=_near_transfer(data.get("transfer"), base),
            )
            if router is not None:
                made.make_router()  # (the file's router and its options: a bad one fails here, naming the file)
            return made
        except (SchedlabError, RouterNotFound, RouterOptionError) as exc:
            msg = str(exc)
            raise SchedlabError(msg if msg.startswith(where) else f"{where}: {msg}", exc.code) from None
        finally:
            _CLI.reset(token)

    @property
    def used(self) -> bool:
        """Whether the run is a cluster's (any field other than its default)."""
        return (
            self.replicas != 1
            or self.router is not None
            or bool(self.router_options)
            or self.router_delay != 0
            or bool(self.groups)
            or bool(self.fail)
        )

    def make_router(self):
        """A fresh router object (one per run: routers keep state, such as round-robin's turn):
        ``schedlab.routers.make_router``, the plugins' one loader; no router given: round-robin."""
        from schedlab.routers import make_router

        return make_router("round-robin" if self.router is None else self.router, self.router_options)


@dataclass(frozen=True)
class EngineOptions:
    """The real MLX engine. ``model``: a preset (``micro``, ``tiny``, ``small``,
    ``smollm2-135m``), a llama ``.gguf`` file or an mlx-lm checkpoint directory; ``dtype``:
    float32, float16, bfloat16, quantized or auto; ``sampling``: ``"greedy"`` or
    ``"temperature=0.7,seed=1"``; ``noise``: settings that may lower the timing noise
    (``"gc-off,pin=0-1,warmup=3"``, see engine/noise.py; None: ``$SCHEDLAB_NOISE``);
    ``model_seed``: a preset's random weights; ``ignore_eos``: generate every request's
    output_tokens, past the model's EOS. The model itself is checked when it is used."""

    model: str = "tiny"
    dtype: str = "float32"
    sampling: str = "greedy"
    noise: str | None = None
    model_seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)):
            fail(f"model is a preset name, a .gguf file or a checkpoint directory, got {type(self.model).__name__}", 2)
        object.__setattr__(self, "model", str(self.model))
        if not isinstance(self.dtype, str):
            fail(f"{opt('dtype')} is a string such as 'float32', got {self.dtype!r}", 2)
        if not isinstance(self.sampling, str):
            fail(
                f"{opt('sampling')} is 'greedy' or a string such as 'temperature=0.7,seed=1', "
                f"got {type(self.sampling).__name__}",
                2,
            )
        if self.noise is not None and not isinstance(self.noise, str):
            fail(f"noise is a string such as 'gc-off,pin=0-1,warmup=3', got {type(self.noise).__name__}", 2)
        check_model_seed(self.model_seed)
        check_bool(self.ignore_eos, "ignore_eos")


def merged(cls, given, what: str, **fields):
    """``given`` (an options object), or one made from ``fields`` (keyword arguments of an API
    function); giving both, with a field other than its default, is an error."""
    if given is None:
        return cls(**fields)
    if not isinstance(given, cls):
        fail(f"{what} is a {cls.__name__}, got {type(given).__name__}", 2)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    clash = [k for k, v in fields.items() if v is not defaults[k] and v != defaults[k]]
    if clash:
        fail(f"give either {what}= or {', '.join(clash)}, not both", 2)
    return given
