"""``serve``'s HTTP side: an OpenAI-compatible FastAPI app (``Server``) whose handlers turn
requests into ``traces.Request`` objects and submit them to the replica's live arrival source,
and the ``Bridge`` that hands each request's tokens from the replica's thread back to its
handler (``TextDelta``: their text as it grows, cut at stop strings). The command itself, which
runs the replica loop, is ``schedlab.commands.serve``."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from typing import Any

from fastapi import Request as HTTPRequest  # (module level: FastAPI resolves handler annotations here)

DEFAULT_MAX_TOKENS = 256  # a request that gives no max_tokens: at most this many (and what the context allows)


def openai_app(title: str):
    """A FastAPI app whose unknown paths and methods answer as OpenAI errors, and ``error``: an
    ``APIError`` as its JSON response (the single replica's server and the cluster's front)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: "APIError") -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return error(APIError(exc.status_code, str(exc.detail), kind="invalid_request_error"))

    return app, error


def models_body(name: str) -> dict[str, Any]:
    """``GET /v1/models``: the one model served, as OpenAI lists models."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "schedlab"}]}


def listening(http_server) -> tuple[str, int] | None:
    """Where a started uvicorn server listens: (host, port), or None."""
    for s in getattr(http_server, "servers", None) or []:
        for sock in getattr(s, "sockets", None) or []:
            host, port = sock.getsockname()[:2]
            return host, port
    return None


class APIError(Exception):
    """An OpenAI-style error response: ``status``, one-line ``message``, ``param``, ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------- engine <-> HTTP


