"""Layer kinds in the analytic model: only the layers whose KV grows with the context count in a
KV capacity in tokens (hybrid Gated-DeltaNet models, sliding-window models), read from config.json
fields as mlx-lm and transformers read them. No MLX needed."""

from __future__ import annotations

import pytest

from schedlab.analysis.analytic.hardware import hardware_from_preset, read_hardware_file
from schedlab.analysis.analytic.modelspec import layer_kinds, load_model_config, model_spec
from schedlab.analysis.analytic.roofline import kv_capacity_tokens


def capacity(cfg, hw="h100-sxm", bits=16):
    """The analytic KV capacity in tokens of ``cfg`` on ``hw`` at ``bits`` bits."""
    return kv_capacity_tokens(hardware_from_preset(hw, read_hardware_file()["presets"][hw]), model_spec(cfg), bits)


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


# Qwen3-Next's Gated DeltaNet shapes (16 key heads, 32 value heads, head dims 128, kernel 4)
DELTANET = dict(
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)


def analytic(cfg, hw="h100-sxm", **kw):
    from schedlab.analysis.analytic.roofline import AnalyticCostModel

    return AnalyticCostModel(hardware_from_preset(hw, read_hardware_file()["presets"][hw]), model_spec(cfg), **kw)


def test_gated_deltanet_layers_replace_attention_weights_and_keep_a_state_per_request(base):
    n, h = base["num_hidden_layers"], base["hidden_size"]
    plain = model_spec(base)
    hyb = model_spec(dict(base, full_attention_interval=4, **DELTANET))
    assert (hyb.linear_layers, hyb.attention_layers) == (n - n // 4, n // 4)
    # one layer: in_proj_qkvz (h x (2 x 2048 + 2 x 4096)), in_proj_ba (h x 64), conv (8192 x 4), out_proj
    per_layer = h * (2 * 2048 + 2 * 4096) + h * 64 + 8192 * 4 + 4096 * h
    assert hyb.linear_params == per_layer
    assert hyb.total_params - plain.total_params == (n - n // 4) * (per_layer - plain.attn_params)
    assert hyb.active_params - plain.active_params == hyb.total_params - plain.total_params
    # its state: 3 conv inputs of 8192 channels at 16 bits + 32 heads x 128 x 128 float32, per linear layer
    assert hyb.state_bytes == (n - n // 4) * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    layout = hyb.cache_layout()
    assert layout == {"kv_bytes_per_token": hyb.kv_bytes_per_token(), "sliding": [], "state_bytes": hyb.state_bytes}
    assert plain.cache_layout() is None
    # without the DeltaNet fields a linear layer is counted as an attention layer with no state
    assert model_spec(dict(base, full_attention_interval=4)).state_bytes == 0


@pytest.mark.parametrize("style", ["mlx", "fused"])
def test_decode_cost_grows_with_context_only_in_the_layers_that_attend_to_it(base, style):
    """Decode rows far past a window: each extra token of context costs what it reads in the
    full-attention layers only (memory-bound decode on an H100): a 1-in-4 hybrid a quarter of the
    all-full model's growth, a 1-in-6 sliding model a sixth; below the window the sliding model
    grows like the all-full one."""
    from schedlab.policies.base import PassShape

    def growth(cfg, lo, hi, rows=8):
        m = analytic(cfg, style=style, lazy_prefill=False)
        dec = lambda c: m.pass_seconds(PassShape((c,) * rows, (), False, rows))  # noqa: E731
        return dec(hi) - dec(lo)

    n = base["num_hidden_layers"]
    full = growth(base, 40_000, 80_000)
    hybrid = growth(dict(base, full_attention_interval=4, **DELTANET), 40_000, 80_000)
    assert hybrid == pytest.approx(full / 4, rel=0.02)
    pattern = dict(base, sliding_window=1024, sliding_window_pattern=6)
    assert growth(pattern, 40_000, 80_000) == pytest.approx(full * (n // 6) / n, rel=0.02)
    assert growth(pattern, 100, 900) == pytest.approx(growth(base, 100, 900), rel=0.02)


def test_prefill_attention_of_a_sliding_layer_is_capped_at_its_window(base):
    m = analytic(dict(base, sliding_window=64, sliding_window_pattern=2), causal_skip=True)
    # a chunk of 10 after 1000 cached: full layers see 1000 + (1..10), sliding ones 64 each
    assert m._qk(10, 1000) == pytest.approx(0.5 * (10 * 1000 + 55) + 0.5 * 640)
    # inside the window the two kinds agree; across its edge each query sees min(position, 64)
    assert m._qk(20, 10) == pytest.approx(20 * 10 + 210)
    assert m._qk(10, 60) == pytest.approx(0.5 * (600 + 55) + 0.5 * (61 + 62 + 63 + 64 * 7))


def test_the_analytic_model_hands_the_simulator_each_requests_state(base):
    """Simulated on a hybrid analytic model, requests hold their recurrent states: a KV cache that
    fits ten of them as plain KV fits fewer."""
    from schedlab.policies import make_policy
    from schedlab.sim import run_replica
    from schedlab.traces.schema import Request

    hyb = analytic(dict(base, full_attention_interval=4, **DELTANET))
    state = hyb.cache_layout["state_bytes"] / hyb.kv_bytes_per_token
    reqs = [Request(str(i), 0.0, 300, 20) for i in range(12)]
    most = []
    res = run_replica(
        reqs,
        make_policy("static", {"batch_size": "64"}),
        hyb,
        kv_capacity=3190,
        on_step=lambda s: most.append(len(s.running)),
    )
    assert res.error is None and all(r.phase.value == "finished" for r in res.requests)
    assert max(most) == 3190 // (319 + int(-(-state // 1))) < 10
    assert res.meta["cache_layout"]["state_bytes"] == hyb.state_bytes


@pytest.mark.parametrize(
    "name, full, sliding, linear",
    [
        ("qwen3-next-80b-a3b", 12, 0, 36),
        ("qwen3.6-35b-a3b", 10, 0, 30),
        ("qwen3.5-27b", 16, 0, 48),
        ("gpt-oss-20b", 12, 12, 0),
        ("gpt-oss-120b", 18, 18, 0),
    ],
)
def test_bundled_hybrid_and_sliding_configs_hold_layers_over_full_layers_times_the_tokens(name, full, sliding, linear):
    """The published configs' layer kinds as read, and the acceptance check: the KV capacity in
    tokens is about layers / full-attention layers times that of the same config with every layer
    full attention (the weights differ a little: linear layers' matrices are not attention's), and
    a request then holds its recurrent state or windows out of it."""
    cfg = dict(load_model_config(name)[1])
    m = model_spec(cfg)
    assert (m.attention_layers, m.sliding_layers, m.linear_layers) == (full, sliding, linear)
    inner = dict(cfg.get("text_config") or cfg)
    if "layer_types" in inner:
        inner["layer_types"] = ["full_attention"] * m.layers
    else:
        inner["full_attention_interval"] = 1
    every = dict(cfg, text_config=inner) if "text_config" in cfg else inner
    assert model_spec(every).attention_layers == m.layers
    assert capacity(cfg, "h200", 4) / capacity(every, "h200", 4) == pytest.approx(m.layers / full, rel=0.02)
    layout = model_spec(cfg).cache_layout()
    if linear:  # Gated DeltaNet: a state of thousands of tokens' KV per request
        assert layout["state_bytes"] > 1000 * m.kv_bytes_per_token() and not layout["sliding"]
    else:  # GPT-OSS: 128-token windows in half the layers
        assert layout["sliding"] == [[128, m.sliding_bytes_per_token()]] and layout["state_bytes"] == 0
