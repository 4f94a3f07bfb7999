"""``export-mlx``: write a GGUF model (or any model the engine loads) as an mlx-lm checkpoint.

The directory holds ``model.safetensors`` (mlx-lm's parameter names), ``config.json``,
``tokenizer.json`` and ``tokenizer_config.json`` (chat template, BOS/EOS), so mlx-lm's own
``mlx_lm.load``/``mlx_lm.generate``/``mlx_lm.server --model OUTDIR`` load it, and
``run-real --model OUTDIR`` too.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import make_app, run_app

export_app = make_app(
    "Write a model (a GGUF preset such as smollm2-135m, a .gguf file, or a checkpoint) as an "
    "mlx-lm checkpoint directory that mlx-lm's own load/generate/server read."
)


@export_app.command()
def export_mlx(
    model: str = typer.Argument(
        ..., help="smollm2-135m, gemma3-270m, a llama or gemma3 .gguf file, or an mlx-lm checkpoint directory"
    ),
    outdir: Path = typer.Argument(..., help="directory to write (must be new or empty)"),
    dtype: str = typer.Option(
        "quantized",
        "--dtype",
        help="quantized (the file's packed weights: smallest; fast on "
        "Apple GPUs), float32, float16 or bfloat16 (dequantized)",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="write into a non-empty OUTDIR"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors"),
) -> None:
    """Export MODEL to OUTDIR as an mlx-lm checkpoint."""
    from schedlab.engine.gguf import export_mlx as write
    from schedlab.engine.models import check_spec, load_model

    check_spec(model, dtype)  # one-line errors before mlx is imported
    info = load_model(model, dtype=dtype)
    out = write(info, outdir, overwrite=overwrite)
    if not quiet:
        files = ", ".join(sorted(p.name for p in out.iterdir()))
        print(f"wrote {out} ({files}): {info.n_params / 1e6:.1f} M parameters, dtype {info.dtype}")


def main() -> None:
    run_app(export_app, "export-mlx")


if __name__ == "__main__":
    main()
