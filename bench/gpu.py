"""The analytic GPU cost model against real passes on a GPU: measure passes there, check the model anywhere.

What the analytic cost model (``analysis/analytic``, ``--hardware``) predicts is the seconds of a
*pass*. Two subcommands:

``measure`` (on a machine with an NVIDIA GPU and PyTorch; needs nothing of schedlab): whole
forward passes of a Llama-3.1-8B-shaped model (``analysis/model_configs/llama-3.1-8b``: hidden
4096, 32 layers, 32 query / 8 KV heads, FFN 14336, vocab 128256), random bf16 weights, written
as a vLLM-style layer: fused QKV and gate/up GEMMs (cuBLAS), RMSNorm, RoPE, SiLU-and-mul, KV
cache write, FlashAttention-2 (PyTorch SDPA's flash backend), the LM head on a prefill chunk's
last position / on every decode row.

- prefill: one request, chunk n at context b (``PassShape(prefill=((n, b),))``);
- decode: ``rows`` sequences at context ``ctx`` each (``decode_contexts=(ctx,) * rows``); GQA
  decode packs a KV head's query heads as query positions (one read of the KV per head).

Variants per pass: ``eager`` (plain launches), ``graph`` (CUDA-graphed, as vLLM decodes) and
``fused_graph`` (RMSNorm+residual, RoPE and SiLU-and-mul fused by ``torch.compile``, then
graphed: the kernel count of a vLLM-class engine, the primary variant). CUDA events around each
pass, warm-ups first, median of ``--reps``. Also recorded: the machine's ceilings (a bf16 GEMM,
a copy, a read), nvidia-smi, the attention paths checked against a float32 reference, and a
per-kernel breakdown for a few shapes. One device call (~90 s on an H100)::

    python bench/gpu.py measure --out $OUT          # writes $OUT/gpu_passes.json
    python bench/gpu.py measure --smoke --out /tmp/g  # the plumbing, on a CPU (needs torch)

``check`` (anywhere, no GPU): every measured pass predicted by the analytic model as it is
when this runs (``make_analytic_cost_model(hardware, model_config, quant, engine)``, default
``h100-sxm``, ``llama-3.1-8b``, 16 bits, the preset's engine: ``vllm`` on NVIDIA presets):
predicted and measured ms, ratio predicted / measured, |error| = |ratio - 1|, the roofline term
that binds, the fraction of the datasheet roofline reached; median and worst |error| by kind
(prefill, decode) and variant. Also fits the roofline's factors to these passes (information
for a refit; nothing is written to the presets)::

    python bench/gpu.py check [--measured $OUT/gpu_passes.json] [--engine vllm|llama.cpp]

Results: ``bench/results/gpu.json`` — the check, with the passes it checked under ``measured``
(``check`` without ``--measured`` checks those again: a refit of the presets re-checked in a
second). Recorded 2026-11-23 on an NVIDIA H100 80GB HBM3 (driver 580.159.04, PyTorch
2.11.0+cu130; ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import common

try:  # keep the module importable where torch is missing (the repo's own environment)
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

CONFIG = common.ROOT / "analysis" / "model_configs" / "llama-3.1-8b" / "config.json"

PREFILL_CTX0 = (64, 128, 256, 512, 1024, 2048, 4096)
PREFILL_CHUNK_CTX = ((512, 1024), (512, 2048), (512, 4096))
DECODE_ROWS = (1, 8, 32, 64, 128, 256)
DECODE_CTX = (512, 1024, 2048, 4096)

T0 = time.time()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


# ---------------------------------------------------------------------------- timing
class Timer:
    """Times a callable: CUDA events on a GPU, perf_counter (after a sync) elsewhere."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], warmup: int, reps: int) -> dict[str, Any]:
        for _ in range(warmup):
            fn()
        self.sync()
        ms: list[float] = []
        wall: list[float] = []
        for _ in range(reps):
            if self.cuda:
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                t = time.perf_counter()
                a.record()
                fn()
                b.record()
                b.synchronize()
                wall.append((time.perf_counter() - t) * 1e3)
                ms.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t) * 1e3)
        out = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "reps": reps, "warmup": warmup}
        if wall:
            out["wall_median_ms"] = statistics.median(wall)
        return out


