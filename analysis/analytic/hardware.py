"""Hardware presets (``analysis/hardware/hardware.json``) and the measured ``cpu-local`` preset.

A preset gives memory (GB), memory bandwidth (GB/s) and peak TFLOP/s by dtype, each with the
ids of its sources, plus an ``efficiency`` block (see :class:`Efficiency`) written by
``python -m schedlab.analysis.analytic refit`` from published single-request benchmarks.
Some presets also give ``price_usd_per_hour`` (same form: value, sources, note): one provider's
on-demand price of one GPU, where a public source exists (``capacity``'s requests per dollar;
quotes vary widely, so users give their own there). See :func:`preset_price`.

A preset name may carry a suffix ``:tp=N`` (``a100-80gb-sxm:tp=2``, also as a cluster file group's
``hardware``): one replica spanning N GPUs of the preset with tensor parallelism, its GPUs joined
by the preset's own ``link`` (see :func:`split_hardware` and, for what it changes in a pass's cost,
:mod:`analysis.analytic.roofline`).

``cpu-local`` is measured on first use: numpy float32 GEMM GFLOP/s (numpy's own BLAS) and a
large-array copy for bandwidth (bytes read + written per second). The result is cached in the
user cache dir (``$SCHEDLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/schedlab``, else
``~/.cache/schedlab``) as ``cpu-local.json``, keyed by machine, so later runs are instant.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .efficiency import ENGINES, Efficiency, ServingEfficiency, engine_kind
from .errors import AnalyticError

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "hardware"
HARDWARE_FILE = HARDWARE_DIR / "hardware.json"
BENCHMARKS_FILE = HARDWARE_DIR / "benchmarks.json"
CPU_LOCAL = "cpu-local"
CPU_CACHE_SCHEMA = "schedlab-cpu-local/1"

#: dtype aliases users may type
_DTYPE_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
    "float8": "fp8",
}


#: Used only where a preset has no efficiency block (before `refit`), and for cpu-local.
DEFAULT_EFFICIENCY = {
    "apple-gpu": Efficiency(0.5, 0.7, 1e-4, basis="default", source="placeholder until refit"),
    "nvidia-gpu": Efficiency(0.5, 0.7, 5e-5, basis="default", source="placeholder until refit"),
    # Fitted by analysis.analytic.local.fit_local to the calibration samples of the tiny-cpu profile
    # as first bundled (112 passes of the engine's float32 `tiny` preset through MLX on CPU with
    # 2-thread OpenBLAS, 2-core Xeon VM; fractions of its measured 229 GFLOP/s numpy GEMM and
    # 16.9 GB/s copy): median |error| 7.8 % over all 151 passes, 9.0 % held out. The profile
    # bundled now (a 2-core EPYC VM) carries its own fit in its analytic_cpu_local block, which
    # validate --hardware cpu-local uses on that machine; this prior serves everywhere else. MLX's CPU attention
    # (scores, mask, softmax materialised) runs at ~3 % of the GEMM peak, decode attention at
    # ~1.5 %; batch-cache copies at ~23 % of the copy rate plus ~0.5 ms per layer per copy.
    # bandwidth = 1.0 is a bound, not a measurement: tiny's 21 MB of weights sit in the L3, so
    # no pass streamed weights from DRAM. Fit yours: calibrate --analytic.
    "cpu": Efficiency(
        0.111,
        1.0,
        1.59e-3,
        step_overhead_s=2.1e-4,
        basis="default",
        engine="mlx (CPU, OpenBLAS)",
        source="fit_local on a tiny-cpu profile's calibration passes (2-core Xeon VM): a prior; "
        "fit yours with calibrate --analytic",
        attention=0.0332,
        decode_attention=0.0151,
        copy=0.23,
        copy_overhead_per_layer_s=4.85e-4,
    ),
}


@dataclass(frozen=True)
class Hardware:
    name: str
    title: str
    kind: str
    memory_bytes: float
    bandwidth: float  # bytes/s, peak
    peak_flops: Mapping[str, float]  # dtype -> FLOP/s, peak
    default_compute: str
    efficiency: Efficiency
    family: str = ""
    info: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: the engine whose factors apply (``vllm``, ``mlx-lm``, ``llama.cpp``: see analysis.analytic.serving)
    engine: str = ""
    #: the ``vllm`` engine's factors (a ServingEfficiency) when ``engine == "vllm"``
    serving: Any = field(default=None, compare=False, repr=False)
    #: on-demand USD per hour of one GPU, where the preset has a sourced price (else None)
    price_usd_per_hour: float | None = None
    #: GPUs one replica spans with tensor parallelism (the ``:tp=N`` suffix), and the link their
    #: all-reduces run over (the preset's own ``link``: name, bytes/s one direction, latency s)
    tp: int = 1
    tp_link: str = ""
    tp_link_bandwidth: float = 0.0
    tp_link_latency_s: float = 0.0

    @property
    def spec(self) -> str:
        """The name that loads this hardware again (``a100-80gb-sxm:tp=2``)."""
        return self.name if self.tp == 1 else f"{self.name}:tp={self.tp}"

    def allreduce_seconds(self, nbytes: float) -> float:
        """One ring all-reduce of ``nbytes`` over the ``tp`` GPUs: 2 (tp - 1) / tp x bytes at the
        link's one-direction bandwidth, plus its latency (0 for tp = 1)."""
        if self.tp == 1:
            return 0.0
        return 2.0 * (self.tp - 1) / self.tp * nbytes / self.tp_link_bandwidth + self.tp_link_latency_s

    def peak(self, dtype: str | None = None) -> float:
        d = _DTYPE_ALIASES.get((dtype or self.default_compute).lower(), (dtype or self.default_compute).lower())
        if d not in self.peak_flops:
            raise AnalyticError(f"{self.name} has no {d} peak (has: {', '.join(sorted(self.peak_flops))})")
        return self.peak_flops[d]

    def with_efficiency(self, eff: Efficiency) -> "Hardware":
        return replace(self, efficiency=eff)

    def engines(self) -> list[str]:
        """The engines this preset has factors for."""
        return preset_engines(self.info)

    def summary(self) -> dict[str, Any]:
        d = {
            "hardware": self.name,
            "hardware_title": self.title,
            "engine": self.engine,
            "memory_gb": self.memory_bytes / 1e9,
            "bandwidth_gbs": self.bandwidth / 1e9,
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "compute_dtype": self.default_compute,
            "efficiency": self.efficiency.to_dict(),
            "tp": self.tp,  # (the figures above are one GPU's)
        }
        if self.tp > 1:
            d["tp_link"] = {
                "link": self.tp_link,
                "bandwidth_gbs": self.tp_link_bandwidth / 1e9,
                "latency_s": self.tp_link_latency_s,
            }
        return d


