"""Model shapes from an mlx-lm / Hugging Face ``config.json``: parameter counts, bytes, KV size.

Only the fields that decide cost are read. Dense (Llama, Qwen2/3, Mistral) and mixture-of-
experts (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3 expert layout) configs are understood:

===========================  ===========================================================
field                        meaning here
===========================  ===========================================================
hidden_size                  H
num_hidden_layers            L
num_attention_heads          query heads; ``head_dim`` defaults to H / heads
num_key_value_heads          KV heads (defaults to the query heads: no GQA)
intermediate_size            dense MLP width (Mixtral: the expert width)
vocab_size                   V; the head is V x H, the embedding V x H (counted once if tied)
num_experts / num_local_      E, routed experts per MoE layer
experts / n_routed_experts
num_experts_per_tok          k, experts each token picks
moe_intermediate_size        expert MLP width
shared_expert_intermediate_  Qwen2-MoE shared expert (plus its 1-wide gate)
size, n_shared_experts
decoder_sparse_step,         which layers are MoE (Qwen); ``first_k_dense_replace`` and
mlp_only_layers              ``moe_layer_freq`` (DeepSeek)
attention_bias, mlp_bias     biases (Qwen2 has q/k/v biases by model type)
kv_lora_rank, q_lora_rank    DeepSeek multi-head latent attention (compressed KV cache)
layer_types,                 which layers are full attention, sliding-window attention
full_attention_interval,     (at most ``sliding_window`` tokens) or linear attention (a
sliding_window(_pattern)     fixed-size recurrent state): ``layer_kinds``
linear_num_key_heads, ...    Gated DeltaNet layers (Qwen3-Next, Qwen3.5/3.6): heads and head
                             dims of keys and values, ``linear_conv_kernel_dim``
attn_output_gate             Qwen3-Next/3.5 full attention's output gate (q_proj doubled)
===========================  ===========================================================

Every MLP is gated (gate, up, down: 3 x H x width), as in all the families above, except
``model_type: phi`` (Phi-2: fc1 and fc2 with biases, 2 x H x width) and ``model_type: opt``.
Norms (2 per layer, the final one, Qwen3's per-head q/k norms) are counted in the totals and stay
16-bit under quantisation; they are too small to matter to time.

``model_type: opt`` (OPT, as transformers' ``OPTForCausalLM`` builds it): ``ffn_dim`` is the MLP
width, a plain fc1 / ReLU / fc2 MLP with biases; q, k, v and out projections with biases
(``enable_bias``, default true); LayerNorms with a bias (``layer_norm_elementwise_affine``,
default true: 2 x H each, two per layer and the final one); learned positional embeddings of
``max_position_embeddings`` + 2 rows (OPT's offset of 2); the vocabulary matrices are
``word_embed_proj_dim`` wide, with a project_in / project_out pair (no bias) when that differs from
H; the head is tied to the embedding (``tie_word_embeddings`` defaults to true). The positional
embeddings and the projections (``extra_params``) count in the totals and the weights' bytes, not
in the FLOPs of a token (a lookup; the projections are 2 x H x ``word_embed_proj_dim``, absent at
13B and above).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from .errors import AnalyticError

#: bits per weight of a quantised matrix: ``bits`` plus a 16-bit scale and a 16-bit bias per
#: group of ``group_size`` weights (mlx's affine quantisation: 4 bits, group 64 -> 4.5 bits).
QUANT_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_BITS = (16, 32)
DEFAULT_GROUP_SIZE = 64


def bits_per_weight(bits: float, group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """Storage bits per weight of a matrix quantised to ``bits`` (16/32: plain floats)."""
    if bits in FLOAT_BITS:
        return float(bits)
    return float(bits) + 32.0 / group_size


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    v = cfg.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise AnalyticError(f"model config field {key} must be a non-negative integer, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs to know about a model, derived from its config."""

    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    native_bits: int
    # per-layer parameter counts (matrices only, no norms)
    attn_params: int  # q, k, v, o (+ biases, + MLA projections)
    dense_mlp_params: int  # a dense layer's MLP
    expert_params: int  # one routed expert (0 for a dense model)
    shared_params: int  # shared experts + router of an MoE layer
    n_experts: int  # E (0 for dense)
    top_k: int  # k (0 for dense)
    moe_layers: int  # how many layers are MoE
    norm_params: int  # all norm weights in the model
    kv_dim: int  # K+V values cached per token per layer
    config: Mapping[str, Any] = field(repr=False, default_factory=dict)
    # layer kinds (``layer_kinds``): full-attention layers keep KV that grows with the context;
    # sliding-window layers keep at most ``sliding_window`` tokens; linear-attention (recurrent)
    # and convolution layers keep a fixed-size state. None: every layer is full attention.
    full_layers: int | None = None
    sliding_layers: int = 0
    sliding_window: int | None = None
    # linear-attention layers: their matrices (in place of ``attn_params`` in those layers), the
    # FLOPs per token of their recurrence, and the state each keeps per request
    linear_layers: int = 0
    linear_params: int = 0
    linear_flops_per_token: float = 0.0
    linear_state_bytes: float = 0.0
    # the vocabulary matrices' width (0: hidden; OPT's word_embed_proj_dim) and parameters outside
    # the layers and the vocabulary matrices (OPT: learned positions, embedding projections)
    embed_dim: int = 0
    extra_params: int = 0
    # bits per weight, as stored, of the routed experts' matrices where the config ships them
    # quantised and the rest at ``native_bits`` (gpt-oss: MXFP4 experts, ``config_expert_bits``);
    # None: every matrix at ``native_bits``. What weights cost unless a --quant says otherwise.
    expert_bits: float | None = None

    # ------------------------------------------------------------------ counts
    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0

    @property
    def embed_params(self) -> int:
        return self.vocab * (self.embed_dim or self.hidden)

    @property
    def head_params(self) -> int:
        return self.vocab * (self.embed_dim or self.hidden)

    @property
    def mixer_delta_params(self) -> int:
        """What the linear-attention layers' matrices add to counting ``attn_params`` in every layer."""
        return self.linear_layers * (self.linear_params - self.attn_params) if self.linear_params else 0

    @property
    def layer_matrix_params(self) -> int:
        """All matrices of all layers (every expert counted)."""
        moe = self.attn_params + self.shared_params + self.n_experts * self.expert_params
        dense = self.attn_params + self.dense_mlp_params
        return self.moe_layers * moe + self.dense_layers * dense + self.mixer_delta_params

    @property
    def total_params(self) -> int:
        emb = self.embed_params if self.tied else 2 * self.embed_params
        return self.layer_matrix_params + emb + self.norm_params + self.extra_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches: every expert replaced by the k it picks."""
        return self.total_params - self.moe_layers * (self.n_experts - self.top_k) * self.expert_params

    @property
    def non_embedding_params(self) -> int:
        return self.total_params - (self.embed_params if self.tied else 2 * self.embed_params)

    def active_matmul_params(self) -> int:
        """Matrix parameters a token multiplies through in the layers (no embedding, no head)."""
        moe = self.attn_params + self.shared_params + self.top_k * self.expert_params
        dense = self.attn_params + self.dense_mlp_params
        return self.moe_layers * moe + self.dense_layers * dense + self.mixer_delta_params

    # ------------------------------------------------------------------ MoE
    def distinct_experts(self, tokens: float) -> float:
        """Expected distinct experts per MoE layer hit by ``tokens`` tokens choosing k of E
        each, uniform routing: E * (1 - (1 - k/E)^T). At most E; k for one token."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        e, k = self.n_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def layer_weight_params_touched(self, tokens: float) -> float:
        """Layer matrix parameters read by a forward over ``tokens`` tokens."""
        dense = self.dense_layers * (self.attn_params + self.dense_mlp_params) + self.mixer_delta_params
        if not self.is_moe:
            return float(dense)
        per = self.attn_params + self.shared_params + self.distinct_experts(tokens) * self.expert_params
        return dense + self.moe_layers * per

    # ------------------------------------------------------------------ bytes
    def weight_bytes(self, bits: float | None = None, group_size: int = DEFAULT_GROUP_SIZE) -> float:
        """Bytes to hold every weight: matrices and embeddings at ``bits`` (None: as the config
        ships them, native bits but for ``expert_bits``), norms at 16 bits."""
        b = bits_per_weight(self.native_bits if bits is None else bits, group_size) / 8.0
        emb = self.embed_params if self.tied else 2 * self.embed_params
        total = (self.layer_matrix_params + emb + self.extra_params) * b + self.norm_params * 2.0
        if bits is None and self.expert_bits is not None:
            total += self.all_expert_params * (self.expert_bits / 8.0 - b)
        return total

    @property
    def all_expert_params(self) -> int:
        """The routed experts' matrices in every MoE layer."""
        return self.moe_layers * self.n_experts * self.expert_params

    def bits_said(self, bits: float | None = None) -> str:
        """How the weights are stored, in words: "16 bits", or "16 bits, experts 4.25 (mxfp4)"."""
        if bits is not None or self.expert_bits is None:
            return f"{self.native_bits if bits is None else bits:g} bits"
        return f"{self.native_bits:g} bits, experts {self.expert_bits:g} (mxfp4)"

    @property
    def kv_layers(self) -> int:
        """Layers whose KV grows with the context (full attention; every layer unless the config
        says otherwise). At least one, so that a capacity in tokens stays finite."""
        return self.layers if self.full_layers is None else max(self.full_layers, 1)

    def kv_bytes_per_token(self, kv_bits: int = 16) -> float:
        """K and V of one token in every full-attention layer: 2 x layers x kv_heads x head_dim x
        bytes (DeepSeek MLA: the compressed latent + rope key per layer). Sliding-window layers
        (at most their window per request) and recurrent layers (a fixed state per request) are
        not counted: a capacity in tokens is a capacity of the layers that grow."""
        return self.kv_layers * self.kv_dim * kv_bits / 8.0

    @property
    def attention_layers(self) -> int:
        """Layers whose attention reads the whole context (every layer unless the config says
        otherwise; 0 for a model of sliding and linear layers only)."""
        return self.layers if self.full_layers is None else self.full_layers

    def sliding_bytes_per_token(self, kv_bits: int = 16) -> float:
        """K and V of one token in every sliding-window layer (each keeps at most its window)."""
        return self.sliding_layers * self.kv_dim * kv_bits / 8.0

    @property
    def state_bytes(self) -> float:
        """Bytes of the fixed-size states one request keeps in the linear-attention layers."""
        return self.linear_layers * self.linear_state_bytes

    def cache_layout(self, kv_bits: int = 16) -> dict[str, Any] | None:
        """What one request's cache holds beyond the full-attention KV, for the simulator's memory
        accounting (``sim.layout.CacheLayout``'s dict); None when every layer is full attention."""
        if not self.sliding_layers and not self.state_bytes:
            return None
        full = self.attention_layers * self.kv_dim * kv_bits / 8.0
        sliding = [[self.sliding_window, self.sliding_bytes_per_token(kv_bits)]] if self.sliding_layers else []
        return {"kv_bytes_per_token": full, "sliding": sliding, "state_bytes": self.state_bytes}

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "layers": self.layers,
            "hidden_size": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "tied_embeddings": self.tied,
            "experts": self.n_experts,
            "experts_per_token": self.top_k,
            "moe_layers": self.moe_layers,
            "full_attention_layers": self.attention_layers,
            "sliding_layers": self.sliding_layers,
            "sliding_window": self.sliding_window,
            "linear_attention_layers": self.linear_layers,
            "state_bytes_per_request": self.state_bytes,
            "total_params": self.total_params,
            "active_params": self.active_params,
        }


