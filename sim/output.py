"""Run directories: summary.json, requests.csv, tokens.csv, steps.csv, passes.csv, meta.json.

passes.csv has one row per request per pass (step, pass index, request id, kind
decode|prefill, tokens, start_s, end_s): what every forward held, for timelines.

Everything but meta.json (wall time, versions, command) is a pure function of the inputs,
so the same trace, policy, profile and seed give byte-identical files.
"""

from __future__ import annotations

import csv
import json
import platform
import sys
from pathlib import Path
from typing import Any, Mapping

from .metrics import request_rows

REQUEST_COLUMNS = (
    "id", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s", "finish_s",
    "ttft_ms", "tpot_ms", "e2e_ms", "decode_rate_tok_s", "status",
)
STEP_COLUMNS = (
    "step", "start_s", "end_s", "predicted_s", "measured_s", "decode_rows", "prefill_tokens",
    "passes", "kv_tokens",
)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_run(out: str | Path, result, summary: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stable = {k: v for k, v in summary.items() if k not in ("wall_s", "meta")}
    (out / "summary.json").write_text(json.dumps(stable, indent=2) + "\n")

    rows = {row["id"]: row for row in request_rows(result.requests)}
    rejected = {r.id for r, _ in result.rejected}
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        for r in result.requests:
            row = rows.get(r.id)
            if row is not None:
                w.writerow([_cell(row[c]) for c in REQUEST_COLUMNS[:-1]] + ["finished"])
            else:
                status = "rejected" if r.id in rejected else "unfinished"
                w.writerow([r.id, _cell(r.arrival_s), r.prompt_tokens, r.output_tokens]
                           + [""] * 6 + [status])

    with open(out / "tokens.csv", "w", newline="") as f:
        f.write("request_id,token_index,time_s\n")
        for r in result.requests:
            rid = r.id
            f.writelines(f"{rid},{i},{t!r}\n" for i, t in enumerate(r.token_times))

    with open(out / "steps.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(STEP_COLUMNS)
        for s in result.steps:
            w.writerow([s.index, _cell(s.start_s), _cell(s.end_s), _cell(s.predicted_s),
                        _cell(s.measured_s), s.decode_rows, s.prefill_tokens, s.passes, s.kv_tokens])

    with open(out / "passes.csv", "w", newline="") as f:
        f.write("step,pass,request_id,kind,tokens,start_s,end_s\n")
        for step, k, t0, t1, p in result.passes:
            tail = f",{t0!r},{t1!r}\n"
            f.writelines(f"{step},{k},{rid},decode,1{tail}" for rid in p.decode)
            f.writelines(f"{step},{k},{rid},prefill,{n}{tail}" for rid, n in p.prefill)

    info = {
        "wall_s": result.wall_s,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "argv": sys.argv,
        **(result.meta or {}),
        **(meta or {}),
    }
    (out / "meta.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return out