# ---------------------------------------------------------------------- presets file


def read_hardware_file(path: Path | None = None) -> dict[str, Any]:
    p = path or HARDWARE_FILE
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise AnalyticError(f"hardware presets file not found: {p}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AnalyticError(f"hardware presets file {p} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("presets"), dict):
        raise AnalyticError(f"hardware presets file {p} has no 'presets' object")
    return data


def list_hardware() -> list[str]:
    return sorted(read_hardware_file()["presets"])


def _value(preset: Mapping[str, Any], key: str, name: str) -> float:
    fig = preset.get(key)
    v = fig.get("value") if isinstance(fig, Mapping) else fig
    if not isinstance(v, (int, float)) or v <= 0:
        raise AnalyticError(f"hardware preset {name}: {key} must be a positive number")
    return float(v)


def _price_value(preset: Mapping[str, Any], name: str) -> float | None:
    """A preset's USD per hour of one GPU (None: no price; not a finite number > 0: an error)."""
    if preset.get("price_usd_per_hour") is None:
        return None
    v = _value(preset, "price_usd_per_hour", name)
    if not math.isfinite(v):
        raise AnalyticError(f"hardware preset {name}: price_usd_per_hour must be a finite positive number")
    return v


def preset_price(name: str, preset: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A preset's ``price_usd_per_hour`` (None when it has none): ``{"value", "sources": [{"id",
    "url", "title"}], "note"}``, its source ids resolved in the file's ``sources``. ``preset``:
    the preset's block (default: read from hardware.json by ``name``, case-insensitive; a
    ``:tp=N`` suffix is dropped: the price is still one GPU's)."""
    data = None
    if preset is None:
        data = read_hardware_file()
        key = split_hardware(name)[0]
        if key not in data["presets"]:
            raise AnalyticError(f"unknown hardware '{name}' (presets: {', '.join(sorted(data['presets']))})")
        name, preset = key, data["presets"][key]
    value = _price_value(preset, name)
    if value is None:
        return None
    fig = preset["price_usd_per_hour"]
    ids = list(fig.get("sources") or []) if isinstance(fig, Mapping) else []
    known = (data or read_hardware_file())["sources"] if ids else {}
    sources = []
    for sid in ids:
        if sid not in known:
            raise AnalyticError(f"hardware preset {name}: price_usd_per_hour cites unknown source '{sid}'")
        sources.append({"id": sid, "url": known[sid].get("url", ""), "title": known[sid].get("title", "")})
    note = str(fig.get("note", "")) if isinstance(fig, Mapping) else ""
    return {"value": value, "sources": sources, "note": note}


