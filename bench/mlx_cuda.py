"""The engine on MLX's CUDA backend: what runs on a borrowed NVIDIA GPU (device side).

Subcommands (each writes one JSON file; nothing here is GPU-specific, so every one also runs
on MLX's CPU backend with a small model, which is how it was tested):

``env OUT``
    versions, the default device, ``mx.device_info()``, and two MLX ceilings on this device:
    a large bf16 matrix product (TFLOP/s) and a large copy (GB/s counting read + write).
``greedy OUT --model SPEC --dtype D [--policies all]``
    every bundled policy in the real loop (``sim.loop.run`` + ``MLXBackend``) on the engine
    tests' 10-request trace; each request's greedy tokens against the single-sequence
    reference (``engine.backend.reference_tokens``): equal, or the first position they differ.
``passes OUT --model SPEC --dtype D``
    per-pass times of the engine's own execute path (``engine.calibrate.Rig``: KV primed,
    the state machine's shapes) at the shapes of ``bench/results/gpu_h100_passes.json``
    (prefill chunks at a context, decode batches at one context), each with its ``PassShape``
    so the analytic models' predictions can be computed afterwards on any machine.
``checkpoint DIR --preset NAME --dtype D``
    a random-weight checkpoint of a shape preset (below) that the CLI's ``--model DIR`` loads.

Shape presets added at run time (random weights, as the engine's own presets):
``llama-1b`` (Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads, ffn 8192, vocab 128256) and
``llama-8b`` (Llama-3.1-8B: 32 layers, hidden 4096, 32/8 heads, ffn 14336, vocab 128256).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = {
    "llama-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, rope_theta=500000.0),
    "llama-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
}

POLICIES = (("mlx-default", {}), ("prefer-prefill", {}), ("static", {"batch_size": 4}),
            ("slots", {"n_slots": 4}), ("chunked-prefill", {"budget": 96}), ("unified", {"token_budget": 128}))


def register_shapes() -> None:
    from schedlab.engine import models

    for name, cfg in SHAPES.items():
        models.PRESETS.setdefault(name, dict((k, v) for k, v in cfg.items() if k != "rope_theta"))


def load(spec: str, dtype: str):
    register_shapes()
    from schedlab.engine.models import load_model

    t0 = time.perf_counter()
    info = load_model(spec, dtype=dtype)  # (presets keep the engine's rope_theta: values, not times)
    return info, time.perf_counter() - t0


def write(out: str, data: dict[str, Any]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {out}", flush=True)


# ----------------------------------------------------------------------------- env

def cmd_env(args) -> dict[str, Any]:
    from schedlab import engine  # noqa: F401
    import mlx.core as mx
    import mlx_lm

    out: dict[str, Any] = {"python": sys.version.split()[0], "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                           "default_device": str(mx.default_device()), "platform": platform.platform()}
    try:
        out["cuda_available"] = bool(mx.cuda.is_available())
    except Exception as exc:  # noqa: BLE001
        out["cuda_available"] = f"{type(exc).__name__}: {exc}"
    try:
        out["device_info"] = {k: v for k, v in mx.device_info().items()}
    except Exception as exc:  # noqa: BLE001
        out["device_info"] = f"{type(exc).__name__}: {exc}"
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    n = args.gemm
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    times = []
    for i in range(8):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[3:])
    out["gemm_bf16"] = {"n": n, "median_s": med, "tflops": 2 * n ** 3 / med / 1e12}
    m = args.copy_mb * 2**20 // 2
    x = mx.random.normal((m,)).astype(mx.bfloat16)
    mx.eval(x)
    times = []
    for i in range(8):
        t0 = time.perf_counter()
        y = x + 1
        mx.eval(y)
        times.append(time.perf_counter() - t0)
        del y
    med = statistics.median(times[3:])
    out["copy"] = {"bytes_each_way": m * 2, "median_s": med, "gbs_read_plus_write": 2 * m * 2 / med / 1e9}
    return out


# -------------------------------------------------------------------------- greedy

def test_trace():
    from schedlab.traces.schema import Request

    rows = [("a", 0.0, 300, 60), ("b", 0.0, 10, 45), ("c", 0.0, 129, 1), ("d", 0.0, 64, 30),
            ("e", 0.0, 1, 12), ("f", 0.005, 257, 20), ("g", 0.02, 77, 25), ("h", 0.03, 200, 2),
            ("i", 0.05, 33, 40), ("j", 0.06, 150, 18)]
    return [Request(rid, t, p, o) for rid, t, p, o in rows]


def cmd_greedy(args) -> dict[str, Any]:
    from schedlab import engine  # noqa: F401
    from schedlab.engine.backend import MLXBackend, reference_tokens
    from schedlab.engine.sampling import prompt_ids
    from schedlab.policies import make_policy
    from schedlab.sim.cost import LinearCostModel
    from schedlab.sim.loop import run

    info, load_s = load(args.model, args.dtype)
    trace = test_trace()
    t0 = time.perf_counter()
    refs = {r.id: reference_tokens(info, prompt_ids(0, r.id, r.prompt_tokens, info.vocab_size), r.output_tokens)
            for r in trace}
    ref_s = time.perf_counter() - t0
    out: dict[str, Any] = {"model": info.name, "dtype": info.dtype, "activation_dtype": info.activation_dtype,
                           "parameters": info.n_params, "load_s": load_s, "reference_s": ref_s,
                           "requests": len(trace), "tokens": sum(r.output_tokens for r in trace), "policies": {}}
    wanted = [p for p in POLICIES if args.policies == "all" or p[0] in args.policies.split(",")]
    for name, opts in wanted:
        t0 = time.perf_counter()
        try:
            backend = MLXBackend(info, ignore_eos=True)
            res = run(test_trace(), make_policy(name, opts), LinearCostModel({}), kv_capacity=100_000, backend=backend)
            if res.error:
                raise RuntimeError(res.error)
            per = {}
            for r in trace:
                got, ref = backend.tokens.get(r.id, []), refs[r.id]
                first = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), None)
                if first is None and len(got) != len(ref):
                    first = min(len(got), len(ref))
                per[r.id] = first
            equal = sum(1 for v in per.values() if v is None)
            out["policies"][name] = {"options": opts, "equal_requests": equal, "first_difference": per,
                                     "steps": len(res.steps), "wall_s": time.perf_counter() - t0}
            print(f"greedy {info.name} {info.dtype} {name}: {equal}/{len(trace)} requests equal the reference",
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            out["policies"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"greedy {name}: {type(exc).__name__}: {exc}", flush=True)
    out["all_equal"] = all(v.get("equal_requests") == len(trace) for v in out["policies"].values())
    return out


# -------------------------------------------------------------------------- passes

PREFILL = ((64, 0), (128, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (512, 1024), (512, 2048),
           (512, 4096))
DECODE_ROWS = (1, 8, 32, 64, 128, 256)
DECODE_CTX = (512, 1024, 2048, 4096)


def shape_json(shape) -> dict[str, Any]:
    return {"decode": list(shape.decode_contexts), "prefill": [list(x) for x in shape.prefill],
            "prefill_done": list(shape.prefill_done), "joins": getattr(shape, "joins", 0),
            "leaves": getattr(shape, "leaves", 0)}


def cmd_passes(args) -> dict[str, Any]:
    from schedlab import engine  # noqa: F401
    from schedlab.engine.calibrate import Rig
    from schedlab.policies.base import Pass

    info, load_s = load(args.model, args.dtype)
    rig = Rig(info)
    reps = args.reps
    max_kv = args.max_kv_tokens
    rows_out: list[dict[str, Any]] = []

    def timed(state, p):
        shape = state.shape(p)
        dt = rig.backend.execute(p, shape, state)
        for r in state.apply_pass(p, 0.0):
            rig.backend.release(r)
        state.step_index += 1
        return shape, dt

    def prefill(n: int, c: int) -> tuple[Any, list[float]]:
        secs, shape = [], None
        for _ in range(reps + 2):
            state, (rid,) = rig.scenario([(c + n, 2)])
            rig.admit(state, [rid], prime=c)
            shape, dt = timed(state, Pass(prefill=((rid, n),)))
            secs.append(dt)
            rig.close(state)
        return shape, secs[2:]

    def decode(b: int, c: int) -> tuple[Any, list[float]]:
        state, ids = rig.scenario([(c, reps + 6)] * b)
        rig.admit(state, ids, prime=c - 1)
        timed(state, Pass(decode=tuple(ids)))  # the batch forms (merge): not timed
        secs, shape = [], None
        for i in range(reps + 2):
            shape, dt = timed(state, Pass(decode=tuple(ids)))
            secs.append(dt)
        rig.close(state)
        return shape, secs[2:]

    # warm-up (first forwards compile kernels)
    t0 = time.perf_counter()
    prefill(64, 0)
    decode(4, 64)
    warm_s = time.perf_counter() - t0
    jobs = [("prefill", n, c) for n, c in PREFILL] + [("decode", b, c) for c in DECODE_CTX for b in DECODE_ROWS]
    for kind, a, c in jobs:
        if kind == "decode" and a * c > max_kv:
            continue
        if kind == "prefill" and a + c > args.max_prefill:
            continue
        t0 = time.perf_counter()
        try:
            shape, secs = prefill(a, c) if kind == "prefill" else decode(a, c)
            name = f"prefill n={a} ctx={c}" if kind == "prefill" else f"decode rows={a} ctx={c}"
            rows_out.append({"name": name, "kind": kind, "shape": shape_json(shape), "median_ms": statistics.median(secs) * 1e3,
                             "min_ms": min(secs) * 1e3, "max_ms": max(secs) * 1e3, "reps": len(secs),
                             "wall_s": time.perf_counter() - t0})
            print(f"passes {info.name}: {name}: {rows_out[-1]['median_ms']:.2f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001
            rows_out.append({"name": f"{kind} {a} {c}", "error": f"{type(exc).__name__}: {exc}"})
            print(f"passes {kind} {a} {c}: {type(exc).__name__}: {exc}", flush=True)
    return {"model": info.name, "dtype": info.dtype, "activation_dtype": info.activation_dtype,
            "parameters": info.n_params, "config": info.config, "load_s": load_s, "warmup_s": warm_s,
            "timing": "wall clock around MLXBackend.execute (one mx.eval per pass, synchronous), median of reps after 2 discarded",
            "passes": rows_out}


def cmd_checkpoint(args) -> dict[str, Any]:
    from schedlab import engine  # noqa: F401
    from schedlab.engine.models import save_checkpoint

    info, load_s = load(args.preset, args.dtype)
    t0 = time.perf_counter()
    save_checkpoint(info, args.out)
    return {"preset": args.preset, "dtype": args.dtype, "parameters": info.n_params, "load_s": load_s,
            "save_s": time.perf_counter() - t0, "dir": args.out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("out")
    e.add_argument("--gemm", type=int, default=8192)
    e.add_argument("--copy-mb", type=int, default=1024)
    g = sub.add_parser("greedy")
    g.add_argument("out")
    g.add_argument("--model", default="micro")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--policies", default="all")
    p = sub.add_parser("passes")
    p.add_argument("out")
    p.add_argument("--model", default="micro")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--max-kv-tokens", type=int, default=131072)
    p.add_argument("--max-prefill", type=int, default=10**9)
    c = sub.add_parser("checkpoint")
    c.add_argument("out")
    c.add_argument("--preset", default="llama-1b")
    c.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    fn = {"env": cmd_env, "greedy": cmd_greedy, "passes": cmd_passes, "checkpoint": cmd_checkpoint}[args.cmd]
    data = fn(args)
    data["elapsed_s"] = time.perf_counter() - t0
    if args.cmd != "checkpoint":
        write(args.out, data)
    else:
        write(str(Path(args.out) / "made.json"), data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
