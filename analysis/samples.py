"""The grid's samples and term groups: what ``engine.calibrate`` measures and both fits read.

A ``Sample`` is one grid point (a pass of one shape, timed over some runs): its group, its
label, every cost term's feature and its seconds. The term groups are the cost model's pass
terms as the grid fit (``analysis.fit``) fits them apart; the fit to real runs
(``analysis.runfit``) scales them as groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from schedlab.sim.cost import DECODE_SHAPE_TERMS, PREFILL_SHAPE_TERMS, SHAPE_TERMS, shape_features

DECODE_TERMS = ("d_pass", "d_multi", "d_rows", "d_kv", "d_ctx") + DECODE_SHAPE_TERMS
DECODE_BASE = DECODE_TERMS[:5]  # always fitted; DECODE_SHAPE_TERMS only where they pay (fit.shape_terms)
JOIN_TERMS = ("c_join0", "c_join", "c_join_row", "c_join_ctx", "c_extend")
LEAVE_TERMS = ("c_leave0", "c_leave")
PREFILL_TERMS = ("p_pass", "p_tokens", "p_attn", "p_ctx", "p_done0", "p_done", "p_done_attn") + PREFILL_SHAPE_TERMS
PREFILL_BASE = PREFILL_TERMS[:7]
STEP_TERMS = ("s_step", "s_row")


@dataclass
class Sample:
    group: str
    label: str
    features: dict[str, float]
    seconds: float
    runs: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "label": self.label,
            "seconds": self.seconds,
            "runs": self.runs,
            "features": {k: v for k, v in self.features.items() if v},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Sample":
        """A sample as ``to_json`` wrote it into a profile."""
        f = dict(d["features"])
        if not any(k in f for k in SHAPE_TERMS):  # recorded before them (or all 0: derived as 0)
            rows = re.match(r"rows=(\d+) ", d["label"]) if d["group"] == "padded" else None
            chunks = int(rows[1]) if rows else int(f.get("p_pass", 0))
            f.update(
                {
                    k: v
                    for k, v in shape_features(
                        int(f.get("d_rows", 0)),
                        int(f.get("d_ctx", 0)),
                        chunks,
                        int(f.get("p_tokens", 0)),
                        rows is not None,
                    ).items()
                    if v
                }
            )
        return cls(d["group"], d["label"], f, d["seconds"], d.get("runs") or [d["seconds"]])