def split_hardware(spec: str) -> tuple[str, int]:
    """(preset name, tensor-parallel degree) of a hardware spec: ``a100-80gb-sxm`` -> (that, 1),
    ``a100-80gb-sxm:tp=2`` -> (that, 2). The name is lower-cased and stripped, not looked up; a bad
    suffix is an :class:`AnalyticError` of one line."""
    text = str(spec).strip()
    name, sep, opts = text.partition(":")
    name = name.strip().lower()
    if not sep:
        return name, 1
    tp = None
    for item in opts.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key != "tp" or not eq:
            raise AnalyticError(
                f"hardware '{text}': unknown option '{item.strip()}' (a preset takes ':tp=N', N GPUs per replica "
                "with tensor parallelism, e.g. a100-80gb-sxm:tp=2)"
            )
        if tp is not None:
            raise AnalyticError(f"hardware '{text}': tp given twice")
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise AnalyticError(f"hardware '{text}': tp must be an integer >= 1 (GPUs per replica), got '{value}'")
        tp = int(value)
    return name, tp if tp is not None else 1


def with_tp(hw: Hardware, tp: int) -> Hardware:
    """``hw`` as a replica of ``tp`` GPUs (:func:`split_hardware`), its all-reduces over the
    preset's own link (tp = 1: one GPU, no link)."""
    if tp == 1:
        return replace(hw, tp=1, tp_link="", tp_link_bandwidth=0.0, tp_link_latency_s=0.0)
    data = read_hardware_file()
    links = data.get("links") or {}
    own = (data["presets"].get(hw.name) or {}).get("link")
    if own is None or own not in links:
        linked = ", ".join(sorted(k for k, v in data["presets"].items() if v.get("link")))
        raise AnalyticError(
            f"hardware '{hw.name}:tp={tp}': the preset names no link between its GPUs, so tensor parallelism "
            f"cannot be priced (presets with one: {linked})"
        )
    entry = links[own]
    bw = _value(entry, "bandwidth_gbs", f"link {own}") * 1e9
    lat = float((entry.get("latency_s") or {}).get("value", 0.0) or 0.0)
    return replace(hw, tp=tp, tp_link=own, tp_link_bandwidth=bw, tp_link_latency_s=lat)


def list_links() -> list[str]:
    """The interconnect presets (``links`` in hardware.json): what a KV transfer between
    replicas runs over (``sim.transfer``)."""
    return sorted(read_hardware_file().get("links") or {})


