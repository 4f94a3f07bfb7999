"""``serve``'s per-request sampling: temperature, top_p/top_k/min_p, seed, penalties, logit_bias
and logprobs, each request its own, batched together in the same passes.

One server (the installed ``serve`` on SmolLM2-135M, as in test_server, greedy by default) and the
``openai`` SDK (``extra_body`` for vLLM's fields). Greedy answers must stay the model alone's
(``engine.backend.reference_tokens``) when sampled requests share their passes; a seeded request
must give the same text whoever shares its passes; logprobs must be the model's log-softmax.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab import traces
from schedlab.engine.models import load_model
from schedlab.traces.schema import Request
from test_server import MODEL, chat, expected

pytestmark = pytest.mark.slow  # a real server on a real model

N = 8  # tokens per answer: short, the checks hold on 8 (the session's server: conftest ``server``)
SEEDED = dict(temperature=0.8, top_p=0.9)  # OpenAI's fields, sampled
STORY = "Once upon a time, in a small village,"
QS = ["What is the capital of France?", "Name three colours."]
_expected: dict = {}


def greedy(smol, q: str | None = None, prompt: str | None = None) -> str:
    """The model alone's greedy text of N tokens (test_server.expected), once per question."""
    key = (q, prompt)
    if key not in _expected:
        _expected[key] = expected(smol, messages=chat(q) if q else None, prompt=prompt, max_tokens=N)[0]
    return _expected[key]


def story(c, seed=None, stream=False, **kw) -> str:
    args = dict(model=MODEL, prompt=STORY, max_tokens=N, **SEEDED, **kw)
    if seed is not None:
        args["seed"] = seed
    if stream:
        return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **args))
    return c.completions.create(**args).choices[0].text


def answer(c, q: str, **kw) -> str:
    return c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=N, **kw).choices[0].message.content


def together(jobs: dict) -> dict:
    """Run the requests at once (the server batches them): their results by name."""
    with ThreadPoolExecutor(len(jobs)) as ex:
        futures = {k: ex.submit(f) for k, f in jobs.items()}
        return {k: f.result(timeout=120) for k, f in futures.items()}


def test_seeded_sampling_repeats_whoever_shares_the_pass_and_greedy_stays_exact(server, smol):
    """A seeded request (temperature 0.8, top_p 0.9, seed 7) alone, then again (streamed, under
    another request id) in a batch with greedy, unseeded and other-seeded requests: the same text;
    seed 8 gives another; the greedy requests beside them are the model alone's, with neutral
    penalties too; top_k=1 (or min_p=1) at temperature 1 is greedy: the filters are applied."""
    c = server.client()
    alone = story(c, seed=7)
    neutral = dict(presence_penalty=0, frequency_penalty=0, extra_body={"repetition_penalty": 1, "top_k": -1})
    got = together(
        {
            "seed7": lambda: story(c, seed=7, stream=True),
            "seed8": lambda: story(c, seed=8),
            "unseeded": lambda: story(c),
            "penalised": lambda: story(c, seed=7, presence_penalty=1.5, extra_body={"repetition_penalty": 1.3}),
            "top_k=1": lambda: answer(c, QS[0], temperature=1.0, extra_body={"top_k": 1}),
            "min_p=1": lambda: answer(c, QS[1], temperature=1.0, seed=1, extra_body={"min_p": 1.0}),
            "greedy0": lambda: answer(c, QS[0]),
            "greedy1": lambda: answer(c, QS[1], **neutral),
        }
    )
    assert got["seed7"] == alone and alone
    assert got["seed8"] != alone and got["penalised"] != alone
    assert got["greedy0"] == got["top_k=1"] == greedy(smol, QS[0])
    assert got["greedy1"] == got["min_p=1"] == greedy(smol, QS[1])


