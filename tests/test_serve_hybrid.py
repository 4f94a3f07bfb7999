"""``serve`` on a hybrid model: the ``micro-qwen3_5`` preset (Gated DeltaNet layers with a recurrent
and a convolution state, full attention every 4th layer), chunked prefill in 8-token chunks, driven
by the ``openai`` SDK on 127.0.0.1. An empty prompt gets an OpenAI 400 and wedges nothing (seed PR
002's first bug: on a hybrid Qwen3.5 with chunked prefill, an empty prompt stuck at the head of the
prefill queue and the scheduler served nothing after it): a request in flight and one sent right
after answer exactly the model alone's text, and nothing is left in the replica.

The preset has no tokenizer (``serve`` takes text), so the server runs the same model (its seeded
weights written as an mlx-lm checkpoint, read back bit for bit) from a directory with a small
byte-level tokenizer of the model's 512 ids and a chat template that renders nothing for a chat
whose messages are all empty.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine.models import load_model, save_checkpoint

import mlx.core as mx
from mlx.utils import tree_flatten

from test_server import Served, expected

pytestmark = pytest.mark.slow  # a real server on a real model

NAME = "micro-qwen3_5"
# ChatML that leaves out empty messages (and the generation prompt when nothing was said)
TEMPLATE = (
    "{% for m in messages if m['content'] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt and messages | selectattr('content') | list %}<|im_start|>assistant\n{% endif %}"
)
LONG = "The quick brown fox jumps over the lazy dog while the rain keeps falling on the old stone bridge. " * 2


def write_tokenizer(out) -> None:
    """A byte-level BPE tokenizer of exactly 512 ids (the model's vocabulary): the 256 bytes,
    253 merges of letter pairs, and 3 special tokens (``<|im_end|>`` its EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    merges = [(a, b) for a in letters for b in letters][: 512 - 3 - len(vocab)]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.get_vocab_size() == 512
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The micro-qwen3_5 preset as a checkpoint directory with a tokenizer, loaded as serve loads it."""
    preset = load_model(NAME)
    path = save_checkpoint(preset, tmp_path_factory.mktemp("micro-qwen3_5"))
    write_tokenizer(path)
    info = load_model(str(path))
    assert set(info.cache_kinds) == {"ArraysCache", "KVCache"} and info.tokenizer is not None
    mine, theirs = dict(tree_flatten(info.model.parameters())), dict(tree_flatten(preset.model.parameters()))
    assert mine.keys() == theirs.keys() and all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    return path, info


@pytest.fixture(scope="module")
def server(hybrid, tmp_path_factory):
    s = Served(
        ["--policy", "chunked-prefill", "-o", "budget=8", "--model", str(hybrid[0]), "--served-model-name", NAME]
        + ["--kv-tokens", "4096", "--max-tokens", "16"],
        tmp_path_factory.mktemp("served-hybrid"),
    )
    yield s
    s.stop()


def test_an_empty_prompt_gets_a_400_and_wedges_nothing(server, hybrid):
    info = hybrid[1]
    c = server.client()
    n_long = len(info.tokenizer.encode(LONG))
    assert n_long > 5 * 8  # its prompt in many chunks
    want = expected(info, prompt=LONG, max_tokens=24)
    with ThreadPoolExecutor(1) as ex:
        in_flight = ex.submit(lambda: c.completions.create(model=NAME, prompt=LONG, max_tokens=24))
        for prompt in ("", [""]):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model=NAME, prompt=prompt, max_tokens=8)
            body = e.value.body
            assert e.value.status_code == 400 and body["type"] == "invalid_request_error" and body["param"] == "prompt"
            assert body["message"] == "prompt is empty", body
        # a chat the template renders as nothing: 0 tokens
        for messages in ([{"role": "user", "content": ""}], [{"role": "system", "content": ""}] * 2):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=NAME, messages=messages, max_tokens=8)
            body = e.value.body
            assert e.value.status_code == 400 and body["param"] == "messages"
            assert body["message"] == "the prompt is 0 tokens for this model's tokenizer", body
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": ""})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        # sent right after: answered, exactly the model alone's text (a completion and a chat)
        r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12)
        got = (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason)
        assert got == expected(info, prompt="Once upon a time", max_tokens=12)
        chat = [{"role": "system", "content": ""}, {"role": "user", "content": "Name three colours."}]
        r = c.chat.completions.create(model=NAME, messages=chat, max_tokens=10)
        got = (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason)
        assert got == expected(info, messages=chat, max_tokens=10)
        r = in_flight.result(timeout=120)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == want
    assert r.usage.prompt_tokens == n_long
    # the empty ones never reached the replica, and nothing is left in it
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "in_flight": 0, "cancelled": 0}
    state = httpx.get(server.url + "/state").json()
    assert (state["waiting"], state["running"], state["kv_used"], state["received"]["requests"]) == (0, 0, 0, 3)


def test_a_request_that_fits_only_without_its_recurrent_state_gets_a_400_naming_it(server, hybrid):
    """The KV (4,096 tokens) holds the prompt and output but not the request's recurrent and
    convolution state as well: refused on arrival, and the sum the message prints adds up."""
    tok = hybrid[1].tokenizer
    text = "Once upon a time " * 1000
    ids = tok.encode(text)
    text = tok.decode(ids[:4060])
    n = len(tok.encode(text))
    assert 4000 < n < 4090
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt=text, max_tokens=4096 - n)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == "max_tokens", body
    m = re.fullmatch(
        rf"this request needs (\d+) KV tokens \(prompt {n} \+ max_tokens {4096 - n} - 1 \+ (\d+) for its sliding "
        r"windows and recurrent state\) but the server's KV capacity is 4096 \(serve --kv-tokens\)",
        body["message"],
    )
    assert m, body["message"]
    need, fixed = int(m[1]), int(m[2])
    assert need == n + (4096 - n) - 1 + fixed > 4096  # the sum adds up, and only the state makes it too big
    r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=4)  # and the server serves on
    assert r.usage.completion_tokens == 4