def link_preset(name: str, latency_s: float | None = None):
    """A ``sim.transfer.Link`` from a link preset (``nvlink4``, ``pcie5-x16``, ...) or a hardware
    preset's own link (``h100-sxm`` -> ``nvlink4``), case-insensitive; ``latency_s`` overrides
    the preset's (published figures give none)."""
    from schedlab.sim.transfer import Link, TransferError

    data = read_hardware_file()
    links = data.get("links") or {}
    key = str(name).strip().lower()
    if key not in links and ":" in key:  # a hardware spec with ':tp=N': its preset's link
        key = split_hardware(key)[0]
    if key not in links and key in data["presets"]:
        own = data["presets"][key].get("link")
        if own is None:
            raise AnalyticError(f"hardware preset {key} names no link (links: {', '.join(sorted(links))})")
        key = own
    if key not in links:
        raise AnalyticError(f"unknown link '{name}' (links: {', '.join(sorted(links))}; or a hardware preset with one)")
    entry = links[key]
    bw = _value(entry, "bandwidth_gbs", f"link {key}")
    lat = latency_s if latency_s is not None else (entry.get("latency_s") or {}).get("value", 0.0)
    try:
        return Link(bw, lat, key)
    except TransferError as exc:
        raise AnalyticError(str(exc)) from None


def _published_engine(preset: Mapping[str, Any]) -> str:
    """The engine kind of a preset's published-figure ``efficiency`` block ('' when unknown)."""
    eff = preset.get("efficiency") or {}
    try:
        return engine_kind(str(eff.get("engine", "")))
    except AnalyticError:
        return ""


def preset_engines(preset: Mapping[str, Any]) -> list[str]:
    """Engines a preset has factors for: its published-figure block's, then ``engines``' keys."""
    out = []
    pub = _published_engine(preset)
    if pub:
        out.append(pub)
    for k in preset.get("engines") or {}:
        if k not in out:
            out.append(k)
    return out


def hardware_from_preset(name: str, preset: Mapping[str, Any], engine: str | None = None) -> Hardware:
    """A preset as a Hardware; ``engine``: whose factors (default: the preset's ``default_engine``)."""
    peaks = {}
    for dtype, fig in (preset.get("peak_tflops") or {}).items():
        v = fig.get("value") if isinstance(fig, Mapping) else fig
        if isinstance(v, (int, float)) and v > 0:
            peaks[dtype] = float(v) * 1e12
    if not peaks:
        raise AnalyticError(f"hardware preset {name} has no peak_tflops")
    kind = str(preset.get("kind", "nvidia-gpu"))
    eff_block = preset.get("efficiency")
    eff = (
        Efficiency.from_dict(eff_block) if eff_block else DEFAULT_EFFICIENCY.get(kind, DEFAULT_EFFICIENCY["nvidia-gpu"])
    )
    serving = None
    chosen = _published_engine(preset) if eff_block else ""
    want = engine if engine is not None else preset.get("default_engine")
    if want:
        want = str(want).strip().lower()
        if want not in ENGINES:
            raise AnalyticError(f"unknown engine '{want}' (engines: {', '.join(ENGINES)})")
        blocks = preset.get("engines") or {}
        if want in blocks:
            serving = ServingEfficiency.from_dict(blocks[want])
            eff = serving.plain()
            chosen = want
        elif want != chosen:
            have = ", ".join(preset_engines(preset)) or "none"
            raise AnalyticError(f"hardware preset {name} has no factors for engine '{want}' (has: {have})")
    return Hardware(
        name=name,
        title=str(preset.get("name", name)),
        kind=kind,
        memory_bytes=_value(preset, "memory_gb", name) * 1e9,
        bandwidth=_value(preset, "bandwidth_gbs", name) * 1e9,
        peak_flops=peaks,
        default_compute=str(preset.get("default_compute", "fp16")),
        efficiency=eff,
        family=str(preset.get("family", "")),
        info=dict(preset),
        engine=chosen,
        serving=serving,
        price_usd_per_hour=_price_value(preset, name),
    )