def test_penalties_and_logit_bias_change_greedy_answers(server, smol):
    """mlx-lm's logits processors, per request: a +100 logit bias makes every token that one; a
    repetition penalty changes a greedy answer that repeats itself."""
    c = server.client()
    tid = smol.tokenizer.encode(" banana")[0]
    q = "Repeat after me: the the the the the the the the"
    got = together(
        {
            "bias": lambda: c.completions.create(model=MODEL, prompt=STORY, max_tokens=5, logit_bias={str(tid): 100}),
            "plain": lambda: answer(c, q),
            "penalised": lambda: answer(c, q, extra_body={"repetition_penalty": 2.0}),
        }
    )
    assert got["bias"].choices[0].text == smol.tokenizer.decode([tid] * 5)
    assert got["penalised"] != got["plain"]


def _reference_logprobs(smol, ids: list[int]) -> np.ndarray:
    """The model alone's log-softmax over the vocabulary for the token after ``ids``."""
    import mlx.core as mx

    logits = smol.model(mx.array([ids], dtype=mx.uint32))[0, -1].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits))


def test_logprobs_chat_and_completions_whole_and_streamed(server, smol):
    c = server.client()
    q = QS[0]
    top3 = dict(model=MODEL, messages=chat(q), max_tokens=N, logprobs=True, top_logprobs=3)
    legacy = dict(model=MODEL, prompt=STORY, max_tokens=N, logprobs=2)
    got = together(
        {
            "chat": lambda: c.chat.completions.create(**top3),
            "chat-streamed": lambda: list(c.chat.completions.create(stream=True, **top3)),
            "none": lambda: c.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=3),
            "legacy": lambda: c.completions.create(**legacy),
            "legacy-streamed": lambda: list(c.completions.create(stream=True, **legacy)),
            "sampled": lambda: c.chat.completions.create(
                model=MODEL, messages=chat(q), max_tokens=6, logprobs=True, top_logprobs=20, temperature=1.0, seed=3
            ),
        }
    )
    text = greedy(smol, q)
    r = got["chat"]
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == text and "".join(e.token for e in content) == text
    for e in content:
        assert len(e.top_logprobs) == 3 and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert bytes(e.bytes) == e.token.encode() and e.logprob <= 0
    # the first token's logprob and alternatives are the model's own log-softmax
    ids = traces.prompt_ids(Request("q", 0.0, None, 1, messages=(("user", q),)), smol.tokenizer)
    ref = _reference_logprobs(smol, ids)
    best = np.argsort(-ref)[:3]
    assert abs(content[0].logprob - ref[best[0]]) < 1e-3
    assert [t.token for t in content[0].top_logprobs] == [smol.tokenizer.decode([int(i)]) for i in best]
    # streamed: the chunks' logprobs add up to the whole answer's
    chunks = got["chat-streamed"]
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].logprobs) > 3  # per chunk, not at the end
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    assert got["none"].choices[0].logprobs is None  # none asked, none given
    # completions: OpenAI's legacy format, the token itself among its top alternatives (up to N + 1)
    ptext = greedy(smol, prompt=STORY)
    for name in ("legacy", "legacy-streamed"):
        parts = got[name] if name.endswith("streamed") else [got[name]]
        lps = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs is not None]
        tokens = [t for lp in lps for t in lp.tokens]
        offsets = [o for lp in lps for o in lp.text_offset]
        assert "".join(p.choices[0].text for p in parts) == ptext == "".join(tokens) and len(tokens) == N, name
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
        for lp in lps:
            for v, top in zip(lp.token_logprobs, lp.top_logprobs):
                assert 2 <= len(top) <= 3 and abs(v - max(top.values())) < 1e-4
    # a sampled token need not be the likeliest, but its logprob is among the distribution's
    for e in got["sampled"].choices[0].logprobs.content:
        assert len(e.top_logprobs) == 20 and e.logprob <= e.top_logprobs[0].logprob + 1e-6
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-4


