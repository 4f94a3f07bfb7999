"""Analytic (roofline) cost models from a model config and a hardware preset.

No measurement needed: the seconds of a pass follow from its FLOPs and bytes against the
chip's peak rate and bandwidth, scaled by efficiencies that belong to an engine: ``vllm`` (a
GPU serving engine, fitted to serving kernels' measured times, :mod:`analysis.analytic.serving`
and :mod:`analysis.analytic.kernels`; the default on NVIDIA presets), ``mlx-lm`` and
``llama.cpp`` (fitted to published single-request figures, ``analysis/hardware/benchmarks.json``,
:mod:`analysis.analytic.roofline` and :mod:`analysis.analytic.fit`). See
:mod:`analysis.analytic.hardware` for the presets, :mod:`analysis.analytic.efficiency` for the factors. Imports no ``mlx``.

Entry point for the CLI::

    cost, kv_tokens, meta = make_analytic_cost_model("m4-max", "qwen3-30b-a3b", 4)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .efficiency import ENGINES, Efficiency, ServingEfficiency, engine_kind
from .errors import AnalyticError
from .fit import FitResult, fit_efficiency, refit
from .local import BLOCK_KEY, block_mismatch, efficiency_from_block, fit_local, shape_from_sample
from .hardware import Hardware, link_preset, list_hardware, list_links, load_hardware, measure_cpu, split_hardware
from .modelspec import ModelSpec, bundled_model_configs, check_quant, load_model_config, model_spec
from .roofline import AnalyticCostModel, Forward, kv_capacity_tokens
from .serving import ServingCostModel

__all__ = [
    "AnalyticCostModel",
    "AnalyticError",
    "Efficiency",
    "FitResult",
    "Forward",
    "Hardware",
    "ModelSpec",
    "analytic_from_config",
    "bundled_model_configs",
    "fit_efficiency",
    "kv_capacity_tokens",
    "kv_transfer",
    "link_preset",
    "list_hardware",
    "list_links",
    "load_hardware",
    "load_model_config",
    "make_analytic_cost_model",
    "measure_cpu",
    "model_spec",
    "refit",
    "BLOCK_KEY",
    "block_mismatch",
    "efficiency_from_block",
    "fit_local",
    "shape_from_sample",
    "split_hardware",
    "ENGINES",
    "ServingCostModel",
    "ServingEfficiency",
    "engine_kind",
    "predict_pass",
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
    engine: str | None = None,
) -> AnalyticCostModel:
    """A cost model for any config dict (e.g. the engine's synthetic presets) on ``hw``.

    ``lazy_prefill`` / ``causal_skip``: see :class:`AnalyticCostModel` (None: by hardware kind).
    ``engine``: whose factors (default: the hardware's; with a ``Hardware`` object, the engine
    it was loaded for). The ``vllm`` engine gives a :class:`ServingCostModel` (``style`` and
    the roofline switches do not apply to it) unless ``efficiency`` is given.
    """
    check_quant(quant)
    if isinstance(hw, Hardware):
        hardware = hw if engine is None or engine == hw.engine else load_hardware(hw.spec, engine=engine)
    else:
        hardware = load_hardware(hw, engine=engine)
    spec = model_spec(config, name or str(config.get("_name_or_path") or config.get("model_type") or "model"))
    if hardware.serving is not None and efficiency is None:
        return ServingCostModel(
            hardware,
            spec,
            quant,
            serving=hardware.serving,
            kv_bits=kv_bits,
            compute_dtype=compute_dtype,
            group_size=group_size,
        )
    return AnalyticCostModel(
        hardware,
        spec,
        quant,
        kv_bits=kv_bits,
        style=style,
        compute_dtype=compute_dtype,
        efficiency=efficiency,
        group_size=group_size,
        lazy_prefill=lazy_prefill,
        causal_skip=causal_skip,
    )


def make_analytic_cost_model(
    hardware: str,
    model_config: str | Path,
    quant: int | None,
    *,
    mem_fraction: float = 0.9,
    style: str = "mlx",
    kv_bits: int = 16,
    engine: str | None = None,
) -> tuple[AnalyticCostModel, int, dict[str, Any]]:
    """(cost model, KV capacity in tokens, metadata) for ``simulate --hardware --model-config``.

    ``hardware``: a preset name, with ``:tp=N`` for a replica of N GPUs with tensor parallelism
    (``a100-80gb-sxm:tp=2``; see :mod:`analysis.analytic.roofline`). ``model_config``: a bundled
    name (see :func:`bundled_model_configs`) or a path to a config.json (or its directory).
    ``quant``: weight bits (4, 8, 16; 2/3/5/6 and 32 also accepted), None for the config's native
    dtype. ``engine``: ``vllm`` (default on NVIDIA
    presets), ``mlx-lm`` or ``llama.cpp`` (see :mod:`analysis.analytic.serving`). Bad input
    raises :class:`AnalyticError` with one line.
    """
    check_quant(quant)
    hw = load_hardware(hardware, engine=engine)
    name, cfg = load_model_config(model_config)
    cost = analytic_from_config(hw, cfg, quant, name=name, style=style, kv_bits=kv_bits)
    capacity = kv_capacity_tokens(hw, cost.model, quant, mem_fraction, kv_bits=kv_bits)
    meta = cost.meta()
    meta.update({"model_config": str(model_config), "kv_tokens": capacity, "mem_fraction": mem_fraction})
    return cost, capacity, meta


def predict_pass(
    hardware: Hardware | str, model_config: Any, shape: Any, engine: str | None = "vllm", quant: int | None = None
) -> float:
    """Seconds of one pass: the easy entry point for checking against measured passes.

    ``hardware``: a preset name (``h100-sxm``, ``a100-80gb-sxm``, ...) or a Hardware;
    ``model_config``: a bundled name (``llama-3.1-8b``), a config.json path or a config dict;
    ``shape``: a ``policies.base.PassShape``, or a dict ``{"decode": [context, ...],
    "prefill": [[chunk_tokens, cached_tokens], ...]}`` (either key may be absent); ``engine``:
    ``vllm`` (default), ``mlx-lm`` or ``llama.cpp`` (None: the preset's default).

    >>> predict_pass("h100-sxm", "llama-3.1-8b", {"prefill": [[2048, 0]]})  # doctest: +SKIP
    """
    from schedlab.policies.base import PassShape

    if isinstance(model_config, Mapping):
        cfg, name = model_config, None
    else:
        name, cfg = load_model_config(model_config)
    if not isinstance(shape, PassShape):
        if not isinstance(shape, Mapping):
            raise AnalyticError("shape must be a PassShape or a dict with 'decode' and/or 'prefill'")
        shape = PassShape(
            decode_contexts=tuple(int(c) for c in shape.get("decode", ())),
            prefill=tuple((int(n), int(b)) for n, b in shape.get("prefill", ())),
        )
    cm = analytic_from_config(hardware, cfg, quant, name=name, engine=engine)
    return cm.pass_seconds(shape)


def kv_transfer(
    model: str | Path, link: Any, mode: str = "layerwise", *, kv_bits: int = 16, latency_s: float | None = None
):
    """What moving a request's KV between two replicas costs (``sim.transfer.KVTransfer``): the
    model's KV bytes per token (a bundled config name or a config.json path; ``kv_bits`` per
    value) over ``link``: a link preset or a hardware preset's own link (``link_preset``;
    ``latency_s`` overrides the preset's), or a ``sim.transfer.Link``."""
    from schedlab.sim.transfer import KVTransfer, Link, TransferError

    name, cfg = load_model_config(model)
    spec = model_spec(cfg, name)
    try:
        lk = link if isinstance(link, Link) else link_preset(link, latency_s)
        return KVTransfer(spec.kv_bytes_per_token(kv_bits), spec.layers, lk, mode)
    except TransferError as exc:
        raise AnalyticError(str(exc)) from None
