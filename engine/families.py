"""Tiny seeded random-weight models of the families people run, built from mlx-lm's own classes.

Each preset is a real mlx-lm architecture (its own ``Model`` class, its own ``make_cache``) at a
size that runs in milliseconds on a CPU, with seeded random weights: nothing is downloaded. They
exist so that every cache kind mlx-lm batches is exercised by the engine's equivalence tests and
can be run by ``run-real --model NAME`` like any other preset:

==================  =============  ==========================================================
preset              family         layers and caches (``model.make_cache()``)
==================  =============  ==========================================================
micro-qwen3_5       qwen3_5        Gated DeltaNet (``ArraysCache``: conv + recurrent state) x3,
                                   full attention (``KVCache``) every 4th layer
micro-qwen3_next    qwen3_next     as qwen3_5, with a mixture-of-experts MLP in every layer
micro-gemma3        gemma3_text    sliding window 16 (``RotatingKVCache``) x3 : 1 global
micro-gpt_oss       gpt_oss        sliding window 16 / full attention alternating, MoE MLP
micro-lfm2          lfm2           short convolutions (``ArraysCache``: conv state) and
                                   attention layers
micro-llama-q4      llama          the ``micro`` llama quantized to 4 bits (mlx ``QuantizedLinear``)
==================  =============  ==========================================================

The windows are small (16 tokens) so that prompts of a few dozen tokens already cross them, and
chunked prefill crosses them inside and across chunks.
"""

from __future__ import annotations

import math
from typing import Any

# Gains of the random init (every random-weight preset: the llama sizes and the families) (std = gain / sqrt(fan_in)). Larger attention/MLP output gains
# make every layer's contribution outweigh the token's own embedding in the residual
# stream, and a larger query/key gain makes attention sharp: the next token then depends
# on the whole context, not only on the last token, so a wrong KV cache changes the
# tokens (the engine's equivalence tests rely on that).
_GAINS = {
    "q_proj": 2.0,
    "k_proj": 2.0,
    "v_proj": 1.5,
    "o_proj": 2.0,
    "gate_proj": 1.5,
    "up_proj": 1.5,
    "down_proj": 2.0,
    "lm_head": 1.0,
}


# the Gated DeltaNet layout both Qwen hybrids share: 3 linear-attention layers, then full attention
_DELTANET: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)

FAMILY_PRESETS: dict[str, dict[str, Any]] = {
    "micro-qwen3_5": dict(
        _DELTANET,
        model_type="qwen3_5",
        tie_word_embeddings=True,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "micro-qwen3_next": dict(
        _DELTANET,
        model_type="qwen3_next",
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        tie_word_embeddings=False,
    ),
    "micro-gemma3": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=512,
        query_pre_attn_scalar=16,
        sliding_window=16,
        sliding_window_pattern=4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_local_base_freq=10000.0,
    ),
    "micro-gpt_oss": dict(
        model_type="gpt_oss",
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        rope_theta=10000,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    ),
    "micro-lfm2": dict(
        model_type="lfm2",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        rope_theta=10000.0,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
}

# the micro llama, quantized (mlx's affine quantization, as mlx-lm's convert writes it)
QUANTIZED_PRESETS: dict[str, dict[str, int]] = {"micro-llama-q4": {"bits": 4, "group_size": 32}}


def names() -> list[str]:
    return list(FAMILY_PRESETS) + list(QUANTIZED_PRESETS)


def init_random(model, seed: int) -> None:
    """Seeded random weights, one key per parameter in sorted-name order."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for i, (name, p) in enumerate(params):
        if p.ndim == 1:  # norm weights (no biases in these presets)
            new.append((name, mx.ones(p.shape, dtype=mx.float32)))
            continue
        if "embed_tokens" in name:
            std = 1.0
        else:
            kind = name.split(".")[-2]
            std = _GAINS.get(kind, 1.0) / math.sqrt(p.shape[-1])
        new.append((name, mx.random.normal(p.shape, key=keys[i]) * std))
    model.update(tree_unflatten(new))


def build(name: str, seed: int):
    """(model, config) of family preset ``name`` with seeded random weights (mlx imported)."""
    from mlx_lm.utils import _get_classes

    cfg = dict(FAMILY_PRESETS[name])
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    init_random(model, seed)
    _sharpen(model)
    return model, cfg


def _sharpen(model) -> None:
    """Make the output depend on the whole context, so that a wrong cache changes the tokens.

    A recurrent state that decays fast forgets early tokens, and normalized queries and keys
    with unit norm weights attend almost uniformly: with those defaults a token 40 positions
    back barely moves the logits. Slower decay (``A_log`` = -2: the Gated DeltaNet's decay rate
    e^-2 of the default's) and larger query/key norm weights (sharper attention) fix that."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    new = []
    for key, p in tree_flatten(model.parameters()):
        leaf = key.rsplit(".", 2)
        if key.endswith("A_log"):
            new.append((key, mx.full(p.shape, -2.0, dtype=p.dtype)))
        elif len(leaf) == 3 and leaf[-2] in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
            new.append((key, mx.full(p.shape, 3.0, dtype=p.dtype)))
    if new:
        model.update(tree_unflatten(new))