def load_hardware(
    name: str, *, cache_dir: str | Path | None = None, remeasure: bool = False, engine: str | None = None
) -> Hardware:
    """A preset by name (case-insensitive); ``cpu-local`` is measured (and cached).

    ``engine``: whose factors to use (``vllm``, ``mlx-lm``, ``llama.cpp``); default the
    preset's ``default_engine`` (``vllm`` on NVIDIA GPUs), else its published-figure fit's.
    ``name`` may end in ``:tp=N`` (:func:`split_hardware`): a replica of N GPUs (``Hardware.tp``).
    """
    data = read_hardware_file()
    presets = data["presets"]
    key, tp = split_hardware(name)
    if key not in presets:
        raise AnalyticError(f"unknown hardware '{name}' (presets: {', '.join(sorted(presets))})")
    if tp > 1:
        return with_tp(load_hardware(key, cache_dir=cache_dir, remeasure=remeasure, engine=engine), tp)
    preset = presets[key]
    if key == CPU_LOCAL:
        m = measure_cpu(cache_dir=cache_dir, remeasure=remeasure)
        preset = dict(preset)
        src = [f"measured {m['measured_at']} on {m['machine']}"]
        preset["memory_gb"] = {"value": m["memory_gb"], "sources": src}
        preset["bandwidth_gbs"] = {
            "value": m["copy_gbs"],
            "sources": src,
            "note": f"numpy copy of {m['copy_mb']} MB arrays, read + write bytes per second, best of {m['repeats']}",
        }
        preset["peak_tflops"] = {
            "fp32": {
                "value": m["gemm_gflops"] / 1e3,
                "sources": src,
                "note": f"numpy float32 matmul, n={m['gemm_n']}, best of {m['repeats']}",
            }
        }
        preset["measurement"] = m
    return hardware_from_preset(key, preset, engine)


# ---------------------------------------------------------------------- cpu-local


def cache_dir_default() -> Path:
    env = os.environ.get("SCHEDLAB_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "schedlab"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    try:  # macOS
        import subprocess

        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5)
        return float(out.stdout.strip())
    except Exception:  # pragma: no cover - exotic platforms
        return 8e9


def machine_key() -> str:
    import numpy as np

    return f"{platform.node()}|{platform.system()}|{platform.machine()}|{cpu_model()}|{_cpu_count()} cpus|numpy {np.__version__}"


def _measure(gemm_sizes: tuple[int, ...] = (1024, 1536), copy_mb: int = 128, repeats: int = 4) -> dict[str, Any]:
    """About a second: float32 GEMM at sizes past the caches, and a large copy."""
    import numpy as np

    rng = np.random.default_rng(0)
    best_gemm = 0.0
    for n in gemm_sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        a @ b  # warm-up (threads, page faults)
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            dt = time.perf_counter() - t0
            best_gemm = max(best_gemm, 2.0 * n**3 / dt)
    n_items = copy_mb * (1 << 20) // 4
    src = np.ones(n_items, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch both
    best_copy = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = time.perf_counter() - t0
        best_copy = max(best_copy, 2.0 * src.nbytes / dt)
    return {
        "gemm_gflops": best_gemm / 1e9,
        "gemm_n": list(gemm_sizes),
        "copy_gbs": best_copy / 1e9,
        "copy_mb": copy_mb,
        "repeats": repeats,
        "memory_gb": _memory_bytes() / 1e9,
        "numpy": np.__version__,
    }


def measure_cpu(cache_dir: str | Path | None = None, remeasure: bool = False) -> dict[str, Any]:
    """The cached measurement for this machine, measuring (about a second) when absent."""
    directory = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    path = directory / "cpu-local.json"
    key = machine_key()
    cache: dict[str, Any] = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
            if cache.get("schema") != CPU_CACHE_SCHEMA or not isinstance(cache.get("machines"), dict):
                cache = {}
        except (OSError, json.JSONDecodeError):
            cache = {}
    machines = cache.get("machines", {})
    if not remeasure and isinstance(machines.get(key), dict):
        return machines[key]
    m = _measure()
    m["machine"] = key
    m["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machines[key] = m
    try:  # a read-only home must not stop a simulation
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"schema": CPU_CACHE_SCHEMA, "machines": machines}, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        pass
    return m
