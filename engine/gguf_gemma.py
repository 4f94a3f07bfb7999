"""Gemma 3 GGUF files (llama.cpp's ``gemma3`` architecture) loaded into mlx-lm's ``gemma3_text``.

``engine.gguf`` dispatches here for ``general.architecture == "gemma3"``. The header (metadata,
tensor table, data offsets) comes from ``engine.gguf.read_header`` (pure Python: llama.cpp's
own reader, ``gguf.GGUFReader``, takes ~15 s over Gemma's 262144-token vocabulary, ours
0.3 s); the tensor data is memory-mapped and dequantized with llama.cpp's numpy dequantizer
(``gguf.quants.dequantize``: every type its converter writes, Q5_0 and the K-quants included,
which MLX's own GGUF reader cannot read).

What llama.cpp's converter did to the Hugging Face weights, undone here:

- **Norms +1.** Gemma's RMSNorm multiplies by ``1 + weight``; the converter stores
  ``weight + 1`` (every ``*norm.weight``: the four per-layer norms, the q/k norms, the output
  norm), and mlx-lm's ``gemma3_text.RMSNorm`` adds the 1 itself, so 1 is subtracted at load.
- **No Q/K permutation.** Unlike llama, gemma's Q/K rows are stored as Hugging Face has them
  (NEOX-style RoPE, mlx-lm's ``traditional=False``).
- **Embedding.** ``token_embd`` is the tied output head (``output.weight`` only when untied);
  the sqrt(hidden) input scale is the model's own (mlx-lm, like Hugging Face, rounds it to
  bfloat16 first: 25.25 for 640, where llama.cpp multiplies by 25.298).
- **What the file does not say.** llama.cpp hard-codes, and so does this: a global
  (full-attention) layer every 6th (``sliding_window_pattern`` 6), local RoPE base 10000 for the
  sliding layers, query scale 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B).

``dtype``: ``float32`` (default on CPU), ``float16``, ``bfloat16`` dequantize every tensor
once; ``quantized`` re-quantizes each quantized matrix with ``mx.quantize`` (affine, groups of
32) at the bits nearest its GGUF type (Q8_0 -> 8, Q6_K -> 6, Q5_* -> 5, Q4_* -> 4, Q3_K -> 3,
Q2_K -> 2), norms stay float32. That is not bit-exact to the file (llama.cpp's blocks are
symmetric or 256-wide super-blocks) but within a fraction of the file's own quantization error.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from .errors import EngineError

# ``header`` arguments are ``engine.gguf.GGUFHeader``s (not imported: engine.gguf imports this module)
GGUFHeader = Any

ARCH = "gemma3"
# types llama.cpp's numpy dequantizer (gguf >= 0.10) reads, and the bits they re-quantize to
GGUF_PY_BITS: dict[str, int | None] = {
    "F32": None,
    "F16": None,
    "BF16": None,
    "Q8_0": 8,
    "Q6_K": 6,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q5_K": 5,
    "Q4_0": 4,
    "Q4_1": 4,
    "Q4_K": 4,
    "Q3_K": 3,
    "Q2_K": 2,
}
GROUP = 32
SLIDING_WINDOW_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
ROPE_LOCAL_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
_TOP_RE = re.compile(r"^([a-z_]+)\.weight$")


def mlx_name(name: str) -> str | None:
    """mlx-lm's gemma3_text parameter name for a GGUF tensor name (None when there is none)."""
    m = _LAYER_RE.match(name)
    if m:
        part = _LAYER_PARTS.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.weight"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.weight"
    return None


def is_norm(name: str) -> bool:
    """A GGUF tensor the converter stored as ``weight + 1`` (Gemma's RMSNorm scale)."""
    return name.endswith("norm.weight")