#: bits per weight of an MXFP4 matrix as stored: 4-bit values, one 8-bit scale per 32 of them
MXFP4_BITS = 4.25


def config_expert_bits(cfg: Mapping[str, Any]) -> float | None:
    """The routed experts' bits per weight where the config says they ship quantised and the other
    matrices do not (``quantization_config``: MXFP4, as gpt-oss's checkpoints and vLLM serve them,
    the attention, router, embeddings and head left out in ``modules_to_not_convert``); else None."""
    q = cfg.get("quantization_config")
    if not isinstance(q, Mapping) or str(q.get("quant_method", "")).lower() != "mxfp4":
        return None
    return MXFP4_BITS


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal configs keep the language model under ``text_config``."""
    inner = cfg.get("text_config")
    if isinstance(inner, Mapping) and "hidden_size" not in cfg:
        merged = dict(inner)
        merged.setdefault("model_type", cfg.get("model_type"))
        return merged
    return cfg


def model_spec(config: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """Read a config dict. Raises ``AnalyticError`` (one line) on what it cannot use."""
    if not isinstance(config, Mapping):
        raise AnalyticError(f"model config {name} is not a JSON object")
    cfg = _text_config(config)
    mtype, h, n_layers, heads, vocab = _required_shape(cfg, name)
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim") or h // heads
    opt = mtype == "opt"
    tied = bool(cfg.get("tie_word_embeddings", opt))  # (OPT: transformers' default, true)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    native_bits = 32 if "32" in dtype else 16

    attn_bias = bool(cfg.get("attention_bias", mtype in ("qwen2", "qwen2_moe")))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    embed_dim = extra = 0
    if opt:  # biases on every linear layer and LayerNorm, learned positions, projections
        attn_bias = mlp_bias = bool(cfg.get("enable_bias", True))
        proj = _int(cfg, "word_embed_proj_dim") or h
        embed_dim = proj if proj != h else 0
        extra = (_int(cfg, "max_position_embeddings", 2048) + 2) * h + (2 * h * proj if proj != h else 0)

    attention = _attention(cfg, mtype, h, heads, kv_heads, head_dim, attn_bias)
    inter = _int(cfg, "intermediate_size") or (_int(cfg, "ffn_dim") if opt else None) or 4 * h
    n_exp = _int(cfg, "num_experts") or _int(cfg, "num_local_experts") or _int(cfg, "n_routed_experts") or 0
    top_k = _int(cfg, "num_experts_per_tok") or (_int(cfg, "top_k") or 0)
    mlp = _mlp_params(mtype, h, mlp_bias)
    experts = _experts(cfg, name, n_layers, h, inter, n_exp, top_k, mlp) if n_exp else _Experts(0, 0, 0)
    final_norm = 2 * h if opt and cfg.get("layer_norm_elementwise_affine", True) else h
    full, sliding, window = layer_kinds(cfg, n_layers)
    linear = n_layers - full - sliding if full is not None else 0
    lin_params, lin_flops, lin_state = _linear_attention(cfg, h, native_bits) if linear else (0, 0.0, 0.0)
    expert_bits = config_expert_bits(cfg) if n_exp else None
    return ModelSpec(
        name=name,
        model_type=mtype,
        hidden=h,
        layers=n_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=attention.head_dim,
        vocab=vocab,
        tied=tied,
        native_bits=native_bits,
        attn_params=attention.params,
        dense_mlp_params=mlp(inter),
        expert_params=experts.expert_params,
        shared_params=experts.shared_params,
        n_experts=n_exp,
        top_k=top_k if n_exp else 0,
        moe_layers=experts.moe_layers,
        norm_params=n_layers * attention.norms_per_layer + final_norm,
        kv_dim=attention.kv_dim,
        config=dict(config),
        full_layers=full,
        sliding_layers=sliding,
        sliding_window=window,
        linear_layers=linear,
        linear_params=lin_params,
        linear_flops_per_token=lin_flops,
        linear_state_bytes=lin_state,
        embed_dim=embed_dim,
        extra_params=extra,
        expert_bits=expert_bits,
    )


def _required_shape(cfg: Mapping[str, Any], name: str) -> tuple[str, int, int, int, int]:
    """(model type, hidden size, layers, attention heads, vocabulary): the fields every config needs."""
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if cfg.get(k) is None
    ]
    if missing:
        raise AnalyticError(f"model config {name} lacks {', '.join(missing)}")
    mtype = str(cfg.get("model_type") or "unknown")
    h = _int(cfg, "hidden_size")
    n_layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    vocab = _int(cfg, "vocab_size")
    if not (h and n_layers and heads and vocab):
        raise AnalyticError(
            f"model config {name}: hidden_size, num_hidden_layers, num_attention_heads and vocab_size must be > 0"
        )
    return mtype, h, n_layers, heads, vocab


class _Attention(NamedTuple):
    params: int  # matrix (and bias) parameters of one layer's attention
    kv_dim: int  # cached values per token per layer
    head_dim: int
    norms_per_layer: int


def _attention(
    cfg: Mapping[str, Any], mtype: str, h: int, heads: int, kv_heads: int, head_dim: int, attn_bias: bool
) -> _Attention:
    """One layer's attention: DeepSeek's multi-head latent attention or (grouped-query) multi-head."""
    kv_lora = _int(cfg, "kv_lora_rank")
    if kv_lora:  # DeepSeek multi-head latent attention
        q_lora = _int(cfg, "q_lora_rank")
        nope = _int(cfg, "qk_nope_head_dim", 128)
        rope = _int(cfg, "qk_rope_head_dim", 64)
        v_dim = _int(cfg, "v_head_dim", 128)
        qk = nope + rope
        q = (h * q_lora + q_lora * heads * qk) if q_lora else h * heads * qk
        attn = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        return _Attention(attn, kv_lora + rope, qk, 2 * h + kv_lora + (q_lora or 0))
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    # Qwen3-Next / Qwen3.5's full attention gates its output: q_proj is twice as wide
    gate = q_out if cfg.get("attn_output_gate", mtype.startswith(("qwen3_next", "qwen3_5"))) else 0
    attn = h * (q_out + gate) + 2 * h * kv_out + q_out * h
    if attn_bias:  # (GPT-OSS and OPT: o_proj's too)
        attn += q_out + gate + 2 * kv_out + (h if mtype in ("gpt_oss", "opt") else 0)
    norms_per_layer = 2 * h + (2 * head_dim if mtype.startswith("qwen3") else 0)
    if mtype == "opt" and cfg.get("layer_norm_elementwise_affine", True):
        norms_per_layer = 4 * h  # two LayerNorms, each a weight and a bias
    return _Attention(attn, 2 * kv_out, head_dim, norms_per_layer)


def _mlp_params(mtype: str, h: int, mlp_bias: bool) -> Callable[[int], int]:
    """Parameters of an MLP of a given width: gated (gate, up, down) everywhere but Phi's and
    OPT's plain fc1/fc2 MLP (with biases)."""
    if mtype == "phi":
        return lambda width: 2 * h * width + width + h
    if mtype == "opt":
        return lambda width: 2 * h * width + (width + h if mlp_bias else 0)
    return lambda width: 3 * h * width + (2 * width + h if mlp_bias else 0)


