"""Shared test helpers for the simulator: requests, known cost models, exact states."""

from __future__ import annotations

from schedlab.policies.base import Pass, Plan
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.state import ReplicaState, ReplicaView
from schedlab.traces.schema import Request

# Known coefficients (not a profile: tests only). Decode ~ a few ms, prefill ~ 20k tok/s.
KNOWN = {
    "d_pass": 0.004,
    "d_multi": 0.001,
    "d_rows": 0.0002,
    "d_kv": 2e-8,
    "d_ctx": 1e-7,
    "c_join0": 0.001,
    "c_join": 1e-8,
    "c_leave0": 0.0005,
    "c_leave": 1e-8,
    "p_pass": 0.004,
    "p_tokens": 5e-5,
    "p_attn": 2e-9,
    "p_ctx": 1e-7,
    "p_done0": 0.002,
    "p_done": 2e-5,
    "p_done_attn": 5e-10,
    "s_step": 0.0005,
    "s_row": 1e-5,
}


def cost_model(**overrides) -> LinearCostModel:
    return LinearCostModel({**KNOWN, **overrides})


def req(rid, prompt, output, arrival=0.0) -> Request:
    return Request(str(rid), float(arrival), int(prompt), int(output))


class Bench:
    """A ReplicaState driven by hand into an exact situation, with a view for policies."""

    def __init__(self, requests, kv_capacity=1_000_000, name="test", block_size=1, layout=None):
        self.state = ReplicaState(requests, kv_capacity, name, block_size=block_size, layout=layout)
        for r in self.state.accepted:
            self.state.arrive(r)
        self.view = ReplicaView(self.state, cost_model())
        self.t = 0.0

    def apply(self, plan: Plan):
        self.state.apply_admin(plan, self.t)
        done = []
        for p in plan.passes:
            self.state.shape(p)
            self.t += 0.01
            done += self.state.apply_pass(p, self.t)
        self.state.step_index += 1
        return done

    def decoding(self, rid):
        """Admit ``rid`` and prefill it whole: it is decoding with one token out."""
        r = self.state.by_id[str(rid)]
        self.apply(Plan(admit=(r.id,), passes=(Pass(prefill=((r.id, r.prompt_tokens),)),)))
        return r

    def prefilling(self, rid, n):
        """Admit ``rid`` and prefill ``n`` of its prompt tokens (n may be 0)."""
        r = self.state.by_id[str(rid)]
        passes = (Pass(prefill=((r.id, n),)),) if n else ()
        self.apply(Plan(admit=(r.id,), passes=passes))
        return r

    def plan(self, policy) -> Plan:
        self.view.now = self.t
        return policy.plan(self.view)


def read_table(path) -> list[dict]:
    """Rows of a run directory's table (requests.csv, or a Parquet table such as
    tokens.parquet) as dicts of plain values; a missing value is ''."""
    import csv
    from pathlib import Path

    path = Path(path)
    if path.suffix != ".parquet":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    import pandas as pd

    df = pd.read_parquet(path).astype(object)
    return df.where(df.notna(), "").to_dict("records")


def png_rgb(path):
    """A PNG's pixels as a (height, width, 3) uint8 RGB array (read by matplotlib, which wrote it)."""
    import numpy as np
    from matplotlib.image import imread

    return (np.asarray(imread(path))[..., :3] * 255).round().astype(np.uint8)


def pixels_of(img, colour) -> int:
    """How many pixels of ``img`` (``png_rgb``) are exactly ``colour`` (a matplotlib colour:
    "C0", "#d1495b"): a series drawn in it leaves hundreds, a figure without it none or few."""
    import numpy as np
    from matplotlib.colors import to_rgb

    rgb = np.array([round(v * 255) for v in to_rgb(colour)], dtype=np.uint8)
    return int(np.all(img == rgb, axis=-1).sum())


def drawn_fraction(img) -> float:
    """The fraction of ``img``'s pixels that are not (near) white: a blank figure's is ~0."""
    return float((img < 250).any(axis=-1).mean())


def svg_series(path) -> list[list[tuple[str | None, list[tuple[float, float]], bool]]]:
    """The lines matplotlib drew in an SVG figure, one list per axes in drawing order:
    (stroke colour "#rrggbb", the points in the page's coordinates (y grows downwards),
    dashed). Grid lines are among them (their own colour); tick marks are not."""
    import re
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    out = []
    for ax in ET.parse(path).getroot().iter(ns + "g"):
        if not ax.get("id", "").startswith("axes_"):
            continue
        lines = []
        for g in ax.iter(ns + "g"):
            p = g.find(ns + "path") if g.get("id", "").startswith("line2d_") else None
            if p is None:
                continue
            style = p.get("style", "")
            colour = re.search(r"stroke: (#[0-9a-f]{6})", style)
            points = [(float(x), float(y)) for x, y in re.findall(r"[ML] (-?[\d.]+) (-?[\d.]+)", p.get("d", ""))]
            lines.append((colour.group(1) if colour else None, points, "stroke-dasharray" in style))
        out.append(lines)
    return out


def svg_texts(path) -> list[str]:
    """Every text of an SVG figure (matplotlib writes text as text: svg.fonttype none)."""
    import xml.etree.ElementTree as ET

    return ["".join(t.itertext()) for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text")]


STANDALONE = ("simulate", "run-real")  # the design card's own commands; the rest are subcommands


def command(name: str) -> list[str]:
    """The argv that runs command ``name`` of this environment's install: ``simulate`` and
    ``run-real`` stand alone, every other one is ``schedlab NAME``."""
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / name)] if name in STANDALONE else [str(bin_dir / "schedlab"), name]


def until(what: str, check, timeout: float = 60.0, every: float = 0.005):
    """Poll ``check()`` until it returns something true, and return that; past ``timeout`` seconds
    (a guard against a hang, never a measure of how long it took) fail naming ``what``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)