def test_bad_sampling_parameters_are_400s_naming_them_and_lose_nothing(server, smol):
    c = server.client()
    bad_chat = [
        (dict(temperature=2.5), "temperature"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(seed="seven"), "seed"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        (dict(n=2), "n"),
        (dict(logit_bias={"not-a-token": 1}), "logit_bias"),
        (dict(logit_bias={"5": 500}), "logit_bias"),
        (dict(logit_bias={str(10**9): 1}), "logit_bias"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(extra_body={"top_k": -2}), "top_k"),
        (dict(extra_body={"top_k": 1.5}), "top_k"),
        (dict(extra_body={"min_p": 1.5}), "min_p"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(extra_body={"seed": 1.5}), "seed"),
        (dict(extra_body={"logprobs": 3}), "logprobs"),
        (dict(extra_body={"min_tokens": 4}), "min_tokens"),
    ]
    bad_completions = [
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(best_of=2), "best_of"),
        (dict(echo=True), "echo"),
        (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),
    ]
    with ThreadPoolExecutor(2) as ex:  # meanwhile, a greedy and a sampled request with logprobs
        in_flight = ex.submit(lambda: answer(c, QS[1]))
        sampled = ex.submit(
            lambda: c.chat.completions.create(model=MODEL, messages=chat(QS[0]), max_tokens=N, **SEEDED, logprobs=True)
        )
        for kwargs, param in bad_chat + bad_completions:
            with pytest.raises(openai.BadRequestError) as e:
                if (kwargs, param) in bad_completions:
                    c.completions.create(model=MODEL, prompt="hi", **kwargs)
                else:
                    c.chat.completions.create(model=MODEL, messages=chat("hi"), **kwargs)
            body = e.value.body
            assert e.value.status_code == 400 and body["param"] == param and param in body["message"], kwargs
            assert body["type"] == "invalid_request_error" and "\n" not in body["message"]
        # what the SDK will not send as such: a JSON bool for a number
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        text, sampled = in_flight.result(timeout=120), sampled.result(timeout=120)
    assert text == greedy(smol, QS[1])
    lps = sampled.choices[0].logprobs.content
    assert "".join(e.token for e in lps) == sampled.choices[0].message.content and len(lps) >= 1


# ---------------------------------------------------------------------------- no server


def test_request_sampling_takes_the_servers_defaults_and_checks_each_field():
    from schedlab.serving.http import APIError
    from schedlab.serving.params import request_sampling
    from schedlab.engine.sampling import Sampling, parse_sampling

    default = parse_sampling("temperature=0.7,seed=1,top_p=0.95")
    s = request_sampling({"top_k": -1, "seed": 9, "logit_bias": {"3": -100}}, default, chat=False, vocab=10)
    assert s == Sampling(temperature=0.7, seed=1, top_p=0.95, top_k=0, request_seed=9, logit_bias=((3, -100.0),))
    s = request_sampling({"temperature": 0, "logprobs": True, "top_logprobs": 4}, default, chat=True)
    assert s.greedy and s.logprobs == 4 and s.top_p == 0.95 and not s.plain
    assert request_sampling({"logprobs": False}, Sampling(), chat=True).plain
    assert request_sampling({"logprobs": 0}, Sampling(), chat=False).logprobs == 0
    for body, chat_, param in (
        ({"temperature": float("inf")}, True, "temperature"),
        ({"top_k": 0.5}, True, "top_k"),
        ({"logprobs": True}, False, "logprobs"),
        ({"logit_bias": {"10": 1}}, True, "logit_bias"),  # past the vocabulary
        ({"best_of": 1, "n": True}, True, "n"),
    ):
        with pytest.raises(APIError) as e:
            request_sampling(body, default, chat=chat_, vocab=10)
        assert e.value.status == 400 and e.value.param == param, body


