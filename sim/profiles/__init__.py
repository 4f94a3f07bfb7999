"""Measured cost-model profiles shipped with schedlab (written by ``calibrate``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..cost import ProfileError

PROFILE_DIR = Path(__file__).resolve().parent
DEFAULT = "tiny-cpu.json"


def default_profile() -> Path:
    p = PROFILE_DIR / DEFAULT
    if not p.is_file():
        raise ProfileError("no default profile is bundled; give --profile FILE (from `calibrate`)")
    return p


def bundled_profiles() -> list[Path]:
    return sorted(p for p in PROFILE_DIR.glob("*.json"))


def resolve_profile(spec: str | None) -> Path:
    """A profile path, a bundled profile name, or the default when ``spec`` is None."""
    if spec is None:
        return default_profile()
    p = Path(spec)
    if p.is_file():
        return p
    for cand in (PROFILE_DIR / spec, PROFILE_DIR / f"{spec}.json"):
        if cand.is_file():
            return cand
    if p.is_dir():
        raise ProfileError(f"profile {spec} is a directory, not a profile JSON (calibrate --out writes one)")
    raise ProfileError(f"profile not found: {spec}")


def bundled_models() -> dict[str, Path]:
    """The bundled profiles by the model each was measured on (its ``model``)."""
    out: dict[str, Path] = {}
    for p in bundled_profiles():
        try:
            model = json.loads(p.read_text()).get("model")
        except (OSError, ValueError):
            continue
        if isinstance(model, str):
            out.setdefault(model, p)
    return out
