"""Layer kinds in the analytic model: only the layers whose KV grows with the context count in a
KV capacity in tokens (hybrid Gated-DeltaNet models, sliding-window models), read from config.json
fields as mlx-lm and transformers read them. No MLX needed."""

from __future__ import annotations

import pytest

from schedlab.analysis.analytic.hardware import hardware_from_preset, read_hardware_file
from schedlab.analysis.analytic.modelspec import layer_kinds, load_model_config, model_spec
from schedlab.analysis.analytic.roofline import kv_capacity_tokens


def capacity(cfg, hw="h100-sxm"):
    """The analytic KV capacity in tokens of ``cfg`` on ``hw`` at 16 bits."""
    return kv_capacity_tokens(hardware_from_preset(hw, read_hardware_file()["presets"][hw]), model_spec(cfg), 16)


@pytest.fixture()
def base():
    """Qwen3-8B's config (36 layers, all full attention; use_sliding_window false), without that flag."""
    cfg = dict(load_model_config("qwen3-8b")[1])
    cfg.pop("use_sliding_window")
    return cfg


def test_a_hybrid_configs_kv_capacity_grows_by_layers_over_full_attention_layers(base):
    n = base["num_hidden_layers"]
    every = capacity(base)
    hybrid = capacity(dict(base, full_attention_interval=4))  # Qwen3-Next: 1 layer in 4 keeps KV
    assert model_spec(dict(base, full_attention_interval=4)).kv_layers == n // 4
    assert hybrid / every == pytest.approx(n / (n // 4), rel=1e-3)
    # the same by layer_types (Qwen3.5's config names each layer)
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (n // 4)
    assert capacity(dict(base, layer_types=types)) == hybrid


def test_sliding_window_layers_are_read_from_layer_types_or_the_gemma_pattern(base):
    n = base["num_hidden_layers"]
    types = ["sliding_attention", "full_attention"] * (n // 2)  # GPT-OSS: alternating
    assert layer_kinds(dict(base, layer_types=types, sliding_window=128), n) == (n // 2, n // 2, 128)
    assert layer_kinds(dict(base, sliding_window=512, sliding_window_pattern=6), n) == (n // 6, n - n // 6, 512)
    # Qwen3's own config: use_sliding_window false: all full attention, whatever else it says
    assert layer_kinds(dict(load_model_config("qwen3-8b")[1], sliding_window=512, sliding_window_pattern=6), n) == (
        None,
        0,
        None,
    )
    # layer_types naming sliding layers without a window: they attend to everything
    assert layer_kinds(dict(base, layer_types=types, sliding_window=None), n) == (None, 0, None)
    spec = model_spec(dict(base, layer_types=types, sliding_window=128))
    assert spec.summary()["sliding_window"] == 128 and spec.summary()["full_attention_layers"] == n // 2
    assert capacity(dict(base, layer_types=types, sliding_window=128)) == pytest.approx(2 * capacity(base), rel=1e-3)
