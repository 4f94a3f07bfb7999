"""Layer kinds of the bundled model configs in the analytic model: what a request holds, what fits.

For each config in ``analysis/model_configs`` (no timing: arithmetic on the configs):

- its layers by kind (full attention, sliding window and its size, linear attention), parameters
  (total, active), KV bytes per token of the full-attention layers, the sliding layers' bytes per
  token, the recurrent state per request (bytes, and in tokens of the full-attention KV);
- on an H200 (``h200``) at 8 bits: the KV capacity in tokens, and that of the same config with
  every layer full attention (``full_attention_interval: 1``, ``layer_types`` all full,
  ``sliding_window_pattern: 1``), their ratio;
- how many requests of 1,024 prompt + 1,024 output tokens fit at once, counting each request's
  windows and state (``sim.layout``) and, for comparison, as if it held its KV only.

    python bench/layer_kinds.py        # writes bench/results/layer_kinds.json (a second)
"""

from __future__ import annotations

import argparse

from common import machine, result_path, write_json

from schedlab.analysis.analytic.hardware import hardware_from_preset, read_hardware_file
from schedlab.analysis.analytic.modelspec import bundled_model_configs, load_model_config, model_spec
from schedlab.analysis.analytic.roofline import kv_capacity_tokens
from schedlab.sim.layout import CacheLayout

HARDWARE = "h200"
QUANT = 8
FOOTPRINT = 1024 + 1024 - 1


def all_full(cfg: dict) -> dict:
    """The same config with every layer full attention."""
    text = "text_config" in cfg and "hidden_size" not in cfg
    inner = dict(cfg["text_config"] if text else cfg)
    n = inner["num_hidden_layers"]
    if isinstance(inner.get("layer_types"), list):
        inner["layer_types"] = ["full_attention"] * n
    if inner.get("full_attention_interval"):
        inner["full_attention_interval"] = 1
    if inner.get("sliding_window_pattern"):
        inner["sliding_window_pattern"] = 1
    return dict(cfg, text_config=inner) if text else inner


def row(name: str, hw) -> dict:
    cfg = load_model_config(name)[1]
    m = model_spec(cfg, name)
    full = model_spec(all_full(cfg), name)
    layout = CacheLayout.from_dict(m.cache_layout())
    kv = m.kv_bytes_per_token()
    out = {
        "layers": m.layers,
        "full_attention_layers": m.attention_layers,
        "sliding_layers": m.sliding_layers,
        "sliding_window": m.sliding_window,
        "linear_attention_layers": m.linear_layers,
        "total_params_b": round(m.total_params / 1e9, 2),
        "active_params_b": round(m.active_params / 1e9, 2),
        "kv_bytes_per_token": kv,
        "sliding_bytes_per_token": m.sliding_bytes_per_token(),
        "state_bytes_per_request": m.state_bytes,
        "state_in_kv_tokens": round(m.state_bytes / kv, 1),
    }
    try:
        cap = kv_capacity_tokens(hw, m, QUANT)
        cap_full = kv_capacity_tokens(hw, full, QUANT)
    except Exception as exc:  # the weights do not fit this device
        out["capacity"] = {"error": str(exc)}
        return out
    fixed = layout.fixed_tokens(FOOTPRINT) if layout else 0
    out["capacity"] = {
        "kv_tokens": cap,
        "kv_tokens_all_full_attention": cap_full,
        "ratio": round(cap / cap_full, 3),
        "layers_over_full_layers": round(m.layers / max(m.attention_layers, 1), 3),
        "fixed_tokens_per_request": fixed,
        "requests_1k_1k": cap // (FOOTPRINT + fixed),
        "requests_1k_1k_kv_only": cap // FOOTPRINT,
        "requests_1k_1k_all_full_attention": cap_full // FOOTPRINT,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(result_path("layer_kinds")))
    args = ap.parse_args()
    hw = hardware_from_preset(HARDWARE, read_hardware_file()["presets"][HARDWARE])
    data = {
        "bench": "layer_kinds",
        "hardware": HARDWARE,
        "quant_bits": QUANT,
        "request": {"prompt": 1024, "output": 1024},
        "machine": machine(),
        "models": {name: row(name, hw) for name in bundled_model_configs()},
    }
    write_json(data, args.out)
    for name, r in data["models"].items():
        c = r["capacity"]
        print(
            f"{name:22s} full {r['full_attention_layers']:>3}/{r['layers']:<3} sliding {r['sliding_layers']:>3} "
            f"linear {r['linear_attention_layers']:>3} state {r['state_bytes_per_request'] / 1e6:7.1f} MB "
            + (f"cap {c['kv_tokens']:>9} x{c['ratio']:.2f} reqs {c['requests_1k_1k']}" if "kv_tokens" in c else "")
        )


if __name__ == "__main__":
    main()
