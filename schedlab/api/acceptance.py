"""Speculative decoding's acceptance measured on the real engine (``calibrate --speculative``):
the entry a profile keeps under ``acceptance``, which ``accept=PROFILE.json`` reads and a trace
may carry as its ``speculative_acceptance``."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import opt
from ._base import TraceLike, fail

POLICY = "unified"  # the policy the drafts are measured under (greedy tokens do not depend on it)


def measure_acceptance(info, trace: TraceLike, spec: dict[str, Any], seed: int, say: Callable[[str], Any]) -> dict:
    """Run ``info``'s model on ``trace``'s requests with speculation ``spec``
    (``parse_speculative``'s: fixed k) and return the acceptance its verify rows showed: the
    per-position profile vLLM's counters give (``Acceptance.from_counters``), the counters, the
    method, k, policy, model and trace.

    Greedy, every request its full output (EOS ignored: the tokens a simulation makes), all of
    them arriving at once (acceptance is the model's on the tokens, not the schedule's: the
    arrivals would only be waited for), ``unified`` wrapped in ``Speculative``, no cost model
    (nothing planned by time)."""
    from dataclasses import replace

    from schedlab.engine.backend import MLXBackend
    from schedlab.policies import make_policy
    from schedlab.sim import run_replica
    from schedlab.sim.cost import DEFAULT_KV_TOKENS, LinearCostModel
    from schedlab.sim.speculation import Acceptance, SpeculationError

    from .deployments import speculative_policy
    from .real import _model_trace

    if spec["adaptive"]:
        fail(f"{opt('speculative')}: acceptance is measured at a fixed k: drop adaptive", 2)
    tr = _model_trace(info, trace, seed)
    pol = speculative_policy(make_policy(POLICY), spec)
    say(f"{pol.name}: measuring the drafts' acceptance on {tr.name} ({len(tr.requests)} requests)")
    reqs = [replace(r, arrival_s=0.0) for r in tr.requests]
    tokens = sum(r.prompt_tokens + r.output_tokens for r in reqs)
    backend = MLXBackend(info, seed=seed, ignore_eos=True)
    res = run_replica(
        reqs, pol, LinearCostModel({}), kv_capacity=min(tokens + 16 * len(reqs), DEFAULT_KV_TOKENS), backend=backend,
        trace_name=tr.name, block_size=16,
    )  # fmt: skip
    if res.error:
        fail(f"{pol.name}: the real run stopped: {res.error}")
    try:
        acc = Acceptance.from_counters(res.speculative or {"drafts": 0, "accepted_per_position": []})
    except SpeculationError:
        fail(
            f"{opt('speculative')}: the real run on {tr.name} verified no drafts ({spec['method']} found none in its "
            f"requests): no acceptance to measure"
        )
    return {
        "accept": list(acc.accept),
        "propose": acc.propose,
        "method": spec["method"],
        "k": spec["k"],
        "policy": pol.name,
        "model": str(info.name),
        "trace": {"name": tr.name, "description": tr.description, "requests": len(reqs)},
        "measured": "greedy, EOS ignored, every request arriving at 0 (calibrate --speculative)",
        "counters": dict(res.speculative),
    }