def capture_graph(fn: Callable[[], Any], warmup: int = 2):
    """A CUDA graph of fn (warmed up on a side stream first); returns (graph, its output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


# ---------------------------------------------------------------------------- machine
def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {exc}"


def smi_snapshot() -> dict[str, str]:
    q = (
        "name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
        "power.draw,power.limit,temperature.gpu,memory.total,memory.used"
    )
    raw = sh(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"])
    keys = q.split(",")
    vals = [v.strip() for v in raw.split(",")]
    return dict(zip(keys, vals)) if len(vals) == len(keys) else {"raw": raw}


def env_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": device,
        "hostname_cpu_count": os.cpu_count(),
    }
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(
            {
                "gpu": p.name,
                "sm_count": p.multi_processor_count,
                "gpu_memory_gib": p.total_memory / 2**30,
                "capability": f"{p.major}.{p.minor}",
                "cuda_runtime": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version(),
                "l2_cache_mb": getattr(p, "L2_cache_size", 0) / 1e6,
                "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
                "matmul_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            }
        )
        try:
            import triton  # noqa: PLC0415

            info["triton"] = triton.__version__
        except Exception:  # noqa: BLE001
            pass
        info["nvidia_smi_before"] = smi_snapshot()
        info["nvidia_smi_q"] = sh(["nvidia-smi", "-q", "-d", "CLOCK,PERFORMANCE,POWER"])[:6000]
    return info


def ceilings(device: str, timer: Timer, smoke: bool) -> dict[str, Any]:
    """The machine's own ceilings: a big bf16 GEMM, a big copy, a big read."""
    dt = torch.bfloat16
    res: dict[str, Any] = {}
    n = 512 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    c = torch.empty(n, n, device=device, dtype=dt)
    t = timer.time(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), 3, 5 if smoke else 20)
    res["gemm_bf16"] = {
        "m": n,
        "n": n,
        "k": n,
        **t,
        "tflops_median": 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12,
        "tflops_best": 2 * n**3 / (t["min_ms"] * 1e-3) / 1e12,
        "data": "randn",
    }
    # a serving-shaped one: 4096 tokens x the gate/up weight
    if not smoke:
        x = torch.randn(4096, 4096, device=device, dtype=dt)
        w = torch.randn(28672, 4096, device=device, dtype=dt)
        t = timer.time(lambda: F.linear(x, w), 3, 20)
        res["gemm_bf16_gate_up_4096tok"] = {
            "m": 4096,
            "n": 28672,
            "k": 4096,
            **t,
            "tflops_median": 2 * 4096 * 28672 * 4096 / (t["median_ms"] * 1e-3) / 1e12,
        }
        del x, w
    del a, b, c
    nbytes = (1 << 20) if smoke else (4 << 30)
    src = torch.empty(nbytes // 2, device=device, dtype=dt).normal_()
    dst = torch.empty_like(src)
    t = timer.time(lambda dst=dst, src=src: dst.copy_(src), 3, 5 if smoke else 20)
    res["copy"] = {
        "bytes_each_way": nbytes,
        **t,
        "tbps_read_plus_write_median": 2 * nbytes / (t["median_ms"] * 1e-3) / 1e12,
        "tbps_read_plus_write_best": 2 * nbytes / (t["min_ms"] * 1e-3) / 1e12,
    }
    del dst
    t = timer.time(lambda src=src: torch.sum(src, dtype=torch.float32), 3, 5 if smoke else 20)
    res["read"] = {
        "bytes": nbytes,
        "op": "torch.sum (bf16 -> fp32)",
        **t,
        "tbps_median": nbytes / (t["median_ms"] * 1e-3) / 1e12,
        "tbps_best": nbytes / (t["min_ms"] * 1e-3) / 1e12,
    }
    del src
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------- model
def load_config(smoke: bool) -> dict[str, int]:
    if smoke:
        return {
            "hidden": 256,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "ffn": 512,
            "vocab": 1000,
            "eps": 1e-5,
            "rope_theta": 500000.0,
            "name": "tiny-smoke",
        }
    cfg = json.loads(CONFIG.read_text())
    return {
        "hidden": cfg["hidden_size"],
        "layers": cfg["num_hidden_layers"],
        "heads": cfg["num_attention_heads"],
        "kv_heads": cfg["num_key_value_heads"],
        "ffn": cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
        "eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "name": "llama-3.1-8b",
    }


class Fused:
    """The small element-wise ops, eager or fused by torch.compile."""

    def __init__(self, eps: float, half: int, compiled: bool) -> None:
        self.eps = eps
        self.half = half
        self.compiled = compiled
        if compiled:
            opts = {"dynamic": True, "fullgraph": True}
            self.add_rms = torch.compile(self._add_rms, **opts)
            self.rms = torch.compile(self._rms, **opts)
            self.rope = torch.compile(self._rope, **opts)
            self.silu_mul = torch.compile(self._silu_mul, **opts)
        else:
            self.add_rms, self.rms, self.rope, self.silu_mul = self._add_rms, self._rms, self._rope, self._silu_mul

    def _rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _add_rms(self, x, r, w):
        y = x + r
        return y, F.rms_norm(y, (y.shape[-1],), w, self.eps)

    def _rope(self, x, cos, sin):  # x (T, h, d); cos/sin (T, 1, d)
        h = self.half
        x1, x2 = x[..., :h], x[..., h:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    @staticmethod
    def _silu_mul(gu):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u


class Model:
    def __init__(self, cfg: dict[str, Any], device: str, max_pos: int) -> None:
        self.cfg = cfg
        self.device = device
        dt = self.dt = torch.bfloat16
        H, nh, nkv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
        self.H, self.nh, self.nkv = H, nh, nkv
        self.hd = hd = H // nh
        self.group = nh // nkv
        self.qkv_out = (nh + 2 * nkv) * hd
        ffn, V = cfg["ffn"], cfg["vocab"]

        def w(o: int, i: int):
            return torch.randn(o, i, device=device, dtype=dt) * (1.0 / math.sqrt(i))

        self.layers = []
        for _ in range(cfg["layers"]):
            self.layers.append(
                {
                    "ln1": torch.ones(H, device=device, dtype=dt),
                    "ln2": torch.ones(H, device=device, dtype=dt),
                    "wqkv": w(self.qkv_out, H),
                    "wo": w(H, nh * hd),
                    "wgu": w(2 * ffn, H),
                    "wd": w(H, ffn),
                }
            )
        self.norm = torch.ones(H, device=device, dtype=dt)
        self.embed = torch.randn(V, H, device=device, dtype=dt)
        self.head = w(V, H)
        self.params = (
            sum(t.numel() for L in self.layers for t in L.values())
            + self.norm.numel()
            + self.embed.numel()
            + self.head.numel()
        )
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.cos = ang.cos().to(dt)
        self.sin = ang.sin().to(dt)
        self.ops = Fused(cfg["eps"], hd // 2, compiled=False)
        self.prefill_attn_mode = "flash_direct"  # see check_attention
        self.kv_views: list[tuple[Any, Any]] = []

    # -- KV cache: layer i uses buffer i % len(views)
    def set_kv(self, pool, rows: int, ctx: int) -> int:
        per = 2 * rows * ctx * self.nkv * self.hd
        nbuf = max(1, min(len(self.layers), pool.numel() // per))
        if pool.numel() < per:
            raise RuntimeError(f"KV pool too small for rows={rows} ctx={ctx}")
        v = pool[: nbuf * per].view(nbuf, 2, rows, ctx, self.nkv, self.hd)
        self.kv_views = [(v[i, 0], v[i, 1]) for i in range(nbuf)]
        return nbuf

    # -- attention
    def attn_prefill(self, q, k, v):
        """q (1, nh, n, d); k, v (1, nkv, S, d) strided views: causal, bottom-right aligned."""
        mode = self.prefill_attn_mode
        if mode == "flash_direct":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
        if mode == "reference":
            return ref_attention(q, k, v).to(q.dtype)
        # fallback: expand GQA heads, lower-right causal bias (mem-efficient backend)
        from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415

        k = k.repeat_interleave(self.group, dim=1)
        v = v.repeat_interleave(self.group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))

    def attn_decode(self, q, k, v):
        """q (B, nh, d) one token per row; k, v (B, nkv, S, d): GQA heads packed as query positions."""
        B = q.shape[0]
        qp = q.view(B, self.nkv, self.group, self.hd)
        if self.device.startswith("cuda"):
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(qp, k, v)
        else:
            o = F.scaled_dot_product_attention(qp, k, v)
        return o.reshape(B, self.nh * self.hd)

    # -- passes
    def prefill(self, ids, b: int):
        """One chunk of len(ids) tokens after b cached: returns the last position's logits."""
        ops, n = self.ops, ids.shape[0]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        cos = self.cos[b : b + n].unsqueeze(1)
        sin = self.sin[b : b + n].unsqueeze(1)
        x = F.embedding(ids, self.embed)
        h = ops.rms(x, self.layers[0]["ln1"])
        nb = len(self.kv_views)
        r = None
        for i, L in enumerate(self.layers):
            if i:
                x, h = ops.add_rms(x, r, L["ln1"])
            qkv = F.linear(h, L["wqkv"])
            qk = ops.rope(qkv[:, : (nh + nkv) * hd].view(n, nh + nkv, hd), cos, sin)
            kc, vc = self.kv_views[i % nb]
            kc[0, b : b + n] = qk[:, nh:]
            vc[0, b : b + n] = qkv[:, (nh + nkv) * hd :].view(n, nkv, hd)
            q = qk[:, :nh].transpose(0, 1).unsqueeze(0)
            o = self.attn_prefill(q, kc[:, : b + n].transpose(1, 2), vc[:, : b + n].transpose(1, 2))
            o = o[0].transpose(0, 1).reshape(n, nh * hd)
            x, h = ops.add_rms(x, F.linear(o, L["wo"]), L["ln2"])
            r = F.linear(ops.silu_mul(F.linear(h, L["wgu"])), L["wd"])
        x = x + r
        h = ops.rms(x[-1:], self.norm)
        return F.linear(h, self.head)

    def decode(self, ids, ctx: int):
        """One token for each of len(ids) rows, each attending to ctx tokens: (rows, vocab) logits."""
        ops, B = self.ops, ids.shape[0]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        p = ctx - 1
        cos = self.cos[p : p + 1].unsqueeze(1)
        sin = self.sin[p : p + 1].unsqueeze(1)
        x = F.embedding(ids, self.embed)
        h = ops.rms(x, self.layers[0]["ln1"])
        nb = len(self.kv_views)
        r = None
        for i, L in enumerate(self.layers):
            if i:
                x, h = ops.add_rms(x, r, L["ln1"])
            qkv = F.linear(h, L["wqkv"])
            qk = ops.rope(qkv[:, : (nh + nkv) * hd].view(B, nh + nkv, hd), cos, sin)
            kc, vc = self.kv_views[i % nb]
            kc[:, p] = qk[:, nh:]
            vc[:, p] = qkv[:, (nh + nkv) * hd :].view(B, nkv, hd)
            o = self.attn_decode(qk[:, :nh], kc[:, :ctx].transpose(1, 2), vc[:, :ctx].transpose(1, 2))
            x, h = ops.add_rms(x, F.linear(o, L["wo"]), L["ln2"])
            r = F.linear(ops.silu_mul(F.linear(h, L["wgu"])), L["wd"])
        x = x + r
        h = ops.rms(x, self.norm)
        return F.linear(h, self.head)


def ref_attention(q, k, v):
    """float32 reference: q (B, nh, n, d), k/v (B, nkv, S, d); causal bottom-right."""
    g = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    n, S = q.shape[2], k.shape[2]
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i = torch.arange(n, device=q.device).unsqueeze(1) + (S - n)
    j = torch.arange(S, device=q.device).unsqueeze(0)
    s = s.masked_fill(j > i, float("-inf"))
    return s.softmax(-1) @ vf


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def check_attention(m: Model) -> dict[str, Any]:
    """Pick the prefill attention path (flash called directly, else a fallback) and check both paths."""
    out: dict[str, Any] = {}
    dev, dt = m.device, m.dt
    n, b = 64, 100
    q = torch.randn(1, m.nh, n, m.hd, device=dev, dtype=dt)
    k = torch.randn(1, m.nkv, b + n, m.hd, device=dev, dtype=dt)
    v = torch.randn(1, m.nkv, b + n, m.hd, device=dev, dtype=dt)
    ref = ref_attention(q, k, v)
    modes = ["flash_direct", "lower_right_bias"] if dev.startswith("cuda") else ["lower_right_bias", "reference"]
    chosen = None
    for mode in modes:
        m.prefill_attn_mode = mode
        try:
            e = rel_err(m.attn_prefill(q, k, v), ref)
            out[f"prefill_{mode}_rel_err"] = e
            if e < 2e-2 and chosen is None:
                chosen = mode
        except Exception as exc:  # noqa: BLE001
            out[f"prefill_{mode}_error"] = f"{type(exc).__name__}: {exc}"[:400]
    if chosen is None:
        raise RuntimeError(f"no prefill attention path passed: {out}")
    m.prefill_attn_mode = chosen
    out["prefill_mode"] = chosen
    # square causal through the same path
    k0, v0 = k[:, :, :n], v[:, :, :n]
    out["prefill_square_rel_err"] = rel_err(
        m.attn_prefill(q, k0.contiguous(), v0.contiguous()), ref_attention(q, k0, v0)
    )
    # decode: one query per row against S keys (no mask)
    B, S = 3, 300
    qd = torch.randn(B, m.nh, m.hd, device=dev, dtype=dt)
    kd = torch.randn(B, m.nkv, S, m.hd, device=dev, dtype=dt)
    vd = torch.randn(B, m.nkv, S, m.hd, device=dev, dtype=dt)
    refd = ref_attention(qd.unsqueeze(2), kd, vd).squeeze(2).reshape(B, -1)
    out["decode_packed_rel_err"] = rel_err(m.attn_decode(qd, kd, vd), refd)
    if out["decode_packed_rel_err"] > 2e-2:
        raise RuntimeError(f"decode attention check failed: {out}")
    return out


# ---------------------------------------------------------------------------- profiling
def classify(name: str) -> str:
    s = name.lower()
    if "flash" in s or "fmha" in s or "attention" in s:
        return "attention"
    if any(t in s for t in ("gemm", "nvjet", "xmma", "cutlass", "gemv", "splitk", "cublas", "sm90_", "sm80_")):
        return "gemm"
    if "triton" in s:
        return "fused_elementwise"
    return "other"


def profile_pass(fn: Callable[[], Any], device: str, n: int = 3) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if cuda:  # kernels (and memcpy/memset) only: the CPU ops that launched them carry their time too
            if "CUDA" not in str(getattr(e, "device_type", "")):
                continue
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0.0)
        else:
            t = getattr(e, "self_cpu_time_total", 0.0)
            if not e.key.startswith("aten::"):
                continue
        if not t:
            continue
        kernels.setdefault(e.key, [0.0, 0])
        kernels[e.key][0] += t
        kernels[e.key][1] += e.count
    by: dict[str, float] = {}
    for k, (t, _) in kernels.items():
        c = classify(k)
        by[c] = by.get(c, 0.0) + t / n / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    try:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60)
    except Exception as exc:  # noqa: BLE001
        table = f"unavailable: {exc}"
    return {
        "table": table,
        "passes_profiled": n,
        "kernel_ms_by_class": by,
        "kernel_ms_total": sum(by.values()),
        "kernels_per_pass": sum(c for _, c in kernels.values()) / n,
        "top_kernels": [
            {"name": k[:160], "ms_per_pass": t / n / 1e3, "calls_per_pass": c / n, "class": classify(k)}
            for k, (t, c) in top
        ],
    }


# ---------------------------------------------------------------------------- main
class Out:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "schema": "schedlab-gpu-passes/1",
            "passes": [],
            "breakdown": [],
            "errors": [],
            "notes": [],
        }

    def save(self) -> None:
        self.data["elapsed_s"] = time.time() - T0
        self.data["log"] = LOG[-400:]
        common.write_json(self.data, self.path, indent=1, default=str)  # (the GPU machine's provenance)


def measure(argv: list[str] | None = None) -> int:
    """Real passes on this machine's GPU (needs torch; ``--smoke``: a tiny model on the CPU)."""
    ap = argparse.ArgumentParser(prog="gpu.py measure", description="real passes on this machine's GPU")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and logs")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: check the plumbing")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=470.0, help="seconds: optional phases stop after this")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile fused variant")
    ap.add_argument("--name", default="gpu_passes.json")
    args = ap.parse_args(argv)
    if torch is None:
        print("gpu.py measure: needs torch", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Out(out_dir / args.name)
    smoke = args.smoke
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not smoke:
        print("gpu.py measure: no CUDA device (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    cuda = device == "cuda"
    torch.manual_seed(0)
    timer = Timer(device)
    reps, warm = (2, 1) if smoke else (args.reps, args.warmup)
    prefill_ctx0 = (8, 16, 32) if smoke else PREFILL_CTX0
    chunk_ctx = ((8, 16), (8, 32)) if smoke else PREFILL_CHUNK_CTX
    dec_rows = (1, 4) if smoke else DECODE_ROWS
    dec_ctx = (16, 32) if smoke else DECODE_CTX

    def late() -> bool:
        return time.time() - T0 > args.deadline

    d = out.data
    d["env"] = env_info(device)
    d["settings"] = {
        "reps": reps,
        "warmup": warm,
        "smoke": smoke,
        "dtype": "bfloat16",
        "timing": "CUDA events around one pass, median of reps after warmup" if cuda else "perf_counter",
    }
    log(f"env: {d['env'].get('gpu', device)} torch {torch.__version__}")
    out.save()

    log("ceilings")
    try:
        d["ceilings"] = ceilings(device, timer, smoke)
        c = d["ceilings"]
        log(
            f"  gemm {c['gemm_bf16']['tflops_median']:.0f} TFLOP/s, copy {c['copy']['tbps_read_plus_write_median']:.2f} "
            f"TB/s (r+w), read {c['read']['tbps_median']:.2f} TB/s"
        )
    except Exception as exc:  # noqa: BLE001
        d["errors"].append(f"ceilings: {traceback.format_exc()[-800:]}")
        log(f"  ceilings failed: {exc}")
    out.save()

    cfg = load_config(smoke)
    max_ctx = max([b + n for n, b in chunk_ctx] + list(prefill_ctx0) + list(dec_ctx))
    log("building model")
    m = Model(cfg, device, max_pos=max_ctx + 8)
    if cuda:
        torch.cuda.synchronize()
    d["model"] = {
        **cfg,
        "head_dim": m.hd,
        "params": m.params,
        "weight_gb": m.params * 2 / 1e9,
        "layer_and_head_params": m.params - m.embed.numel(),
    }
    # KV pool: what is left after the weights, less headroom for activations and graphs
    if cuda:
        free, _total = torch.cuda.mem_get_info()
        pool_bytes = max(free - (10 << 30), 1 << 30)
    else:
        pool_bytes = 2 * 2 * max(dec_rows) * max(dec_ctx) * m.nkv * m.hd * cfg["layers"] + (1 << 20)
    pool = torch.empty(pool_bytes // 2, device=device, dtype=torch.bfloat16)
    chunk = 1 << 28
    for s0 in range(0, pool.numel(), chunk):
        pool[s0 : s0 + chunk].normal_()
    d["model"]["kv_pool_gib"] = pool.numel() * 2 / 2**30
    d["model"]["kv_bytes_per_token"] = 2 * cfg["layers"] * m.nkv * m.hd * 2
    log(f"  params {m.params / 1e9:.2f} B, KV pool {pool.numel() * 2 / 2**30:.1f} GiB")
    out.save()

    try:
        d["checks"] = check_attention(m)
        log(f"  attention checks: {d['checks']}")
    except Exception:  # noqa: BLE001
        d["errors"].append(f"attention check: {traceback.format_exc()[-1500:]}")
        out.save()
        raise
    out.save()

    gen = torch.Generator(device=device).manual_seed(1)

    def ids_for(n: int):
        return torch.randint(0, cfg["vocab"], (n,), device=device, generator=gen)

    def measure(entry: dict[str, Any], fn: Callable[[], Any], variant: str, graph: bool) -> Any:
        res = None
        try:
            if graph:
                g, res = capture_graph(fn)
                entry["variants"][variant] = timer.time(g.replay, warm, reps)
                del g
            else:
                res = fn()
                entry["variants"][variant] = timer.time(fn, warm, reps)
        except Exception as exc:  # noqa: BLE001
            entry["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            d["errors"].append(f"{entry['name']} {variant}: {traceback.format_exc()[-600:]}")
        return res

    def run_prefill(n: int, b: int, variants: list[tuple[str, bool]]) -> dict[str, Any]:
        name = f"prefill n={n} ctx={b}"
        entry = next((e for e in d["passes"] if e["name"] == name), None)
        if entry is None:
            entry = {
                "name": name,
                "kind": "prefill",
                "tokens": n,
                "context": b,
                "rows": 1,
                "pass_shape": {"prefill": [[n, b]], "prefill_done": [True]},
                "variants": {},
            }
            d["passes"].append(entry)
        entry["kv_buffers"] = m.set_kv(pool, 1, b + n)
        ids = ids_for(n)
        outs = {}
        for variant, graph in variants:
            r = measure(entry, lambda: m.prefill(ids, b), variant, graph)
            if r is not None:
                outs[variant] = r.float().clone()
                if not torch.isfinite(r).all():
                    entry.setdefault("nonfinite", []).append(variant)
        if len(outs) > 1:
            base = next(iter(outs.values()))
            entry["variant_rel_err"] = {k: rel_err(v, base) for k, v in outs.items()}
        v = entry["variants"]
        log(f"  {name}: " + ", ".join(f"{k} {x.get('median_ms', float('nan')):.3f} ms" for k, x in v.items()))
        if cuda:
            torch.cuda.empty_cache()
        return entry

    def run_decode(rows: int, ctx: int, variants: list[tuple[str, bool]]) -> dict[str, Any]:
        name = f"decode rows={rows} ctx={ctx}"
        entry = next((e for e in d["passes"] if e["name"] == name), None)
        if entry is None:
            entry = {
                "name": name,
                "kind": "decode",
                "rows": rows,
                "context": ctx,
                "tokens": rows,
                "pass_shape": {"decode_rows": rows, "decode_context": ctx},
                "kv_gib_read_logical": rows * ctx * d["model"]["kv_bytes_per_token"] / 2**30,
                "variants": {},
            }
            d["passes"].append(entry)
        entry["kv_buffers"] = m.set_kv(pool, rows, ctx)
        ids = ids_for(rows)
        outs = {}
        for variant, graph in variants:
            r = measure(entry, lambda: m.decode(ids, ctx), variant, graph)
            if r is not None:
                outs[variant] = r.float().clone()
                if not torch.isfinite(r).all():
                    entry.setdefault("nonfinite", []).append(variant)
        if len(outs) > 1:
            base = next(iter(outs.values()))
            entry["variant_rel_err"] = {k: rel_err(v, base) for k, v in outs.items()}
        v = entry["variants"]
        log(f"  {name}: " + ", ".join(f"{k} {x.get('median_ms', float('nan')):.3f} ms" for k, x in v.items()))
        if cuda:
            torch.cuda.empty_cache()
        return entry

    base_variants = [("eager", False)] + ([("graph", True)] if cuda else [])
    log("prefill passes")
    for n in prefill_ctx0:
        run_prefill(n, 0, base_variants)
        out.save()
    for n, b in chunk_ctx:
        run_prefill(n, b, base_variants)
        out.save()
    log("decode passes")
    for ctx in dec_ctx:
        for rows in dec_rows:
            run_decode(rows, ctx, base_variants)
            out.save()

    # the same version timed twice: the spread between runs
    if cuda:
        log("repeats")
        run_prefill(512, 0, [("graph_repeat", True)])
        run_decode(64, 2048, [("graph_repeat", True)])
        run_decode(1, 512, [("graph_repeat", True)])
        out.save()

    # per-kernel breakdown (eager passes: kernel time on the GPU, launch gaps excluded)
    log("breakdown")
    shapes = (
        [("prefill", 16, 0), ("decode", 4, 32)]
        if smoke
        else [
            ("prefill", 64, 0),
            ("prefill", 512, 0),
            ("prefill", 4096, 0),
            ("prefill", 512, 4096),
            ("decode", 1, 512),
            ("decode", 64, 2048),
            ("decode", 256, 512),
            ("decode", 256, 4096),
        ]
    )
    for kind, a, b in shapes:
        if late():
            d["notes"].append("breakdown cut short by the deadline")
            break
        try:
            if kind == "prefill":
                m.set_kv(pool, 1, a + b)
                ids = ids_for(a)
                prof = profile_pass(lambda: m.prefill(ids, b), device)
                name = f"prefill n={a} ctx={b}"
            else:
                m.set_kv(pool, a, b)
                ids = ids_for(a)
                prof = profile_pass(lambda: m.decode(ids, b), device)
                name = f"decode rows={a} ctx={b}"
            d["breakdown"].append({"name": name, "variant": "eager", **prof})
            log(
                f"  {name}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in prof["kernel_ms_by_class"].items())
                + f" ms; {prof['kernels_per_pass']:.0f} kernels/pass"
            )
        except Exception as exc:  # noqa: BLE001
            d["errors"].append(f"breakdown {kind} {a} {b}: {traceback.format_exc()[-600:]}")
            log(f"  breakdown failed: {exc}")
        out.save()

    # fused element-wise ops (torch.compile) + CUDA graphs: the small-kernel count of vLLM
    if cuda and not args.no_compile and not late():
        log("fused variant (torch.compile of the element-wise ops)")
        try:
            t = time.time()
            m.ops = Fused(cfg["eps"], m.hd // 2, compiled=True)
            m.set_kv(pool, 1, 512)
            ids = ids_for(512)
            m.prefill(ids, 0)
            m.set_kv(pool, 8, 1024)
            m.decode(ids_for(8), 1024)
            torch.cuda.synchronize()
            d["fused_compile_s"] = time.time() - t
            log(f"  compiled in {d['fused_compile_s']:.1f} s")
            fv = [("fused_graph", True)]
            for n in prefill_ctx0:
                if late():
                    break
                run_prefill(n, 0, fv)
                out.save()
            for n, b in chunk_ctx:
                if late():
                    break
                run_prefill(n, b, fv)
                out.save()
            for ctx in dec_ctx:
                for rows in dec_rows:
                    if late():
                        break
                    run_decode(rows, ctx, fv)
                    out.save()
            if not late():
                for kind, a, b in (("decode", 64, 2048), ("prefill", 512, 0)):
                    if kind == "prefill":
                        m.set_kv(pool, 1, a + b)
                        ids = ids_for(a)
                        prof = profile_pass(lambda: m.prefill(ids, b), device)
                        name = f"prefill n={a} ctx={b}"
                    else:
                        m.set_kv(pool, a, b)
                        ids = ids_for(a)
                        prof = profile_pass(lambda: m.decode(ids, b), device)
                        name = f"decode rows={a} ctx={b}"
                    d["breakdown"].append({"name": name, "variant": "fused_eager", **prof})
                    log(
                        f"  fused {name}: "
                        + ", ".join(f"{k} {v:.3f}" for k, v in prof["kernel_ms_by_class"].items())
                        + f" ms; {prof['kernels_per_pass']:.0f} kernels/pass"
                    )
            if late():
                d["notes"].append("fused variant cut short by the deadline")
        except Exception as exc:  # noqa: BLE001
            d["errors"].append(f"fused variant: {traceback.format_exc()[-1500:]}")
            log(f"  fused variant failed: {exc}")
        out.save()

    if cuda:
        d["env"]["nvidia_smi_after"] = smi_snapshot()
        d["env"]["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out.save()
    # the short table last (the tool's reply carries the end of the output)
    print(f"\n{'pass':28s} " + " ".join(f"{v:>12s}" for v in ("eager", "graph", "fused_graph")))
    for e in d["passes"]:
        print(
            f"{e['name']:28s} "
            + " ".join(
                f"{e['variants'].get(v, {}).get('median_ms', float('nan')):12.3f}"
                for v in ("eager", "graph", "fused_graph")
            )
        )
    print(f"errors: {len(d['errors'])}; elapsed {time.time() - T0:.0f} s")
    return 0


# ---------------------------------------------------------------------- check (anywhere)

VARIANTS = ("fused_graph", "graph", "eager")


def pass_shape(entry: dict[str, Any]):
    """A measured pass's ``PassShape``."""
    from schedlab.policies.base import PassShape

    s = entry["pass_shape"]
    if "decode_rows" in s:
        return PassShape(decode_contexts=(int(s["decode_context"]),) * int(s["decode_rows"]))
    return PassShape(
        prefill=tuple((int(n), int(b)) for n, b in s["prefill"]),
        prefill_done=tuple(bool(x) for x in s.get("prefill_done", ())),
    )


def unit_terms(cost: Any, shape: Any) -> tuple[float, float, float, str]:
    """(FLOPs, bytes, forwards, bound) of a pass, summed over its forwards."""
    flops = byts = 0.0
    n = 0
    bounds = []
    for f in cost.forwards(shape):
        flops += cost.flops(f)
        byts += cost.bytes(f) + f.extra_bytes
        bounds.append(cost.bound(f))
        n += 1
    return flops, byts, float(n), "/".join(sorted(set(bounds)))


def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    errs = [(r["abs_err"][key], r["name"]) for r in rows if key in r["abs_err"]]
    ratios = [r["ratio"][key] for r in rows if key in r["ratio"]]
    if not errs:
        return {}
    worst = max(errs)
    return {
        "n": len(errs),
        "median_abs_err": statistics.median(e for e, _ in errs),
        "worst_abs_err": worst[0],
        "worst_pass": worst[1],
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }


def fits(cost: Any, rows: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    """The roofline's factors fitted to these passes (information only)."""
    from schedlab.analysis.analytic import fit_efficiency

    samples = [
        {"shape": r["_shape"], "seconds": r["measured_ms"][variant] / 1e3, "label": r["name"]}
        for r in rows
        if variant in r["measured_ms"]
    ]
    out: dict[str, Any] = {"variant": variant, "points": len(samples)}
    # decode attention is left tied to the others: it is bound by the KV read, which the bytes
    # term already counts (fitted on its own it only turns the max into a sum)
    for name, optional in (("plain", ()), ("with_prefill_attention", ("attention",))):
        try:
            res = fit_efficiency(
                samples,
                cost_model=cost,
                optional=optional,
                engine="PyTorch bf16 + FA2",
                source="bench/results/gpu.json (measured)",
            )
            e = res.efficiency
            block = {"compute": e.compute, "bandwidth": e.bandwidth, "overhead_per_layer_s": e.overhead_per_layer_s}
            for k in optional:
                block[k] = getattr(e, k)
            out[name] = {
                "efficiency": block,
                "fitted": list(res.fitted),
                "max_abs_residual": res.max_abs_residual,
                "rms_residual": res.rms_residual,
                "residuals": {r["label"]: round(r["rel"], 4) for r in res.residuals},
            }
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def check(argv: list[str] | None = None) -> int:
    """The analytic model's predictions against measured passes (runs anywhere, no GPU)."""
    from schedlab.analysis.analytic import make_analytic_cost_model

    ap = argparse.ArgumentParser(prog="gpu.py check", description=check.__doc__)
    ap.add_argument(
        "--measured", default=None, help="a `measure` output (default: the passes recorded in bench/results/gpu.json)"
    )
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model-config", default="llama-3.1-8b")
    ap.add_argument("--quant", type=int, default=16)
    ap.add_argument("--engine", default=None, help="whose factors (vllm, llama.cpp, mlx-lm; default: the preset's)")
    ap.add_argument("--variant", default="fused_graph", choices=VARIANTS, help="the primary measured variant")
    ap.add_argument("--out", default=str(common.result_path("gpu")))
    ap.add_argument("--no-fit", action="store_true")
    args = ap.parse_args(argv)

    source = Path(args.measured) if args.measured else common.result_path("gpu")
    try:
        meas = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        print(f"gpu.py check: cannot read {source}: {e}", file=sys.stderr)
        return 2
    if isinstance(meas, dict) and "measured" in meas:  # a check's results: the passes it checked
        meas = meas["measured"]
    if not isinstance(meas, dict) or not all("pass_shape" in e for e in meas.get("passes") or [{}]):
        print(f"gpu.py check: {source} holds no measured passes (give --measured, a `measure` output)", file=sys.stderr)
        return 2
    cost, _kv, meta = make_analytic_cost_model(args.hardware, args.model_config, args.quant, engine=args.engine)
    peak, bw = cost.peak, cost.hardware.bandwidth
    ceil = meas.get("ceilings", {})
    m_peak = ceil.get("gemm_bf16", {}).get("tflops_median", 0.0) * 1e12
    m_bw = ceil.get("read", {}).get("tbps_median", 0.0) * 1e12

    rows: list[dict[str, Any]] = []
    for e in meas["passes"]:
        shape = pass_shape(e)
        pred = cost.pass_seconds(shape) * 1e3
        flops, byts, nfw, bound = unit_terms(cost, shape)
        unit_ms = max(flops / peak, byts / bw) * 1e3
        r: dict[str, Any] = {
            "name": e["name"],
            "kind": e["kind"],
            "rows": e.get("rows"),
            "tokens": e.get("tokens"),
            "context": e.get("context"),
            "predicted_ms": pred,
            "bound": bound,
            "gflop": flops / 1e9,
            "gbytes": byts / 1e9,
            "roofline_datasheet_ms": unit_ms,
            "roofline_measured_ceilings_ms": (max(flops / m_peak, byts / m_bw) * 1e3 if m_peak and m_bw else None),
            "measured_ms": {},
            "ratio": {},
            "abs_err": {},
            "fraction_of_datasheet_roofline": {},
            "_shape": shape,
        }
        for v in VARIANTS:
            x = e["variants"].get(v, {})
            if "median_ms" in x:
                r["measured_ms"][v] = x["median_ms"]
                r["ratio"][v] = pred / x["median_ms"]
                r["abs_err"][v] = abs(pred / x["median_ms"] - 1)
                r["fraction_of_datasheet_roofline"][v] = unit_ms / x["median_ms"]
        rows.append(r)

    summary = {
        v: {k: summarize([r for r in rows if r["kind"] == k], v) for k in ("prefill", "decode", "all") if k != "all"}
        for v in VARIANTS
    }
    for v in VARIANTS:
        summary[v]["all"] = summarize(rows, v)
    result: dict[str, Any] = {
        "schema": "schedlab-gpu-check/1",
        "about": "analytic roofline predictions vs real GPU passes (bench/gpu.py measure, under `measured`); "
        "ratio = predicted / measured, abs_err = |ratio - 1|",
        "measured_env": {k: meas.get("env", {}).get(k) for k in ("gpu", "torch", "cuda_runtime", "sm_count")},
        "measured_ceilings": {
            "gemm_bf16_tflops": m_peak / 1e12,
            "read_tbps": m_bw / 1e12,
            "copy_tbps_read_plus_write": ceil.get("copy", {}).get("tbps_read_plus_write_median"),
        },
        "cost_model": {
            "hardware": args.hardware,
            "model_config": args.model_config,
            "quant": args.quant,
            "git": common.git_rev(),
            "peak_tflops": peak / 1e12,
            "bandwidth_tbps": bw / 1e12,
            "engine": cost.hardware.engine or meta.get("engine"),
            "efficiency_applied": meta.get("efficiency_applied") or meta.get("serving_efficiency"),
            "style": meta.get("style"),
            "step_overhead_s": cost.efficiency.step_overhead_s,
        },
        "primary_variant": args.variant,
        "summary": summary,
        "passes": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }
    if not args.no_fit:
        result["fitted_to_these_passes"] = {v: fits(cost, rows, v) for v in (args.variant, "eager")}
    result["measured"] = meas
    common.write_json(result, args.out, indent=1)

    v = args.variant
    eff = meta.get("efficiency_applied") or meta.get("serving_efficiency") or {}
    print(
        f"{args.hardware}, engine {cost.hardware.engine or '-'} (e_c {eff.get('compute')}, e_b {eff.get('bandwidth')}, "
        f"o {eff.get('overhead_per_layer_s')} s/layer) vs {meas.get('env', {}).get('gpu')}; measured = {v}"
    )
    print(f"{'pass':26s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s} {'eager':>8s} {'roofline':>8s} {'bound':>7s}")
    for r in rows:
        mm = r["measured_ms"].get(v, float("nan"))
        print(
            f"{r['name']:26s} {mm:9.2f} {r['predicted_ms']:9.2f} {r['ratio'].get(v, float('nan')):6.2f} "
            f"{r['measured_ms'].get('eager', float('nan')):8.2f} {r['roofline_datasheet_ms']:8.2f} {r['bound']:>7s}"
        )
    for k in ("prefill", "decode", "all"):
        s = summary[v].get(k) or {}
        if s:
            print(
                f"{k:8s} median |err| {s['median_abs_err']:6.1%}  worst {s['worst_abs_err']:6.1%} ({s['worst_pass']})  "
                f"median ratio {s['median_ratio']:.2f}"
            )
    for name, f in (result.get("fitted_to_these_passes", {}).get(v) or {}).items():
        if isinstance(f, dict) and "efficiency" in f:
            print(
                f"fit {name}: {json.dumps({k: round(x, 6) for k, x in f['efficiency'].items()})} "
                f"max|res| {f['max_abs_residual']:.1%}"
            )
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"measure": measure, "check": check}
    if not argv or argv[0] not in commands:
        print("usage: python bench/gpu.py {measure,check} [options]  (--help after either)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
