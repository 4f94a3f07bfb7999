"""Efficiency factors: how far from a chip's peaks an engine runs.

:class:`Efficiency` holds the plain roofline's factors (``analysis.analytic.roofline``; a
hardware preset's ``efficiency`` block), :class:`ServingEfficiency` the ``vllm`` engine's
kernel-by-kernel ones (``analysis.analytic.serving``; a preset's ``engines`` blocks).
Efficiencies belong to an engine, not to a chip: :data:`ENGINES` are the kinds known.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .errors import AnalyticError

#: optional efficiency factors (fractions of a peak; None: fall back to a main factor)
OPTIONAL_FACTORS = ("attention", "decode_attention", "copy")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a real engine reaches, and its per-forward floor.

    compute: achieved / peak FLOP/s on compute-bound forwards (prefill).
    bandwidth: achieved / peak bytes/s on memory-bound forwards (decode).
    overhead_per_layer_s: fixed seconds per layer per forward (kernel launches, dispatch).
    step_overhead_s: seconds per scheduler step outside forwards (0: not modelled).

    Optional factors (None / 0: the plain roofline, as every published-figure fit uses):

    attention: achieved / peak FLOP/s on the attention scores of prefill chunks (None: the
      compute factor). Where attention is not a fused kernel running at the matmul rate
      (MLX on CPU: scores, mask, softmax and exp materialised), it is far slower.
    decode_attention: the same for decode rows' attention (one query per row; None: the
      attention factor).
    copy: achieved / peak bytes/s of the batch-cache copies (joins and leaves; None: the
      bandwidth factor).
    copy_overhead_per_layer_s: fixed seconds per layer per copy event (a join or a leave).
    """

    compute: float
    bandwidth: float
    overhead_per_layer_s: float = 0.0
    step_overhead_s: float = 0.0
    basis: str = "default"  # fitted | borrowed | default | user
    engine: str = ""
    source: str = ""
    #: factors for mixture-of-experts models (gathered expert matmuls run slower than dense
    #: ones): a mapping with compute, bandwidth, overhead_per_layer_s (+ basis, source)
    moe: Mapping[str, Any] | None = field(default=None, compare=False)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    attention: float | None = None
    decode_attention: float | None = None
    copy: float | None = None
    copy_overhead_per_layer_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("compute", "bandwidth") + OPTIONAL_FACTORS:
            v = getattr(self, key)
            if v is None and key in OPTIONAL_FACTORS:
                continue
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise AnalyticError(f"efficiency {key} must be in (0, 1], got {v!r}")
        for key in ("overhead_per_layer_s", "step_overhead_s", "copy_overhead_per_layer_s"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or v < 0 or v != v:
                raise AnalyticError(f"efficiency {key} must be >= 0, got {v!r}")

        if self.moe is not None:
            for key in ("compute", "bandwidth", "overhead_per_layer_s"):
                if not isinstance(self.moe.get(key), (int, float)):
                    raise AnalyticError(f"efficiency moe block lacks {key}")
            if not (
                0 < self.moe["compute"] <= 1
                and 0 < self.moe["bandwidth"] <= 1
                and self.moe["overhead_per_layer_s"] >= 0
            ):
                raise AnalyticError("efficiency moe block out of range")

    def for_model(self, is_moe: bool) -> "Efficiency":
        """The factors that apply to a model: the ``moe`` block for MoE models when present."""
        if not is_moe or not self.moe:
            return self
        m = self.moe
        return replace(
            self,
            compute=float(m["compute"]),
            bandwidth=float(m["bandwidth"]),
            overhead_per_layer_s=float(m["overhead_per_layer_s"]),
            basis=str(m.get("basis", self.basis)),
            source=str(m.get("source", self.source)),
            moe=None,
        )

    @property
    def attention_factor(self) -> float:
        """The factor applied to prefill attention FLOPs."""
        return self.compute if self.attention is None else self.attention

    @property
    def decode_attention_factor(self) -> float:
        """The factor applied to decode rows' attention FLOPs."""
        return self.attention_factor if self.decode_attention is None else self.decode_attention

    @property
    def copy_factor(self) -> float:
        """The factor applied to batch-cache copy bytes."""
        return self.bandwidth if self.copy is None else self.copy

    def to_dict(self) -> dict[str, Any]:
        d = {
            "compute": self.compute,
            "bandwidth": self.bandwidth,
            "overhead_per_layer_s": self.overhead_per_layer_s,
            "step_overhead_s": self.step_overhead_s,
            "basis": self.basis,
            "engine": self.engine,
            "source": self.source,
        }
        for key in OPTIONAL_FACTORS:  # only when set: the presets' blocks stay as they are
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.copy_overhead_per_layer_s:
            d["copy_overhead_per_layer_s"] = self.copy_overhead_per_layer_s
        if self.moe:
            d["moe"] = dict(self.moe)
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Efficiency":
        known = {
            "compute",
            "bandwidth",
            "overhead_per_layer_s",
            "step_overhead_s",
            "basis",
            "engine",
            "source",
            "moe",
            "copy_overhead_per_layer_s",
            *OPTIONAL_FACTORS,
        }
        try:
            opt = {k: (None if d.get(k) is None else float(d[k])) for k in OPTIONAL_FACTORS}
            return cls(
                compute=float(d["compute"]),
                bandwidth=float(d["bandwidth"]),
                overhead_per_layer_s=float(d.get("overhead_per_layer_s", 0.0)),
                step_overhead_s=float(d.get("step_overhead_s", 0.0)),
                basis=str(d.get("basis", "default")),
                engine=str(d.get("engine", "")),
                source=str(d.get("source", "")),
                moe=dict(d["moe"]) if d.get("moe") else None,
                extra={k: v for k, v in d.items() if k not in known},
                copy_overhead_per_layer_s=float(d.get("copy_overhead_per_layer_s", 0.0)),
                **opt,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise AnalyticError(f"bad efficiency block: {exc}") from None


#: engine kinds: a GPU serving engine, mlx-lm on Apple silicon, llama.cpp
ENGINES = ("vllm", "mlx-lm", "llama.cpp")


def engine_kind(engine: str | None) -> str:
    """The engine kind (one of :data:`ENGINES`) an efficiency block's ``engine`` text names."""
    e = (engine or "").strip().lower()
    if e.startswith(("vllm", "sarathi", "sglang", "serving")):
        return "vllm"
    if e.startswith("mlx"):
        return "mlx-lm"
    if e.startswith("llama.cpp") or e.startswith("llamacpp") or e.startswith("llama-cpp"):
        return "llama.cpp"
    raise AnalyticError(f"unknown engine '{engine}' (engines: {', '.join(ENGINES)})")


def _tuple(v: Any, key: str) -> tuple[float, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise AnalyticError(f"serving efficiency {key} must be a non-empty list")
    return tuple(float(x) for x in v)


@dataclass(frozen=True)
class ServingEfficiency:
    """The ``vllm`` engine's factors on one chip (see the module docstring for where each enters).

    Efficiencies are fractions of the chip's peak FLOP/s or bandwidth, in (0, 1]; a table is
    (knots, efficiencies), interpolated in log2 of the knot variable (inverse efficiencies
    linearly), flat beyond its ends.
    """

    gemm_tile_tokens: int
    compute_tokens: tuple[float, ...]
    compute: tuple[float, ...]
    bandwidth: float
    overhead_per_layer_s: float
    decode_rows: tuple[float, ...]
    decode_attention: tuple[float, ...]
    decode_overhead_per_layer_s: float
    decode_per_row_s: float
    prefill_chunks: tuple[float, ...]
    prefill_context: tuple[float, ...]
    prefill_causal: tuple[float, ...]
    prefill_overhead_per_layer_s: float
    step_overhead_s: float = 0.0
    basis: str = "fitted"
    engine: str = "vllm"
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    TABLES = (
        ("compute_tokens", "compute"),
        ("decode_rows", "decode_attention"),
        ("prefill_chunks", "prefill_context"),
        ("prefill_chunks", "prefill_causal"),
    )
    SCALARS = (
        "bandwidth",
        "overhead_per_layer_s",
        "decode_overhead_per_layer_s",
        "decode_per_row_s",
        "prefill_overhead_per_layer_s",
        "step_overhead_s",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.gemm_tile_tokens, int) or self.gemm_tile_tokens < 1:
            raise AnalyticError(f"gemm_tile_tokens must be a positive integer, got {self.gemm_tile_tokens!r}")
        for kx, ky in self.TABLES:
            xs, ys = getattr(self, kx), getattr(self, ky)
            if len(xs) != len(ys) or any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] <= 0:
                raise AnalyticError(f"serving efficiency {ky}: knots must be increasing, positive and one per value")
            if any(not 0 < y <= 1 for y in ys):
                raise AnalyticError(f"serving efficiency {ky} must be in (0, 1], got {ys}")
        if not 0 < self.bandwidth <= 1:
            raise AnalyticError(f"serving efficiency bandwidth must be in (0, 1], got {self.bandwidth}")
        for k in self.SCALARS[1:]:
            v = getattr(self, k)
            if not v >= 0:
                raise AnalyticError(f"serving efficiency {k} must be >= 0, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "engine": self.engine,
            "basis": self.basis,
            "source": self.source,
            "gemm_tile_tokens": self.gemm_tile_tokens,
        }
        for kx, ky in self.TABLES:
            d[kx] = [float(x) for x in getattr(self, kx)]
            d[ky] = [round(float(y), 4) for y in getattr(self, ky)]
        for k in self.SCALARS:
            d[k] = float(f"{getattr(self, k):.4g}") if k.endswith("_s") else round(float(getattr(self, k)), 4)
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ServingEfficiency":
        known = {"engine", "basis", "source", "gemm_tile_tokens", *cls.SCALARS}
        for kx, ky in cls.TABLES:
            known |= {kx, ky}
        try:
            return cls(
                gemm_tile_tokens=int(d["gemm_tile_tokens"]),
                compute_tokens=_tuple(d["compute_tokens"], "compute_tokens"),
                compute=_tuple(d["compute"], "compute"),
                bandwidth=float(d["bandwidth"]),
                overhead_per_layer_s=float(d["overhead_per_layer_s"]),
                decode_rows=_tuple(d["decode_rows"], "decode_rows"),
                decode_attention=_tuple(d["decode_attention"], "decode_attention"),
                decode_overhead_per_layer_s=float(d["decode_overhead_per_layer_s"]),
                decode_per_row_s=float(d["decode_per_row_s"]),
                prefill_chunks=_tuple(d["prefill_chunks"], "prefill_chunks"),
                prefill_context=_tuple(d["prefill_context"], "prefill_context"),
                prefill_causal=_tuple(d["prefill_causal"], "prefill_causal"),
                prefill_overhead_per_layer_s=float(d["prefill_overhead_per_layer_s"]),
                step_overhead_s=float(d.get("step_overhead_s", 0.0)),
                basis=str(d.get("basis", "fitted")),
                engine=str(d.get("engine", "vllm")),
                source=str(d.get("source", "")),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AnalyticError(f"bad serving efficiency block: {exc}") from None

    def plain(self) -> Efficiency:
        """The nearest plain-roofline factors (large-T GEMM efficiency, bandwidth, overhead)."""
        return Efficiency(
            compute=self.compute[-1],
            bandwidth=self.bandwidth,
            overhead_per_layer_s=self.overhead_per_layer_s,
            step_overhead_s=self.step_overhead_s,
            basis=self.basis,
            engine=self.engine,
            source=self.source,
        )
