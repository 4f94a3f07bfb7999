"""Join cost: what rows joining the decode batch cache cost, against the joining rows' shape.

A decode pass where rows join the engine's batch cache merges their own caches into one
(``engine.backend._merge_with_headroom``: a zero-filled batch cache as wide as the longest row,
then each row's own length copied in) and, when the batch already holds rows, extends it
(mlx-lm's ``BatchKVCache.extend``: both padded to one width and concatenated). Each case is
timed as the join pass minus the median of the steady passes over the same rows right after
it, for batches whose rows are alike (contexts within 75-100 % of the longest, as the
calibration grid's batches were) and heavy-tailed (one long row, the others a tenth of it, as
production prompts make them), from nothing (merge) and into a batch of as many rows
(extend). Rounds are interleaved (every case once per round), medians over the rounds.

Least squares over the cases' medians then gives seconds per unit of what each operation
touches: merges on rows x longest context (the zero-filled allocation) and the joining rows'
contexts summed (the copy); extends on rows after x longest (the concatenation) on top.

    python bench/join_cost.py [--model tiny] [--rounds 5] [--out bench/results/join_cost_tiny.json]

``$SCHEDLAB_NOISE`` (``engine/noise.py``: e.g. ``malloc-keep``) applies to the whole measurement,
as ``calibrate`` applies it; the JSON records it. ``--alternate none,malloc-keep``: settings
compared side by side, each round of each in a child process of its own (a setting such as
malloc-keep holds for the rest of a process), the settings alternating round by round; the JSON
holds each setting's cases (medians over all its rounds) and the per-case ratios to the first.

    python bench/join_cost.py --model smollm2-135m --rounds 2 --alternate none,malloc-keep
    python bench/join_cost.py --model smollm2-135m --rounds 2 --alternate none,mlx-cache=2g \
        --out bench/results/join_cost_smollm2-135m_mlx_cache.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab import engine  # noqa: E402,F401  (OpenBLAS before mlx)
from schedlab.engine import blas  # noqa: E402
from schedlab.engine.calibrate import Rig, batch_contexts  # noqa: E402
from schedlab.engine.errors import EngineError  # noqa: E402
from schedlab.engine.models import load_model  # noqa: E402
from schedlab.engine.noise import Noise  # noqa: E402
from schedlab.policies.base import Pass  # noqa: E402

BATCHES = (4, 8, 16)
CONTEXTS = {"tiny": (400, 800, 1600)}  # other models: (300, 600, 1000)


def contexts(kind: str, rows: int, longest: int) -> list[int]:
    if kind == "uniform":
        return batch_contexts(rows, longest)  # as the calibration grid's alike batches
    return [longest] + [max(8, longest // 10)] * (rows - 1)  # one long row, the rest short


def _key(case: dict) -> tuple:
    return case["mode"], case["rows"], case["longest"], case["kind"]


def one_case(rig: Rig, kind: str, rows: int, longest: int, mode: str) -> dict:
    """mode "merge": ``rows`` rows join from nothing; "extend": rows/2 rows decode as a batch,
    rows/2 (shaped by ``kind``) join it."""
    if mode == "merge":
        base_c, join_c = [], contexts(kind, rows, longest)
    else:
        base_c, join_c = contexts("uniform", rows // 2, longest), contexts(kind, rows // 2, longest)
    state, ids = rig.scenario([(c, 40) for c in base_c + join_c])
    for rid in ids:
        rig.admit(state, [rid], prime=state.by_id[rid].prompt_tokens - 1)
    base = ids[:len(base_c)]
    for _ in range(3 if base else 0):  # the batch forms, then decodes
        rig.timed(state, Pass(decode=tuple(base)))
    feats, join_s = rig.timed(state, Pass(decode=tuple(ids)))
    steady = [rig.timed(state, Pass(decode=tuple(ids)))[1] for _ in range(3)]
    rig.close(state)
    return {"join_s": join_s, "steady_s": statistics.median(steady), "rows_x_longest": feats["c_join"],
            "join_context": feats["c_join_ctx"], "extend": feats["c_extend"]}


def fit(cases: list[dict]) -> dict:
    """Seconds per unit: extra = a + b rows x longest + c joining contexts (+ e rows x longest
    when extending), least squares over the cases' medians."""
    x = np.array([[1.0, c["rows_x_longest"], c["join_context"], c["extend"]] for c in cases])
    y = np.array([c["extra_s_median"] for c in cases])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    names = ("fixed_s", "per_row_x_longest_s", "per_join_context_token_s", "per_extend_row_x_longest_s")
    return {"coefficients": dict(zip(names, (float(v) for v in coef))),
            "median_abs_error_pct": float(np.median(np.abs(pred - y) / y) * 100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--alternate", default=None, help="noise settings to compare side by side (none, malloc-keep, ...)")
    args = ap.parse_args()
    if args.alternate:
        return alternate(args)
    out_path = Path(args.out or ROOT / "bench" / "results" / f"join_cost_{args.model}.json")
    info = load_model(args.model)
    noise = Noise.from_env()
    with noise.active():
        res = measure(info, args)
    res["noise"] = noise.describe()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{'mode':<7} {'rows':>4} {'longest':>7} {'kind':<8} {'extra ms':>9} {'steady ms':>9}")
    for x in res["cases"]:
        print(f"{x['mode']:<7} {x['rows']:>4} {x['longest']:>7} {x['kind']:<8} {1e3 * x['extra_s_median']:9.2f} "
              f"{1e3 * x['steady_s_median']:9.2f}")
    print("fit:", json.dumps(res["fit_merges_and_extends"]))
    print(f"wrote {out_path}")


def alternate(args) -> None:
    import os
    import subprocess
    import tempfile

    settings = [s.strip() for s in args.alternate.split(",") if s.strip()]
    for s in settings:
        try:
            if s != "none":
                Noise.parse(s)  # a bad setting stops here, before any round
        except EngineError as e:
            raise SystemExit(f"--alternate: {e}") from None
    out_path = Path(args.out or ROOT / "bench" / "results" / f"join_cost_{args.model}_alternate.json")
    tmp = Path(tempfile.mkdtemp(prefix="join-cost-"))
    rounds: dict[str, list[dict]] = {s: [] for s in settings}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for s in settings:
            path = tmp / f"{r}-{s}.json"
            env = dict(os.environ, SCHEDLAB_NOISE="" if s == "none" else s)
            subprocess.run([sys.executable, __file__, "--model", args.model, "--rounds", "1", "--out", str(path)],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            rounds[s].append(json.loads(path.read_text()))
            print(f"round {r + 1}/{args.rounds} {s}: {time.perf_counter() - t0:.0f} s", flush=True)
    per: dict[str, dict] = {}
    for s, rs in rounds.items():
        cases = {}
        for res in rs:
            for c in res["cases"]:
                got = cases.setdefault(_key(c), dict(c, extra_s=[], steady_s=[]))
                got["extra_s"] += c["extra_s"]
                got["steady_s"].append(c["steady_s_median"])
        for c in cases.values():
            c["extra_s_median"] = statistics.median(c["extra_s"])
            c["steady_s_median"] = statistics.median(c["steady_s"])
        per[s] = {"noise": rs[0]["noise"], "cases": list(cases.values()),
                  "extra_s_sum": sum(c["extra_s_median"] for c in cases.values())}
    base = {_key(c): c for c in per[settings[0]]["cases"]}
    ratios = {}
    for s in settings[1:]:
        ex = [c["extra_s_median"] / base[_key(c)]["extra_s_median"] for c in per[s]["cases"]]
        st = [c["steady_s_median"] / base[_key(c)]["steady_s_median"] for c in per[s]["cases"]]
        ratios[s] = {"extra_median": statistics.median(ex), "extra_min": min(ex), "extra_max": max(ex),
                     "steady_median": statistics.median(st)}
        print(f"{s} / {settings[0]}: join extra x{ratios[s]['extra_median']:.2f} (median over {len(ex)} shapes; "
              f"{ratios[s]['extra_min']:.2f}-{ratios[s]['extra_max']:.2f}), summed {per[settings[0]]['extra_s_sum']:.1f} s"
              f" -> {per[s]['extra_s_sum']:.1f} s; decode steps x{ratios[s]['steady_median']:.3f}")
    res = {"benchmark": "join_cost", "model": args.model, "rounds": args.rounds, "alternate": settings,
           "wall_s": round(time.perf_counter() - t0, 1), "ratios_to_first": ratios, "settings": per}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out_path}")


def measure(info, args) -> dict:
    rig = Rig(info)
    one_case(rig, "uniform", 4, 64, "merge")  # warm-up
    lengths = CONTEXTS.get(args.model, (300, 600, 1000))
    keys = [(mode, b, c, kind) for mode in ("merge", "extend") for b in BATCHES for c in lengths
            for kind in ("uniform", "skewed")]
    runs: dict = {k: [] for k in keys}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for k in keys:
            runs[k].append(one_case(rig, k[3], k[1], k[2], k[0]))
        print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t0:.0f} s", flush=True)
    cases = []
    for (mode, b, c, kind), rs in runs.items():
        extra = [x["join_s"] - x["steady_s"] for x in rs]
        cases.append({"mode": mode, "rows": b, "longest": c, "kind": kind,
                      "extra_s_median": statistics.median(extra), "steady_s_median": statistics.median(x["steady_s"] for x in rs),
                      "extra_s": extra, "rows_x_longest": rs[0]["rows_x_longest"],
                      "join_context": rs[0]["join_context"], "extend": rs[0]["extend"]})
    by = {_key(x): x["extra_s_median"] for x in cases}
    skew = {f"{m} rows={b} longest={c}": round(by[(m, b, c, "skewed")] / by[(m, b, c, "uniform")], 3)
            for m in ("merge", "extend") for b in BATCHES for c in lengths}
    return {"benchmark": "join_cost", "model": args.model, "rounds": args.rounds,
            "wall_s": round(time.perf_counter() - t0, 1),
            "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads")},
            "machine": {"platform": platform.platform()},
            "skewed_over_uniform_extra": skew,
            "fit_merges_and_extends": fit(cases), "cases": cases}


if __name__ == "__main__":
    main()
