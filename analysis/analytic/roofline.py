"""A roofline cost model: seconds of a pass from FLOPs and bytes, no measurement needed.

Per **forward** (one model call), with the hardware's peak rate P (FLOP/s, by dtype), peak
bandwidth W (bytes/s), and the efficiencies e_c, e_b and per-layer overhead o::

    seconds = o * layers + max(FLOPs / (P * e_c), bytes / (W * e_b))

The larger of the compute and the memory term wins **per forward**, not per pass and not per
phase: a forward is one pass over the weights, so its arithmetic and its traffic overlap;
two forwards run one after the other.

Optional factors (``efficiency.Efficiency``; unset in every published-figure fit, where the
line above is the whole model) split the compute term and add the batch-cache copies::

    seconds = o * layers + max(matmul FLOPs / (P e_c) + attention FLOPs / (P e_attn), bytes / (W e_b))
              + copy bytes / (W e_copy) + o_copy * layers * copy events

``e_attn`` is ``decode_attention`` for a decode forward, ``attention`` for a prefill chunk
(each defaults to the one before it, then to e_c). ``e_copy`` defaults to e_b and o_copy to
0. The copies sit outside the max in every case: the engine evaluates them on their own.

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
      (a leave that keeps no row copies nothing), charged outside the max (see above)

On hardware of kind ``cpu`` (``cpu-local``: MLX's CPU backend, measured) two defaults change,
both switchable (``lazy_prefill``, ``causal_skip``):

- attention scores are counted in full, n x (b + n) per chunk, not causally: MLX's CPU
  attention materialises every score and masks (mask="causal" costs what no mask costs);
- prefill is lazy in the ``mlx`` style: a chunk that does not complete its prompt computes
  no head row, and its last layer only its keys and values (no query, attention output or
  MLP); a padded forward is lazy when none of its rows completes. A PassShape without
  ``prefill_done`` counts as completing (the full cost).

Efficiencies are the preset's fitted factors (``efficiency.Efficiency``, see
``analysis/hardware/EFFICIENCY.md``); a mixture-of-experts model uses the preset's ``moe`` factors.

Tensor parallelism (``Hardware.tp`` > 1, a hardware spec ``PRESET:tp=N``): one replica spans N
GPUs, Megatron-style as vLLM runs it. Each GPU holds 1/N of every weight matrix (column- then
row-parallel projections and MLP, experts split by width, the head vocabulary-parallel) and 1/N
of the KV heads, so a forward's matmul and attention FLOPs and its weight and KV bytes per GPU are
1/N of the replica's: the model charges them against N x the peak and N x the bandwidth, with the
same efficiencies and the same per-layer overhead (each GPU launches every layer's kernels).
Added, outside the max: two all-reduces per layer (after attention's output projection and after
the MLP) of tokens x hidden x 2 bytes (4 at fp32), each a ring all-reduce over the preset's own
link: 2 (N - 1) / N x bytes / link bandwidth + link latency (the presets' latency is 0: no
published figure, so NCCL's per-call latency, which dominates a decode step's small all-reduces,
is missing). Not counted: the embedding's all-reduce and the logits' gather (one each per
forward), any overlap of communication with compute. N must divide the attention heads; with fewer KV heads than
N (GQA) each GPU keeps a whole KV head, replicated N / kv_heads times (DeepSeek's latent KV: on
every GPU), and the KV bytes per GPU follow. The KV capacity is N x the memory less the weights
(:func:`kv_capacity_tokens`). N = 1 is the single-GPU model, float for float.

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

from schedlab.policies.base import CostModel, PassShape

from .efficiency import Efficiency
from .errors import AnalyticError
from .hardware import Hardware
from .modelspec import DEFAULT_GROUP_SIZE, ModelSpec, bits_per_weight, check_quant

STYLES = ("mlx", "fused")


class Forward(NamedTuple):
    """One model call: what its cost depends on."""

    tokens: float  # tokens computed (rows x longest when padded)
    head_rows: float  # rows whose logits are computed
    attn_qk: float  # sum over query tokens of the keys each attends to (summed over layers / layers)
    kv_read: float  # KV tokens read
    kv_write: float  # KV tokens written
    extra_bytes: float = 0.0  # batch-cache copies (a separate evaluation: outside the roofline's max)
    copies: float = 0.0  # copy events (joins, leaves) that go with this forward
    decode: bool = False  # decode rows: their attention is decode attention
    partial_tokens: float = 0.0  # tokens whose last layer computes only its keys and values (lazy)
    # the vllm engine's one forward per pass (analysis.analytic.serving) keeps what its kernels need:
    rows: int = 0  # decode rows
    decode_kv: float = 0.0  # KV tokens the decode rows read, summed
    chunks: tuple = ()  # (tokens, cached) of each prefill chunk
    state_bytes: float = 0.0  # sliding windows' KV and recurrent states read and written (such models)


class AnalyticCostModel(CostModel):
    """A ``policies.base.CostModel`` from hardware peaks and a model's shape (pass and step
    seconds; no after-idle terms, its decode runs pass by pass: the base class's defaults)."""

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
        lazy_prefill: bool | None = None,
        causal_skip: bool | None = None,
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
        cpu = hardware.kind == "cpu"
        # MLX on CPU (the only CPU engine here) evaluates prefill lazily and computes every
        # query x key score of a chunk (mask="causal" costs what no mask costs: measured)
        self.lazy_prefill = bool(style == "mlx" and cpu) if lazy_prefill is None else bool(lazy_prefill)
        self.causal_skip = (not cpu) if causal_skip is None else bool(causal_skip)
        m = model
        if bits is not None:
            check_quant(bits)
        # bpw: bits per weight as stored (e.g. a GGUF file's size / parameters); overrides bits
        self.bytes_per_weight = (
            bpw if bpw is not None else bits_per_weight(m.native_bits if bits is None else bits, group_size)
        ) / 8.0
        # tensor parallelism: a replica of tp GPUs has tp x the peak and the bandwidth (module docstring)
        tp = self.tp = hardware.tp
        self._kv_rep = kv_replication(m, tp)
        self.peak = hardware.peak(self.compute_dtype) * peak_scale * tp
        self.bandwidth = hardware.bandwidth * tp
        self.kv_bytes_per_token = m.kv_bytes_per_token(kv_bits)
        if self._kv_rep != 1:
            self.kv_bytes_per_token *= self._kv_rep
        # two all-reduces per layer of tokens x hidden activations (0 seconds at tp = 1)
        act_bytes = 4.0 if self.compute_dtype in ("fp32", "float32") else 2.0
        self.allreduce_bytes_per_token = m.hidden * act_bytes if tp > 1 else 0.0
        if tp > 1:  # ring all-reduce: 2 (tp - 1) / tp x bytes over the link, plus its latency
            ring = 2.0 * (tp - 1) / tp / hardware.tp_link_bandwidth
            self._ar_per_token = 2 * m.layers * ring * self.allreduce_bytes_per_token
            self._ar_fixed = 2 * m.layers * hardware.tp_link_latency_s
        # layer kinds: attn_qk counts query x key pairs averaged over the layers, full-attention
        # layers (a fraction _fw of them) over the whole context, sliding ones (_sw) over at most
        # the window _win; linear-attention layers have none (their recurrence is per token)
        self._mixed = bool(m.sliding_layers or m.linear_layers)
        self._fw = m.attention_layers / m.layers
        self._sw = m.sliding_layers / m.layers
        self._win = m.sliding_window or 0
        self.sliding_bytes_per_token = m.sliding_bytes_per_token(kv_bits)
        if self._kv_rep != 1:
            self.sliding_bytes_per_token *= self._kv_rep
        self.state_bytes = m.state_bytes
        # what the simulator's memory accounting holds per request besides the KV (sim.layout)
        self.cache_layout = m.cache_layout(kv_bits)
        # FLOPs and bytes per unit of work (divided by the effective rates at use)
        self._flops_per_token = 2.0 * m.active_matmul_params() + m.linear_layers * m.linear_flops_per_token
        self._flops_per_head_row = 2.0 * m.head_params
        self._flops_per_qk = 4.0 * m.layers * m.heads * m.head_dim
        # a lazy chunk's last layer projects keys and values only
        self._partial_saving = max(0.0, 2.0 * (m.active_matmul_params() / m.layers - m.hidden * m.kv_dim))
        self._partial_qk = (m.layers - 1) / m.layers
        self._head_bytes = m.head_params * self.bytes_per_weight
        self._dense_bytes = (m.dense_layers * (m.attn_params + m.dense_mlp_params) + m.mixer_delta_params) * (
            self.bytes_per_weight
        )
        self._moe_fixed_bytes = m.moe_layers * (m.attn_params + m.shared_params) * self.bytes_per_weight
        # the routed experts' bytes per weight: the rest's, but where the config ships them quantised
        # and nothing else was asked for (gpt-oss: MXFP4)
        self._expert_bpw = self.bytes_per_weight
        if bits is None and bpw is None and m.expert_bits is not None:
            self._expert_bpw = m.expert_bits / 8.0
        self._expert_bytes = m.moe_layers * m.expert_params * self._expert_bpw
        self._set_efficiency(self.efficiency)

    def _set_efficiency(self, eff: Efficiency) -> None:
        self.efficiency = eff
        self.applied = applied = eff.for_model(self.model.is_moe)  # MoE models: the moe block
        self._rate = self.peak * applied.compute
        self._rate_attn = self.peak * applied.attention_factor
        self._rate_dattn = self.peak * applied.decode_attention_factor
        self._bw = self.bandwidth * applied.bandwidth
        self._bw_copy = self.bandwidth * applied.copy_factor
        self._ovh = applied.overhead_per_layer_s * self.model.layers
        self._copy_ovh = applied.copy_overhead_per_layer_s * self.model.layers

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

    def matmul_flops(self, f: Forward) -> float:
        """Weight matmuls and the head (no attention)."""
        return (
            f.tokens * self._flops_per_token
            - f.partial_tokens * self._partial_saving
            + f.head_rows * self._flops_per_head_row
        )

    def attention_flops(self, f: Forward) -> float:
        return f.attn_qk * self._flops_per_qk

    def flops(self, f: Forward) -> float:
        return self.matmul_flops(f) + self.attention_flops(f)

    def bytes(self, f: Forward) -> float:
        """The forward's own traffic: weights and KV (not the batch-cache copies)."""
        return self.weight_bytes_read(f.tokens) + (f.kv_read + f.kv_write) * self.kv_bytes_per_token + f.state_bytes

    def forward_parts(self, f: Forward) -> tuple[float, float, float, float, float, float, int]:
        """Seconds at unit efficiency: (matmul at peak, prefill attention at peak, decode
        attention at peak, own bytes at peak bandwidth, copy bytes at peak bandwidth,
        copy events x layers, layers). ``forward_seconds`` is, with the factors e and o::

            o L + max(mm / e_c + attn / e_attn + dattn / e_dattn, mem / e_b) + copy / e_copy + o_copy copies L
        """
        attn = self.attention_flops(f) / self.peak
        layers = self.model.layers
        return (
            self.matmul_flops(f) / self.peak,
            0.0 if f.decode else attn,
            attn if f.decode else 0.0,
            self.bytes(f) / self.bandwidth,
            f.extra_bytes / self.bandwidth,
            f.copies * layers,
            layers,
        )

    def forward_terms(self, f: Forward) -> tuple[float, float, int]:
        """(seconds at peak compute, seconds at peak bandwidth incl. copies, layers) at unit efficiency."""
        return (self.flops(f) / self.peak, (self.bytes(f) + f.extra_bytes) / self.bandwidth, self.model.layers)

    def forward_seconds(self, f: Forward) -> float:
        c = self.matmul_flops(f) / self._rate + self.attention_flops(f) / (
            self._rate_dattn if f.decode else self._rate_attn
        )
        m = self.bytes(f) / self._bw
        t = self._ovh + (c if c > m else m) + f.extra_bytes / self._bw_copy + f.copies * self._copy_ovh
        return t + self.allreduce_seconds(f.tokens) if self.tp > 1 else t

    def allreduce_seconds(self, tokens: float) -> float:
        """The tensor-parallel all-reduces of a forward over ``tokens`` tokens: 2 per layer (0 at tp = 1)."""
        if self.tp == 1 or not tokens:
            return 0.0
        return self._ar_fixed + self._ar_per_token * tokens

    def _qk(self, n: float, b: float) -> float:
        """Query x key pairs of a chunk of n after b cached (averaged over the layers)."""
        full = n * b + n * (n + 1) / 2.0 if self.causal_skip else n * (b + n)
        if not self._mixed:
            return full
        w = self._win
        if not self._sw:
            return self._fw * full
        if self.causal_skip:  # query i (1-based position b + i) sees min(b + i, w) keys
            lo, hi = b + 1, b + n
            if hi <= w:
                win = (lo + hi) * n / 2.0
            elif lo >= w:
                win = n * w
            else:
                win = (lo + w) * (w - lo + 1) / 2.0 + (hi - w) * w
        else:  # every query against what the window kept and the chunk
            win = n * (min(b, w) + n)
        return self._fw * full + self._sw * win

    def _row_qk(self, c: float) -> float:
        """Query x key pairs of a decode row attending to c tokens (averaged over the layers)."""
        if not self._mixed:
            return c
        return self._fw * c + (self._sw * min(c, self._win) if self._sw else 0.0)

    def _row_state_bytes(self, c: float) -> float:
        """A decode row's window KV and recurrent state read and written."""
        return self.sliding_bytes_per_token * min(c, self._win) + 2.0 * self.state_bytes

    def _chunk_state_bytes(self, n: float, b: float) -> float:
        """A prefill chunk's window KV read and written, its recurrent state read and written."""
        return self.sliding_bytes_per_token * (min(b, self._win) + min(n, self._win)) + 2.0 * self.state_bytes

    def _copy_bytes(self, rows: float, longest: float) -> float:
        """Bytes a batch-cache copy of ``rows`` rows of ``longest`` tokens moves (read + written)."""
        b = 2.0 * rows * longest * self.kv_bytes_per_token
        if self._mixed:
            b += 2.0 * rows * (self.sliding_bytes_per_token * min(longest, self._win) + self.state_bytes)
        return b

    def forwards(self, s: PassShape) -> Iterator[Forward]:
        """The forwards a pass runs (see the module docstring)."""
        ctx = s.decode_contexts
        chunks = s.prefill
        if self.style == "fused":
            tokens = head = qk = rd = wr = 0.0
            st = 0.0
            if ctx:
                rows = len(ctx)
                total = float(sum(ctx))
                tokens += rows
                head += rows
                qk += total if not self._mixed else sum(map(self._row_qk, ctx))
                rd += total - rows
                wr += rows
                if self._mixed:
                    st += sum(map(self._row_state_bytes, ctx))
            if chunks:
                if s.padded:
                    n = max(c for c, _ in chunks)
                    b = max(x for _, x in chunks)
                    r = len(chunks)
                    tokens += r * n
                    qk += r * self._qk(n, b)
                    rd += r * b
                    wr += r * n
                    if self._mixed:
                        st += r * self._chunk_state_bytes(n, b)
                else:
                    for n, b in chunks:
                        tokens += n
                        qk += self._qk(n, b)
                        rd += b
                        wr += n
                        if self._mixed:
                            st += self._chunk_state_bytes(n, b)
                head += len(chunks)
            if tokens:
                yield Forward(tokens, head, qk, rd, wr, state_bytes=st)
            return
        if ctx:
            rows = len(ctx)
            longest = max(ctx)
            extra = copies = 0.0
            if s.joins:  # extend: the batch cache is rebuilt with the new rows
                extra += self._copy_bytes(rows, longest)
                copies += 1
            if s.leaves:  # filter: the kept rows are copied (nothing when none is kept)
                kept = max(s.batch_rows_before + s.joins - s.leaves, 0)
                if kept:
                    extra += self._copy_bytes(kept, longest)
                    copies += 1
            st = rows * self._row_state_bytes(longest) if self._mixed else 0.0
            qk = rows * self._row_qk(longest)
            yield Forward(rows, rows, qk, rows * (longest - 1), rows, extra, copies, True, state_bytes=st)
        if chunks:
            done = s.prefill_done or (True,) * len(chunks)  # unknown: completing (the full cost)
            lazy = self.lazy_prefill
            if s.padded:
                n = max(c for c, _ in chunks)
                b = max(x for _, x in chunks)
                r = len(chunks)
                n_done = sum(1 for d in done if d)
                partial = lazy and not n_done
                qk = r * self._qk(n, b) * (self._partial_qk if partial else 1.0)
                st = r * self._chunk_state_bytes(n, b) if self._mixed else 0.0
                yield Forward(
                    r * n,
                    n_done if lazy else r,
                    qk,
                    r * b,
                    r * n,
                    partial_tokens=r * n if partial else 0.0,
                    state_bytes=st,
                )
            else:
                for (n, b), d in zip(chunks, done):
                    partial = lazy and not d
                    yield Forward(
                        n,
                        0 if partial else 1,
                        self._qk(n, b) * (self._partial_qk if partial else 1.0),
                        b,
                        n,
                        partial_tokens=n if partial else 0.0,
                        state_bytes=self._chunk_state_bytes(n, b) if self._mixed else 0.0,
                    )

    # ------------------------------------------------------------------ CostModel
    def _seconds(self, tokens: float, head: float, qk: float, kv: float, partial: float = 0.0) -> float:
        """One prefill forward's seconds (kv: KV tokens read + written). The hot path of pass_seconds."""
        c = (
            tokens * self._flops_per_token - partial * self._partial_saving + head * self._flops_per_head_row
        ) / self._rate + qk * self._flops_per_qk / self._rate_attn
        b = self._dense_bytes + self._head_bytes + kv * self.kv_bytes_per_token
        if self._expert_bytes:
            b += self._moe_fixed_bytes + self.model.distinct_experts(tokens) * self._expert_bytes
        m = b / self._bw
        if self.tp > 1:
            return self._ovh + (c if c > m else m) + self.allreduce_seconds(tokens)
        return self._ovh + (c if c > m else m)

    def pass_seconds(self, shape: PassShape) -> float:
        """Seconds of one pass: the sum of its forwards (same as summing ``forwards()``)."""
        if self.style != "mlx" or self._mixed:  # (layer kinds: through the forwards)
            return sum(self.forward_seconds(f) for f in self.forwards(shape))
        t = 0.0
        ctx = shape.decode_contexts
        if ctx:
            rows = len(ctx)
            longest = max(ctx)
            c = (
                rows * (self._flops_per_token + self._flops_per_head_row) / self._rate
                + rows * longest * self._flops_per_qk / self._rate_dattn
            )
            b = self._dense_bytes + self._head_bytes + rows * longest * self.kv_bytes_per_token
            if self._expert_bytes:
                b += self._moe_fixed_bytes + self.model.distinct_experts(rows) * self._expert_bytes
            m = b / self._bw
            t += self._ovh + (c if c > m else m)
            if self.tp > 1:
                t += self.allreduce_seconds(rows)
            if shape.joins:
                t += 2.0 * rows * longest * self.kv_bytes_per_token / self._bw_copy + self._copy_ovh
            if shape.leaves:
                kept = shape.batch_rows_before + shape.joins - shape.leaves
                if kept > 0:
                    t += 2.0 * kept * longest * self.kv_bytes_per_token / self._bw_copy + self._copy_ovh
        chunks = shape.prefill
        if chunks:
            done = shape.prefill_done
            lazy = self.lazy_prefill
            causal = self.causal_skip
            if shape.padded:
                n = max(c for c, _ in chunks)
                b = max(x for _, x in chunks)
                r = len(chunks)
                n_done = sum(1 for d in done if d) if done else r
                partial = lazy and not n_done
                qk = r * (n * b + n * (n + 1) / 2.0 if causal else n * (b + n))
                if partial:
                    qk *= self._partial_qk
                t += self._seconds(r * n, n_done if lazy else r, qk, r * (b + n), r * n if partial else 0.0)
            else:
                for i, (n, b) in enumerate(chunks):
                    qk = n * b + n * (n + 1) / 2.0 if causal else n * (b + n)
                    if lazy and done and not done[i]:
                        t += self._seconds(n, 0, qk * self._partial_qk, b + n, n)
                    else:
                        t += self._seconds(n, 1, qk, b + n)
        return t

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        return self.efficiency.step_overhead_s

    # ------------------------------------------------------------------ introspection
    def bound(self, f: Forward) -> str:
        """'compute' or 'memory': which term wins this forward."""
        c = self.matmul_flops(f) / self._rate + self.attention_flops(f) / (
            self._rate_dattn if f.decode else self._rate_attn
        )
        return "compute" if c >= self.bytes(f) / self._bw else "memory"

    def meta(self) -> dict[str, Any]:
        m = self.model
        applied = {
            k: v
            for k, v in self.applied.to_dict().items()
            if k
            in (
                "compute",
                "bandwidth",
                "overhead_per_layer_s",
                "basis",
                "source",
                "attention",
                "decode_attention",
                "copy",
                "copy_overhead_per_layer_s",
            )
        }
        return {
            "cost_model": "analytic-roofline",
            "style": self.style,
            **self.hardware.summary(),
            "efficiency": self.efficiency.to_dict(),
            "efficiency_applied": applied,
            "compute_dtype": self.compute_dtype,
            "lazy_prefill": self.lazy_prefill,
            "causal_skip": self.causal_skip,
            "model": m.summary(),
            "quant_bits": self.bits if self.bits is not None else m.native_bits,
            "bits_per_weight": self.bytes_per_weight * 8,
            "weight_gb": (
                (m.layer_matrix_params + (1 if m.tied else 2) * m.embed_params) * self.bytes_per_weight
                + m.all_expert_params * (self._expert_bpw - self.bytes_per_weight)
            )
            / 1e9,
            **({"expert_bits_per_weight": self._expert_bpw * 8} if self._expert_bpw != self.bytes_per_weight else {}),
            "kv_bits": self.kv_bits,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            **(
                {
                    "tensor_parallel": {
                        "tp": self.tp,
                        "kv_replicas": self._kv_rep,
                        "allreduces_per_forward": 2 * m.layers,
                        "allreduce_bytes_per_token": self.allreduce_bytes_per_token,
                        "note": "FLOPs, weight and KV bytes per GPU: 1/tp of the replica's (tp x peak and "
                        "bandwidth); 2 ring all-reduces per layer over the preset's link",
                    }
                }
                if self.tp > 1
                else {}
            ),
        }