class _Experts(NamedTuple):
    expert_params: int  # one routed expert's MLP
    shared_params: int  # per MoE layer, whatever token: the router and any shared expert
    moe_layers: int


def _experts(
    cfg: Mapping[str, Any],
    name: str,
    n_layers: int,
    h: int,
    inter: int,
    n_exp: int,
    top_k: int,
    mlp: Callable[[int], int],
) -> _Experts:
    """The mixture of experts of a config with ``n_exp`` routed experts, ``top_k`` per token."""
    if not top_k or top_k > n_exp:
        raise AnalyticError(f"model config {name}: num_experts_per_tok must be 1..{n_exp}, got {top_k}")
    moe_width = _int(cfg, "moe_intermediate_size") or inter  # Mixtral: intermediate_size is per expert
    expert = mlp(moe_width)
    shared = h * n_exp  # router
    shared_width = _int(cfg, "shared_expert_intermediate_size")
    n_shared = _int(cfg, "n_shared_experts") or _int(cfg, "num_shared_experts") or 0
    if shared_width:
        shared += mlp(shared_width) + h  # Qwen2-MoE shared expert and its 1-wide gate
    elif n_shared:
        shared += n_shared * expert
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:  # DeepSeek layout
        first = _int(cfg, "first_k_dense_replace", 0)
        freq = _int(cfg, "moe_layer_freq", 1) or 1
        moe_layers = sum(1 for i in range(n_layers) if i >= first and i % freq == 0)
    else:  # Qwen-MoE / Mixtral layout
        step = _int(cfg, "decoder_sparse_step", 1) or 1
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(n_layers) if i not in only_mlp and (i + 1) % step == 0)
    return _Experts(expert, shared, moe_layers)