class _Stream:
    """One request's way back to its handler: events on an asyncio queue of the server's loop;
    with stop strings, its text as the engine makes it (to end the request at one)."""

    __slots__ = ("loop", "queue", "text", "cancelled", "hit_stop")

    def __init__(self, loop: asyncio.AbstractEventLoop, text: "TextDelta | None" = None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = text  # a TextDelta with the request's stop strings, or None
        self.cancelled = False  # its client went away: end it at its next token
        self.hit_stop = False

    def put(self, item: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Bridge:
    """Hands each request's tokens from the replica's thread to its handler.

    Events: ``("tokens", [ids])`` as each token is made (``MLXBackend.on_token``: at the end of
    the pass that made it, not of the step), then ``("done", finish_reason)`` or ``("error",
    APIError)``. A token that completes one of the request's stop strings, or that comes after its
    client went away (``cancel``), is its last (``on_token`` says so to the engine, which ends it as
    at EOS). ``on_token`` and ``on_finish`` run on the replica's thread; ``open`` and ``cancel`` on
    the server's."""

    def __init__(self, backend, kv_capacity: int, tokenizer=None, eos: frozenset[int] = frozenset()):
        self.backend = backend
        self.kv_capacity = kv_capacity
        self.tokenizer = tokenizer
        self.eos = eos
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.cancelled = 0  # requests ended early because their client went away
        backend.on_token = self.on_token
        # what GET /state reads (a cluster's router): the replica's ReplicaState, known once the
        # run starts (the loop hands it to the backend's start), and what was sent to it
        self.state = None
        self.received = [0, 0, 0]  # requests, prompt tokens, output tokens submitted (cumulative)
        self._refused = [0, 0]  # prompt and output tokens of requests refused on arrival
        self._sizes: dict[str, tuple[int, int]] = {}
        start = backend.start

        def start_and_keep(state, requests=None):
            self.state = state
            return start(state, requests)

        backend.start = start_and_keep

    def open(
        self,
        rid: str,
        loop: asyncio.AbstractEventLoop,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        sizes: tuple[int, int] | None = None,
    ) -> _Stream:
        """A stream for request ``rid`` (``sizes``: its prompt and output tokens, counted as sent)."""
        st = _Stream(loop, TextDelta(self.tokenizer, self.eos, stop) if stop else None)
        with self._lock:
            self._streams[rid] = st
            if ignore_eos:
                self.backend.no_eos.add(rid)
            if sizes is not None:
                self._sizes[rid] = sizes
                self._count(sizes, 1)
        return st

    def _count(self, sizes: tuple[int, int], sign: int) -> None:
        self.received[0] += sign
        self.received[1] += sign * sizes[0]
        self.received[2] += sign * sizes[1]

    def drop(self, rid: str) -> None:
        """Forget ``rid``: it was never submitted."""
        with self._lock:
            self._streams.pop(rid, None)
            self.backend.no_eos.discard(rid)
            sizes = self._sizes.pop(rid, None)
            if sizes is not None:
                self._count(sizes, -1)

    def cancel(self, rid: str) -> None:
        with self._lock:
            st = self._streams.get(rid)
            if st is not None and not st.cancelled:
                st.cancelled = True
                self.cancelled += 1

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def on_token(self, rid: str, token: int) -> bool:
        with self._lock:
            st = self._streams.get(rid)
        if st is None:
            return False
        if st.cancelled:
            return True
        st.put(("tokens", [token]))
        if st.text is not None:
            st.text.feed([token])
            st.hit_stop = st.text.stopped
        return st.hit_stop

    def on_finish(self, r, t: float) -> None:
        with self._lock:
            st = self._streams.pop(r.id, None)
            self.backend.no_eos.discard(r.id)
            sizes = self._sizes.pop(r.id, None)
            if sizes is not None and r.finish_s is None:  # refused: its tokens are never done
                self._refused[0] += sizes[0]
                self._refused[1] += sizes[1]
        if st is None:
            return
        if r.finish_s is None:  # refused on arrival: it can never fit this replica's KV cache
            st.put(
                (
                    "error",
                    APIError(
                        400,
                        f"this request needs {r.kv_footprint} KV tokens (prompt {r.prompt_tokens} + max_tokens "
                        f"{r.output_tokens} - 1) but the server's KV capacity is {self.kv_capacity} (serve --kv-tokens)",
                        "max_tokens",
                    ),
                )
            )
            return
        st.put(("done", "stop" if r.id in self.backend.stopped or st.hit_stop else "length"))

    def signals(self) -> dict[str, Any]:
        """GET /state: the replica as a router reads it (``routers.ReplicaSignals``' fields): requests
        waiting (sent and not admitted: in the source's queue or the waiting queue) and running,
        prompt and output tokens outstanding (sent less what the steps did), KV used and capacity;
        and ``received``, what was sent to it so far (requests, prompt tokens, output tokens). Read
        from the replica loop's state while it runs (plain counters: a snapshot, not a locked one)."""
        st = self.state
        with self._lock:
            in_flight = len(self._streams)
            n, p, o = self.received
            rp, ro = self._refused
        running = len(st.running) if st is not None else 0
        return {
            "waiting": max(in_flight - running, 0),
            "running": running,
            "prompt_tokens": max(p - rp - (st.prompt_done if st is not None else 0), 0),
            "output_tokens": max(o - ro - (st.output_done if st is not None else 0), 0),
            "kv_used": st.kv_used if st is not None else 0,
            "kv_capacity": st.kv_capacity if st is not None else self.kv_capacity,
            "received": {"requests": n, "prompt_tokens": p, "output_tokens": o},
        }

    def fail_all(self, error: APIError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for st in streams:
            st.put(("error", error))


class TextDelta:
    """Incremental text of a growing list of token ids: each ``feed`` returns the new text. Held
    back: an incomplete UTF-8 sequence at the end (the tokenizer's replacement character), and
    an end that may begin one of the ``stop`` strings; the text ends before the first stop string
    (``stopped`` then), which it never contains, as OpenAI's API returns it."""

    def __init__(self, tokenizer, eos: frozenset[int], stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.eos = eos
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def feed(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i not in self.eos]
        full = self.tok.decode(self.ids)
        cuts = [i for i in (full.find(x) for x in self.stop) if i >= 0]
        if cuts:
            full, final, self.stopped = full[: min(cuts)], True, True
        if not final:
            if full.endswith("\ufffd"):
                return ""
            hold = max((k for x in self.stop for k in range(1, len(x)) if full.endswith(x[:k])), default=0)
            full = full[: len(full) - hold]
        if not full.startswith(self.text):
            return ""  # (a decoding that rewrote earlier text: what was sent stands)
        delta, self.text = full[len(self.text) :], full
        return delta


# ---------------------------------------------------------------------------- requests


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
    """What a completion request asks for, checked against what this server does."""

    def __init__(self, body: Any, server: "Server", chat: bool):
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
        self._sampling(body, server)
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

    @staticmethod
    def _sampling(body: dict, server: "Server") -> None:
        want = server.temperature
        t = _number(body, "temperature")
        if t is not None and not math.isclose(t, want, abs_tol=1e-9):
            raise APIError(
                400,
                f"this server samples every request at temperature {want:g} (serve --sampling); "
                f"temperature {t:g} is not available",
                "temperature",
            )
        if _number(body, "top_p", 1.0) != 1.0:
            raise APIError(400, "top_p other than 1 is not supported by this server", "top_p")
        n = body.get("n")
        if n not in (None, 1):
            raise APIError(400, f"n must be 1 (one choice per request), got {json.dumps(n)}", "n")
        for key in ("presence_penalty", "frequency_penalty"):
            if _number(body, key, 0.0) != 0.0:
                raise APIError(400, f"{key} other than 0 is not supported by this server", key)
        # vLLM's extensions, as vllm bench serve sends them: only their neutral values
        for key, neutral in (
            ("repetition_penalty", (1.0,)),
            ("top_k", (-1, 0)),
            ("min_p", (0.0,)),
            ("min_tokens", (0,)),
        ):
            if _number(body, key, neutral[0]) not in neutral:
                raise APIError(400, f"{key} other than {neutral[0]} is not supported by this server", key)
        for key in (
            "logprobs",
            "top_logprobs",
            "echo",
            "best_of",
            "logit_bias",
            "suffix",
            "tools",
            "functions",
            "response_format",
        ):
            v = body.get(key)
            if v not in (None, False, [], {}, "") and not (key == "best_of" and v == 1):
                raise APIError(400, f"{key} is not supported by this server", key)


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


# ---------------------------------------------------------------------------- the server


async def _json(http: HTTPRequest) -> Any:
    try:
        return await http.json()
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None


class Server:
    """The HTTP side: a FastAPI app whose handlers submit to ``source`` and read ``bridge``."""

    def __init__(
        self,
        info,
        source,
        bridge: Bridge,
        model_name: str,
        temperature: float,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ):
        self.info = info
        self.tokenizer = info.tokenizer
        self.eos = frozenset(info.eos_token_ids or ())
        self.source = source
        self.bridge = bridge
        self.model_name = model_name
        self.temperature = temperature
        self.default_max_tokens = default_max_tokens
        self._ids = itertools.count()
        self._used: set[str] = set()  # request ids given so far (the replica's state keeps them all)
        self.app = self._make_app()

    def claim_id(self, chat: bool, given: str | None = None) -> str:
        """A fresh request id: ``given`` (a cluster's front names its requests, header
        ``X-Schedlab-Request-Id``) unless already used here, else the next of ours."""
        if given is not None:
            if not given or len(given) > 200 or given in self._used:
                raise APIError(400, f"request id {given[:200]!r} is empty, too long or already used on this replica")
            rid = given
        else:
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
            while rid in self._used:
                rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        self._used.add(rid)
        return rid

    def request(self, params: Params, chat: bool, rid: str = "request"):
        """A ``traces.Request`` for ``params``, counted with the model's tokenizer (not stamped)."""
        from schedlab import traces
        from schedlab.engine.errors import EngineError
        from schedlab.traces.schema import Request, TraceError

        req = Request(rid, 0.0, None, 1, prompt=params.prompt, messages=params.messages)
        try:
            n = len(traces.prompt_ids(req, self.tokenizer))
        except TraceError as exc:
            raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        if n < 1:
            raise APIError(400, "the prompt is 0 tokens for this model's tokenizer", "messages" if chat else "prompt")
        ctx = self.info.max_context
        if params.max_tokens is None:
            room = self.default_max_tokens if ctx is None else min(self.default_max_tokens, ctx - n)
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt is {n} tokens and the model's context is {ctx}: no room for output",
                    "messages" if chat else "prompt",
                )
            max_tokens, key = room, "max_tokens"
        else:
            max_tokens, key = params.max_tokens, params.max_tokens_key
        req = Request(rid, 0.0, n, max_tokens, prompt=params.prompt, messages=params.messages)
        try:
            self.info.check_trace([req])
        except EngineError as exc:
            raise APIError(
                400, str(exc).replace(f"request {rid} needs", "this request needs").replace("+ output", f"+ {key}"), key
            ) from None
        return req

    def _make_app(self):
        from fastapi.responses import StreamingResponse

        from schedlab.sim.sources import SourceClosed

        app, error = openai_app("schedlab serve")
        server = self

        @app.get("/health")
        async def health():
            return {"status": "ok", "in_flight": server.bridge.in_flight(), "cancelled": server.bridge.cancelled}

        @app.get("/state")
        async def state():  # what a cluster's router reads (routers.ReplicaSignals' fields)
            return server.bridge.signals()

        async def prepare(http: HTTPRequest, chat: bool):
            """A completion request checked and counted, not submitted (a cluster's front asks
            before it routes): its prompt and max_tokens, or the error it would get."""
            try:
                params = Params(await _json(http), server, chat)
                req = server.request(params, chat)
                server.check_fits(req)
            except APIError as e:
                return error(e)
            return {
                "prompt_tokens": req.prompt_tokens,
                "max_tokens": req.output_tokens,
                "stream": params.stream,
                "include_usage": params.include_usage,
                "prompt": req.prompt,
                "messages": req.chat(),
            }

        @app.post("/prepare/completions")
        async def prepare_completions(http: HTTPRequest):
            return await prepare(http, chat=False)

        @app.post("/prepare/chat/completions")
        async def prepare_chat_completions(http: HTTPRequest):
            return await prepare(http, chat=True)

        @app.get("/v1/models")
        async def models():
            return models_body(server.model_name)

        async def handle(http: HTTPRequest, chat: bool):
            try:
                params = Params(await _json(http), server, chat)
                rid = server.claim_id(chat, http.headers.get("x-schedlab-request-id"))
                req = server.request(params, chat, rid)
            except APIError as e:
                return error(e)
            st = server.bridge.open(
                req.id,
                asyncio.get_running_loop(),
                params.stop,
                params.ignore_eos,
                (req.prompt_tokens, req.output_tokens),
            )
            try:
                server.source.submit(req)
            except SourceClosed as exc:
                server.bridge.drop(req.id)
                return error(APIError(503, str(exc), kind="server_error"))
            created = int(time.time())
            if params.stream:
                return StreamingResponse(server._events(req, st, params, chat, created), media_type="text/event-stream")
            return await server._whole(req, st, params, chat, created)

        @app.post("/v1/completions")
        async def completions(http: HTTPRequest):
            return await handle(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HTTPRequest):
            return await handle(http, chat=True)

        return app

    def check_fits(self, req) -> None:
        """The 400 the replica gives on arrival a request larger than its KV capacity, said now."""
        st = self.bridge.state
        capacity = st.kv_capacity if st is not None else self.bridge.kv_capacity
        need = req.prompt_tokens + req.output_tokens - 1
        if need > capacity:
            raise APIError(
                400,
                f"this request needs {need} KV tokens (prompt {req.prompt_tokens} + max_tokens "
                f"{req.output_tokens} - 1) but the server's KV capacity is {self.bridge.kv_capacity} (serve --kv-tokens)",
                "max_tokens",
            )

    def _usage(self, req, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": req.prompt_tokens + completion,
        }

    async def _whole(self, req, st: _Stream, params: Params, chat: bool, created: int):
        from fastapi.responses import JSONResponse

        ids: list[int] = []
        try:
            while True:
                kind, value = await st.queue.get()
                if kind == "tokens":
                    ids += value
                elif kind == "error":
                    return JSONResponse(value.body(), status_code=value.status)
                else:
                    break
        except asyncio.CancelledError:  # the client went away: end the request at its next token
            self.bridge.cancel(req.id)
            raise
        text = TextDelta(self.tokenizer, self.eos, params.stop)
        text.feed(ids, final=True)
        text = text.text
        choice: dict[str, Any] = {"index": 0, "finish_reason": value, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse(
            {
                "id": req.id,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": self._usage(req, len(ids)),
            }
        )

    async def _events(self, req, st: _Stream, params: Params, chat: bool, created: int):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None = None, finish: str | None = None, role: bool = False, usage=None) -> str:
            if usage is not None:
                choices: list = []
            elif chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choices = [{"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}]
            else:
                choices = [{"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}]
            out: dict[str, Any] = {
                "id": req.id,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

        text = TextDelta(self.tokenizer, self.eos, params.stop)
        n = 0
        ended = False
        try:
            if chat:
                yield chunk("", role=True)
            while True:
                kind, value = await st.queue.get()
                if kind == "tokens":
                    n += len(value)
                    delta = text.feed(value)
                    if delta:
                        yield chunk(delta)
                elif kind == "error":
                    ended = True
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:
                    ended = True
                    rest = text.feed([], final=True)
                    if rest:
                        yield chunk(rest)
                    yield chunk(None if chat else "", finish=value)
                    if params.include_usage:
                        yield chunk(usage=self._usage(req, n))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away mid-answer: end the request at its next token
                self.bridge.cancel(req.id)