def test_each_row_samples_the_same_alone_or_in_a_batch():
    """``MLXBackend._sample`` on a batch of rows with different samplers (greedy, seeded top-p,
    top-k with logprobs, penalties, min-p): each row's token and logprobs are those it gets alone;
    greedy rows are the plain argmax; a seeded row does not depend on its request id; a
    backend-wide temperature samples as it always did (Gumbel-max on logits / temperature)."""
    import mlx.core as mx

    from schedlab.engine.backend import MLXBackend, _logprobs
    from schedlab.engine.sampling import Sampling, h64

    b = MLXBackend(load_model("micro"), warmup=False)
    vocab = b.vocab
    logits = mx.array(np.random.default_rng(0).normal(size=(6, vocab)).astype(np.float32) * 3)
    rids = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(rids):
        b.tokens[rid] = [1, 2, 3][: i % 4]
        b._seq[rid] = [5, 6, 7] + b.tokens[rid]
    b.request_sampling = {
        "r1": Sampling(temperature=0.8, top_p=0.9, request_seed=7),
        "r2": Sampling(temperature=1.0, top_k=1, logprobs=3),
        "r3": Sampling(repetition_penalty=1.3, presence_penalty=0.5, logprobs=0),
        "r4": Sampling(temperature=0.7, min_p=0.1, frequency_penalty=1.0, request_seed=-3, logprobs=2),
        "r5": Sampling(logprobs=2),
    }

    def sample(rows, names):
        tok = b._sample(logits[rows], names)
        mx.eval(tok, *[a for v in b._lp_lazy.values() for a in v[:3] if a is not None])
        lps = {r: _logprobs(b._lp_lazy.pop(r)) for r in list(b._lp_lazy)}
        return tok.tolist(), lps

    toks, lps = sample(mx.arange(6), rids)
    greedy = mx.argmax(logits, axis=-1).tolist()
    assert toks[0] == greedy[0] and toks[2] == greedy[2] and toks[5] == greedy[5]  # greedy rows (r2: top_k=1)
    assert set(lps) == {"r2", "r3", "r4", "r5"} and len(lps["r2"][1]) == 3 and lps["r3"][1] == []
    assert lps["r5"][0] == lps["r5"][1][0][1] and lps["r5"][1][0][0] == greedy[5]
    for i, rid in enumerate(rids):
        for rows in ([i], [i, (i + 3) % 6]):  # alone, and beside another row
            t, lp = sample(mx.array(rows), [rid] + [rids[r] for r in rows[1:]])
            assert t[0] == toks[i] and lp.get(rid) == lps.get(rid), rid
    # a seeded row under another request id draws the same; without a seed, the id matters
    b.request_sampling["other-id"] = b.request_sampling["r1"]
    b.tokens["other-id"] = b.tokens["r1"]
    assert sample(mx.array([1]), ["other-id"])[0] == [toks[1]]
    draws = set()
    for seed in range(12):
        b.request_sampling["r1"] = Sampling(temperature=1.0, top_k=3, request_seed=seed)
        draws.add(sample(mx.array([1]), ["r1"])[0][0])
    assert draws <= set(np.argsort(-np.array(logits[1]))[:3].tolist()) and len(draws) > 1
    # the backend-wide temperature: the Gumbel-max of logits / temperature, as before
    b.request_sampling = {}
    b.sampling = Sampling(temperature=1.5, seed=3)
    noise = np.stack([np.random.default_rng([3, h64(r), len(b.tokens[r])]).gumbel(size=vocab) for r in rids])
    want = mx.argmax(logits / 1.5 + mx.array(noise.astype(np.float32)), axis=-1).tolist()
    assert sample(mx.arange(6), rids)[0] == want


def test_logprobs_of_tokens_inside_a_character_give_their_own_bytes_and_names(server, smol):
    # an emoji is several tokens here, each part of its UTF-8 bytes: OpenAI gives each token its own
    # bytes, and names an alternative that is part of a character bytes:\\xNN..., never U+FFFD
    c = server.client()
    prompt = "Emoji list: \U0001f600\U0001f603\U0001f604\U0001f601\U0001f606\U0001f605"
    r = c.chat.completions.create(
        model=MODEL, messages=chat(prompt), max_tokens=12, logprobs=True, top_logprobs=5, temperature=0
    )
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == r.choices[0].message.content.encode()
    names = [t.token for e in content for t in e.top_logprobs]
    assert not any("\ufffd" in n for n in names)
    partial = [t for e in content for t in e.top_logprobs if t.token.startswith("bytes:")]
    assert partial and all(bytes(t.bytes).hex() == t.token[6:].replace("\\x", "") for t in partial)
    # the legacy format's alternatives, a dict by name: as many as asked, and the token's own among them
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=5, temperature=0)
    lp = r.choices[0].logprobs
    for top, own in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) >= 5 and own in top.values(), top