def _linear_attention(cfg: Mapping[str, Any], h: int, act_bits: int) -> tuple[int, float, float]:
    """(matrix parameters, recurrence FLOPs per token, state bytes per request) of one Gated
    DeltaNet layer (Qwen3-Next, Qwen3.5/3.6, as mlx-lm builds it): q, k, v and the output gate z
    projected from the hidden state (``in_proj_qkvz``), a beta and a decay per value head
    (``in_proj_ba``), a depthwise causal convolution over q, k, v (kernel ``linear_conv_kernel_dim``),
    the output projection; its state per request is the convolution's last kernel - 1 inputs (at
    the activations' precision) and, per value head, a key x value matrix in float32. The
    recurrence costs about 6 x value heads x key dim x value dim FLOPs per token (decay, the delta
    update, the read-out). A config without those fields (another linear kind) counts such a
    layer as an attention layer with no state: (0, 0, 0)."""
    nk = _int(cfg, "linear_num_key_heads")
    nv = _int(cfg, "linear_num_value_heads")
    dk = _int(cfg, "linear_key_head_dim")
    dv = _int(cfg, "linear_value_head_dim")
    kernel = _int(cfg, "linear_conv_kernel_dim", 4)
    if not (nk and nv and dk and dv):
        return 0, 0.0, 0.0
    key, value = nk * dk, nv * dv
    conv = 2 * key + value
    params = h * (2 * key + 2 * value) + h * 2 * nv + conv * kernel + value * h
    state = (kernel - 1) * conv * act_bits / 8.0 + nv * dk * dv * 4.0
    return params, 6.0 * nv * dk * dv, state


