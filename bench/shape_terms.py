"""Shape terms: what the grid's own points say about the decode and prefill shape terms.

For each profile given (default: the fidelity recordings' kept profiles in
``bench/results/profiles/``), its grid samples as ``analysis.fit`` reads them: per group
(decode; prefill with the padded passes) the leave-one-out median |error| of the base terms, of
each shape term added, and the set ``analysis.fit.shape_terms`` chooses; and the raw costs the
terms stand for: the decode step's extra seconds per row between batch sizes (at the grid's
shortest context) and per row x token between contexts (per batch size), and a chunk's seconds
per token between chunk sizes (at context 0). No engine runs: seconds.

    python bench/shape_terms.py [PROFILE ...] [--out bench/results/shape_terms.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab.analysis.fit import DECODE_BASE, PREFILL_BASE, Sample, _loo_median, shape_terms  # noqa: E402
from schedlab.sim.cost import DECODE_SHAPE_TERMS, PREFILL_SHAPE_TERMS  # noqa: E402

_DECODE = re.compile(r"^B=(\d+) C=(\d+)")
_PREFILL = re.compile(r"^n=(\d+) c=(\d+)")


def group_report(samples: list[Sample], base, shape) -> dict:
    terms, tries = shape_terms(samples, base, shape)
    return {"points": len(samples), "base_loo_median_abs_pct": round(_loo_median(samples, list(base)), 2),
            "each_added": {k: round(_loo_median(samples, list(base) + [k]), 2) for k in shape},
            "chosen": list(terms[len(base):]),
            "chosen_loo_median_abs_pct": round(_loo_median(samples, list(terms)), 2)}


def decode_costs(samples: list[Sample]) -> dict:
    pts = {}
    for s in samples:
        m = _DECODE.match(s.label)
        if m and "skewed" not in s.label:
            pts[int(m[1]), int(m[2])] = s.seconds
    batches = sorted({b for b, _ in pts})
    contexts = sorted({c for _, c in pts})
    c0 = contexts[0]
    per_row = {f"{a}->{b}": round((pts[b, c0] - pts[a, c0]) / (b - a) * 1e3, 4)
               for a, b in zip(batches, batches[1:]) if (a, c0) in pts and (b, c0) in pts}
    per_row_token = {}
    for b in batches:
        cs = [c for c in contexts if (b, c) in pts]
        per_row_token[str(b)] = {f"{x}->{y}": round((pts[b, y] - pts[b, x]) / (b * (y - x)) * 1e6, 4)
                                 for x, y in zip(cs, cs[1:])}
    return {"context": c0, "ms_per_row": per_row, "us_per_row_token": per_row_token}


def prefill_costs(samples: list[Sample]) -> dict:
    pts = {}
    for s in samples:
        m = _PREFILL.match(s.label)
        if m and int(m[2]) == 0:
            pts[int(m[1])] = s.seconds
    ns = sorted(pts)
    return {"ms_per_token_at_context_0": {f"{a}->{b}": round((pts[b] - pts[a]) / (b - a) * 1e3, 4)
                                          for a, b in zip(ns, ns[1:])}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="*")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.profiles] or sorted((ROOT / "bench/results/profiles").glob("*.json"))
    if not paths:
        raise SystemExit("no profiles given and none in bench/results/profiles/")
    out = {"benchmark": "shape_terms", "profiles": {}}
    for path in paths:
        try:
            prof = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: cannot read the profile ({exc})") from None
        samples = [Sample.from_json(x) for x in prof.get("samples") or []]
        if not samples:
            raise SystemExit(f"{path}: the profile keeps no grid samples")
        dec = [s for s in samples if s.group == "decode"]
        pre = [s for s in samples if s.group in ("prefill", "padded")]
        row = {"model": prof.get("model"), "decode": group_report(dec, DECODE_BASE, DECODE_SHAPE_TERMS),
               "prefill": group_report(pre, PREFILL_BASE, PREFILL_SHAPE_TERMS),
               "decode_costs": decode_costs(dec), "prefill_costs": prefill_costs(pre)}
        out["profiles"][path.name] = row
        d, p = row["decode"], row["prefill"]
        print(f"{path.name}: decode loo {d['base_loo_median_abs_pct']} -> {d['chosen_loo_median_abs_pct']} % "
              f"({'+'.join(d['chosen']) or 'base'}); prefill loo {p['base_loo_median_abs_pct']} -> "
              f"{p['chosen_loo_median_abs_pct']} % ({'+'.join(p['chosen']) or 'base'})")
    rows = list(out["profiles"].values())
    out["summary"] = {g: {"base_loo_median_abs_pct": [min(r[g]["base_loo_median_abs_pct"] for r in rows),
                                                      max(r[g]["base_loo_median_abs_pct"] for r in rows)],
                          "chosen_loo_median_abs_pct": [min(r[g]["chosen_loo_median_abs_pct"] for r in rows),
                                                        max(r[g]["chosen_loo_median_abs_pct"] for r in rows)],
                          "median_gain_pct": round(statistics.median(
                              r[g]["base_loo_median_abs_pct"] - r[g]["chosen_loo_median_abs_pct"] for r in rows), 2)}
                      for g in ("decode", "prefill")}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
