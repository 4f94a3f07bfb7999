"""Make the serving-kernel tables from your own checkout of microsoft/vidur (MIT). Not shipped.

schedlab does not ship Vidur's data: the tables that ``python -m schedlab.analysis.analytic
refit-serving`` (and the tests that recompute the fit) read are made here, from a clone of
Vidur at the commit the committed factors were fitted to. This extracts medians from Vidur's
profiling CSVs; it does not build or run Vidur.

    git clone https://github.com/microsoft/vidur && git -C vidur checkout 7d47513363ec447a741ac5e47241580b47724fbf
    git -C vidur lfs pull --include data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv  # optional
    python analysis/hardware/kernels/extract_vidur.py vidur \
        [--attention vidur/data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv] [--out DIR]

Reads ``data/profiling/compute/{a100,h100,a40}/<org>/<model>/mlp.csv`` and keeps, for one GPU
(no tensor parallelism: ``num_tensor_parallel_workers == 1``) and each token count, the median
of every per-layer operation Vidur times (milliseconds, as in the source). ``--attention``: a
copy of Vidur's A100 Llama-2-7B ``attention.csv`` (a Git LFS object in the repository, so not
in a plain clone) or a transcription of its medians with the same columns; rows marked
interpolated in a ``source`` column are dropped. Writes ``vidur_linear.csv``,
``vidur_attention_a100_llama2_7b.csv`` and ``vidur_models.csv`` into ``--out`` (default:
``$SCHEDLAB_KERNEL_DATA``, else ``.data/vidur-kernels/`` in this repository, which git ignores).
Never commit them.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
#: where refit-serving looks for the tables (analysis.analytic.kernels.kernel_data_dir)
DEFAULT_OUT = Path(os.environ.get("SCHEDLAB_KERNEL_DATA") or REPO / ".data" / "vidur-kernels")
OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
GPUS = ("a100", "h100", "a40")
#: layers per model (vidur/config/model_config.py); the mlp.csv files time one layer
LAYERS = {
    "Llama-2-7b-hf": 32,
    "Llama-2-70b-hf": 80,
    "Meta-Llama-3-8B": 32,
    "Meta-Llama-3-70B": 80,
    "CodeLlama-34b-Instruct-hf": 48,
    "internlm-20b": 60,
    "Qwen-72B": 80,
    "phi-2": 32,
}


def _median(row: dict, op: str) -> str:
    v = row.get(f"time_stats.{op}.median", "")
    return "" if v in ("", "nan", "NaN") else f"{float(v):.6g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vidur", type=Path, help="a checkout of microsoft/vidur")
    ap.add_argument("--attention", type=Path, help="A100 Llama-2-7B attention.csv (or its transcribed medians)")
    ap.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory to write the tables to (default $SCHEDLAB_KERNEL_DATA or {DEFAULT_OUT})",
    )
    a = ap.parse_args(argv)
    out_dir = a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, models = [], {}
    for gpu in GPUS:
        for f in sorted((a.vidur / "data/profiling/compute" / gpu).glob("*/*/mlp.csv")):
            model = f.parent.name
            seen = set()
            with f.open() as fh:
                for r in csv.DictReader(fh):
                    if int(r["num_tensor_parallel_workers"]) != 1:
                        continue
                    t = int(r["num_tokens"])
                    if t in seen:
                        continue
                    seen.add(t)
                    rows.append([gpu, model, t] + [_median(r, op) for op in OPS])
                    models[model] = [
                        model,
                        f"{f.parent.parent.name}/{model}",
                        LAYERS[model],
                        r["n_head"],
                        r["n_kv_head"],
                        r["n_embd"],
                        r["n_expanded_embd"],
                        r["vocab_size"],
                        r["use_gated_mlp"],
                    ]
    rows.sort(key=lambda x: (x[0], x[1], x[2]))
    if not rows:
        raise SystemExit(f"no data/profiling/compute/*/*/*/mlp.csv under {a.vidur}: is it a clone of microsoft/vidur?")
    with (out_dir / "vidur_linear.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["gpu", "model", "num_tokens"] + [f"{op}_ms" for op in OPS])
        w.writerows(rows)
    with (out_dir / "vidur_models.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "model",
                "hf_name",
                "layers",
                "n_head",
                "n_kv_head",
                "n_embd",
                "n_expanded_embd",
                "vocab_size",
                "use_gated_mlp",
            ]
        )
        w.writerows(sorted(models.values()))
    if a.attention:
        out = []
        with a.attention.open() as fh:
            for r in csv.DictReader(fh):
                if r.get("source", "real") != "real":
                    continue
                pre = str(r["is_prefill"]).lower() == "true"
                t = r["time_stats.attn_prefill.median" if pre else "time_stats.attn_decode.median"]
                out.append(
                    [
                        "prefill" if pre else "decode",
                        int(r["batch_size"]),
                        int(r["prefill_chunk_size"]),
                        int(r["kv_cache_size"]),
                        f"{float(t):.6g}",
                    ]
                )
        out.sort()
        with (out_dir / "vidur_attention_a100_llama2_7b.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["kind", "batch_size", "prefill_chunk_size", "kv_cache_size", "median_ms"])
            w.writerows(out)
    print(
        f"wrote the tables to {out_dir}"
        + ("" if a.attention else " (no --attention: vidur_attention_a100_llama2_7b.csv not written)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
