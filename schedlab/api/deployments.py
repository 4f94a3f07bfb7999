"""Building a deployment (``sim.Deployment``) from what a user gives, in one place.

A run is given a policy and its options, a cost source (a profile, a hardware preset and a
model config, or a cost model object) and the KV cache's settings (``ReplicaOptions``), and,
for several replicas, ``ClusterOptions`` (a router and its options, the delay of its signals,
failures; or replica groups, from Python or a cluster file, with a prefill/decode transfer).
``build`` looks every name up (policies, routers, profiles, hardware presets), makes each
replica its own policy object and the run its router, and returns the ``sim.Deployment`` that
``sim.run`` runs; whatever is wrong is one line (``SchedlabError``, exit status 2), naming the
cluster file and the group where there is one. ``simulate`` and ``capacity`` build their
runs here; the summary's per-replica labels and meta.json's ``cluster`` come from the
deployment (``label_summary``, ``cluster_meta``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

from ..errors import opt
from ._base import fail
from .inputs import as_policy
from .options import ClusterOptions, ReplicaOptions
from .profiles import pick_cost, profile_path


def _copies(policy: Any, options: Any, count: int) -> list[Any]:
    """``count`` policy objects: a name, file or class made afresh each time; an object itself
    first, then copies of it (policies keep state between steps)."""
    first = as_policy(policy, options)
    fresh = isinstance(policy, (str, Path, type))
    return [first] + [as_policy(policy, options) if fresh else copy.deepcopy(first) for _ in range(count - 1)]


def _groups(cu: ClusterOptions):
    """Each group of a cluster of groups as a ``sim.Group``: a policy object per replica and the
    group's cost model; a name that is not found is one line naming the file and the group."""
    from schedlab.sim import Group

    from ..errors import _CLI, SchedlabError, user_error_types

    where = f"{cu.file}: " if cu.file else ""
    token = _CLI.set(False)  # the groups' keys, not the command's flags
    out = []
    try:
        for k, g in enumerate(cu.groups, 1):
            try:
                spec = g.policy if isinstance(g.policy, (str, Path, type)) else copy.deepcopy(g.policy)
                pols = _copies(spec, g.options, g.count)
                model, capacity, meta = pick_cost(g.profile, g.kv_tokens, g.hardware, g.model_config, g.quant, g.cost)
            except user_error_types() as exc:
                raise SchedlabError(f"{where}group {k}: {exc}", getattr(exc, "code", 1)) from None
            out.append(Group(tuple(pols), model, capacity, g.pool, meta))
    finally:
        _CLI.reset(token)
    return tuple(out)


SPECULATIVE_KEYS = ("k", "adaptive", "accept", "seed", "model", "draft_profile")


def parse_speculative(value: Any) -> dict[str, Any] | None:
    """``--speculative METHOD:key=value,...`` (or a mapping of the same keys with ``method``)
    as the ``policies.speculative.Speculative`` options and the acceptance profile: ``method``
    (``ngram``: prompt lookup; ``draft``: a draft model), ``k`` (draft tokens per row, default 4),
    ``adaptive`` (k chosen per step), ``accept`` (per-position acceptance, ``P1/P2/...``: a
    simulation draws each row's accepted drafts from it), ``seed`` (of those draws); with
    ``draft``, ``model`` (the draft model: a preset, a .gguf file or a checkpoint directory, of
    the target's vocabulary) and ``draft_profile`` (its cost profile, when none is bundled for
    it). None: no speculation."""
    from schedlab.policies.plugins import checked_option, parse_option

    if value is None or value is False:
        return None
    if isinstance(value, str):
        method, _, rest = value.strip().partition(":")
        fields: dict[str, Any] = {"method": method.strip()}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, v = item.partition("=")
            if not eq:
                fail(f"{opt('speculative')} is METHOD:key=value,... such as ngram:k=4, got {value!r}", 2)
            fields[key.strip().replace("-", "_")] = v.strip()
    elif isinstance(value, Mapping):
        fields = dict(value)
    else:
        fail(f"{opt('speculative')} is a string such as 'ngram:k=4' or a mapping, got {type(value).__name__}", 2)
    unknown = sorted(set(fields) - {"method", *SPECULATIVE_KEYS})
    if unknown:
        fail(f"{opt('speculative')}: unknown key {unknown[0]!r} (keys: {', '.join(SPECULATIVE_KEYS)})", 2)
    method = fields.get("method")
    if method not in ("ngram", "draft"):
        fail(
            f"{opt('speculative')}: the method is ngram (prompt lookup) or draft (a draft model: draft:model=M), "
            f"got {method!r}",
            2,
        )
    out = {"method": method, "k": fields.get("k", 4), "adaptive": fields.get("adaptive", False)}
    out["seed"] = fields.get("seed", 0)
    out["model"], out["draft_profile"] = _draft_fields(method, fields)
    for key, kind in (("k", int), ("adaptive", bool), ("seed", int)):
        v = out[key]
        try:
            out[key] = parse_option(v, kind) if isinstance(v, str) else checked_option(v, kind)
        except ValueError:
            fail(
                f"{opt('speculative')}: {key} must be {'an integer' if kind is int else 'true or false'}, got {v!r}", 2
            )
    if out["seed"] < 0:
        fail(f"{opt('speculative')}: seed must be an integer >= 0, got {out['seed']}", 2)
    out["accept"] = fields.get("accept")
    return out


