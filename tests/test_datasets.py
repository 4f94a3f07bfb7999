"""traces.datasets: vLLM's random and sonnet datasets, request rates, dataset specs.

Tokenizers here are real ``tokenizers`` tokenizers built in the test (a byte-level BPE
trained on the sonnet lines, a word-level one over their words), not fakes: prompt lengths
are checked by encoding the prompts again."""

from __future__ import annotations

import hashlib
import math
import statistics
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from simkit import command

from schedlab import traces
from schedlab.traces import TraceError
from schedlab.traces.datasets import (
    SONNET_BASE_PROMPT,
    SONNET_FILE,
    length_range,
    parse_spec,
    random_dataset,
    request_times,
    sonnet_dataset,
    sonnet_lines,
)

LINES = sonnet_lines()


class ChatML:
    """A tokenizer with a chat template (ChatML, as SmolLM2's): the template renders a
    string, which is encoded; ``as_ids`` returns ids instead, as transformers' does."""

    def __init__(self, tok: Tokenizer, as_ids: bool = False):
        self.tok = tok
        self.as_ids = as_ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def apply_chat_template(self, messages, add_generation_prompt: bool = False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if self.as_ids else text


def make_bpe() -> Tokenizer:
    """A byte-level BPE trained on the sonnet lines (500 tokens, ChatML's special tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(LINES, trainer=trainer)
    assert tok.get_vocab_size() > 300
    return tok


def make_chat_bpe() -> ChatML:
    """For ``python -m schedlab.traces.build --sonnet-tokenizer test_datasets:make_chat_bpe``."""
    return ChatML(make_bpe())


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return make_bpe()


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    vocab = {"[UNK]": 0}
    for line in LINES + [SONNET_BASE_PROMPT]:
        for w in line.split():
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _n(tok, r) -> int:
    return len(traces.prompt_ids(r, tok))


# ---------------------------------------------------------------------------------------
# the sonnet file


def test_sonnet_file_is_vllms():
    data = SONNET_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == "d58663195ba6780da5f029b920c7ac00cad1e435ee1df7e03bf9ec2470f8dea4"
    assert len(LINES) == 518 and LINES[0] == "FROM fairest creatures we desire increase,\n"
    assert traces.resolve("sonnet").name == "sonnet.json"  # a bare "sonnet" is the bundled trace


# ---------------------------------------------------------------------------------------
# arrivals


def test_rate_inf_sends_everything_at_zero():
    assert request_times(50, math.inf) == [0.0] * 50
    tr = traces.load("random:n=30,input_len=16,output_len=4")
    assert {r.arrival_s for r in tr.requests} == {0.0}


def test_poisson_arrivals_span_and_spread():
    n, rate = 2000, 4.0
    t = request_times(n, rate, seed=5)
    assert t[0] == 0.0 and all(a <= b for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    # vLLM scales the cumulated gaps so request n is sent at exactly n / rate; re-based,
    # the span is that less the first gap (one gap: ~1 / rate)
    assert n / rate - 5 / rate < t[-1] < n / rate
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert 0.9 < cv < 1.1  # exponential gaps


def test_burstiness_shapes_the_gaps():
    even = request_times(100, 2.0, burstiness=math.inf)
    assert all(b - a == pytest.approx(0.5, abs=1e-6) for a, b in zip(even, even[1:]))
    bursty = request_times(3000, 2.0, burstiness=0.25, seed=1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.pstdev(gaps) / statistics.mean(gaps) > 1.6  # gamma(k=0.25): CV 2


# ---------------------------------------------------------------------------------------
# random


def test_random_seeds_reproduce_and_differ():
    spec = "random:n=200,input_len=512,output_len=128,range_ratio=0.5,rate=2"
    a, b, c = (traces.dumps_json(traces.load(spec, seed=s)) for s in (7, 7, 8))
    assert a == b and a != c
    # the rate changes the arrivals, not the lengths
    slow = traces.load(spec.replace("rate=2", "rate=0.5"), seed=7)
    fast = traces.load(spec, seed=7)
    assert [(r.prompt_tokens, r.output_tokens) for r in slow.requests] == [
        (r.prompt_tokens, r.output_tokens) for r in fast.requests
    ]
    assert slow.requests[-1].arrival_s == pytest.approx(4 * fast.requests[-1].arrival_s)


@pytest.mark.parametrize("input_len,output_len,ratio", [(512, 128, 0.5), (100, 3, 0.9), (7, 1, 0.3)])
def test_random_range_ratio_bounds(input_len, output_len, ratio):
    tr = random_dataset(n=3000, input_len=input_len, output_len=output_len, range_ratio=ratio, seed=2)
    ins = [r.prompt_tokens for r in tr.requests]
    outs = [r.output_tokens for r in tr.requests]
    lo, hi = math.floor(input_len * (1 - ratio)), math.ceil(input_len * (1 + ratio))
    olo, ohi = max(1, math.floor(output_len * (1 - ratio))), max(1, math.ceil(output_len * (1 + ratio)))
    assert (lo, hi) == length_range(input_len, ratio) and (olo, ohi) == length_range(output_len, ratio, 1)
    assert min(ins) == max(lo, 1) and max(ins) == hi  # both ends reached, nothing beyond
    assert min(outs) == olo and max(outs) == ohi
    assert statistics.mean(ins) == pytest.approx((max(lo, 1) + hi) / 2, rel=0.05)


def test_random_fixed_lengths_and_shared_prefix():
    tr = traces.load("random:n=50,input_len=300,output_len=20,prefix_len=1100")
    assert {(r.prompt_tokens, r.output_tokens) for r in tr.requests} == {(1400, 20)}
    # the prefix's two whole 512-token blocks are shared (the engine makes equal ids for them)
    assert len({r.prefix_ids for r in tr.requests}) == 1 and len(tr.requests[0].prefix_ids) == 2
    other = traces.load("random:n=5,input_len=300,output_len=20,prefix_len=1100", seed=1)
    assert other.requests[0].prefix_ids != tr.requests[0].prefix_ids
    assert traces.load("random:n=5,prefix_len=511").requests[0].prefix_ids is None
    var = random_dataset(n=500, input_len=100, range_ratio=0.2, prefix_len=40)
    assert all(40 + 80 <= r.prompt_tokens <= 40 + 120 for r in var.requests)


def test_random_defaults_are_vllms():
    tr = traces.load("random")
    assert len(tr) == 1000 and {(r.prompt_tokens, r.output_tokens) for r in tr.requests} == {(1024, 128)}
    assert "rate inf" in tr.description


def test_random_runs_in_the_simulator():
    from schedlab.policies import make_policy
    from schedlab.sim import run_replica
    from simkit import cost_model

    tr = traces.load("random:n=40,input_len=64,output_len=8,range_ratio=0.5,rate=20", seed=3)
    res = run_replica(tr.requests, make_policy("unified", {}), cost_model(), kv_capacity=100_000, trace_name=tr.name)
    assert len(res.requests) == 40 and all(r.finish_s is not None for r in res.requests)


# ---------------------------------------------------------------------------------------
# sonnet


@pytest.mark.parametrize("kind", ["chat-str", "chat-ids", "plain", "words"])
def test_sonnet_lengths_are_exact(kind, bpe, words):
    tok = {"chat-str": ChatML(bpe), "chat-ids": ChatML(bpe, as_ids=True), "plain": bpe, "words": words}[kind]
    for input_len, prefix_len in ((1024, 200), (333, 0), (120, 100)):
        tr = sonnet_dataset(tok, n=25, input_len=input_len, output_len=64, prefix_len=prefix_len, rate=3.0, seed=4)
        assert len(tr) == 25
        for r in tr.requests:
            assert r.prompt_tokens == input_len == _n(tok, r), (kind, r.id)
            assert r.output_tokens == 64
            if kind.startswith("chat"):
                assert r.prompt is None and r.messages[0][0] == "user" and len(r.messages) == 1
            else:
                assert r.messages is None and r.prompt.startswith(SONNET_BASE_PROMPT)


def test_sonnet_prompts_are_sonnet_lines(bpe):
    tr = sonnet_dataset(ChatML(bpe), n=20, input_len=600, output_len=8, prefix_len=0, seed=1)
    for r in tr.requests:
        text = r.messages[0][1]
        assert text.startswith(SONNET_BASE_PROMPT)
        rest = text[len(SONNET_BASE_PROMPT) :]
        # whole file lines (the file's last line has no newline, so, as in vLLM, it runs
        # into the next one), then the start of one more line
        while True:
            line = next((x for x in LINES if rest.startswith(x)), None)
            if line is None:
                break
            rest = rest[len(line) :]
        assert rest == "" or any(x.startswith(rest) for x in LINES), rest


def test_sonnet_prefix_is_shared(bpe):
    tok = ChatML(bpe)
    tr = sonnet_dataset(tok, n=12, input_len=800, output_len=8, prefix_len=300, seed=2)
    texts = [r.messages[0][1] for r in tr.requests]
    ids = [traces.prompt_ids(r, tok) for r in tr.requests]
    common = 0
    while all(len(x) > common for x in ids) and len({x[common] for x in ids}) == 1:
        common += 1
    assert 240 <= common <= 360  # whole lines: about prefix_len tokens, chat header included
    k = next(
        i for i in range(len(LINES), 0, -1) if all(t.startswith(SONNET_BASE_PROMPT + "".join(LINES[:i])) for t in texts)
    )
    assert k >= 10  # the file's first lines, in order
    # without a prefix the prompts part right after the base prompt
    free = sonnet_dataset(tok, n=12, input_len=800, output_len=8, prefix_len=0, seed=2)
    firsts = {r.messages[0][1][len(SONNET_BASE_PROMPT) :].splitlines()[0] for r in free.requests}
    assert len(firsts) > 6


def test_sonnet_seeds_reproduce_and_differ(bpe):
    tok = ChatML(bpe)
    spec = "sonnet:n=15,input_len=400,output_len=32,prefix_len=120,rate=2"
    a, b, c = (traces.dumps_json(traces.load(spec, seed=s, tokenizer=tok)) for s in (3, 3, 4))
    assert a == b and a != c
    tr = traces.load(spec, seed=3, tokenizer=tok)
    assert tr.requests[0].arrival_s == 0.0 and tr.requests[-1].arrival_s > 0
    assert "exactly 400 tokens" in tr.description


def test_sonnet_needs_a_tokenizer():
    for spec in ("sonnet:", "sonnet:n=5,input_len=256"):
        with pytest.raises(TraceError) as ei:
            traces.load(spec)
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith("sonnet:") and "--model" in msg and "tokenizer" in msg
    # the bare name is the bundled file, which needs none
    assert len(traces.load("sonnet")) == 100
    # simulate has no --model: its error says which commands count with one, and what simulate takes
    proc = subprocess.run([*command("simulate"), "-p", "vllm", "-t", "sonnet:n=3"], capture_output=True, text=True)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "\n" not in err and "run-real" in err and "sonnet.json" in err, err
    helps = {
        c: subprocess.run([*command(c), "--help"], capture_output=True, text=True).stdout
        for c in ("run-real", "simulate")
    }
    assert "--model" in helps["run-real"] and "--model " not in helps["simulate"]


def test_sonnet_impossible_lengths(bpe):
    tok = ChatML(bpe)
    with pytest.raises(TraceError, match="base prompt"):
        sonnet_dataset(tok, n=2, input_len=10, output_len=4, prefix_len=0)
    with pytest.raises(TraceError, match="prefix_len"):
        traces.load("sonnet:n=2,input_len=100,prefix_len=200", tokenizer=tok)
    # a prefix as long as the prompt leaves whole lines out, but the length is still exact
    tr = sonnet_dataset(tok, n=3, input_len=200, output_len=4, prefix_len=200)
    assert all(_n(tok, r) == 200 for r in tr.requests)


# ---------------------------------------------------------------------------------------
# specs


BAD_SPECS = [
    ("random:n=0", "n must be an integer >= 1"),
    ("random:n=-3", "n must be an integer"),
    ("random:n=2.5", "n must be an integer"),
    ("random:input_len=abc", "input_len"),
    ("random:output_len=0", "output_len"),
    ("random:range_ratio=1", "range_ratio must be in [0, 1)"),
    ("random:range_ratio=-0.1", "range_ratio"),
    ("random:rate=0", "rate must be > 0"),
    ("random:rate=nan", "rate must be a number"),
    ("random:burstiness=0", "burstiness"),
    ("random:prefix_len=-1", "prefix_len"),
    ("random:input_len=0", "empty"),
    ("random:foo=1", "unknown parameter 'foo'"),
    ("random:range_ratio=0.1,range_ratio=0.2", "given twice"),
    ("random:n", "expected key=value"),
    ("random:n=5,,rate=1", "expected key=value"),
    ("sonnet:range_ratio=0.5", "unknown parameter 'range_ratio'"),
    ("sonnet:input_len=0", "input_len"),
]


@pytest.mark.parametrize("spec,needle", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_specs_are_one_line(spec, needle):
    with pytest.raises(TraceError) as ei:
        traces.load(spec)
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg and msg.split(":")[0] in ("random", "sonnet"), msg


def test_spec_parsing_and_options():
    assert parse_spec(" random:n=3, rate=inf ,input_len=9") == ("random", {"n": 3, "rate": math.inf, "input_len": 9})
    assert parse_spec("sonnet:") == ("sonnet", {})
    with pytest.raises(TraceError, match="do not apply"):
        traces.load("random:n=3", drop_invalid=True)
    with pytest.raises(TraceError, match="not found"):
        traces.load("randomish:n=3")


# ---------------------------------------------------------------------------------------
# python -m schedlab.traces.build --sonnet-tokenizer


@pytest.mark.slow
def test_build_sonnet_json_from_the_dataset(synthetic_build, tmp_path, monkeypatch):
    from schedlab.traces import build as tbuild

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "data"
    assert (
        tbuild.main(["--out", str(out), "--synthetic-only", "--sonnet-tokenizer", "test_datasets:make_chat_bpe"]) == 0
    )
    tr = traces.load(str(out / "sonnet.json"))  # counted: loads without a tokenizer
    tok = make_chat_bpe()
    assert len(tr) == tbuild.SONNET_PARAMS["n"] and tr.requests[0].messages
    assert all(r.prompt_tokens == 1024 == _n(tok, r) and r.output_tokens == 128 for r in tr.requests)
    shipped = traces.load("sonnet")  # the same requests and arrivals, with text
    assert [(r.id, r.arrival_s) for r in tr.requests] == [(r.id, r.arrival_s) for r in shipped.requests]
    assert (out / "sonnet.txt").read_bytes() == SONNET_FILE.read_bytes()
    # without the tokenizer the bundled token-count sonnet.json is rebuilt as shipped
    rc, plain = synthetic_build  # main(["--out", PLAIN, "--synthetic-only"]) (conftest: once a session)
    assert rc == 0
    assert (plain / "sonnet.json").read_bytes() == (SONNET_FILE.parent / "sonnet.json").read_bytes()
    assert tbuild.main(["--out", str(tmp_path / "x"), "--synthetic-only", "--sonnet-tokenizer", "nope"]) == 1
    assert (
        tbuild.main(["--out", str(tmp_path / "x"), "--synthetic-only", "--sonnet-tokenizer", "no_such_module:f"]) == 1
    )
