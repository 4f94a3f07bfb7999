"""A GPU serving engine's passes (vLLM-class: FlashAttention, paged KV, cuBLAS GEMMs), kernel by kernel.

Engines differ in how far from the chip's peaks they run, so efficiencies belong to an
engine, not to a chip. Three engines are known (:data:`analysis.analytic.efficiency.ENGINES`):

- ``vllm``: a GPU serving engine (vLLM, Sarathi-Serve, SGLang): one forward per pass over all
  its tokens (decode rows and prefill chunks together, no padding), FlashAttention for prefill
  chunks, paged decode attention. Its factors are fitted to serving kernels' measured times
  (Vidur's public profiling medians, not shipped: ``analysis/hardware/kernels/README.md``;
  the fit and its errors: ``analysis/hardware/SERVING.md``); this model, its factors a
  :class:`~analysis.analytic.efficiency.ServingEfficiency`.
- ``mlx-lm`` and ``llama.cpp``: the plain roofline of :mod:`analysis.analytic.roofline` with
  factors fitted to those engines' published single-request figures (``EFFICIENCY.md``).

A pass of the ``vllm`` engine runs, per layer, GEMMs (the projections and the MLP) over all
T tokens of the pass, then the attention kernels, one after the other. So its seconds are a
sum of per-layer parts, each a roofline of its own (L layers, P peak FLOP/s, W bandwidth)::

    seconds = L x [ o + max(2 N Tq / (P e_c(Tq)), weight bytes / (W e_b))          GEMMs + element-wise ops
                  + (decode rows > 0)   (o_d + r_d x rows + KV bytes / (W e_d(rows)))   decode attention
                  + sum over chunks     (o_p + 4 h d (n b / (P e_x(n)) + n(n+1)/2 / (P e_y(n)))) ]   prefill attention
              + max(2 V H rows_out / (P e_c), head bytes / (W e_b))                      the LM head

- N: matrix parameters per layer a token uses; Tq: the pass's tokens rounded up to the GEMM
  tile (``gemm_tile_tokens``: cuBLAS runs a 129-token GEMM as a 256-token one on an A100 —
  the measured times step every 128 tokens); e_c(Tq) by token count (a few knots,
  interpolated in log2 T, flat outside). Norms, rope, activation and residual adds are folded
  into e_c and o (they scale with T like the GEMMs).
- Decode attention reads every row's own context (paged: no padding), memory-bound at e_d,
  which grows with the number of rows (more rows fill more of the GPU), plus a fixed and a
  per-row cost.
- Prefill attention of a chunk of n tokens after b cached: FLOPs of its n x b keys at e_x(n)
  and of its causal n x n triangle at e_y(n) (FlashAttention's efficiency grows with the
  chunk), plus a fixed cost.

Where the plain roofline takes one max per forward, this takes it per kernel group: a
Sarathi pass of 448 prefill tokens and 64 decode rows at 1.5k context runs its GEMMs
compute-bound (~34 ms on an A100 for Llama-2-7B) and then its decode attention
memory-bound (~29 ms); one max over the forward would hide the second under the first
(the kernel data show the sum). Not modelled: CPU-side scheduling and sampling (0 by
default, ``step_overhead_s``), quantised kernels (weights' bytes follow the bits, their FLOPs
run at the fp16 rate).

Tensor parallelism (a hardware spec ``PRESET:tp=N``, :mod:`analysis.analytic.roofline` has the
rule): each GPU runs every kernel above on its 1/N share (1/N of the attention heads, 1/N of
every GEMM's output or input width), so the GEMMs' FLOPs and weight bytes, the head, the decode
attention's KV bytes and the prefill attention's FLOPs are charged against N x the peak and
bandwidth; the fixed costs (per-layer overheads, the per-row decode cost) stay one GPU's. The
efficiencies stay those fitted to Vidur's TP-1 tables, interpolated at the pass's token count:
a GPU's narrower GEMMs (1/N the width) are assumed to run as efficiently as the whole ones,
which flatters tp > 1 where the GEMMs are small. The two all-reduces per layer are added to the
GEMMs' part (``linear_seconds``), after its max.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

from schedlab.policies.base import PassShape

from .efficiency import ServingEfficiency
from .hardware import Hardware
from .modelspec import DEFAULT_GROUP_SIZE, ModelSpec
from .roofline import AnalyticCostModel, Forward


def log_weights(x: float, knots: Sequence[float]) -> list[tuple[int, float]]:
    """(knot index, weight) pairs of piecewise-linear interpolation in log2 x, clamped."""
    if x <= knots[0]:
        return [(0, 1.0)]
    if x >= knots[-1]:
        return [(len(knots) - 1, 1.0)]
    lx = math.log2(x)
    for j in range(len(knots) - 1):
        if x <= knots[j + 1]:
            a = (lx - math.log2(knots[j])) / (math.log2(knots[j + 1]) - math.log2(knots[j]))
            return [(j, 1.0 - a), (j + 1, a)]
    return [(len(knots) - 1, 1.0)]  # pragma: no cover


def inv_interp(x: float, knots: Sequence[float], effs: Sequence[float]) -> float:
    """1 / efficiency at x (inverse efficiencies interpolated in log2 x)."""
    return sum(w / effs[j] for j, w in log_weights(x, knots))


class ServingCostModel(AnalyticCostModel):
    """A ``policies.base.CostModel`` for the ``vllm`` engine (see the module docstring)."""

    engine = "vllm"

    def __init__(
        self,
        hardware: Hardware,
        model: ModelSpec,
        bits: float | None = None,
        *,
        serving: ServingEfficiency,
        kv_bits: int = 16,
        compute_dtype: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> None:
        super().__init__(
            hardware,
            model,
            bits,
            kv_bits=kv_bits,
            style="fused",
            compute_dtype=compute_dtype,
            efficiency=serving.plain(),
            group_size=group_size,
            lazy_prefill=False,
            causal_skip=True,
        )
        self.serving = serving
        s = serving
        L = model.layers
        self._L = L
        self._q = s.gemm_tile_tokens
        self._W = self.bandwidth  # (tp GPUs: tp x one GPU's, see roofline's tensor parallelism)
        self._inv_bw = 1.0 / (self.bandwidth * s.bandwidth)
        self._kv_per_layer = self.kv_bytes_per_token / L
        self._qk_layer = 4.0 * model.heads * model.head_dim  # attention FLOPs per query-key pair per layer
        self._o = s.overhead_per_layer_s * L
        self._head_inv_rate = 1.0 / (self.peak * s.compute[-1])
        self._head_mem = self._head_bytes * self._inv_bw
        self._lin_cache: dict[int, float] = {}
        self._dec_cache: dict[int, tuple[float, float]] = {}
        self._pre_cache: dict[int, tuple[float, float]] = {}
        if self._mixed:  # layer kinds (see ``_mixed_pass_seconds``): decode runs pass by pass
            self.has_run_formula = False

    # ------------------------------------------------------------------ parts
    def linear_seconds(self, tokens: int) -> float:
        """GEMMs and element-wise ops of all layers (no head) for a pass of ``tokens`` tokens."""
        v = self._lin_cache.get(tokens)
        if v is None:
            s = self.serving
            q = self._q
            tq = -(-tokens // q) * q
            c = tq * self._flops_per_token * inv_interp(tq, s.compute_tokens, s.compute) / self.peak
            b = self._dense_bytes
            if self._expert_bytes:
                b += self._moe_fixed_bytes + self.model.distinct_experts(tokens) * self._expert_bytes
            m = b * self._inv_bw
            v = self._o + (c if c > m else m)
            if self.tp > 1:  # the all-reduces after attention and the MLP of every layer
                v += self.allreduce_seconds(tokens)
            if len(self._lin_cache) < 65536:
                self._lin_cache[tokens] = v
        return v

    def head_seconds(self, rows: float) -> float:
        c = rows * self._flops_per_head_row * self._head_inv_rate
        return c if c > self._head_mem else self._head_mem

    def _decode_coef(self, rows: int) -> tuple[float, float]:
        v = self._dec_cache.get(rows)
        if v is None:
            s = self.serving
            fixed = self._L * (s.decode_overhead_per_layer_s + s.decode_per_row_s * rows)
            per_token = self._L * self._kv_per_layer * inv_interp(rows, s.decode_rows, s.decode_attention) / self._W
            v = (fixed, per_token)
            if len(self._dec_cache) < 65536:
                self._dec_cache[rows] = v
        return v

    def decode_attention_seconds(self, rows: int, context_total: float) -> float:
        """Decode attention of ``rows`` rows reading ``context_total`` KV tokens in all (all layers)."""
        if not rows:
            return 0.0
        fixed, per_token = self._decode_coef(rows)
        return fixed + per_token * context_total

    def _prefill_coef(self, n: int) -> tuple[float, float]:
        v = self._pre_cache.get(n)
        if v is None:
            s = self.serving
            k = self._L * self._qk_layer / self.peak
            v = (
                k * inv_interp(n, s.prefill_chunks, s.prefill_context),
                k * inv_interp(n, s.prefill_chunks, s.prefill_causal),
            )
            if len(self._pre_cache) < 65536:
                self._pre_cache[n] = v
        return v

    def prefill_attention_seconds(self, n: int, b: int) -> float:
        """One chunk of n tokens after b cached (all layers)."""
        if n <= 0:
            return 0.0
        cx, cy = self._prefill_coef(n)
        return self._L * self.serving.prefill_overhead_per_layer_s + cx * n * b + cy * n * (n + 1) / 2.0

    # ------------------------------------------------------------------ CostModel
    def _chunks(self, s: PassShape) -> Sequence[tuple[int, int]]:
        chunks = s.prefill
        if chunks and s.padded:  # a padded pass computes rows x longest chunk at the longest context
            n = max(c for c, _ in chunks)
            b = max(x for _, x in chunks)
            return ((n, b),) * len(chunks)
        return chunks

    def _mixed_pass_seconds(self, shape: PassShape) -> float:
        """A model with sliding-window or linear-attention layers: the attention kernels' FLOPs and
        KV reads are those of its attention layers (a fraction ``_fw`` of the L layers over the
        whole context, ``_sw`` over at most the window); the windows' KV and the recurrent states
        are read and written at the decode-attention bandwidth; the GEMMs are all layers'."""
        ctx = shape.decode_contexts
        chunks = self._chunks(shape)
        rows = len(ctx)
        tokens = rows + sum(n for n, _ in chunks)
        if not tokens:
            return 0.0
        t = 0.0
        w, fw, sw = self._win, self._fw, self._sw
        for n, b in chunks:
            cx, cy = self._prefill_coef(n)
            tri_w = n * (n + 1) / 2.0 if n <= w else w * (w + 1) / 2.0 + (n - w) * w
            t += cx * (fw * n * b + sw * n * min(b, w)) + cy * (fw * n * (n + 1) / 2.0 + sw * tri_w)
            t += self._inv_bw * self._chunk_state_bytes(n, b)
        t += len(chunks) * self._L * self.serving.prefill_overhead_per_layer_s
        if rows:
            s = self.serving
            fixed, per_token = self._decode_coef(rows)
            t += fixed + per_token * sum(ctx)  # (the full-attention layers' KV)
            e = inv_interp(rows, s.decode_rows, s.decode_attention) / self._W
            t += e * sum(map(self._row_state_bytes, ctx))
        t += self.linear_seconds(tokens)
        return t + self.head_seconds(rows + len(chunks))

    def pass_seconds(self, shape: PassShape) -> float:
        if self._mixed:
            return self._mixed_pass_seconds(shape)
        ctx = shape.decode_contexts
        chunks = self._chunks(shape)
        rows = len(ctx)
        t = 0.0
        tokens = rows
        if chunks:
            for n, b in chunks:
                tokens += n
                cx, cy = self._pre_cache.get(n) or self._prefill_coef(n)
                t += cx * n * b + cy * n * (n + 1) / 2.0
            t += len(chunks) * self._L * self.serving.prefill_overhead_per_layer_s
        if not tokens:
            return 0.0
        if rows:
            fixed, per_token = self._dec_cache.get(rows) or self._decode_coef(rows)
            t += fixed + per_token * sum(ctx)
        lin = self._lin_cache.get(tokens)
        t += lin if lin is not None else self.linear_seconds(tokens)
        hr = rows + len(chunks)
        c = hr * self._flops_per_head_row * self._head_inv_rate
        return t + (c if c > self._head_mem else self._head_mem)

    has_run_formula = True

    def decode_run_seconds(self, shape: PassShape, k: int) -> Iterator[float]:
        """``pass_seconds`` of the ``k`` decode passes that follow ``shape`` over the same rows, each
        context one longer each time: only the KV read grows (by ``rows`` tokens a pass), the same
        terms added in the same order as ``pass_seconds`` adds them, so a run costs float for float
        what its passes one by one would. Lazy; a pure formula (``has_run_formula``)."""
        ctx = shape.decode_contexts
        rows = len(ctx)
        if not rows or shape.prefill or self._mixed:
            return super().decode_run_seconds(shape, k)
        fixed, per_token = self._decode_coef(rows)  # (once per run: the parts' own cached methods)
        lin, head = self.linear_seconds(rows), self.head_seconds(rows)
        total = sum(ctx)
        return ((fixed + per_token * (total + j * rows)) + lin + head for j in range(1, k + 1))

    def parts(self, shape: PassShape) -> dict[str, float]:
        """The pass's seconds by part: linear (GEMMs etc.), decode/prefill attention, head."""
        ctx = shape.decode_contexts
        chunks = self._chunks(shape)
        tokens = len(ctx) + sum(n for n, _ in chunks)
        if not tokens:
            return {"linear": 0.0, "decode_attention": 0.0, "prefill_attention": 0.0, "head": 0.0}
        return {
            "linear": self.linear_seconds(tokens),
            "decode_attention": self.decode_attention_seconds(len(ctx), float(sum(ctx))),
            "prefill_attention": sum(self.prefill_attention_seconds(n, b) for n, b in chunks),
            "head": self.head_seconds(len(ctx) + len(chunks)),
        }

    def forwards(self, s: PassShape) -> Iterator[Forward]:
        """One forward per pass (all its tokens), as the engine runs it."""
        ctx = s.decode_contexts
        chunks = self._chunks(s)
        rows = len(ctx)
        tokens = rows + sum(n for n, _ in chunks)
        if not tokens:
            return
        total = float(sum(ctx))
        qk = total + sum(n * b + n * (n + 1) / 2.0 for n, b in chunks)
        yield Forward(
            tokens,
            rows + len(chunks),
            qk,
            total - rows + sum(b for _, b in chunks),
            rows + sum(n for n, _ in chunks),
            decode=False,
            rows=rows,
            decode_kv=total,
            chunks=tuple(chunks),
        )

    def forward_seconds(self, f: Forward) -> float:
        """Seconds of a forward from :meth:`forwards` (equal to ``pass_seconds`` of its pass; a
        model with layer kinds: see ``_mixed_pass_seconds``)."""
        t = self.linear_seconds(int(f.tokens)) + self.head_seconds(f.head_rows)
        t += self.decode_attention_seconds(int(f.rows), f.decode_kv)
        return t + sum(self.prefill_attention_seconds(n, b) for n, b in f.chunks)

    def bound(self, f: Forward) -> str:
        """'compute' or 'memory': which side wins the GEMMs of this forward."""
        s = self.serving
        t = int(f.tokens)
        tq = -(-t // self._q) * self._q
        c = tq * self._flops_per_token * inv_interp(tq, s.compute_tokens, s.compute) / self.peak
        return "compute" if c >= self._dense_bytes * self._inv_bw else "memory"

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return self.serving.step_overhead_s

    def meta(self) -> dict[str, Any]:
        d = super().meta()
        d.update({"cost_model": "analytic-serving", "engine": "vllm", "serving_efficiency": self.serving.to_dict()})
        d.pop("efficiency_applied", None)
        return d