def _draft_fields(method: str, fields: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The draft model and its cost profile (``model``, ``draft_profile``): the draft method's,
    which needs a model; none for ngram."""
    model, profile = fields.get("model"), fields.get("draft_profile")
    if method != "draft":
        if model is not None or profile is not None:
            key = "model" if model is not None else "draft_profile"
            fail(f"{opt('speculative')}: {key}= goes with the draft method (draft:model=M,k=3), not {method}", 2)
        return None, None
    if not model:
        fail(
            f"{opt('speculative')}: the draft method needs its model: draft:model=M (a preset such as tiny, a .gguf "
            "file or a checkpoint directory, of the target model's vocabulary)",
            2,
        )
    for key, v in (("model", model), ("draft_profile", profile)):
        if v is not None and not isinstance(v, (str, Path)):
            fail(f"{opt('speculative')}: {key} is a name or a path, got {type(v).__name__}", 2)
    return str(model), (str(profile) if profile is not None else None)


def _draft_cost(spec: dict[str, Any], required: bool):
    """The draft model's cost model: its ``draft_profile``, else the bundled profile measured on
    it; without either, one line where ``required`` (a simulation), else None (a real run: its
    draft's passes are measured, not predicted)."""
    if spec.get("method") != "draft":
        return None
    from schedlab.sim.cost import LinearCostModel, ProfileError
    from schedlab.sim.profiles import bundled_models

    given, model = spec.get("draft_profile"), spec["model"]
    try:
        if given is not None:
            return LinearCostModel.from_profile(profile_path(given))
        bundled = bundled_models()
        if model in bundled:
            return LinearCostModel.from_profile(bundled[model])
    except ProfileError as exc:
        fail(f"{opt('speculative')}: draft_profile: {exc}", 2)
    if required:
        fail(
            f"{opt('speculative')}: no cost profile of draft model {model} is bundled (bundled: "
            f"{', '.join(sorted(bundled))}): give draft_profile=PATH (calibrate --model {model} measures one)",
            2,
        )
    return None


def _speculation(spec: dict[str, Any] | None, simulated: bool = True):
    """The acceptance profile of a speculative deployment, and a wrapper of its policies (with a
    draft model: its cost model, which a simulation (``simulated``) must have)."""
    if spec is None:
        return None, None
    from schedlab.policies.speculative import Speculative
    from schedlab.sim.speculation import Acceptance, SpeculationError

    try:
        seed = int(spec["seed"])
        acceptance = Acceptance.parse(spec["accept"], seed) if spec["accept"] is not None else None
    except (SpeculationError, ValueError, TypeError) as exc:
        fail(f"{opt('speculative')}: {exc}", 2)
    accept = acceptance.accept if acceptance is not None else ()
    draft_cost = _draft_cost(spec, simulated)

    def wrap(pol):
        return Speculative(pol, spec["k"], spec["method"], spec["adaptive"], accept, spec.get("model"), draft_cost)

    wrap(_Probe())  # (bad k or adaptive without accept: one line now, not per replica)
    return acceptance, wrap


def speculative_text(spec: dict[str, Any] | None) -> str | None:
    """``parse_speculative``'s answer as ``--speculative``'s text (what a replica process is given)."""
    if spec is None:
        return None
    parts = [f"{key}={spec[key]}" for key in ("model", "draft_profile") if spec.get(key) is not None]
    parts += [f"k={spec['k']}", f"adaptive={str(bool(spec['adaptive'])).lower()}", f"seed={spec['seed']}"]
    accept = spec.get("accept")
    if accept is not None:
        parts.append("accept=" + (accept if isinstance(accept, str) else "/".join(str(p) for p in accept)))
    return f"{spec['method']}:" + ",".join(parts)


def speculative_policy(policy: Any, spec: dict[str, Any] | None) -> Any:
    """``policy`` drafting tokens as ``spec`` (``parse_speculative``'s) says: a real run's (its
    model decides what it accepts; ``accept``, if given, is the adaptive k's prior; a draft
    model is checked here, before any model loads, and loaded by the engine's backend)."""
    if spec is None:
        return policy
    if spec.get("model") is not None:
        from ..errors import user_error_types
        from ._base import check_model

        try:
            check_model(spec["model"], "float32")
        except user_error_types() as exc:
            fail(f"{opt('speculative')}: draft model: {exc}", 2)
    _, wrap = _speculation(spec, simulated=False)
    return wrap(policy)


class _Probe:
    name = "probe"

    def plan(self, view):  # pragma: no cover - never planned
        raise NotImplementedError


def build(
    policy: Any,
    options: Any,
    cost: tuple = (None, None, None, None, None, None),
    replica: ReplicaOptions | None = None,
    cluster: ClusterOptions | None = None,
    picked: tuple | None = None,
    speculative: dict[str, Any] | None = None,
):
    """The ``sim.Deployment`` of a run: ``policy`` (a name, ``file.py:Class``, a class or an
    object) with ``options`` on the cost source ``cost`` = (profile, kv_tokens, hardware,
    model_config, quant, cost object) — or ``picked``, a ``pick_cost`` answer made before —
    ``replica`` (the KV cache) and ``cluster`` (None or default: one replica, no router; with
    groups, ``policy`` and ``cost`` are not used); ``speculative``: ``parse_speculative``'s
    answer, every replica's policy drafting tokens."""
    from schedlab.sim import Deployment, DeploymentError, Group

    replica = replica or ReplicaOptions()
    cu = cluster or ClusterOptions()
    acceptance, wrap = _speculation(speculative)
    if cu.groups:
        groups = _groups(cu)
    else:
        model, capacity, meta = picked if picked is not None else pick_cost(*cost)
        groups = (Group(tuple(_copies(policy, options, cu.replicas)), model, capacity, None, meta),)
    if wrap is not None:
        groups = tuple(Group(tuple(map(wrap, g.policies)), g.cost_model, g.kv_capacity, g.pool, g.meta) for g in groups)
    where = f"{cu.file}: " if cu.file else ""
    for k, g in enumerate(groups, 1):
        if g.kv_capacity < replica.block_size:  # (Group checked it is an integer >= 1)
            group = f"group {k}: " if cu.groups else ""
            from_profile = g.meta.get("profile") and not cu.groups and replica.kv_tokens is None
            source = f" (profile {g.meta['profile']}'s kv_tokens)" if from_profile else ""
            fail(
                f"{where}{group}a KV capacity of {g.kv_capacity} tokens{source} is less than one block "
                f"({opt('block_size')} {replica.block_size})",
                2,
            )
    try:
        return Deployment(
            groups,
            router=cu.make_router() if cu.used else None,
            router_delay=cu.router_delay,
            fail=cu.fail,
            transfer=_transfer(cu, where) if cu.disaggregated else None,
            block_size=replica.block_size,
            prefix_caching=replica.prefix_caching,
            file=cu.file,
            acceptance=acceptance,
        )
    except DeploymentError as exc:
        fail(f"{where}{exc}", 2)


def _transfer(cu: ClusterOptions, where: str):
    """The ``KVTransfer`` of a disaggregated cluster's ``transfer`` table: its link (a preset, the
    groups' one hardware preset's own, or a bandwidth and latency) and the KV bytes of its model
    config (given, or the groups' one model config)."""
    from schedlab.analysis.analytic import AnalyticError, kv_transfer, link_preset, split_hardware
    from schedlab.sim.transfer import KVTransfer, Link, TransferError

    t = dict(cu.transfer or {})
    link = t.get("link")
    if link is None and t.get("bandwidth_gbs") is None:
        try:  # (the presets, not their ':tp=N': a TP-2 prefill and a TP-1 decode group share one link)
            hws = {split_hardware(str(g.hardware))[0] for g in cu.groups if g.hardware is not None}
        except AnalyticError as exc:
            fail(f"{where}transfer: {exc}", 2)
        if len(hws) != 1:
            fail(
                f"{where}transfer: give link (a preset: nvlink4, pcie5-x16, ib-ndr-400, ...) or bandwidth_gbs; "
                f"the groups name no one hardware preset whose link it would be",
                2,
            )
        link = hws.pop()
    mode = t.get("mode", "layerwise")
    try:
        lk = (
            link_preset(link, t.get("latency_s"))
            if link
            else Link(t["bandwidth_gbs"], t.get("latency_s", 0.0), "given")
        )
        if t.get("kv_bytes_per_token") is not None:  # (a model with no config: its KV's size given)
            return KVTransfer(t["kv_bytes_per_token"], t.get("layers", 1), lk, mode)
        mc = t.get("model_config")
        if mc is None:
            mcs = {str(g.model_config) for g in cu.groups if g.model_config is not None}
            if len(mcs) != 1:
                fail(
                    f"{where}transfer: give model_config (the model whose KV moves) or kv_bytes_per_token: the groups "
                    "name no one model config",
                    2,
                )
            mc = mcs.pop()
        return kv_transfer(mc, lk, mode, kv_bits=t.get("kv_bits", 16))
    except (AnalyticError, TransferError) as exc:
        fail(f"{where}transfer: {exc}", 2)


def _cost_label(meta: Mapping[str, Any]) -> str:
    """A cost model in a few words, as each replica's summary names it."""
    if "profile" in meta:
        return Path(meta["profile"]).name
    a = meta.get("analytic")
    if isinstance(a, Mapping):
        bits = a.get("quant_bits")
        return " ".join(
            str(x) for x in (a.get("hardware"), a.get("model_config"), f"{bits}-bit" if bits else None) if x
        )
    return str(meta.get("cost_model", "cost model"))


def _names(d) -> list[str]:
    return [str(getattr(p, "name", type(p).__name__)) for p in d.policies]


def common_meta(d) -> dict[str, Any]:
    """The cost model's meta when every group has the same one, else none (meta.json's
    ``cluster.groups`` has each group's)."""
    first = d.groups[0].meta
    return dict(first) if all(g.meta == first for g in d.groups) else {}


def common_options(d) -> dict[str, Any] | None:
    """The policies' options when every replica runs the same policy alike, else None
    (meta.json's ``cluster.groups`` has each group's)."""
    from ._base import policy_options

    opts = [policy_options(p) for p in d.policies]
    names = _names(d)
    same = all(o == opts[0] and n == names[0] for o, n in zip(opts, names))
    return dict(opts[0]) if same else None


def kv_tokens_of(result) -> int | list[int]:
    """The KV capacity the replicas had (whole blocks): one number, or one per replica when they differ."""
    caps = [p.kv_capacity for p in result.replicas or ()] or [result.kv_capacity]
    return caps[0] if len(set(caps)) == 1 else caps


def cluster_meta(d, result) -> dict[str, Any]:
    """meta.json's ``cluster``: the run's (router, its options, delay, failures), then the file
    and each group's replicas (first, last), policy, its options, cost model and KV capacity."""
    groups = [{k: v for k, v in g.items() if k != "pool"} for g in d.describe()["groups"]]
    return {**dict(result.cluster), **({"file": d.file} if d.file else {}), "groups": groups}


def run_meta(d, result, grouped: bool, seed: int) -> dict[str, Any]:
    """meta.json of a simulation of deployment ``d``: the cost model's (the one every group has),
    the KV capacity, the KV cache's settings, the seed, the policy's options, the cluster's and
    the deployment as it was described."""
    from ._base import policy_options

    several = d.router is not None
    meta = common_meta(d) if grouped else dict(d.groups[0].meta)
    return {
        **meta,
        "kv_tokens": result.kv_capacity if not several else kv_tokens_of(result),
        "block_size": d.block_size,
        "prefix_caching": d.prefix_caching,
        "seed": seed,
        "policy_options": policy_options(d.policies[0]) if not grouped else common_options(d),
        **({"cluster": cluster_meta(d, result) if grouped else dict(result.cluster)} if several else {}),
        "deployment": d.describe(),
    }


def label_summary(s: dict[str, Any], d, result) -> dict[str, Any]:
    """The summary with each replica's group, policy, cost model and KV capacity in its own
    summary (and its pool in a disaggregated deployment), and the policies' names joined when
    they differ."""
    names = _names(d)
    group_of, caps = d.group_of, [p.kv_capacity for p in result.replicas]
    n_prefill = sum(g.count for g in d.groups if g.pool == "prefill")
    parts = s.get("replicas")
    if parts:
        s["replicas"] = [
            {
                "replica": p["replica"],
                "group": group_of[p["replica"]],
                "policy": names[p["replica"]],
                "cost": _cost_label(d.groups[group_of[p["replica"]] - 1].meta),
                "kv_tokens": caps[p["replica"]],
                **{k: v for k, v in p.items() if k != "replica"},
            }
            for p in parts
        ]
        if d.disaggregated:
            for part in s["replicas"]:
                part["pool"] = "prefill" if part["replica"] < n_prefill else "decode"
    distinct = list(dict.fromkeys(names))
    if len(distinct) > 1:
        s["policy"] = "+".join(distinct)
    return s
