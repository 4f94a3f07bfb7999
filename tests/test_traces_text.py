"""Text in traces: prompt/messages in the schema and JSON, validation, counting tokens with a
tokenizer (a real ``tokenizers`` tokenizer built here), and the errors without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from schedlab import traces
from schedlab.traces import Request, Trace, TraceError
from schedlab.traces.transforms import scale_lengths, scale_rate, window

ROOT = Path(__file__).resolve().parents[1]

WORDS = "the a sky is blue why be brief once upon time there was king who ruled land".split()


class Chat:
    """A word tokenizer with a chat template, as transformers' tokenizers have it:
    ``add_generation_prompt`` defaults to False and ids are returned."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.calls: list[bool] = []

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        self.calls.append(add_generation_prompt)
        text = " ".join(f"<{m['role']}> {m['content']} </s>" for m in messages)
        if add_generation_prompt:
            text += " <assistant>"
        return self.encode(text) if tokenize else text


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    vocab = {"[UNK]": 0, "<system>": 1, "<user>": 2, "<assistant>": 3, "</s>": 4}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return t


def _write(tmp_path: Path, rows: list[dict], name: str = "t.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"name": "t", "requests": rows}))
    return p


TEXT_ROWS = [
    {"id": "p", "arrival_s": 0.0, "prompt": "once upon a time there was a king", "output_tokens": 16},
    {
        "id": "m",
        "arrival_s": 0.5,
        "output_tokens": 8,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue"}],
    },
    {"id": "c", "arrival_s": 1.0, "prompt_tokens": 12, "output_tokens": 4},
]


# ---------------------------------------------------------------------------------------
# counting


def test_text_trace_counts_with_a_tokenizer(tmp_path, tok):
    chat = Chat(tok)
    tr = traces.load(str(_write(tmp_path, TEXT_ROWS)), tokenizer=chat)
    by = {r.id: r for r in tr.requests}
    assert by["p"].prompt_tokens == 8
    # <system> be brief </s> (4) <user> why is the sky blue </s> (7) <assistant> (1)
    assert by["m"].prompt_tokens == 12 == len(traces.prompt_ids(by["m"], chat))
    assert chat.calls and all(chat.calls)  # the generation prompt is asked for
    assert by["c"].prompt_tokens == 12 and not by["c"].has_text
    assert by["m"].chat()[1] == {"role": "user", "content": "why is the sky blue"}


def test_text_without_tokenizer_is_a_clear_error(tmp_path):
    p = _write(tmp_path, TEXT_ROWS)
    with pytest.raises(TraceError) as ei:
        traces.load(str(p))
    msg = str(ei.value)
    assert "\n" not in msg and "2 of 3 request(s)" in msg and "first: p" in msg
    assert "--model" in msg and "tokenizer" in msg and "prompt_tokens" in msg
    # the raw loader keeps the trace uncounted; tokenize() counts it
    raw = traces.load_json(p)
    assert [r.id for r in raw.uncounted] == ["p", "m"]
    with pytest.raises(TraceError, match="--model"):
        traces.require_counts(raw)


def test_counts_in_the_file_are_kept_unless_recounted(tmp_path, tok):
    rows = [{"id": "p", "arrival_s": 0, "prompt": "the sky is blue", "prompt_tokens": 40, "output_tokens": 2}]
    p = _write(tmp_path, rows)
    assert traces.load(str(p)).requests[0].prompt_tokens == 40  # counted: no tokenizer needed
    assert traces.load(str(p), tokenizer=tok).requests[0].prompt_tokens == 40
    assert traces.load(str(p), tokenizer=tok, recount=True).requests[0].prompt_tokens == 4


def test_tokenizers_encoding_and_protocol(tok):
    # tokenizers.Tokenizer.encode returns an Encoding: accepted as it is
    assert isinstance(tok, traces.Tokenizer)
    tr = traces.tokenize(Trace("x", "", [Request("a", 0.0, None, 3, prompt="the blue sky")]), tok)
    assert tr.requests[0].prompt_tokens == 3


def test_tokenizer_problems_are_one_line(tok):
    chat_only = Trace("x", "", [Request("m", 0.0, None, 3, messages=(("user", "why"),))])
    with pytest.raises(TraceError) as ei:
        traces.tokenize(chat_only, tok)  # no apply_chat_template
    assert "request m" in str(ei.value) and "chat template" in str(ei.value)

    class Broken:
        def encode(self, text):
            raise RuntimeError("vocab\nmissing")

    with pytest.raises(TraceError) as ei:
        traces.tokenize(Trace("x", "", [Request("p", 0.0, None, 3, prompt="hi")]), Broken())
    msg = " ".join(str(ei.value).split())
    assert "request p" in msg and "RuntimeError" in msg

    class Empty:
        def encode(self, text):
            return []

    with pytest.raises(TraceError, match="0 tokens"):
        traces.tokenize(Trace("x", "", [Request("p", 0.0, None, 3, prompt="hi")]), Empty())
    with pytest.raises(TraceError, match="not a tokenizer"):
        traces.tokenize(Trace("x", "", [Request("p", 0.0, None, 3, prompt="hi")]), object())


# ---------------------------------------------------------------------------------------
# JSON


def test_json_round_trip_keeps_text(tmp_path, tok):
    tr = traces.tokenize(traces.load_json(_write(tmp_path, TEXT_ROWS)), Chat(tok))
    p = traces.save_json(tr, tmp_path / "again.json")
    back = traces.load(str(p))
    assert back.requests == tr.requests
    assert back.requests[0].prompt == "once upon a time there was a king"
    assert back.requests[1].messages == (("system", "be brief"), ("user", "why is the sky blue"))
    assert traces.dumps_json(back) == p.read_text()
    # uncounted requests round-trip too (no prompt_tokens written)
    raw = traces.load_json(_write(tmp_path, TEXT_ROWS))
    row = json.loads(traces.dumps_json(raw).splitlines()[2].rstrip(","))
    assert "prompt_tokens" not in row and row["prompt"].startswith("once")


def _req(**kw):
    row = {"id": "a", "arrival_s": 0.0, "output_tokens": 4}
    row.update(kw)
    return row


BAD = [
    ("nothing", _req(), ["request a", "no prompt", "prompt_tokens", "messages"]),
    ("both", _req(prompt="x", messages=[{"role": "user", "content": "y"}]), ["not both"]),
    ("prompt-type", _req(prompt=5), ["'prompt' must be a string"]),
    ("prompt-empty", _req(prompt=""), ["empty prompt"]),
    ("msgs-type", _req(messages="hello"), ["'messages' must be a non-empty list"]),
    ("msgs-empty", _req(messages=[]), ["'messages' must be a non-empty list"]),
    ("msg-type", _req(messages=["hello"]), ["messages[0]", "object"]),
    ("msg-role-missing", _req(messages=[{"content": "x"}]), ["messages[0]", "'role'"]),
    ("msg-role-bad", _req(messages=[{"role": "usr", "content": "x"}]), ["messages[0]", "role", "user"]),
    ("msg-content", _req(messages=[{"role": "user", "content": None}]), ["messages[0]", "'content' must be a string"]),
    ("msg-extra", _req(messages=[{"role": "user", "content": "x", "name": "n"}]), ["unsupported", "'name'"]),
    ("msg-blank", _req(messages=[{"role": "user", "content": ""}]), ["empty prompt"]),
    ("neg-count", _req(prompt_tokens=-3), ["prompt_tokens must be >= 1", "-3"]),
    ("neg-count-text", _req(prompt="x", prompt_tokens=-1), ["prompt_tokens must be >= 1"]),
    ("null-count", _req(prompt_tokens=None), ["'prompt_tokens' must be an integer"]),
    ("neg-output", _req(prompt="x", output_tokens=-2), ["output_tokens"]),
]


@pytest.mark.parametrize("row,needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_text_rows_are_one_line(tmp_path, row, needles):
    p = _write(tmp_path, [row], "bad.json")
    with pytest.raises(TraceError) as ei:
        traces.load(str(p))
    msg = str(ei.value)
    assert "\n" not in msg and "bad.json" in msg
    for needle in needles:
        assert needle in msg, msg


def test_request_objects_are_validated():
    with pytest.raises(TraceError, match="neither prompt_tokens nor text"):
        Trace("x", "", [Request("a", 0.0, None, 3)])
    with pytest.raises(TraceError, match="not both"):
        Trace("x", "", [Request("a", 0.0, 5, 3, prompt="x", messages=(("user", "y"),))])
    hash(Request("a", 0.0, 5, 3, messages=(("user", "y"),)))  # still hashable


# ---------------------------------------------------------------------------------------
# transforms, stats, imports


def test_transforms_keep_text_and_scaling_drops_it(tmp_path, tok):
    tr = traces.tokenize(traces.load_json(_write(tmp_path, TEXT_ROWS)), Chat(tok))
    for out in (scale_rate(tr, 2), window(tr, 0, 10), scale_lengths(tr, output=2)):
        assert [r.prompt for r in out.requests] == [r.prompt for r in tr.requests]
        assert [r.messages for r in out.requests] == [r.messages for r in tr.requests]
    longer = scale_lengths(tr, prompt=2)
    assert not any(r.has_text for r in longer.requests)  # the text no longer fits the count
    with pytest.raises(TraceError, match="count"):
        scale_lengths(traces.load_json(_write(tmp_path, TEXT_ROWS)), prompt=2)
    assert traces.trace_stats(tr)["with_text"] == 2


def test_importing_traces_stays_light():
    code = (
        "import sys, traces, traces.datasets, traces.text; "
        "bad = [m for m in ('mlx', 'tokenizers', 'transformers', 'numpy', 'sim', 'engine') "
        "if m in sys.modules]; assert not bad, bad"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
