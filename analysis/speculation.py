"""Speculative decoding's acceptance, simulated against measured: what ``validate --speculative``
adds to validation.json (``speculative``) and prints under its latency table; and the line
``calibrate --speculative`` prints of what it measured (``acceptance_line``).

Both sides are vLLM's spec-decode counters (summary.json's ``speculative``); the real side is the
real runs' counters added up (``sim.speculation.pooled_counters``: greedy runs of one trace,
whose tokens are the same in every run). Compared: the acceptance rate (accepted over drafted
tokens), the mean acceptance length (1 + accepted per verify row), the verify rows, and per
position the conditional acceptance (``sim.speculation.conditional_acceptance``), beside the
profile the simulation drew from and where it came from.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from schedlab.sim.speculation import conditional_acceptance, pooled_counters

ACCEPTANCE_SCHEMA = "schedlab-acceptance/1"  # calibrate --acceptance-only's file: the measured acceptance alone


def _err(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or real is None or real == 0 else 100.0 * (sim - real) / real


def compare_acceptance(
    sim: Mapping[str, Any] | None,
    reals: Sequence[Mapping[str, Any] | None],
    profile: Sequence[float],
    source: str,
) -> dict[str, Any]:
    """validation.json's ``speculative``: the simulated run's counters (``sim``) against the real
    runs' (``reals``, one per run; None: a run that verified no draft), the simulation having
    drawn from ``profile`` (``source``: where it came from)."""
    real = pooled_counters(reals)
    out: dict[str, Any] = {"profile": list(profile), "profile_source": source}
    for key in ("acceptance_rate", "mean_acceptance_length", "drafts"):
        s = (sim or {}).get(key)
        r = (real or {}).get(key)
        out[key] = {"sim": s, "real": r, "error_pct": _err(s, r)}
    out["per_position"] = {
        "sim": list(conditional_acceptance(sim)) if sim else [],
        "real": list(conditional_acceptance(real)) if real else [],
    }
    out["real_runs"] = [dict(r) if r else None for r in reals]
    out["sim_counters"] = dict(sim) if sim else None
    return out


def format_acceptance(v: Mapping[str, Any]) -> str:
    """The printed lines of ``compare_acceptance``'s answer."""

    def num(x: float | None, pct: bool = False) -> str:
        return "-" if x is None else (f"{100 * x:.1f} %" if pct else (f"{x:.0f}" if abs(x) >= 100 else f"{x:.3f}"))

    def err(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1f}"

    lines = [
        f"speculative decoding: the simulation drew from {'/'.join(f'{p:.3f}' for p in v['profile'])} "
        f"({v['profile_source']})",
        f"{'acceptance':<28}{'simulated':>12}{'measured':>12}{'error %':>10}",
    ]
    for key, label, pct in (
        ("acceptance_rate", "acceptance rate", True),
        ("mean_acceptance_length", "mean acceptance length", False),
        ("drafts", "verify rows (drafts)", False),
    ):
        row = v[key]
        lines.append(f"{label:<28}{num(row['sim'], pct):>12}{num(row['real'], pct):>12}{err(row['error_pct']):>10}")
    sim_pos, real_pos = v["per_position"]["sim"], v["per_position"]["real"]
    for i in range(max(len(sim_pos), len(real_pos))):
        s = sim_pos[i] if i < len(sim_pos) else None
        r = real_pos[i] if i < len(real_pos) else None
        lines.append(
            f"{f'  position {i + 1} (given {i})':<28}{num(s, True):>12}{num(r, True):>12}{err(_err(s, r)):>10}"
        )
    return "\n".join(lines)


def acceptance_line(entry: dict[str, Any]) -> str:
    """One line of a measured acceptance entry (``calibrate --speculative``'s; ``calibrate`` prints
    it)."""
    c = entry.get("counters") or {}
    rate, length = c.get("acceptance_rate"), c.get("mean_acceptance_length")
    trace = (entry.get("trace") or {}).get("name", "?")
    return (
        f"acceptance of {entry.get('method')} k={entry.get('k')} drafts on {trace} ({c.get('drafts')} verify rows): "
        f"{'/'.join(f'{p:.3f}' for p in entry['accept'])} per position"
        + (f", rate {100 * rate:.1f} %" if rate is not None else "")
        + (f", mean acceptance length {length:.2f}" if length is not None else "")
    )
