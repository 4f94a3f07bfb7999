"""A roofline cost model: seconds of a pass from FLOPs and bytes, no measurement needed.

Per **forward** (one model call), with the hardware's peak rate P (FLOP/s, by dtype), peak
bandwidth W (bytes/s), and the efficiencies e_c, e_b and per-layer overhead o::

    seconds = o * layers + max(FLOPs / (P * e_c), bytes / (W * e_b))

The larger of the compute and the memory term wins **per forward**, not per pass and not per
phase: a forward is one pass over the weights, so its arithmetic and its traffic overlap;
two forwards run one after the other.

Which forwards a pass is made of follows the policy API (``policies.base.Pass``), in the
default ``style="mlx"``: the decode rows are one batched forward; each prefill chunk is its
own forward, unless the pass is ``padded``, when all chunks are one right-padded forward
computing rows x longest chunk tokens. A mixed pass is the sum of its forwards (it never
costs less than any of its parts). ``style="fused"`` models engines that run a whole pass
as one forward over a paged KV cache (vLLM/SGLang-style): weights are read once per pass,
tokens are summed, attention reads each row's own context (no padding).

FLOPs of a forward over T tokens::

    2 x active matrix parameters x T            (for MoE: attention, router, shared experts
                                                 and the k experts each token picks)
  + 2 x vocab x hidden x rows needing logits     (the head; decode rows, 1 per prefill chunk)
  + 4 x layers x heads x head_dim x sum over queries of the keys each attends to
      (decode row: its context; prefill chunk of n after b cached: n*b + n(n+1)/2)

Bytes of a forward::

    weights it reads once: every dense layer, the head, and for MoE layers attention,
      router, shared experts and the distinct experts its T tokens touch,
      E x (1 - (1 - k/E)^T) per layer (uniform routing)
  + KV read: each decode row's context (``mlx``: rows x longest, the left-padded batch cache
      mlx-lm keeps), each chunk's cached context
  + KV written: one token per decode row, n per chunk
  + (``mlx``) rows joining or leaving the batch cache copy it: 2 x rows x longest x KV bytes

Efficiencies are the preset's fitted factors (``hardware.Efficiency``, see
``sim/hardware/EFFICIENCY.md``); a mixture-of-experts model uses the preset's ``moe`` factors.

Weight bytes follow the quantisation (``bits``): mlx affine quantisation stores a 16-bit scale
and bias per group of 64 weights, so 4 bits -> 4.5 bits/weight, 8 -> 8.5; 16 is plain
fp16/bf16. Compute runs at the preset's default dtype (fp16 tensor rate on GPUs: quantised
weights are dequantised, W4A16/W8A16). KV cache: fp16 unless ``kv_bits`` says otherwise.
Not modelled: activations' memory traffic, the embedding lookup (a few rows), norms,
softmax/rope element-wise work, the scheduler's own time (``step_overhead_seconds`` is the
efficiency block's ``step_overhead_s``, 0 by default).
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

from policies.base import PassShape

from .errors import AnalyticError
from .hardware import Efficiency, Hardware
from .modelspec import DEFAULT_GROUP_SIZE, ModelSpec, bits_per_weight, check_quant

STYLES = ("mlx", "fused")


class Forward(NamedTuple):
    """One model call: what its cost depends on."""

    tokens: float  # tokens computed (rows x longest when padded)
    head_rows: float  # rows whose logits are computed
    attn_qk: float  # sum over query tokens of the keys each attends to
    kv_read: float  # KV tokens read
    kv_write: float  # KV tokens written
    extra_bytes: float = 0.0  # other traffic (batch-cache copies)


class AnalyticCostModel:
    """Implements ``policies.base.CostModel`` from hardware peaks and a model's shape."""

    def __init__(
        self,
        hardware: Hardware,
        model: ModelSpec,
        bits: float | None = None,
        *,
        kv_bits: int = 16,
        style: str = "mlx",
        compute_dtype: str | None = None,
        efficiency: Efficiency | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        peak_scale: float = 1.0,
        bpw: float | None = None,
    ) -> None:
        if style not in STYLES:
            raise AnalyticError(f"unknown roofline style '{style}' (choose: {', '.join(STYLES)})")
        if kv_bits not in (8, 16, 32):
            raise AnalyticError(f"kv_bits must be 8, 16 or 32, got {kv_bits}")
        self.hardware = hardware
        self.model = model
        self.bits = bits
        self.kv_bits = kv_bits
        self.style = style
        self.compute_dtype = compute_dtype or hardware.default_compute
        self.efficiency = efficiency or hardware.efficiency
        self.group_size = group_size
        m = model
        if bits is not None:
            check_quant(bits)
        # bpw: bits per weight as stored (e.g. a GGUF file's size / parameters); overrides bits
        self.bytes_per_weight = (bpw if bpw is not None else
                                 bits_per_weight(m.native_bits if bits is None else bits, group_size)) / 8.0
        self.peak = hardware.peak(self.compute_dtype) * peak_scale
        self.kv_bytes_per_token = m.kv_bytes_per_token(kv_bits)
        # FLOPs and bytes per unit of work (divided by the effective rates at use)
        self._flops_per_token = 2.0 * m.active_matmul_params()
        self._flops_per_head_row = 2.0 * m.vocab * m.hidden
        self._flops_per_qk = 4.0 * m.layers * m.heads * m.head_dim
        self._head_bytes = m.head_params * self.bytes_per_weight
        self._dense_bytes = m.dense_layers * (m.attn_params + m.dense_mlp_params) * self.bytes_per_weight
        self._moe_fixed_bytes = m.moe_layers * (m.attn_params + m.shared_params) * self.bytes_per_weight
        self._expert_bytes = m.moe_layers * m.expert_params * self.bytes_per_weight
        self._set_efficiency(self.efficiency)

    def _set_efficiency(self, eff: Efficiency) -> None:
        self.efficiency = eff
        self.applied = applied = eff.for_model(self.model.is_moe)  # MoE models: the moe block
        self._rate = self.peak * applied.compute
        self._bw = self.hardware.bandwidth * applied.bandwidth
        self._ovh = applied.overhead_per_layer_s * self.model.layers

    def with_efficiency(self, eff: Efficiency) -> "AnalyticCostModel":
        clone = object.__new__(AnalyticCostModel)
        clone.__dict__.update(self.__dict__)
        clone._set_efficiency(eff)
        return clone

    # ------------------------------------------------------------------ forwards
    def weight_bytes_read(self, tokens: float) -> float:
        b = self._dense_bytes + self._head_bytes
        if self._expert_bytes:
            b += self._moe_fixed_bytes + self.model.distinct_experts(tokens) * self._expert_bytes
        return b

    def flops(self, f: Forward) -> float:
        return f.tokens * self._flops_per_token + f.head_rows * self._flops_per_head_row + f.attn_qk * self._flops_per_qk

    def bytes(self, f: Forward) -> float:
        return (self.weight_bytes_read(f.tokens) + (f.kv_read + f.kv_write) * self.kv_bytes_per_token
                + f.extra_bytes)

    def forward_terms(self, f: Forward) -> tuple[float, float, int]:
        """(seconds at peak compute, seconds at peak bandwidth, layers) at unit efficiency."""
        return self.flops(f) / self.peak, self.bytes(f) / self.hardware.bandwidth, self.model.layers

    def forward_seconds(self, f: Forward) -> float:
        return self._ovh + max(self.flops(f) / self._rate, self.bytes(f) / self._bw)

    def forwards(self, s: PassShape) -> Iterator[Forward]:
        """The forwards a pass runs (see the module docstring)."""
        ctx = s.decode_contexts
        chunks = s.prefill
        if self.style == "fused":
            tokens = head = qk = rd = wr = 0.0
            if ctx:
                rows = len(ctx)
                total = float(sum(ctx))
                tokens += rows
                head += rows
                qk += total
                rd += total - rows
                wr += rows
            if chunks:
                if s.padded:
                    n = max(c for c, _ in chunks)
                    b = max(x for _, x in chunks)
                    r = len(chunks)
                    tokens += r * n
                    qk += r * (n * b + n * (n + 1) / 2.0)
                    rd += r * b
                    wr += r * n
                else:
                    for n, b in chunks:
                        tokens += n
                        qk += n * b + n * (n + 1) / 2.0
                        rd += b
                        wr += n
                head += len(chunks)
            if tokens:
                yield Forward(tokens, head, qk, rd, wr)
            return
        if ctx:
            rows = len(ctx)
            longest = max(ctx)
            extra = 0.0
            if s.joins:  # extend: the batch cache is rebuilt with the new rows
                extra += 2.0 * rows * longest * self.kv_bytes_per_token
            if s.leaves:  # filter: the kept rows are copied
                kept = max(s.batch_rows_before + s.joins - s.leaves, 0)
                extra += 2.0 * kept * longest * self.kv_bytes_per_token
            yield Forward(rows, rows, rows * longest, rows * (longest - 1), rows, extra)
        if chunks:
            if s.padded:
                n = max(c for c, _ in chunks)
                b = max(x for _, x in chunks)
                r = len(chunks)
                yield Forward(r * n, r, r * (n * b + n * (n + 1) / 2.0), r * b, r * n)
            else:
                for n, b in chunks:
                    yield Forward(n, 1, n * b + n * (n + 1) / 2.0, b, n)

    # ------------------------------------------------------------------ CostModel protocol
    def _seconds(self, tokens: float, head: float, qk: float, kv: float, extra: float = 0.0) -> float:
        """One forward's seconds (kv: KV tokens read + written). The hot path of pass_seconds."""
        flops = tokens * self._flops_per_token + head * self._flops_per_head_row + qk * self._flops_per_qk
        b = self._dense_bytes + self._head_bytes + kv * self.kv_bytes_per_token + extra
        if self._expert_bytes:
            b += self._moe_fixed_bytes + self.model.distinct_experts(tokens) * self._expert_bytes
        c = flops / self._rate
        m = b / self._bw
        return self._ovh + (c if c > m else m)

    def pass_seconds(self, shape: PassShape) -> float:
        """Seconds of one pass: the sum of its forwards (same as summing ``forwards()``)."""
        if self.style != "mlx":
            return sum(self.forward_seconds(f) for f in self.forwards(shape))
        t = 0.0
        ctx = shape.decode_contexts
        if ctx:
            rows = len(ctx)
            longest = max(ctx)
            extra = 0.0
            if shape.joins:
                extra += 2.0 * rows * longest * self.kv_bytes_per_token
            if shape.leaves:
                kept = shape.batch_rows_before + shape.joins - shape.leaves
                if kept > 0:
                    extra += 2.0 * kept * longest * self.kv_bytes_per_token
            t += self._seconds(rows, rows, rows * longest, rows * longest, extra)
        chunks = shape.prefill
        if chunks:
            if shape.padded:
                n = max(c for c, _ in chunks)
                b = max(x for _, x in chunks)
                r = len(chunks)
                t += self._seconds(r * n, r, r * (n * b + n * (n + 1) / 2.0), r * (b + n))
            else:
                for n, b in chunks:
                    t += self._seconds(n, 1, n * b + n * (n + 1) / 2.0, b + n)
        return t

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return self.efficiency.step_overhead_s

    # ------------------------------------------------------------------ introspection
    def bound(self, f: Forward) -> str:
        """'compute' or 'memory': which term wins this forward."""
        return "compute" if self.flops(f) / self._rate >= self.bytes(f) / self._bw else "memory"

    def meta(self) -> dict[str, Any]:
        m = self.model
        return {
            "cost_model": "analytic-roofline",
            "style": self.style,
            **self.hardware.summary(),
            "efficiency": self.efficiency.to_dict(),
            "efficiency_applied": {k: v for k, v in self.applied.to_dict().items()
                                   if k in ("compute", "bandwidth", "overhead_per_layer_s", "basis", "source")},
            "compute_dtype": self.compute_dtype,
            "model": m.summary(),
            "quant_bits": self.bits if self.bits is not None else m.native_bits,
            "bits_per_weight": self.bytes_per_weight * 8,
            "weight_gb": (m.layer_matrix_params + (1 if m.tied else 2) * m.embed_params) * self.bytes_per_weight / 1e9,
            "kv_bits": self.kv_bits,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def kv_capacity_tokens(hw: Hardware, model: ModelSpec, quant: float | None = None, mem_fraction: float = 0.9,
                       *, kv_bits: int = 16, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """KV tokens that fit in ``mem_fraction`` of the memory once the weights are loaded.

    Raises ``AnalyticError`` (one line) when the weights alone do not fit.
    """
    check_quant(quant)
    if not 0 < mem_fraction <= 1:
        raise AnalyticError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    weights = model.weight_bytes(quant, group_size)
    budget = hw.memory_bytes * mem_fraction
    bits = model.native_bits if quant is None else quant
    if weights >= budget:
        raise AnalyticError(
            f"{model.name} at {bits:g} bits needs {weights / 1e9:.0f} GB of weights; {hw.name} has "
            f"{hw.memory_bytes / 1e9:.0f} GB ({mem_fraction:.0%} usable: {budget / 1e9:.0f} GB)")
    tokens = int((budget - weights) // model.kv_bytes_per_token(kv_bits))
    if tokens < 1:
        raise AnalyticError(f"{model.name} at {bits:g} bits leaves no room for a KV cache on {hw.name}")
    return tokens
