"""A completion request's body checked against what the server does (``Params``), OpenAI's
ranges and formats: sampling, logprobs, stop strings, the prompt or the messages."""

from __future__ import annotations

import json
import math
from typing import Any

from .http import APIError


def _number(body: dict, key: str, default=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(400, f"{key} must be a number, got {json.dumps(v)}", key)
    return v


def _int(body: dict, key: str):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise APIError(400, f"{key} must be an integer >= 1, got {json.dumps(v)}", key)
    return v


class Params:
    """What a completion request asks for, checked against what ``server`` (a ``server.Server``) does."""

    def __init__(self, body: Any, server, chat: bool):
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise APIError(400, "model is required", "model")
        if model != server.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{server.model_name}`)",
                "model",
                "model_not_found",
            )
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise APIError(400, f"stream must be true or false, got {json.dumps(stream)}", "stream")
        self.stream = stream
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise APIError(400, "stream_options must be an object", "stream_options")
        self.include_usage = bool((opts or {}).get("include_usage", False))
        if opts is not None and not stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        self.sampling = request_sampling(body, server.sampling, chat, getattr(server.info, "vocab_size", None))
        self.logprobs = self.sampling.logprobs  # None, or the alternatives asked for per token
        keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_tokens = None
        for k in keys:
            v = _int(body, k)
            if v is not None:
                self.max_tokens, self.max_tokens_key = v, k
                break
        self.stop = _stop(body.get("stop"))
        self.ignore_eos = body.get("ignore_eos", False)  # vLLM's extension (vllm bench serve --ignore-eos)
        if not isinstance(self.ignore_eos, bool):
            raise APIError(400, f"ignore_eos must be true or false, got {json.dumps(self.ignore_eos)}", "ignore_eos")
        if chat:
            self.messages = _messages(body.get("messages"))
            self.prompt = None
        else:
            self.messages = None
            self.prompt = _prompt(body.get("prompt"))


def request_sampling(body: dict, default, chat: bool, vocab: int | None = None):
    """The ``engine.sampling.Sampling`` a completion request asks for: the server's ``default``
    (serve --sampling) with what the request sets instead (OpenAI's ``temperature``, ``top_p``,
    ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and logprobs; vLLM's
    ``top_k``, ``min_p``, ``repetition_penalty``), each checked against OpenAI's ranges; what this
    server does not do (``n`` or ``best_of`` > 1, ``echo``, ``min_tokens``, tools, ...) is a 400."""
    from dataclasses import replace

    from schedlab.engine.sampling import MAX_LOGPROBS, SAMPLING_KEYS, check_sampling_value

    values: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        v = body.get(key)
        if v is None:
            continue
        ok, why = check_sampling_value(key, v)
        if why is not None:
            raise APIError(400, why, key)
        values["request_seed" if key == "seed" else key] = ok
    bias = body.get("logit_bias")
    if bias is not None:
        values["logit_bias"] = _logit_bias(bias, vocab)
    values["logprobs"] = _logprobs_asked(body, chat, MAX_LOGPROBS)
    for key, neutral in (("n", 1), ("best_of", 1), ("min_tokens", 0)):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or v != neutral):
            what = "one choice per request" if key != "min_tokens" else "not supported by this server"
            raise APIError(400, f"{key} must be {neutral} ({what}), got {json.dumps(v)}", key)
    for key in ("echo", "suffix", "tools", "functions", "response_format"):
        v = body.get(key)
        if v in (None, False, [], {}, "") or (key == "response_format" and v == {"type": "text"}):
            continue  # (plain text, OpenAI's default response_format, which some clients always send)
        raise APIError(400, f"{key} is not supported by this server", key)
    return replace(default, **values)


def _logit_bias(bias: Any, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {token id (a string): bias from -100 to 100}."""
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object of token ids to biases from -100 to 100", "logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            tid = -1
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise APIError(400, f"logit_bias: {json.dumps(k)} is not a token id of this model", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise APIError(400, f"logit_bias of token {tid} must be a number from -100 to 100, got {json.dumps(v)}",
                           "logit_bias")  # fmt: skip
        out[tid] = float(v)
    return tuple(sorted(out.items()))


def _logprobs_asked(body: dict, chat: bool, most: int) -> int | None:
    """How many alternatives per token a request wants with its tokens' logprobs (None: no
    logprobs): chat's ``logprobs: true`` and ``top_logprobs``, completions' ``logprobs``: N."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise APIError(400, "top_logprobs is for chat completions (completions take logprobs: 0 to 20)",
                           "top_logprobs")  # fmt: skip
        if lp is None:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= most:
            raise APIError(400, f"logprobs must be an integer from 0 to {most}, got {json.dumps(lp)}", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise APIError(400, f"logprobs must be true or false, got {json.dumps(lp)}", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= most:
            raise APIError(400, f"top_logprobs must be an integer from 0 to {most}, got {json.dumps(top)}",
                           "top_logprobs")  # fmt: skip
        if top and not lp:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None


def _stop(v: Any) -> tuple[str, ...]:
    """``stop``: a string or up to 4 strings, none empty (OpenAI's limits)."""
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(x, str) and x for x in stops):
        raise APIError(400, f"stop must be a non-empty string or a list of 1 to 4 of them, got {json.dumps(v)}", "stop")
    return tuple(stops)


def _prompt(p: Any) -> str:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise APIError(400, "prompt must be a string (one prompt per request)", "prompt")
    if not p:
        raise APIError(400, "prompt is empty", "prompt")
    return p


def _messages(ms: Any) -> tuple[tuple[str, str], ...]:
    from schedlab.traces.schema import ROLES

    if not isinstance(ms, list) or not ms:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise APIError(
                400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", "messages"
            )
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        out.append((role, content))
    return tuple(out)