def kv_replication(model: ModelSpec, tp: int) -> float:
    """How many GPUs of a ``tp``-GPU replica hold each KV value: 1 while the KV heads split over
    them, tp / kv_heads when there are fewer KV heads than GPUs (each GPU keeps a whole head, as
    vLLM does), tp for DeepSeek's latent KV (on every GPU). Raises ``AnalyticError`` (one line)
    when tp does not divide the attention heads, or the KV heads and tp divide neither way."""
    if tp == 1:
        return 1
    if model.heads % tp:
        raise AnalyticError(
            f"tp={tp} does not divide {model.name}'s {model.heads} attention heads (tensor parallelism splits them)"
        )
    if model.config.get("kv_lora_rank"):
        return tp
    kv = model.kv_heads
    if kv % tp and tp % kv:
        raise AnalyticError(f"tp={tp} and {model.name}'s {kv} KV heads do not divide one another")
    return tp / kv if kv < tp else 1


def kv_capacity_tokens(
    hw: Hardware,
    model: ModelSpec,
    quant: float | None = None,
    mem_fraction: float = 0.9,
    *,
    kv_bits: int = 16,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """KV tokens that fit in ``mem_fraction`` of the memory once the weights are loaded.

    Tokens of the full-attention layers' KV: a model with sliding-window or linear-attention
    layers holds more per request (its windows, its recurrent states), which the simulator takes
    out of this capacity request by request (``AnalyticCostModel.cache_layout``).

    A replica of ``hw.tp`` GPUs (tensor parallelism) has tp x the memory, the weights split over
    them; its KV per token is the model's, times :func:`kv_replication` where KV heads repeat.

    Raises ``AnalyticError`` (one line) when the weights alone do not fit.
    """
    check_quant(quant)
    if not 0 < mem_fraction <= 1:
        raise AnalyticError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    weights = model.weight_bytes(quant, group_size)
    tp = hw.tp
    rep = kv_replication(model, tp)
    budget = hw.memory_bytes * tp * mem_fraction
    bits = model.bits_said(quant)
    if weights >= budget:
        gpus = f"{tp} x {hw.name}" if tp > 1 else hw.name
        raise AnalyticError(
            f"{model.name} at {bits} needs {weights / 1e9:.0f} GB of weights; {gpus} has "
            f"{hw.memory_bytes * tp / 1e9:.0f} GB ({mem_fraction:.0%} usable: {budget / 1e9:.0f} GB)"
        )
    per_token = model.kv_bytes_per_token(kv_bits)
    if rep != 1:
        per_token *= rep
    tokens = int((budget - weights) // per_token)
    if tokens < 1:
        raise AnalyticError(f"{model.name} at {bits} leaves no room for a KV cache on {hw.name}")
    return tokens
