"""Analytic (roofline) cost models from a model config and a hardware preset.

No measurement needed: the seconds of a pass follow from its FLOPs and bytes against the
chip's peak rate and bandwidth, scaled by efficiencies fitted to published single-request
figures (``analysis/hardware/benchmarks.json``). See :mod:`analysis.analytic.roofline` for the
formulas, :mod:`analysis.analytic.hardware` for the presets and :mod:`analysis.analytic.fit` for the
fits. Imports no ``mlx``.

Entry point for the CLI::

    cost, kv_tokens, meta = make_analytic_cost_model("m4-max", "qwen3-30b-a3b", 4)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .errors import AnalyticError
from .fit import FitResult, fit_efficiency, refit
from .local import BLOCK_KEY, block_mismatch, efficiency_from_block, fit_local, shape_from_sample
from .hardware import Efficiency, Hardware, list_hardware, load_hardware, measure_cpu
from .modelspec import ModelSpec, bundled_model_configs, check_quant, load_model_config, model_spec
from .roofline import AnalyticCostModel, Forward, kv_capacity_tokens

__all__ = [
    "AnalyticCostModel", "AnalyticError", "Efficiency", "FitResult", "Forward", "Hardware", "ModelSpec",
    "analytic_from_config", "bundled_model_configs", "fit_efficiency", "kv_capacity_tokens", "list_hardware",
    "load_hardware", "load_model_config", "make_analytic_cost_model", "measure_cpu", "model_spec", "refit",
    "BLOCK_KEY", "block_mismatch", "efficiency_from_block", "fit_local", "shape_from_sample",
]


def analytic_from_config(
    hw: Hardware | str,
    config: Mapping[str, Any],
    quant: int | None = None,
    *,
    name: str | None = None,
    style: str = "mlx",
    kv_bits: int = 16,
    compute_dtype: str | None = None,
    efficiency: Efficiency | None = None,
    group_size: int = 64,
    lazy_prefill: bool | None = None,
    causal_skip: bool | None = None,
) -> AnalyticCostModel:
    """A cost model for any config dict (e.g. the engine's synthetic presets) on ``hw``.

    ``lazy_prefill`` / ``causal_skip``: see :class:`AnalyticCostModel` (None: by hardware kind).
    """
    check_quant(quant)
    hardware = hw if isinstance(hw, Hardware) else load_hardware(hw)
    spec = model_spec(config, name or str(config.get("_name_or_path") or config.get("model_type") or "model"))
    return AnalyticCostModel(hardware, spec, quant, kv_bits=kv_bits, style=style, compute_dtype=compute_dtype,
                             efficiency=efficiency, group_size=group_size, lazy_prefill=lazy_prefill,
                             causal_skip=causal_skip)


def make_analytic_cost_model(
    hardware: str,
    model_config: str | Path,
    quant: int | None,
    *,
    mem_fraction: float = 0.9,
    style: str = "mlx",
    kv_bits: int = 16,
) -> tuple[AnalyticCostModel, int, dict[str, Any]]:
    """(cost model, KV capacity in tokens, metadata) for ``simulate --hardware --model-config``.

    ``model_config``: a bundled name (see :func:`bundled_model_configs`) or a path to a
    config.json (or its directory). ``quant``: weight bits (4, 8, 16; 2/3/5/6 and 32 also
    accepted), None for the config's native dtype. Bad input raises :class:`AnalyticError`
    with one line.
    """
    check_quant(quant)
    hw = load_hardware(hardware)
    name, cfg = load_model_config(model_config)
    cost = analytic_from_config(hw, cfg, quant, name=name, style=style, kv_bits=kv_bits)
    capacity = kv_capacity_tokens(hw, cost.model, quant, mem_fraction, kv_bits=kv_bits)
    meta = cost.meta()
    meta.update({"model_config": str(model_config), "kv_tokens": capacity, "mem_fraction": mem_fraction})
    return cost, capacity, meta