def check_header(header: GGUFHeader) -> None:
    """One-line EngineError unless the file is a gemma3 GGUF this loader maps completely."""
    what = f"model {header.path}"
    bad = [(n, t) for n, (_, t) in header.tensors.items() if t not in GGUF_PY_BITS]
    if bad:
        n, t = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise EngineError(
            f"{what}: tensor {n} has type {t}{more}, which the gemma3 loader cannot dequantize "
            f"(supported: {', '.join(GGUF_PY_BITS)})"
        )
    unknown = [n for n in header.tensors if mlx_name(n) is None]
    if unknown:
        raise EngineError(
            f"{what}: tensor {unknown[0]} has no counterpart in mlx-lm's gemma3_text model "
            f"({len(unknown)} unmapped tensor{'s' if len(unknown) > 1 else ''}; vision towers and "
            "other gemma3 variants are not supported)"
        )
    meta = header.metadata
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if not isinstance(meta.get(f"{ARCH}.{key}"), int):
            raise EngineError(f"{what}: GGUF metadata lacks {ARCH}.{key}")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        v = meta.get(f"{ARCH}.{key}")
        if isinstance(v, (int, float)) and v > 0:
            raise EngineError(f"{what}: {ARCH}.{key} ({v}) is not supported by mlx-lm's gemma3_text")
    missing = [
        f"blk.{i}.{p}.weight"
        for i in range(meta[f"{ARCH}.block_count"])
        for p in _LAYER_PARTS
        if f"blk.{i}.{p}.weight" not in header.tensors
    ]
    missing += [t for t in ("token_embd.weight", "output_norm.weight") if t not in header.tensors]
    if missing:
        raise EngineError(
            f"{what}: GGUF file lacks tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


def config(header: GGUFHeader) -> dict[str, Any]:
    """An mlx-lm ``gemma3_text`` config.json from the GGUF metadata (after check_header)."""
    meta = header.metadata
    what = f"model {header.path}"

    def get(key, default=None):
        return meta.get(f"{ARCH}.{key}", default)

    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    kv_heads = get("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise EngineError(f"{what}: per-layer KV head counts are not supported")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise EngineError(f"{what}: different key and value head sizes are not supported")
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise EngineError(f"{what}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    emb_shape = header.tensors["token_embd.weight"][0]
    vocab = get("vocab_size")
    if not isinstance(vocab, int):
        vocab = emb_shape[0]
    if emb_shape != (vocab, hidden):
        raise EngineError(f"{what}: token_embd is {emb_shape}, not ({vocab}, {hidden}) as the metadata says")
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise EngineError(f"{what}: the tokenizer has {len(tokens)} tokens, more than the model's {vocab}")
    window = get("attention.sliding_window")
    pattern = SLIDING_WINDOW_PATTERN
    flags = get("attention.sliding_window_pattern")  # newer files: one bool per layer (True: sliding)
    if isinstance(flags, list) and flags:
        pattern = _period(flags)
        if pattern is None:
            raise EngineError(
                f"{what}: sliding-window layers {flags} are not every-Nth-global, which mlx-lm's gemma3_text needs"
            )
    if not isinstance(window, int) or window <= 0:  # no sliding window: every layer global (llama.cpp's SWA none)
        window, pattern = int(get("context_length", 32768)), 1
    # llama.cpp: attention scale 1/sqrt(head_dim), except 1/sqrt(hidden/heads) for the 27B (62 layers)
    scalar = hidden // heads if layers == 62 else head_dim
    cfg: dict[str, Any] = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab,
        "rope_theta": float(get("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "query_pre_attn_scalar": scalar,
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "max_position_embeddings": int(get("context_length", 32768)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = get("rope.scaling.factor")
        if scaling != "linear" or not isinstance(factor, (int, float)):
            raise EngineError(f"{what}: RoPE scaling {scaling!r} is not supported (linear is)")
        if factor != 1.0:  # (global layers only, as in Hugging Face's and llama.cpp's gemma3)
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    for key, cfg_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if isinstance(meta.get(key), int):
            cfg[cfg_key] = meta[key]
    return cfg


def _period(flags: list) -> int | None:
    """N when every Nth layer is global (False) and the others sliding (True); else None."""
    n = len(flags)
    for p in range(1, n + 1):
        if all(bool(f) == ((i % p) != p - 1) for i, f in enumerate(flags)):
            return p
    if not any(flags):
        return 1
    return None


def iter_tensors(header: GGUFHeader, names=None):
    """(GGUF name, float32 numpy array, outermost dimension first) per tensor, as stored (norms
    still +1): the file memory-mapped, each tensor dequantized by ``gguf.quants.dequantize``."""
    import numpy as np

    try:
        import gguf  # llama.cpp's gguf-py
        from gguf.quants import dequantize
    except ImportError:
        raise EngineError(
            f"model {header.path}: gemma3 GGUF files need llama.cpp's gguf package: pip install 'gguf>=0.10'"
        ) from None
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    for name in names if names is not None else header.tensors:
        shape, tname = header.tensors[name]
        qtype = gguf.GGMLQuantizationType[tname]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        start = header.offsets[name]
        raw = data[start : start + math.prod(shape) // block * size]
        try:
            arr = dequantize(raw.reshape(*shape[:-1], shape[-1] // block * size), qtype)
        except (NotImplementedError, ValueError) as exc:
            raise EngineError(f"model {header.path}: tensor {name} ({tname}) could not be dequantized: {exc}") from None
        yield name, np.asarray(arr, dtype=np.float32).reshape(shape)


def read_tensors(header: GGUFHeader, names=None) -> dict[str, Any]:
    """{GGUF name: float32 numpy array} (``iter_tensors``)."""
    return dict(iter_tensors(header, names))


def load(path: str | Path, dtype: str, header: GGUFHeader):
    """(model, config) from a gemma3 GGUF file; ``dtype`` already resolved (no ``auto``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import gemma3_text

    path = Path(path)
    cfg = config(header)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    compute = mx.float32 if dtype == "quantized" else getattr(mx, dtype)
    weights: dict[str, Any] = {}
    bits: dict[str, int] = {}
    for name, arr in iter_tensors(header):  # one at a time: each float32 numpy copy is freed at once
        if is_norm(name):
            arr = arr - 1.0  # the converter's +1 (mlx-lm's RMSNorm adds it back)
        target = mlx_name(name)
        weights[target] = mx.array(arr).astype(compute)
        mx.eval(weights[target])
        b = GGUF_PY_BITS[header.tensors[name][1]]
        if b is not None and arr.ndim == 2:
            bits[target[: -len(".weight")]] = b
    weights = model.sanitize(weights)  # tied head: drops lm_head (as mlx-lm's loader does)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise EngineError(
            f"model {path}: the GGUF tensors do not fit a gemma3_text model of this config: "
            f"{' '.join(str(exc).split())[:300]}"
        ) from None
    if dtype == "quantized" and bits:
        nn.quantize(
            model,
            group_size=GROUP,
            bits=4,
            class_predicate=lambda p, m: (
                {"group_size": GROUP, "bits": bits[p]} if p in bits and hasattr(m, "to_quantized") else False
            ),
        )
    model.eval()
    mx.eval(model.parameters())
    return model, cfg