def layer_kinds(cfg: Mapping[str, Any], n_layers: int) -> tuple[int | None, int, int | None]:
    """(full-attention layers or None when all are, sliding-window layers, window) from a config:
    ``layer_types`` ("full_attention", "sliding_attention"; any other kind, such as
    "linear_attention" or "conv", keeps a fixed-size state), else ``full_attention_interval``
    (Qwen3-Next, Qwen3.5: every n-th layer full, the rest Gated DeltaNet), else a
    ``sliding_window`` with ``sliding_window_pattern`` (Gemma 3: every n-th layer global)."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or not isinstance(window, int) or isinstance(window, bool) or window < 1:
        window = None
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        full = sum(1 for t in types if t == "full_attention")
        sliding = sum(1 for t in types if t == "sliding_attention")
        if window is None:  # sliding layers without a window attend to everything
            full, sliding = full + sliding, 0
        return (None if full == n_layers else full), sliding, (window if sliding else None)
    interval = _int(cfg, "full_attention_interval")
    if interval:
        return n_layers // interval, 0, None
    pattern = _int(cfg, "sliding_window_pattern")
    if window is not None and pattern:
        full = n_layers // pattern
        return full, n_layers - full, window
    return None, 0, None


# ---------------------------------------------------------------------- bundled configs

CONFIG_DIR = Path(__file__).resolve().parent.parent / "model_configs"


def bundled_model_configs() -> list[str]:
    if not CONFIG_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in CONFIG_DIR.glob("*/config.json"))


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise AnalyticError(f"model config not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AnalyticError(f"model config {path} is not valid JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise AnalyticError(f"model config {path} is not a JSON object")
    return data


def load_model_config(spec: str | Path) -> tuple[str, dict[str, Any]]:
    """A bundled name (``qwen3-30b-a3b``) or a path to a config.json (or its directory)."""
    text = str(spec)
    bundled = bundled_model_configs()
    if text.lower() in bundled:
        return text.lower(), read_config_file(CONFIG_DIR / text.lower() / "config.json")
    p = Path(text)
    if p.exists():
        name = p.parent.name if p.is_file() else p.name
        return name or text, read_config_file(p)
    raise AnalyticError(
        f"unknown model config '{text}' (bundled: {', '.join(bundled)}; or give a path to a config.json)"
    )


def check_quant(bits: int | float | None, name: str = "--quant") -> None:
    if bits is None:
        return
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits not in QUANT_BITS + FLOAT_BITS:
        allowed = ", ".join(str(b) for b in QUANT_BITS + FLOAT_BITS)
        raise AnalyticError(f"{name} must be one of {allowed} bits, got {bits!r}")
